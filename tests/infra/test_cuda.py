"""Host -> driver -> CUDA, and image -> CUDA: checked against AWS's own published rows where one ships with the
SDKs (botocore's SageMaker service model), and each rule shown to refuse what it must refuse."""

from __future__ import annotations

import copy
import gzip
import json
import re
from pathlib import Path
from typing import Any

import botocore
import pytest

from kvfleet.errors import KvfleetError
from kvfleet.infra import cuda
from kvfleet.infra.images import _releases, dlc_image
from kvfleet.targets.ec2.config import Ec2Target
from kvfleet.targets.ec2.infra.hosts import HOSTS as EC2
from kvfleet.targets.eks.infra.hosts import HOSTS as EKS
from kvfleet.targets.sagemaker.infra.hosts import HOSTS as SAGEMAKER

DLC_CU130 = "763104351884.dkr.ecr.us-east-1.amazonaws.com/vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker"


def sagemaker_model() -> dict[str, Any]:
    path = Path(botocore.__file__).parent / "data" / "sagemaker" / "2017-07-24" / "service-2.json.gz"
    model: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return model


def documented_amis(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """ProductionVariant.InferenceAmiVersion's documentation: name -> driver branch, CUDA, compat mounting."""
    doc = model["shapes"]["ProductionVariant"]["members"]["InferenceAmiVersion"]["documentation"]
    out = {}
    for name, body in re.findall(r"<dt>([^<]+)</dt>\s*<dd>(.*?)</dd>", doc, flags=re.S):
        driver = re.search(r"NVIDIA driver version: (\d+)", body)
        version = re.search(r"CUDA version: (\d+\.\d+)", body)
        if driver and version:
            out[name] = {
                "driver_branch": int(driver[1]),
                "cuda": version[1],
                "cuda_compat_mounting": "disabled CUDA-compat mounting" not in body,
            }
    return out


def check_sagemaker_rows(rows: list[dict[str, Any]], model: dict[str, Any]) -> list[str]:
    """The data's inference AMI rows are exactly the GPU AMIs the API lists, with the documented driver/CUDA."""
    enum = [v for v in model["shapes"]["ProductionVariantInferenceAmiVersion"]["enum"] if "-gpu-" in v]
    documented = documented_amis(model)
    problems = []
    ours = {r["setting"]: {k: r[k] for k in ("driver_branch", "cuda", "cuda_compat_mounting")} for r in rows}
    for name in enum:
        if name not in ours:
            problems.append(f"{name}: listed by the API, missing from hosts.json")
        elif ours[name] != documented.get(name):
            problems.append(f"{name}: hosts.json says {ours[name]}, the API reference {documented.get(name)}")
    problems += [f"{name}: not a value the API accepts" for name in ours if name not in enum]
    return problems


def test_sagemaker_amis_are_the_apis() -> None:
    model = sagemaker_model()
    assert check_sagemaker_rows(cuda.host_data(SAGEMAKER.package)["hosts"], model) == []
    # Today's newest: driver 580, CUDA 13.0.
    assert cuda.hosts(SAGEMAKER)[-1].setting == "al2023-ami-sagemaker-inference-gpu-4-1"


def test_sagemaker_ami_check_fails_on_drift() -> None:
    model = sagemaker_model()
    rows = copy.deepcopy(cuda.host_data(SAGEMAKER.package)["hosts"])
    rows[-1]["cuda"] = "12.8"
    rows.append(
        {
            "setting": "al2-ami-sagemaker-inference-gpu-9",
            "driver_branch": 999,
            "cuda": "99.0",
            "cuda_compat_mounting": 0,
        }
    )
    problems = check_sagemaker_rows(rows[1:], model)
    assert any(p.startswith("al2-ami-sagemaker-inference-gpu-2: listed by the API") for p in problems)
    assert any("al2023-ami-sagemaker-inference-gpu-4-1: hosts.json says" in p for p in problems)
    assert any("gpu-9: not a value the API accepts" in p for p in problems)


def test_ec2_hosts_are_the_default_parameter_and_dlami_releases() -> None:
    # The default parameter (as of its release) and each release a lock may pin, by the AMI name DescribeImages gives.
    default = Ec2Target.model_fields["ami_parameter"].default
    hosts = {h.setting: h for h in cuda.hosts(EC2)}
    assert default in hosts
    releases = [s for s in hosts if s != default]
    assert releases and all(
        s.startswith("Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) ") for s in releases
    )
    # The parameter's row is as of the newest release it names.
    newest = max(releases, key=lambda s: s.rsplit(" ", 1)[1])
    assert hosts[default].driver_branch == hosts[newest].driver_branch
    [eks] = cuda.hosts(EKS)
    assert eks.setting == "AL2023_x86_64_NVIDIA" and eks.driver_branch == 580


@pytest.mark.parametrize(
    ("image", "want"),
    [
        (DLC_CU130, (13, 0)),
        ("763104351884.dkr.ecr.us-east-1.amazonaws.com/djl-inference:0.33.0-tensorrtllm0.21.0-cu128", (12, 8)),
        ("123456789012.dkr.ecr.eu-west-1.amazonaws.com/team/img:1.0-cu124", (12, 4)),
        ("123456789012.dkr.ecr.eu-west-1.amazonaws.com/kvfleet-vllm:0.30.0-kvfleet1", None),
        ("123456789012.dkr.ecr.eu-west-1.amazonaws.com/cu130/x:latest", None),  # a repository name says nothing
    ],
)
def test_image_cuda_from_the_tag(image: str, want: tuple[int, int] | None) -> None:
    assert cuda.image_cuda(image) == want


@pytest.mark.parametrize("framework", ["vllm", "djl-tensorrtllm"])
def test_every_published_dlc_names_its_cuda(framework: str) -> None:
    for release in _releases(framework):
        engine = "vllm" if framework == "vllm" else "trtllm"
        if engine == "trtllm":
            tag = str(_releases(framework)[release]["tag_prefix"])
            version = tag.split("tensorrtllm")[1].split("-", maxsplit=1)[0]
            instance = "ml.p5.48xlarge"
        else:
            version, instance = release, "ml.g6e.xlarge"
        img = dlc_image(engine=engine, engine_version=version, instance_type=instance)
        assert img.cuda is not None, (framework, release)


def test_driver_cuda_rules() -> None:
    assert cuda.driver_cuda(470) == (11, 4)
    assert cuda.driver_cuda(535) == (12, 2)
    assert cuda.driver_cuda(580) == (13, 0)
    assert cuda.compatibility(580, (13, 0)) == "native"
    assert cuda.compatibility(580, (12, 8)) == "native"
    # Minor-version compatibility: same major family, at or above its minimum branch.
    assert cuda.compatibility(535, (12, 8)) == "minor_version"
    assert cuda.compatibility(550, (12, 9)) == "minor_version"
    # Across major families only the cuda-compat package helps, which is not planned on.
    assert cuda.compatibility(550, (13, 0)) is None
    assert cuda.compatibility(535, (13, 0)) is None
    assert cuda.compatibility(470, (12, 2)) is None  # CUDA 12 needs branch 525 or newer


def test_sagemaker_defaults_cannot_run_the_default_image() -> None:
    # Why the variant must name an AMI: the hosts SageMaker picks without one run driver 470 or 535.
    for row in cuda.host_data(SAGEMAKER.package)["defaults"]:
        assert cuda.compatibility(int(row["driver_branch"]), (13, 0)) is None


def test_cu130_gets_the_580_ami() -> None:
    choice = cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130)
    assert choice.host.setting == "al2023-ami-sagemaker-inference-gpu-4-1"
    assert (choice.image_cuda, choice.compatibility) == ((13, 0), "native")


