"""The SageMaker deployment stack: every property issue 3 asks of it, asserted on the synthesized template."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template
from cdk_nag import AwsSolutionsChecks

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.engines import EngineArgs
from kvfleet.infra.app import build_app
from kvfleet.infra.stack import DeploymentStack
from kvfleet.sizing.hosting import Routing
from kvfleet.targets.sagemaker.config import SageMakerTarget
from kvfleet.targets.sagemaker.infra.endpoint import routing_strategy
from tests.infra.helpers import REPO, SAGEMAKER_ENV, environment, make_app, only, props, synth


@pytest.fixture(scope="module")
def template() -> Template:
    return only()


def policy_statements(t: Template) -> list[dict[str, Any]]:
    out = []
    for p in props(t, "AWS::IAM::Policy"):
        out += p["PolicyDocument"]["Statement"]
    return out


def statements_with(t: Template, action: str) -> list[dict[str, Any]]:
    return [
        s for s in policy_statements(t) if action in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
    ]


def execution_policy(t: Template) -> list[dict[str, Any]]:
    [p] = [
        r["Properties"]
        for k, r in t.find_resources("AWS::IAM::Policy").items()
        if k.startswith("EndpointExecutionPolicy")
    ]
    return list(p["PolicyDocument"]["Statement"])


# ---- model, endpoint config, endpoint -----------------------------------------------------------------


def test_one_model_endpoint_config_and_endpoint(template: Template) -> None:
    for kind in ("AWS::SageMaker::Model", "AWS::SageMaker::EndpointConfig", "AWS::SageMaker::Endpoint"):
        template.resource_count_is(kind, 1)


def test_no_fixed_physical_names(template: Template) -> None:
    [model] = props(template, "AWS::SageMaker::Model")
    [config] = props(template, "AWS::SageMaker::EndpointConfig")
    [endpoint] = props(template, "AWS::SageMaker::Endpoint")
    assert "ModelName" not in model
    assert "EndpointConfigName" not in config
    assert "EndpointName" not in endpoint
    for role in props(template, "AWS::IAM::Role"):
        assert "RoleName" not in role
    for dash in props(template, "AWS::CloudWatch::Dashboard"):
        assert "DashboardName" not in dash


def test_variant_takes_the_plan() -> None:
    env = environment()
    [r] = resolve_environment(env)
    [config] = props(only(), "AWS::SageMaker::EndpointConfig")
    [variant] = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.g6e.xlarge" == r.instance_type
    assert variant["InitialInstanceCount"] == r.initial_instance_count
    assert variant["ModelDataDownloadTimeoutInSeconds"] == r.download_timeout_s
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == r.startup_timeout_s
    assert 600 <= r.startup_timeout_s <= 3600
    # Least outstanding requests, which TARGETS["sagemaker"] declares (SageMaker's default is RANDOM).
    assert variant["RoutingConfig"] == {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}


def test_sagemaker_has_no_round_robin() -> None:
    # A declaration SageMaker cannot carry out fails synth instead of deploying its default.
    assert routing_strategy(Routing.RANDOM) == "RANDOM"
    with pytest.raises(ValueError, match="SageMaker cannot route round_robin"):
        routing_strategy(Routing.ROUND_ROBIN)


def test_container_environment_carries_the_engine_settings(template: Template) -> None:
    [model] = props(template, "AWS::SageMaker::Model")
    env = model["PrimaryContainer"]["Environment"]
    [r] = resolve_environment(environment())
    args = EngineArgs.from_json(env[contract.ENV_ENGINE_ARGS])
    assert args == r.engine_args
    assert args.max_num_seqs == r.candidate.concurrency_per_replica == 16
    assert args.max_model_len == 4096 + 1024
    assert args.tensor_parallel_size == 1
    assert args.gpu_memory_utilization == r.candidate.capacity.gpu_memory_utilization
    assert args.enable_prefix_caching is True
    assert env[contract.ENV_DEPLOYMENT] == "test-chat"
    assert env[contract.ENV_NAMESPACE] == contract.NAMESPACE
    # The file's 420 s, cut to what SageMaker's kill 30 s after SIGTERM leaves (tests/infra/sagemaker/test_scale_in.py).
    assert env[contract.ENV_DRAIN_BUDGET_S] == "25"
    assert env[contract.ENV_TOKEN_BUDGET] == str(r.candidate.capacity.kv_cache_tokens)
    assert env[contract.ENV_MODEL] == "meta-llama/Llama-3.1-8B"
    assert env[contract.ENV_HF_TOKEN_SECRET_ARN] == "kvfleet/hf-token"
    # Every value a string, but the region: the stack's own (a Ref, resolved at deploy time).
    assert all(isinstance(v, str) for k, v in env.items() if k != contract.REGION_VARIABLE)


def test_image_is_the_kvfleet_repository_at_the_engine_version(template: Template) -> None:
    [model] = props(template, "AWS::SageMaker::Model")
    image = json.dumps(model["PrimaryContainer"]["Image"])
    assert "/kvfleet-vllm:0.30.0" in image


def test_in_vpc_private_subnets_with_a_security_group(template: Template) -> None:
    [model] = props(template, "AWS::SageMaker::Model")
    vpc = model["PrimaryContainer"].get("VpcConfig") or model["VpcConfig"]
    assert len(vpc["Subnets"]) == 2
    assert all(s["Ref"].startswith("NetworkVpcserving") for s in vpc["Subnets"])
    assert len(vpc["SecurityGroupIds"]) == 1
    assert model["EnableNetworkIsolation"] is False


def test_local_nvme_instance_gets_no_volume_and_no_kms_key(template: Template) -> None:
    # g6e.xlarge has local NVMe: SageMaker refuses VolumeSizeInGB and KmsKeyId for it.
    [config] = props(template, "AWS::SageMaker::EndpointConfig")
    assert "VolumeSizeInGB" not in config["ProductionVariants"][0]
    assert "KmsKeyId" not in config
    template.resource_count_is("AWS::KMS::Key", 0)


def alerts_for(app: cdk.App, r: ResolvedDeployment) -> Any:
    """The environment's alerts stack, which a deployment stack notifies (as build_app makes it)."""
    from kvfleet.infra.alerts import AlertsStack

    return AlertsStack(app, "Alerts", environment=r.environment)


