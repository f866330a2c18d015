"""DLC image URIs come from the SageMaker SDK's own table, offline, for every region; the kvfleet image's tag digests
what it is built from, its build and push script skips a pushed tag (and, asked to, pushes as the CDK
image-publishing role while the base is pulled as the caller), and its repositories are one stack per account and
region."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template
from sagemaker.core import image_uris

from kvfleet import contract
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError
from kvfleet.infra.image_build import (
    DOCKERFILE,
    PACKAGED_CONTAINERS,
    ImageBuild,
    base_image,
    base_release,
    copied_sources,
    kvfleet_build,
    push_script,
    repository_name,
)
from kvfleet.infra.images import dlc_image, parse_ecr_uri
from kvfleet.infra.repository import ImageRepositoriesStack, publishing_role_arn
from tests.infra.helpers import REPO, make_app, only


@pytest.fixture(scope="module")
def vllm() -> object:
    return dlc_image(engine="vllm", engine_version="0.30.0", instance_type="ml.g6e.xlarge")


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1", "ap-east-1", "me-central-1", "us-west-2"])
def test_vllm_uri_equals_the_sdk(region: str) -> None:
    img = dlc_image(engine="vllm", engine_version="0.30.0", instance_type="ml.g6e.xlarge")
    want = image_uris.retrieve(framework="vllm", region=region, version="0.30.0", instance_type="ml.g6e.xlarge")
    assert img.in_region(region).uri == want


def test_short_version_is_the_same_release() -> None:
    a = dlc_image(engine="vllm", engine_version="0.30", instance_type="ml.g6e.xlarge")
    assert a.in_region("us-east-1").uri.split(":")[1].startswith("0.30.0-")


def test_trtllm_maps_to_the_djl_release_that_bundles_it() -> None:
    img = dlc_image(engine="trtllm", engine_version="0.21.0", instance_type="ml.p5.48xlarge")
    assert img.framework == "djl-tensorrtllm"
    assert img.version == "0.33.0"
    want = image_uris.retrieve(
        framework="djl-tensorrtllm", region="eu-south-2", version="0.33.0", instance_type="ml.p5.48xlarge"
    )
    assert img.in_region("eu-south-2").uri == want


def test_unpublished_vllm_release_lists_what_exists() -> None:
    with pytest.raises(KvfleetError) as info:
        dlc_image(engine="vllm", engine_version="0.11.0", instance_type="ml.g6e.xlarge")
    msg = str(info.value)
    assert msg.startswith("engine.version: no AWS vLLM container for vLLM 0.11.0; published: ")
    assert "0.30.0" in msg and "image.source kvfleet" in msg


def test_unbundled_trtllm_release_lists_what_exists() -> None:
    with pytest.raises(KvfleetError, match=r"bundled: .*0\.21\.0"):
        dlc_image(engine="trtllm", engine_version="1.0.0", instance_type="ml.p5.48xlarge")


def test_region_without_the_image() -> None:
    img = dlc_image(engine="vllm", engine_version="0.30.0", instance_type="ml.g6e.xlarge")
    with pytest.raises(KvfleetError, match=r"region: the vllm 0\.30\.0 container is not published in xx-nowhere-1"):
        img.in_region("xx-nowhere-1")
    assert all(not r.startswith("cn-") for r, _ in img.by_region)


def test_parse_ecr_uri() -> None:
    e = parse_ecr_uri("123456789012.dkr.ecr.eu-west-1.amazonaws.com/team/kvfleet-vllm:0.30.0")
    assert (e.account, e.region, e.repository) == ("123456789012", "eu-west-1", "team/kvfleet-vllm")
    with pytest.raises(KvfleetError, match="not an ECR image URI"):
        parse_ecr_uri("docker.io/vllm/vllm-openai:latest")


def test_dlc_cuda_comes_from_its_tag(vllm: object) -> None:
    from kvfleet.infra.images import DlcImage

    assert isinstance(vllm, DlcImage)
    assert vllm.cuda == (13, 0)  # vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker
    djl = dlc_image(engine="trtllm", engine_version="0.21.0", instance_type="ml.p5.48xlarge")
    assert djl.cuda == (12, 8)  # djl-inference:0.33.0-tensorrtllm0.21.0-cu128


URI = "    image:\n      source: uri\n      uri: 123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:{tag}\n"


@pytest.mark.parametrize(
    ("image", "want"),
    [
        ("    image:\n      source: dlc\n", (13, 0)),
        ("", (13, 0)),  # the kvfleet image inherits its base DLC's CUDA
        (URI.format(tag="0.30.0-kvfleet1-cu128"), (12, 8)),  # a build on another base says so in its build id
        (URI.format(tag="0.30.0-kvfleet1"), (13, 0)),
    ],
    ids=["dlc", "kvfleet", "uri-cu128", "uri-kvfleet"],
)
def test_serving_image_cuda(image: str, want: tuple[int, int] | None) -> None:
    from kvfleet import contract
    from kvfleet.deployments import resolve_environment
    from kvfleet.infra.images import serving_image_cuda
    from tests.envs import SAGEMAKER_ENV, environment

    text = SAGEMAKER_ENV.replace("      hf_token_secret: kvfleet/hf-token\n", "").replace(
        "max_replicas: 4", "max_replicas: 1"
    )
    text += image.replace("kvfleet1", f"kvfleet{contract.CONTRACT_VERSION}")
    [r] = resolve_environment(environment(text))
    assert serving_image_cuda(r) == want


# ---- the kvfleet image as a build ----------------------------------------------------------------------------------


def _checkout(tmp_path: Path) -> Path:
    """A copy of what the image is built from (the Dockerfile and what it copies), to change one file of."""
    for name in ("containers/Dockerfile", *copied_sources((REPO / "containers/Dockerfile").read_text())):
        src, dst = REPO / name, tmp_path / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return tmp_path


def _tag(root: Path, **kw: str) -> str:
    args = {"engine": "vllm", "engine_version": "0.30.0", "region": "us-east-1", "instance_type": "g6e.xlarge"}
    return kvfleet_build(**{**args, **kw}, root=root).tag


def test_the_tag_names_release_contract_and_inputs_and_changes_with_each(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    tag = _tag(root)
    assert contract.parse_image_tag(tag) == ("0.30.0", contract.CONTRACT_VERSION)
    assert re.fullmatch(rf"0\.30\.0-kvfleet{contract.CONTRACT_VERSION}-[0-9a-f]{{12}}", tag)
    assert _tag(root) == tag  # deterministic: no clock, no git
    assert _tag(REPO) == _tag(REPO)
    (root / "kvfleet/agent/__pycache__").mkdir(exist_ok=True)
    (root / "kvfleet/agent/__pycache__/server.cpython-311.pyc").write_bytes(b"\0")
    assert _tag(root) == tag  # what the build context leaves out is no input
    assert _tag(root, region="eu-west-1") != tag  # another base image (the region's AWS container)
    assert _tag(root, engine_version="0.29.0") != tag
    server = root / "kvfleet/agent/server.py"
    server.write_text(server.read_text() + "\n# a change to the agent\n")
    changed = _tag(root)
    assert changed != tag  # an agent change is a new image in every stack
    (root / "containers/Dockerfile").write_text((root / "containers/Dockerfile").read_text() + "\n# x\n")
    assert _tag(root) != changed


def test_every_file_the_dockerfile_copies_is_an_input() -> None:
    # The Dockerfile's own COPY lines give the inputs: a new COPY cannot be left out of the tag.
    sources = copied_sources((REPO / "containers/Dockerfile").read_text())
    assert {"kvfleet/contract.py", "kvfleet/engines/", "kvfleet/agent/", "containers/agent-requirements.txt"} <= set(
        sources
    )
    assert copied_sources("FROM x\nCOPY --chown=1:1 a b \\\n  c /dst/\nCOPY --from=build /x /y\n") == ("a", "b", "c")


def test_the_build_passes_the_dockerfiles_args_and_its_contract_check() -> None:
    b = kvfleet_build(engine="vllm", engine_version="0.30.0", region="us-east-1", instance_type="g6e.xlarge")
    dockerfile = (REPO / "containers/Dockerfile").read_text()
    declared = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    assert set(b.build_args) <= declared
    # The Dockerfile fails the build unless CONTRACT_VERSION is contract.py's (its last RUN check).
    assert b.build_args["CONTRACT_VERSION"] == str(contract.CONTRACT_VERSION)
    assert "engines.adapter(sys.argv[1])" in dockerfile and '"${ENGINE}" "${CONTRACT_VERSION}"' in dockerfile
    # us-east-1 at the Dockerfile's release is the Dockerfile's default base, and the adapter's.
    assert b.base_image == ENGINES["vllm"].default_base_image
    assert f"ARG BASE_IMAGE={b.base_image}" in dockerfile
    cmd = b.docker_build("r/kvfleet-vllm:" + b.tag)
    assert cmd[:4] == ["docker", "build", "-f", "containers/Dockerfile"] and cmd[-1] == "."


def test_the_push_script_skips_a_pushed_tag_and_stops_at_a_failed_build(tmp_path: Path) -> None:
    b = kvfleet_build(engine="vllm", engine_version="0.30.0", region="eu-west-1", instance_type="g6e.xlarge")
    [line] = push_script([b, b], account="123456789012", region="eu-west-1")
    uri = f"123456789012.dkr.ecr.eu-west-1.amazonaws.com/kvfleet-vllm:{b.tag}"
    assert f"--image-ids imageTag={b.tag} " in line and f"docker push {uri}" in line
    # Run by sh with fakes of aws and docker: a pushed tag builds nothing, a failed build pushes nothing.
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "log"
    for tool in ("aws", "docker"):
        (bin_ / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {log}\n! echo "$1 $2" | grep -Eqx "$FAIL"\n')
        (bin_ / tool).chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin"}
    subprocess.run(["sh", "-euc", line], env={**env, "FAIL": "none"}, check=True)
    assert "docker build" not in log.read_text()
    log.unlink()
    done = subprocess.run(["sh", "-euc", line], env={**env, "FAIL": "ecr describe-images"}, check=False)
    assert done.returncode == 0 and f"docker push {uri}" in log.read_text()
    log.unlink()
    done = subprocess.run(["sh", "-euc", line], env={**env, "FAIL": "ecr describe-images|build -f"}, check=False)
    assert done.returncode != 0 and "docker push" not in log.read_text()


def test_a_role_pushes_and_the_callers_credentials_pull_the_base() -> None:
    b = kvfleet_build(engine="vllm", engine_version="0.30.0", region="eu-west-1", instance_type="g6e.xlarge")
    role = publishing_role_arn("123456789012", "eu-west-1")
    lines = push_script([b], account="123456789012", region="eu-west-1", role_arn=role)
    assert lines[0].startswith(f"creds=$(aws sts assume-role --role-arn {role} ")
    assert 'AWS_SESSION_TOKEN="$(echo "$creds" | cut -f3)" aws ecr describe-images' in lines[1]
    base_registry = b.base_image.split("/")[0]
    assert (
        f"aws ecr get-login-password --region eu-west-1 | docker login --username AWS --password-stdin {base_registry}"
        in lines[1]
    )


def test_without_the_dockerfile_or_its_packaged_copy_a_tag_is_asked_for(tmp_path: Path) -> None:
    with pytest.raises(KvfleetError) as err:
        _tag(tmp_path)
    assert err.value.field == "image.tag" and "\n" not in str(err.value)


def test_an_installed_layout_computes_the_checkouts_tag(tmp_path: Path) -> None:
    # An install has kvfleet/ and no containers/: the Dockerfile and the requirements it copies come as package data
    # (kvfleet/infra/containers, a link to containers/ in the checkout). tests/test_install.py does it with the wheel.
    root = _checkout(tmp_path / "checkout")
    installed = tmp_path / "site-packages"
    shutil.copytree(root / "kvfleet", installed / "kvfleet")
    shutil.copytree(root / "containers", installed / PACKAGED_CONTAINERS)
    assert _tag(installed) == _tag(root) == _tag(REPO)
    assert (REPO / PACKAGED_CONTAINERS / "Dockerfile").read_bytes() == (REPO / DOCKERFILE).read_bytes()
    (installed / PACKAGED_CONTAINERS / "agent-requirements.txt").write_text("aiohttp==0\n", encoding="utf-8")
    assert _tag(installed) != _tag(root)  # the packaged copy is read, not skipped


def test_the_base_runs_the_release_the_tag_names() -> None:
    # The region's own container of the release; where AWS publishes it elsewhere only, the same release's from the
    # Dockerfile's default region (the pushed image is the region's own; only its build pulls across regions).
    assert base_release(base_image("vllm", "0.29.0", "eu-west-1", "g6e.xlarge")) == "0.29.0"
    assert ".eu-west-1." in base_image("vllm", "0.29.0", "eu-west-1", "g6e.xlarge")
    elsewhere = base_image("vllm", "0.29.0", "xx-nowhere-1", "g6e.xlarge")
    assert ".us-east-1." in elsewhere and base_release(elsewhere) == "0.29.0"
    assert base_image("trtllm", "1.0.0", "eu-west-1", "p5.48xlarge") == ENGINES["trtllm"].default_base_image
    assert base_release("nvcr.io/nvidia/tensorrt-llm/release:1.0.0") == "1.0.0"
    assert (
        base_release("x.dkr.ecr.us-east-1.amazonaws.com/vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker") == "0.30.0"
    )
    assert base_release("example.com/img:latest") is None and base_release("localhost:5000/img") is None


@pytest.mark.parametrize(
    ("engine", "release", "fix"),
    [
        ("vllm", "0.34.0", "pin engine.version to a published release"),  # modelled, but no AWS container
        ("trtllm", "0.21.0", "pin engine.version: 1.0.0"),  # NVIDIA's base runs 1.0.0
    ],
)
def test_a_release_no_base_runs_is_refused_naming_what_to_set(engine: str, release: str, fix: str) -> None:
    # Before, the build fell back to the adapter's default base: an image tagged for one release running another.
    with pytest.raises(KvfleetError) as err:
        kvfleet_build(engine=engine, engine_version=release, region="us-east-1", instance_type="p5.48xlarge")
    e = err.value
    assert e.field == "engine.version" and "\n" not in str(e)
    assert fix in e.message and "image.tag" in e.message and "--build-arg BASE_IMAGE=<an image of " in e.message


# ---- the repositories ----------------------------------------------------------------------------------------------


def test_one_repository_per_engine_scanned_immutable_retained_and_pushable_by_the_bootstrap_role() -> None:
    app = make_app()
    stack = ImageRepositoriesStack(app, "Images", env=cdk.Environment(account="123456789012", region="eu-west-1"))
    repos = Template.from_stack(stack).find_resources("AWS::ECR::Repository")
    assert sorted(r["Properties"]["RepositoryName"] for r in repos.values()) == sorted(
        repository_name(e) for e in ENGINES
    )
    for r in repos.values():
        p = r["Properties"]
        assert p["ImageScanningConfiguration"] == {"ScanOnPush": True} and p["ImageTagMutability"] == "IMMUTABLE"
        assert r["DeletionPolicy"] == "Retain"  # a destroyed stack leaves the images fleets run
        assert json.loads(p["LifecyclePolicy"]["LifecyclePolicyText"])["rules"][0]["selection"]["tagStatus"] == (
            "untagged"
        )
        [statement] = p["RepositoryPolicyText"]["Statement"]
        principal = json.dumps(statement["Principal"])
        assert ":iam::123456789012:role/cdk-hnb659fds-image-publishing-role-123456789012-eu-west-1" in principal
        assert "ecr:PutImage" in statement["Action"]
    assert stack.stack_name == "kvfleet-images"  # one per account and region, whoever deploys it


def test_the_repositories_stack_is_the_same_for_every_environment() -> None:
    # Two environments in one account and region deploy one stack to one template: no second stack creates a
    # repository that exists. Its template depends on the engine registry alone.
    place = cdk.Environment(account="123456789012", region="eu-west-1")
    a = Template.from_stack(ImageRepositoriesStack(make_app(), "A", env=place)).to_json()
    b = Template.from_stack(ImageRepositoriesStack(make_app(), "B", env=place)).to_json()
    assert a == b


def test_the_stacks_name_the_built_tag() -> None:
    t = only()
    want = kvfleet_build(engine="vllm", engine_version="0.30.0", region=None, instance_type="g6e.xlarge").tag
    assert f"kvfleet-vllm:{want}" in json.dumps(t.to_json())


# ---- pushing as the image-publishing role ----------------------------------------------------------------------------


def _fakes(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """aws and docker stand-ins logging each call with the access key it ran under; `aws sts assume-role` answers
    with the role's keys as the script's --query prints them, and any call matching $FAIL fails."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "log"
    for tool in ("aws", "docker"):
        body = f'#!/bin/sh\necho "[${{AWS_ACCESS_KEY_ID:-caller}}] {tool} $*" >> {log}\n'
        if tool == "aws":
            body += 'if [ "$1 $2" = "sts assume-role" ]; then printf "ROLEKEY\\tROLESECRET\\tROLETOKEN\\n"; fi\n'
        body += '! echo "$1 $2" | grep -Eqx "$FAIL"\n'
        (bin_ / tool).write_text(body)
        (bin_ / tool).chmod(0o755)
    return {"PATH": f"{bin_}:/usr/bin:/bin", "FAIL": "ecr describe-images"}, log