def test_cu128_prefers_the_newest_driver_and_accepts_a_pinned_older_one() -> None:
    img = "x.dkr.ecr.us-east-1.amazonaws.com/djl-inference:0.33.0-tensorrtllm0.21.0-cu128"
    assert cuda.host_for_image(rule=SAGEMAKER, image=img).host.driver_branch == 580
    pinned = cuda.host_for_image(rule=SAGEMAKER, image=img, pinned="al2-ami-sagemaker-inference-gpu-2")
    assert (pinned.host.setting, pinned.compatibility) == ("al2-ami-sagemaker-inference-gpu-2", "minor_version")


def test_a_pinned_ami_that_cannot_run_the_image_is_refused() -> None:
    with pytest.raises(KvfleetError) as info:
        cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130, pinned="al2-ami-sagemaker-inference-gpu-3-1")
    [line] = str(info.value).splitlines()
    assert line.startswith("target.inference_ami_version: the image ")
    assert "needs CUDA 13.0" in line and "driver 550, CUDA 12.4" in line


def test_an_unknown_pinned_ami_lists_the_known() -> None:
    with pytest.raises(KvfleetError, match=r"not a known sagemaker host; known: .*gpu-4-1"):
        cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130, pinned="al2-ami-sagemaker-inference-gpu-7")


def test_without_a_cuda_13_host_the_error_says_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    # The data as it stood before AWS listed the 580 AMI: nothing runs cu130.
    data = copy.deepcopy(cuda.host_data(SAGEMAKER.package))
    data["hosts"] = [a for a in data["hosts"] if a["driver_branch"] < 580]
    monkeypatch.setattr(cuda, "host_data", lambda package: data)
    cuda.hosts.cache_clear()
    try:
        with pytest.raises(KvfleetError) as info:
            cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130)
    finally:
        cuda.hosts.cache_clear()
    [line] = str(info.value).splitlines()
    assert line.startswith("engine.version: the image ") and "needs CUDA 13.0" in line
    assert "al2-ami-sagemaker-inference-gpu-3-1 (driver 550, CUDA 12.4)" in line
    assert "built for CUDA 12.4 or older" in line


def test_unknown_image_cuda_gets_the_newest_host() -> None:
    choice = cuda.host_for_image(rule=EKS, image="nvcr.io/nvidia/tensorrt-llm/release:1.0.0")
    assert choice.compatibility == "image_cuda_unknown" and choice.host.setting == "AL2023_x86_64_NVIDIA"


def test_cuda_13_refuses_a_gpu_older_than_turing() -> None:
    # CUDA 13.0 dropped Maxwell, Pascal and Volta (compute capability below 7.5): a V100 cannot run cu130.
    with pytest.raises(
        KvfleetError, match=r"^engine\.version: .*does not support the NVIDIA V100 \(compute capability 7\.0"
    ):
        cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130, gpu=("NVIDIA V100", 7.0))
    assert cuda.host_for_image(rule=SAGEMAKER, image=DLC_CU130, gpu=("NVIDIA T4", 7.5)).host.driver_branch == 580
    cu128 = "x.dkr.ecr.us-east-1.amazonaws.com/djl-inference:0.33.0-tensorrtllm0.21.0-cu128"
    assert cuda.host_for_image(rule=SAGEMAKER, image=cu128, gpu=("NVIDIA V100", 7.0)).compatibility == "native"