def ebs_only_template() -> tuple[Template, ResolvedDeployment]:
    # Every GPU type SageMaker offers in the catalog has local NVMe; the EBS path is for those that do not.
    [r] = resolve_environment(environment())
    instance = dataclasses.replace(r.candidate.instance, local_nvme_gb=0)
    r = dataclasses.replace(r, candidate=dataclasses.replace(r.candidate, instance=instance))
    app = make_app()
    return Template.from_stack(DeploymentStack(app, "EbsOnly", resolved=r, alerts=alerts_for(app, r))), r


def test_ebs_only_instance_gets_an_encrypted_volume_sized_for_the_weights() -> None:
    t, r = ebs_only_template()
    [config] = props(t, "AWS::SageMaker::EndpointConfig")
    variant = config["ProductionVariants"][0]
    assert variant["VolumeSizeInGB"] == r.disk_gib
    assert r.disk_gib * 2**30 > r.checkpoint_bytes + 20 * 2**30
    assert config["KmsKeyId"]["Fn::GetAtt"][0].startswith("EndpointStorageKey")
    [key] = props(t, "AWS::KMS::Key")
    assert key["EnableKeyRotation"] is True


def test_blue_green_update_waits_the_drain_budget_and_rolls_back_on_alarms(template: Template) -> None:
    [endpoint] = props(template, "AWS::SageMaker::Endpoint")
    cfg = endpoint["DeploymentConfig"]
    bg = cfg["BlueGreenUpdatePolicy"]
    assert bg["TerminationWaitInSeconds"] == 420
    assert bg["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    assert 600 <= bg["MaximumExecutionTimeoutInSeconds"] <= 14400
    refs = sorted(a["AlarmName"]["Ref"] for a in cfg["AutoRollbackConfiguration"]["Alarms"])
    # The 5xx rate only: counts grow with traffic and would roll a good release back at peak load.
    assert [r.rstrip("0123456789ABCDEF") for r in refs] == ["MonitoringServerErrorRate"]
    alarms = template.find_resources("AWS::CloudWatch::Alarm")
    for ref in refs:
        # Rollback alarms read the agent's signals, not the endpoint: no dependency cycle.
        stats = [m["MetricStat"]["Metric"] for m in alarms[ref]["Properties"]["Metrics"] if "MetricStat" in m]
        assert stats and all(m["Namespace"] == contract.NAMESPACE for m in stats)


def test_the_execution_role_may_read_the_rollback_alarms_and_no_others(template: Template) -> None:
    [endpoint] = props(template, "AWS::SageMaker::Endpoint")
    names = [a["AlarmName"]["Ref"] for a in endpoint["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]]
    statements = [
        st
        for p in props(template, "AWS::IAM::Policy")
        for st in p["PolicyDocument"]["Statement"]
        if "cloudwatch:DescribeAlarms" in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
    ]
    [st] = statements
    resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
    assert sorted(r["Fn::GetAtt"][0] for r in resources) == sorted(names)


def test_canary_update() -> None:
    text = SAGEMAKER_ENV.replace(
        "      platform: sagemaker\n", "      platform: sagemaker\n      canary_percent: 20\n      canary_wait_s: 300\n"
    )
    [endpoint] = props(only(text), "AWS::SageMaker::Endpoint")
    routing = endpoint["DeploymentConfig"]["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
    assert routing == {
        "Type": "CANARY",
        "WaitIntervalInSeconds": 300,
        "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 20},
    }


def test_rolling_update_waits_the_drain_budget_between_batches() -> None:
    text = SAGEMAKER_ENV.replace("      platform: sagemaker\n", "      platform: sagemaker\n      update: rolling\n")
    [endpoint] = props(only(text), "AWS::SageMaker::Endpoint")
    cfg = endpoint["DeploymentConfig"]
    assert "BlueGreenUpdatePolicy" not in cfg
    rolling = cfg["RollingUpdatePolicy"]
    assert rolling["WaitIntervalInSeconds"] == 420
    assert rolling["MaximumBatchSize"] == {"Type": "INSTANCE_COUNT", "Value": 1}
    assert len(cfg["AutoRollbackConfiguration"]["Alarms"]) == 1


# ---- execution role: least privilege ---------------------------------------------------------------


def test_role_is_assumed_by_sagemaker_only(template: Template) -> None:
    roles = [
        r["Properties"]
        for k, r in template.find_resources("AWS::IAM::Role").items()
        if k.startswith("EndpointExecutionRole")
    ]
    [role] = roles
    [stmt] = role["AssumeRolePolicyDocument"]["Statement"]
    assert stmt["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert "ManagedPolicyArns" not in role


def test_role_pulls_only_its_image_repository(template: Template) -> None:
    stmts = execution_policy(template)
    pulls = [s for s in stmts if "ecr:BatchGetImage" in s["Action"]]
    assert len(pulls) == 1
    assert "repository/kvfleet-vllm" in json.dumps(pulls[0]["Resource"])
    for s in stmts:
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        assert not any(a.endswith(":*") or a == "*" for a in actions), s


def test_role_reads_only_the_token_secret(template: Template) -> None:
    stmts = [s for s in execution_policy(template) if "secretsmanager:GetSecretValue" in s["Action"]]
    [s] = stmts
    assert "secret:kvfleet/hf-token-??????" in json.dumps(s["Resource"])


def test_role_reads_the_tenant_key_where_the_file_isolates_tenants() -> None:
    text = SAGEMAKER_ENV.replace(
        "      tenancy: single\n", "      tenant_header: X-Tenant\n      tenant_secret: kvfleet/tenant-salt\n"
    )
    t = only(text)
    reads = json.dumps([s for s in execution_policy(t) if "secretsmanager:GetSecretValue" in s["Action"]])
    assert "secret:kvfleet/hf-token-??????" in reads and "secret:kvfleet/tenant-salt-??????" in reads
    [model] = [r["Properties"] for r in t.find_resources("AWS::SageMaker::Model").values()]
    env = model["PrimaryContainer"]["Environment"]
    assert env[contract.ENV_TENANT_HEADER] == "X-Tenant"
    assert env[contract.ENV_TENANT_SECRET_ARN] == "kvfleet/tenant-salt"


def test_metrics_limited_to_the_kvfleet_namespace(template: Template) -> None:
    [s] = [s for s in execution_policy(template) if s["Action"] == "cloudwatch:PutMetricData"]
    assert s["Condition"] == {"StringEquals": {"cloudwatch:namespace": contract.NAMESPACE}}


def test_logs_limited_to_sagemaker_endpoint_log_groups(template: Template) -> None:
    [s] = [s for s in execution_policy(template) if "logs:PutLogEvents" in s["Action"]]
    assert all("/aws/sagemaker/Endpoints/" in json.dumps(r) for r in s["Resource"])


def test_no_s3_access_without_an_s3_model(template: Template) -> None:
    assert not [s for s in execution_policy(template) if any(a.startswith("s3:") for a in s["Action"])]


S3_ISOLATED = SAGEMAKER_ENV.replace(
    "      hf_token_secret: kvfleet/hf-token\n", "      s3_uri: s3://model-bucket/llama/8b\n"
).replace("      platform: sagemaker\n", "      platform: sagemaker\n      network_isolation: true\n")


@pytest.fixture(scope="module")
def isolated() -> Template:
    return only(S3_ISOLATED)


def test_s3_model_is_read_from_its_prefix_uncompressed(isolated: Template) -> None:
    [model] = props(isolated, "AWS::SageMaker::Model")
    src = model["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    assert src == {"S3Uri": "s3://model-bucket/llama/8b/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    assert model["PrimaryContainer"]["Environment"][contract.ENV_MODEL] == contract.MODEL_DIR == "/opt/ml/model"
    stmts = execution_policy(isolated)
    [get] = [s for s in stmts if s["Action"] == "s3:GetObject"]
    assert json.dumps(get["Resource"]).endswith(':s3:::model-bucket/llama/8b/*"]]}')
    [lst] = [s for s in stmts if s["Action"] == "s3:ListBucket"]
    assert lst["Condition"] == {"StringLike": {"s3:prefix": ["llama/8b/*"]}}


def test_network_isolation(isolated: Template) -> None:
    [model] = props(isolated, "AWS::SageMaker::Model")
    assert model["EnableNetworkIsolation"] is True
    assert contract.ENV_HF_TOKEN_SECRET_ARN not in model["PrimaryContainer"]["Environment"]


# ---- autoscaling on the signals ----------------------------------------------------------------------


def test_scalable_target_on_the_variant(template: Template) -> None:
    [st] = props(template, "AWS::ApplicationAutoScaling::ScalableTarget")
    assert st["ServiceNamespace"] == "sagemaker"
    assert st["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert (st["MinCapacity"], st["MaxCapacity"]) == (1, 4)
    rid = st["ResourceId"]["Fn::Join"][1]
    assert rid[0] == "endpoint/" and rid[2] == "/variant/AllTraffic"
    assert rid[1]["Fn::GetAtt"][1] == "EndpointName"


def test_two_target_tracking_policies_on_saturation_and_queue(template: Template) -> None:
    policies = props(template, "AWS::ApplicationAutoScaling::ScalingPolicy")
    assert len(policies) == 2
    by_metric = {}
    for p in policies:
        assert p["PolicyType"] == "TargetTrackingScaling"
        cfg = p["TargetTrackingScalingPolicyConfiguration"]
        spec = cfg["CustomizedMetricSpecification"]
        assert spec["Namespace"] == contract.NAMESPACE
        assert spec["Dimensions"] == [{"Name": contract.DEPLOYMENT_DIMENSION, "Value": "test-chat"}]
        assert spec["Statistic"] == "Average"
        by_metric[spec["MetricName"]] = cfg
    assert set(by_metric) == {s.name for s in contract.SCALING_SIGNALS}
    assert by_metric[contract.REPLICA_SATURATION.name]["TargetValue"] == 0.75
    assert contract.KV_CACHE_UTILIZATION.name not in by_metric  # published and charted, not scaled on
    assert by_metric[contract.REQUESTS_WAITING.name]["TargetValue"] == 2
    for cfg in by_metric.values():
        # Fast out, slow in: scale-in waits at least 15 min and twice the drain budget.
        assert cfg["ScaleOutCooldown"] == 60
        assert cfg["ScaleInCooldown"] == max(900, 2 * 420)
        assert cfg["ScaleOutCooldown"] < cfg["ScaleInCooldown"]


def test_targets_come_from_the_config() -> None:
    text = SAGEMAKER_ENV.replace(
        "      drain_budget_s: 420\n",
        "      drain_budget_s: 600\n      saturation_target: 0.6\n      queue_depth_target: 5\n",
    )
    values = {
        p["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]["MetricName"]: p[
            "TargetTrackingScalingPolicyConfiguration"
        ]
        for p in props(only(text), "AWS::ApplicationAutoScaling::ScalingPolicy")
    }
    assert values["ReplicaSaturation"]["TargetValue"] == 0.6
    assert values["RequestsWaiting"]["TargetValue"] == 5
    assert values["RequestsWaiting"]["ScaleInCooldown"] == 1200


def test_fixed_size_has_no_scaling() -> None:
    text = SAGEMAKER_ENV.replace("max_replicas: 4", "max_replicas: 1")
    t = only(text)
    t.resource_count_is("AWS::ApplicationAutoScaling::ScalableTarget", 0)
    t.resource_count_is("AWS::ApplicationAutoScaling::ScalingPolicy", 0)


# ---- monitoring -------------------------------------------------------------------------------------


def dashboard_body(t: Template) -> str:
    [dash] = props(t, "AWS::CloudWatch::Dashboard")
    return json.dumps(dash["DashboardBody"])


def test_dashboard_shows_every_signal_and_the_platform(template: Template) -> None:
    body = dashboard_body(template)
    for s in contract.SIGNALS:
        assert s.name in body, s.name
    for needle in (
        "Time to first token",
        "Inter-token latency",
        "Output tokens/s",
        "Replica saturation",
        "Requests waiting",
        "Requests running",
        "Preemptions",
        "Invocation4XXErrors",
        "Invocation5XXErrors",
        "Instances",
        '\\"stat\\":\\"p50\\"',
        '\\"stat\\":\\"p95\\"',
    ):
        assert needle in body, needle


def alarm_metric(alarm: dict[str, Any]) -> dict[str, Any]:
    """Namespace, MetricName, Dimensions and Stat of a single-metric alarm, whichever shape CDK rendered."""
    if "Metrics" in alarm:
        [m] = alarm["Metrics"]
        stat = m["MetricStat"]
        return {**stat["Metric"], "Stat": stat["Stat"], "Period": stat["Period"]}
    return {
        "Namespace": alarm["Namespace"],
        "MetricName": alarm["MetricName"],
        "Dimensions": alarm["Dimensions"],
        "Stat": alarm["Statistic"],
        "Period": alarm["Period"],
    }


def alarms_by_id(t: Template) -> dict[str, dict[str, Any]]:
    return {k: r["Properties"] for k, r in t.find_resources("AWS::CloudWatch::Alarm").items()}


def test_alarms(template: Template) -> None:
    alarms = alarms_by_id(template)
    names = {k.split("Monitoring")[1].rstrip("0123456789ABCDEF") for k in alarms}
    assert {"Saturated", "QueueGrowing", "Preempting", "ServerErrorRate", "SignalsMissing", "Platform5xx"} <= names

    def find(prefix: str) -> dict[str, Any]:
        [a] = [v for k, v in alarms.items() if k.startswith("Monitoring" + prefix)]
        return a

    saturated = find("Saturated")
    assert alarm_metric(saturated)["MetricName"] == contract.REPLICA_SATURATION.name
    assert saturated["Threshold"] == 0.95
    assert saturated["EvaluationPeriods"] >= 10  # sustained, not a spike
    assert "sequence slots" in saturated["AlarmDescription"]
    assert find("QueueGrowing")["Threshold"] == 4 * 2.0
    missing = find("SignalsMissing")
    assert missing["TreatMissingData"] == "breaching"
    assert alarm_metric(missing)["Stat"] == "SampleCount"
    assert alarm_metric(missing)["MetricName"] == contract.REPLICA_SATURATION.name
    for a in alarms.values():
        if len(a.get("Metrics", ())) > 1:  # metric math: every metric it reads
            metrics = [
                {**m["MetricStat"]["Metric"], "Period": m["MetricStat"]["Period"]}
                for m in a["Metrics"]
                if "MetricStat" in m
            ]
        else:
            metrics = [alarm_metric(a)]
        for m in metrics:
            assert m["Period"] == 60
            if m["Namespace"] == contract.NAMESPACE:
                assert m["Dimensions"] == [{"Name": "Deployment", "Value": "test-chat"}]
        assert a["AlarmDescription"]


def test_tags_name_environment_deployment_and_model(template: Template) -> None:
    [endpoint] = props(template, "AWS::SageMaker::Endpoint")
    tags = {t["Key"]: t["Value"] for t in endpoint["Tags"]}
    assert tags == {
        "kvfleet:environment": "test",
        "kvfleet:deployment": "chat",
        "kvfleet:model": "meta-llama/Llama-3.1-8B",
    }


# ---- images and environments ---------------------------------------------------------------------------


DLC = (
    SAGEMAKER_ENV.replace("max_replicas: 4", "max_replicas: 1").replace("      hf_token_secret: kvfleet/hf-token\n", "")
    + "    image:\n      source: dlc\n"
)


def test_dlc_image_for_a_known_region() -> None:
    t = only(DLC)
    [model] = props(t, "AWS::SageMaker::Model")
    c = model["PrimaryContainer"]
    assert (
        c["Image"] == "763104351884.dkr.ecr.us-east-1.amazonaws.com/vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker"
    )
    env = c["Environment"]
    assert env["SM_VLLM_MODEL"] == "meta-llama/Llama-3.1-8B"
    assert env["SM_VLLM_MAX_NUM_SEQS"] == "16"
    assert env["SM_VLLM_ENABLE_PREFIX_CACHING"] == ""  # a bare flag
    assert not any(k.startswith("KVFLEET_") for k in env)
    # Without the agent there are no signals to alarm on; the platform's own 5xx alarm stays.
    names = " ".join(alarms_by_id(t))
    assert "SignalsMissing" not in names and "Platform5xx" in names
    [endpoint] = props(t, "AWS::SageMaker::Endpoint")
    assert "AutoRollbackConfiguration" not in endpoint["DeploymentConfig"]


def test_dlc_image_for_an_environment_agnostic_stack_maps_every_region() -> None:
    t = only(DLC.replace("region: us-east-1\n", ""))
    mappings = t.to_json()["Mappings"]
    [table] = [m for k, m in mappings.items() if "DlcImage" in k]
    assert len(table) > 20
    assert table["eu-west-1"]["account"] == "763104351884"
    assert table["eu-west-1"]["uri"].startswith("763104351884.dkr.ecr.eu-west-1.amazonaws.com/vllm:0.30.0-")
    [model] = props(t, "AWS::SageMaker::Model")
    assert "Fn::FindInMap" in model["PrimaryContainer"]["Image"]


def test_environment_agnostic_unless_the_config_names_account_and_region() -> None:
    text = SAGEMAKER_ENV.replace("region: us-east-1\n", "")
    app_templates = synth(text)
    assert list(app_templates) == ["kvfleet-test-chat"]


def test_one_stack_per_deployment_named_from_environment_and_deployment() -> None:
    second = SAGEMAKER_ENV.split("deployments:\n")[1].replace("name: chat", "name: summarize")
    text = SAGEMAKER_ENV + second
    assert sorted(synth(text)) == ["kvfleet-test-chat", "kvfleet-test-summarize"]


def test_sagemaker_target_type() -> None:
    env = environment()
    assert isinstance(env.deployments[0].target, SageMakerTarget)


@pytest.mark.parametrize("text", [SAGEMAKER_ENV, S3_ISOLATED, DLC], ids=["hf", "s3-isolated", "dlc"])
def test_cdk_nag_passes(text: str, tmp_path: Path) -> None:
    # AwsSolutions findings fail synth; every accepted one is acknowledged beside its cause.
    app = build_app(environment(text), app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    report = json.loads((tmp_path / "validation-report.json").read_text())
    assert report["pluginReports"] == []


def test_cdk_nag_passes_with_a_kms_encrypted_volume(tmp_path: Path) -> None:
    [r] = resolve_environment(environment())
    instance = dataclasses.replace(r.candidate.instance, local_nvme_gb=0)
    r = dataclasses.replace(r, candidate=dataclasses.replace(r.candidate, instance=instance))
    app = make_app(outdir=str(tmp_path))
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    DeploymentStack(app, "EbsOnly", resolved=r, alerts=alerts_for(app, r))
    app.synth()


def test_cdk_nag_catches_an_unacknowledged_wildcard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The gate can fail: without the acknowledgments the same stack does not synthesize.
    import kvfleet.targets.sagemaker.infra.endpoint as endpoint_module

    monkeypatch.setattr(endpoint_module, "acknowledge", lambda *a, **k: None)
    app = build_app(environment(), app=make_app(outdir=str(tmp_path)), nag=True)
    with pytest.raises(RuntimeError, match="ValidationFailed"):
        app.synth()
    assert "AwsSolutions-IAM5" in (tmp_path / "validation-report.json").read_text()


# ---- the host's NVIDIA driver runs the image's CUDA -----------------------------------------------------


def variant_of(t: Template) -> dict[str, Any]:
    [config] = props(t, "AWS::SageMaker::EndpointConfig")
    [variant] = config["ProductionVariants"]
    return dict(variant)


@pytest.mark.parametrize("text", [SAGEMAKER_ENV, DLC], ids=["kvfleet", "dlc"])
def test_variant_names_the_ami_whose_driver_runs_the_images_cuda(text: str) -> None:
    # The vLLM 0.30 DLC (and the kvfleet image built on it) is cu130; SageMaker's default hosts run driver
    # 470 or 535. The 580 AMI (CUDA 13.0) runs it natively.
    assert variant_of(only(text))["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"


def test_a_pinned_ami_is_used() -> None:
    text = SAGEMAKER_ENV.replace(
        "      platform: sagemaker\n",
        "      platform: sagemaker\n      inference_ami_version: al2023-ami-sagemaker-inference-gpu-4-1\n",
    )
    assert variant_of(only(text))["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"


def test_a_pinned_ami_too_old_for_the_image_fails_synth() -> None:
    from kvfleet.errors import KvfleetError

    text = SAGEMAKER_ENV.replace(
        "      platform: sagemaker\n",
        "      platform: sagemaker\n      inference_ami_version: al2-ami-sagemaker-inference-gpu-3-1\n",
    )
    with pytest.raises(KvfleetError, match=r"^deployments\[0\]\.target\.inference_ami_version: .*needs CUDA 13\.0"):
        only(text)


def test_no_ami_for_the_image_fails_synth(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host table without a CUDA 13 AMI (as the API listed it before the 580 AMI): synth refuses cu130.
    import copy

    from kvfleet.errors import KvfleetError
    from kvfleet.infra import cuda
    from kvfleet.targets.sagemaker.infra.hosts import HOSTS

    data = copy.deepcopy(cuda.host_data(HOSTS.package))
    data["hosts"] = data["hosts"][:-1]
    monkeypatch.setattr(cuda, "host_data", lambda package: data)
    cuda.hosts.cache_clear()
    try:
        with pytest.raises(KvfleetError, match=r"^deployments\[0\]\.engine\.version: the image .*needs CUDA 13\.0"):
            only()
    finally:
        cuda.hosts.cache_clear()


@pytest.mark.parametrize("name", ["dev", "prod"])
def test_the_example_environments_synthesize_on_an_ami_that_runs_them(name: str) -> None:
    from kvfleet.config.loader import load_environment

    env = load_environment(REPO / "environments" / f"{name}.yaml")
    app = build_app(env, app=make_app())
    templates = [Template.from_stack(c) for c in app.node.children if isinstance(c, cdk.Stack)]
    serving = [t for t in templates if t.find_resources("AWS::SageMaker::EndpointConfig")]
    assert serving
    for t in serving:
        assert variant_of(t)["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"


# ---- the region, for the agent's AWS clients ------------------------------------------------------------


@pytest.mark.parametrize("text", [SAGEMAKER_ENV, S3_ISOLATED, DLC], ids=["hf", "s3-isolated", "dlc"])
def test_container_environment_names_the_region(text: str) -> None:
    [model] = props(only(text), "AWS::SageMaker::Model")
    assert model["PrimaryContainer"]["Environment"][contract.REGION_VARIABLE] == {"Ref": "AWS::Region"}


# ---- updates keep the scaled instance count, and an instance-type change is spelled out ------------------


def test_update_keeps_the_scaled_instance_count_and_takes_the_rest_from_the_plan(template: Template) -> None:
    [endpoint] = props(template, "AWS::SageMaker::Endpoint")
    assert endpoint["RetainAllVariantProperties"] is True
    excluded = {p["VariantPropertyType"] for p in endpoint["ExcludeRetainedVariantProperties"]}
    # The values UpdateEndpoint accepts (botocore's VariantPropertyType), all but the instance count.
    assert excluded == {"DesiredWeight", "DataCaptureConfig"}


def test_fixed_size_update_takes_the_plans_count() -> None:
    [endpoint] = props(only(SAGEMAKER_ENV.replace("max_replicas: 4", "max_replicas: 1")), "AWS::SageMaker::Endpoint")
    assert endpoint["RetainAllVariantProperties"] is False
    assert "ExcludeRetainedVariantProperties" not in endpoint


def test_variant_property_names_are_the_apis() -> None:
    import gzip

    import botocore

    from kvfleet.targets.sagemaker.infra import endpoint as endpoint_module

    path = Path(botocore.__file__).parent / "data" / "sagemaker" / "2017-07-24" / "service-2.json.gz"
    model = json.loads(gzip.decompress(path.read_bytes()))
    assert set(endpoint_module.VARIANT_PROPERTIES) == set(model["shapes"]["VariantPropertyType"]["enum"])


def test_the_instance_type_change_of_a_scaled_variant_is_documented() -> None:
    # SageMaker fails an update that changes the instance type of a variant registered with Application Auto Scaling.
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "endpoint-scaling-update.html" in readme and "`scaling.min_replicas` equal to `max_replicas`" in readme