def test_make_image_can_push_as_the_publishing_role_and_pulls_the_base_as_the_caller(tmp_path: Path) -> None:
    from kvfleet.infra.repository import ASSUME_FLAG, _script

    # The script `make image ENV=dev ASSUME_PUBLISHING_ROLE=1` writes and runs (sh -eu), with stand-ins.
    dev = str(REPO / "environments" / "dev.yaml")
    lines = _script([dev, ASSUME_FLAG])
    env, log = _fakes(tmp_path)
    subprocess.run(["sh", "-euc", "\n".join(lines)], env=env, check=True, timeout=60)
    calls = log.read_text().splitlines()
    role = publishing_role_arn("222222222222", "us-east-1")
    assert calls[0].startswith(f"[caller] aws sts assume-role --role-arn {role} ")
    by_key = {c.split("] ", 1)[1].split(" --")[0]: c.split("]")[0] for c in calls}
    assert by_key["aws ecr describe-images"] == "[ROLEKEY"  # the repository's policy lets the role read its tags
    pushed = [c for c in calls if " docker push " in c]
    assert pushed and pushed[0].split(" docker push ")[1].startswith("222222222222.dkr.ecr.us-east-1.amazonaws.com/")
    logins = [c for c in calls if "aws ecr get-login-password" in c]
    # The base from AWS's registry as the caller (the role may pull only from the bootstrap's own repository), the
    # push registry's login as the role.
    assert [c.split("]")[0] for c in logins] == ["[caller", "[ROLEKEY"]
    # Without the flag every call runs as the caller, as before.
    log.unlink()
    subprocess.run(["sh", "-euc", "\n".join(_script([dev]))], env=env, check=True, timeout=60)
    assert all(c.startswith("[caller]") for c in log.read_text().splitlines())
    with pytest.raises(KvfleetError, match=r"usage: python -m kvfleet\.infra\.repository --script"):
        _script([dev, "--as-me"])


