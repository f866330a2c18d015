"""Rules synth or AWS would enforce, enforced when the file is loaded (issue 12, items 8 and 9): each refused
value gets one line at its key, saying what to change."""

from __future__ import annotations

import json

import pytest

from kvfleet.config import aws, dlc
from kvfleet.config.loader import parse_environment
from kvfleet.engines import ENGINES
from kvfleet.errors import ConfigError
from tests.envs import SAGEMAKER_ENV, with_serving

EC2 = SAGEMAKER_ENV.replace("platform: sagemaker", "platform: ec2").replace(
    "instance_type: ml.g6e.xlarge", "instance_type: g6e.xlarge"
)
CERT = "arn:aws:acm:{}:123456789012:certificate/0f0e0d0c-1234-5678-9abc-def012345678"
OIDC = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.{}.amazonaws.com/id/ABCDEF0123456789"
EKS_EXISTING = """\
name: test
region: us-east-1
network:
  vpc_id: vpc-0123456789abcdef0
  private_subnet_ids: [subnet-0123456789abcdef0, subnet-0123456789abcdef1]
  availability_zones: [us-east-1a, us-east-1b]
deployments:
  - name: chat
    model: {id: meta-llama/Llama-3.1-8B}
    engine: {name: vllm, version: "0.30.0"}
    workload: {max_input_tokens: 4096, max_output_tokens: 1024}
    target:
      platform: eks
      cluster:
        name: shared
        security_group_id: sg-0123456789abcdef0
        oidc_provider_arn: OIDC
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_environment(text, source="f.yaml")
    return info.value.lines


def one(text: str) -> str:
    lines = problems(text)
    assert len(lines) == 1, lines
    return lines[0]


def test_dlc_rule_refuses_at_load_what_synth_refuses() -> None:
    # vLLM 0.21 is modelled (the planner sizes it) but AWS publishes no container for it: synth's dlc_image fails.
    text = (
        SAGEMAKER_ENV.replace('version: "0.30.0"', 'version: "0.21.0"').replace(
            "      max_replicas: 4\n", "      max_replicas: 1\n"
        )
        + "    image:\n      source: dlc\n"
    )
    line = one(text.replace("hf_token_secret: kvfleet/hf-token", "s3_uri: s3://models-bucket/llama"))
    assert line.startswith(
        "f.yaml:11: deployments[0].engine.version: no AWS vLLM container for vLLM 0.21.0; published:"
    )


def test_dlc_copy_matches_the_sdk() -> None:
    # The SDK's own files (the table kvfleet/infra/images.py reads through sagemaker.core.image_uris at synth),
    # read without importing the SDK, which takes seconds.
    import importlib.metadata

    files = {f.name: f for f in importlib.metadata.files("sagemaker-core") or () if "image_uri_config" in str(f)}
    for engine in (name for name, a in ENGINES.items() if a.dlc is not None):
        cfg = json.loads(files[f"{dlc.dlc_framework(engine)}.json"].read_text(encoding="utf-8"))
        releases = cfg.get("versions") or cfg.get("inference", {}).get("versions")
        sdk = {k: str(v.get("tag_prefix", "")) for k, v in releases.items()}
        assert dlc.published(engine) == sdk, "regenerate kvfleet/config/data/dlc_releases.json from the SDK"


@pytest.mark.parametrize("region", ["us-west-2", "eu-west-1"])
def test_certificate_in_another_region(region: str) -> None:
    text = EC2.replace(
        "      platform: ec2\n",
        f"      platform: ec2\n      load_balancer:\n        certificate_arn: {CERT.format(region)}\n",
    )
    line = one(text)
    assert line.startswith("f.yaml:19: deployments[0].target.load_balancer.certificate_arn: the certificate is in ")
    assert "request or import it in us-east-1" in line


def test_certificate_in_the_region_is_accepted() -> None:
    text = EC2.replace(
        "      platform: ec2\n",
        f"      platform: ec2\n      load_balancer:\n        certificate_arn: {CERT.format('us-east-1')}\n",
    )
    parse_environment(text, source="f.yaml")


def test_oidc_provider_of_another_region() -> None:
    line = one(EKS_EXISTING.replace("OIDC", OIDC.format("eu-west-1")))
    assert line.startswith(
        "f.yaml:17: deployments[0].target.cluster.oidc_provider_arn: the provider is for a cluster in eu-west-1"
    )
    parse_environment(EKS_EXISTING.replace("OIDC", OIDC.format("us-east-1")), source="f.yaml")


def test_topic_of_another_region() -> None:
    text = SAGEMAKER_ENV.replace(
        "notifications: none\n", "notifications:\n  topic_arn: arn:aws:sns:eu-west-1:123456789012:alerts\n"
    )
    assert "use a topic in us-east-1" in one(text)


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        (
            "subnet-0123456789abcdef1]",
            "subnet-0123456789abcdef0]",
            "network.private_subnet_ids: subnet-0123456789abcdef0 given more than once",
        ),
        (
            "[us-east-1a, us-east-1b]",
            "[us-east-1a, us-east-1a]",
            "network.availability_zones: us-east-1a given more than once",
        ),
        (
            "[us-east-1a, us-east-1b]",
            "[us-east-1a, eu-west-1b]",
            "network.availability_zones[1]: eu-west-1b is not in region us-east-1",
        ),
        (
            "[us-east-1a, us-east-1b]",
            "[use1-az1, use1-az2]",
            "network.availability_zones: use1-az1 is a zone id; give the zone's name",
        ),
        (
            "[us-east-1a, us-east-1b]",
            "[us-east-1a, mars]",
            "network.availability_zones: mars is not an availability zone",
        ),
    ],
    ids=["subnet-twice", "zone-twice", "zone-elsewhere", "zone-id", "not-a-zone"],
)
def test_network_zones_and_subnets(old: str, new: str, expect: str) -> None:
    text = EKS_EXISTING.replace("OIDC", OIDC.format("us-east-1")).replace(old, new)
    assert expect in one(text)


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_port_outside_the_tcp_range(port: str) -> None:
    text = EKS_EXISTING.replace("OIDC", OIDC.format("us-east-1")).replace(
        "      cluster:\n", f"      addons: {{prometheus_url: 'http://prom.monitoring:{port}/'}}\n      cluster:\n"
    )
    assert one(text).endswith("prometheus_url: the port must be a number from 1 to 65535")


@pytest.mark.parametrize(
    "bucket",
    [
        "ab",
        "a" * 64,
        "My-Bucket",
        "-bucket",
        "bucket-",
        "a..b",
        "192.168.1.1",
        "xn--bucket",
        "sthree-b",
        "b-s3alias",
        "b--ol-s3",
        "b_c",
    ],
)
def test_s3_bucket_names_by_aws_rules(bucket: str) -> None:
    assert aws.bucket_name_problem(bucket) is not None
    text = SAGEMAKER_ENV.replace(
        "hf_token_secret: kvfleet/hf-token", f"s3_uri: {json.dumps('s3://' + bucket + '/llama')}"
    )
    assert ": deployments[0].model.s3_uri: bucket " in one(text)


@pytest.mark.parametrize("bucket", ["abc", "a" * 63, "my.bucket-1", "1bucket"])
def test_s3_bucket_names_accepted(bucket: str) -> None:
    assert aws.bucket_name_problem(bucket) is None
    parse_environment(
        SAGEMAKER_ENV.replace("hf_token_secret: kvfleet/hf-token", f"s3_uri: s3://{bucket}/x"), source="f"
    )


@pytest.mark.parametrize(
    ("secret", "ok"),
    [
        ("kvfleet/hf-token", True),
        ("a+b=c.d@e_f-g", True),
        ("arn:aws:secretsmanager:us-east-1:123456789012:secret:kvfleet/hf-token-AbCdEf", True),
        ("has space", False),
        ("x" * 513, False),
        ("arn:aws:secretsmanager:us-east-1:1234:secret:x", False),
        ("arn:aws:s3:::bucket", False),
    ],
)
def test_secret_ids_and_arns(secret: str, ok: bool) -> None:
    text = SAGEMAKER_ENV.replace("hf_token_secret: kvfleet/hf-token", f"hf_token_secret: {json.dumps(secret)}")
    if ok:
        parse_environment(text, source="f")
    else:
        assert ": deployments[0].model.hf_token_secret: " in one(text)


def test_derived_kubernetes_names_are_dns_labels() -> None:
    # The longest names the schema allows still make a label Kubernetes takes: 21 + 1 + 31 characters.
    env_name, dep_name = "e" * 21, "d" * 31
    text = (
        EKS_EXISTING.replace("OIDC", OIDC.format("us-east-1"))
        .replace("name: test", f"name: {env_name}")
        .replace("name: chat", f"name: {dep_name}")
    )
    parse_environment(text, source="f")
    assert aws.DNS_LABEL.fullmatch(f"{env_name}-{dep_name}")


TENANCY = "    serving:\n      tenant_header: X-Tenant\n      tenant_secret: kvfleet/tenant-salt\n"


def test_tenant_isolation_and_admission_are_set_in_the_file() -> None:
    from kvfleet.deployments import resolve_environment

    [r] = resolve_environment(parse_environment(with_serving(TENANCY), source="f.yaml"))
    env = r.container_environment()
    assert env["KVFLEET_TENANT_HEADER"] == "X-Tenant" and env["KVFLEET_TENANT_SECRET_ARN"] == "kvfleet/tenant-salt"
    assert "KVFLEET_TENANT_SECRET" not in env  # the key itself never leaves Secrets Manager but for the agent
    assert "KVFLEET_ADMISSION" not in env
    [off] = resolve_environment(parse_environment(with_serving("    serving:\n      admission: false\n"), source="f"))
    assert off.container_environment()["KVFLEET_ADMISSION"] == "0"
    assert "KVFLEET_TENANT_HEADER" not in off.container_environment()


@pytest.mark.parametrize(
    ("serving", "expect"),
    [
        ("    serving:\n      tenant_header: X-Tenant\n", "tenant_secret: set both"),
        ("    serving:\n      tenant_secret: kvfleet/tenant-salt\n", "tenant_header: set both"),
        ("    serving:\n      tenant_header: 'X Tenant'\n      tenant_secret: kvfleet/t\n", "tenant_header"),
        ("    serving:\n      tenant_header: X-Tenant\n      tenant_secret: 'bad secret'\n", "tenant_secret"),
    ],
)
def test_tenant_isolation_needs_a_header_name_and_a_secret(serving: str, expect: str) -> None:
    assert expect in one(with_serving(serving))


def test_tenant_isolation_needs_the_agent_and_a_network() -> None:
    dlc_env = (
        SAGEMAKER_ENV.replace("      max_replicas: 4\n", "      max_replicas: 1\n").replace(
            "hf_token_secret: kvfleet/hf-token", "s3_uri: s3://models-bucket/llama"
        )
        + "    image:\n      source: dlc\n"
    )
    assert "without the kvfleet agent" in one(with_serving(TENANCY, dlc_env))
    isolated = SAGEMAKER_ENV.replace("hf_token_secret: kvfleet/hf-token", "s3_uri: s3://models-bucket/llama").replace(
        "      platform: sagemaker\n", "      platform: sagemaker\n      network_isolation: true\n"
    )
    assert "network_isolation" in one(with_serving(TENANCY, isolated))
