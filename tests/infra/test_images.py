"""DLC image URIs come from the SageMaker SDK's own table, offline, for every region."""

from __future__ import annotations

import pytest
from sagemaker.core import image_uris

from kvfleet.errors import KvfleetError
from kvfleet.infra.images import dlc_image, parse_ecr_uri


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