def test_the_make_target_passes_the_flag_only_when_asked() -> None:
    def dry(*args: str) -> str:
        done = subprocess.run(
            ["make", "-n", "image", "ENV=dev", *args], check=False, cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        [line] = [x for x in done.stdout.replace("\\\n", " ").splitlines() if "--script dev" in x]
        return " ".join(line.split())

    assert "--script dev --assume-publishing-role > cdk.out/images/push.sh" in dry("ASSUME_PUBLISHING_ROLE=1")
    assert "--script dev > cdk.out/images/push.sh" in dry()


def test_the_bases_are_pulled_from_their_repositories_in_awss_account() -> None:
    from kvfleet.infra.image_build import base_repositories
    from kvfleet.infra.repository import partition_of

    b = kvfleet_build(engine="vllm", engine_version="0.30.0", region="eu-west-1", instance_type="g6e.xlarge")
    assert base_repositories([b, b]) == ["arn:aws:ecr:eu-west-1:763104351884:repository/vllm"]
    assert [partition_of(r) for r in ("us-east-1", "cn-north-1", "us-gov-west-1")] == ["aws", "aws-cn", "aws-us-gov"]
    nvidia = ImageBuild(
        engine="trtllm", engine_version="1.0.0", base_image="nvcr.io/nvidia/x:1", repository="r", tag="t"
    )
    assert base_repositories([nvidia]) == []  # a public registry: no AWS permission involved
