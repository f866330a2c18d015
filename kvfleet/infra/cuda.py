"""Which host runs which image: host -> NVIDIA driver -> the CUDA it runs; image -> the CUDA it needs.

The rules are data with their sources: NVIDIA's compatibility rules here (``data/cuda.json``), and each target's
host images in its folder (``kvfleet/targets/<name>/infra/hosts.json``, named by the target's ``HostRule``):
SageMaker's inference AMI versions (the ProductionVariant API reference, checked against botocore's service model in
tests/infra/test_cuda.py), the EC2 Deep Learning Base OSS NVIDIA Driver AMI on Amazon Linux 2023 (its SSM
parameter), the EKS ``AL2023_x86_64_NVIDIA`` AMI type. NVIDIA's rules:

- a driver runs natively every CUDA up to the toolkit it was released with;
- minor-version compatibility (CUDA 11 on): a CUDA X.y application runs on a driver of the same major family
  at or above that family's minimum branch, with a limited feature set;
- forward compatibility (the cuda-compat package, across major families) works on data center GPUs and listed
  driver branches only, and SageMaker's ``-1`` AMIs do not mount it: kvfleet never plans on it (the serving
  image sets it up at run time as a fallback, see containers/Dockerfile).

``host_for_image`` is pure: each target's construct calls it with its ``HostRule`` for the host setting it deploys
(SageMaker's ``InferenceAmiVersion``) or to check the AMI it runs on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from kvfleet.deployments import ResolvedDeployment
from kvfleet.errors import KvfleetError
from kvfleet.sizing.hardware import AcceleratorKind

CudaVersion = tuple[int, int]
Compatibility = Literal["native", "minor_version", "image_cuda_unknown"]

# cu130, cu128, cu124 in an image tag: the last digit is the minor version.
_CUDA_TAG = re.compile(r"(?:^|[-_:.])cu(?P<major>\d{2})(?P<minor>\d)(?=$|[-_.])")


@dataclass(frozen=True, kw_only=True)
class HostRule:
    """A target's host images: the ``hosts.json`` of its package (each row a setting, the driver branch it runs,
    optionally the CUDA it runs natively and whether it mounts cuda-compat) and the setting that picks one."""

    platform: str  # the target's name, in messages
    package: str  # the package whose hosts.json lists them
    field: str  # the environment file's key that picks the host, or words naming what does


@dataclass(frozen=True, kw_only=True)
class Host:
    """One host image a platform offers: the setting that selects it and the driver it runs."""

    platform: str
    setting: str  # SageMaker InferenceAmiVersion, EC2 SSM parameter, EKS AMI type
    driver_branch: int
    cuda: CudaVersion  # the newest CUDA the driver runs natively
    cuda_compat_mounting: bool = False  # SageMaker: the container toolkit mounts the image's cuda-compat libs

    def describe(self) -> str:
        return f"{self.setting} (driver {self.driver_branch}, CUDA {format_cuda(self.cuda)})"


@dataclass(frozen=True, kw_only=True)
class HostChoice:
    host: Host
    image_cuda: CudaVersion | None
    compatibility: Compatibility


def format_cuda(v: CudaVersion) -> str:
    return f"{v[0]}.{v[1]}"


def parse_cuda(text: str) -> CudaVersion:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def image_cuda(image: str) -> CudaVersion | None:
    """The CUDA an image is built for, from its tag (``vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker`` ->
    (13, 0), ``djl-inference:0.33.0-tensorrtllm0.21.0-cu128`` -> (12, 8)); None when the tag does not say."""
    tag = image.rsplit("/", 1)[-1].partition(":")[2] or image
    found = [(int(m["major"]), int(m["minor"])) for m in _CUDA_TAG.finditer(tag)]
    return found[-1] if found else None


@cache
def _data() -> dict[str, Any]:
    text = resources.files("kvfleet.infra").joinpath("data/cuda.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def driver_cuda(driver_branch: int) -> CudaVersion:
    """The newest CUDA a driver branch runs natively (the toolkit it was released with)."""
    known = sorted((int(b["branch"]), parse_cuda(b["cuda"])) for b in _data()["drivers"]["branches"])
    runs = [cuda for branch, cuda in known if branch <= driver_branch]
    if not runs:
        raise KvfleetError(f"NVIDIA driver branch {driver_branch} is older than any kvfleet knows")
    return runs[-1]


def compatibility(driver_branch: int, cuda: CudaVersion) -> Literal["native", "minor_version"] | None:
    """How a driver runs an application built for ``cuda``: natively, by minor-version compatibility, or not
    at all (forward compatibility is not planned on)."""
    native = driver_cuda(driver_branch)
    if cuda <= native:
        return "native"
    minimum = _data()["minor_version_compatibility"]["minimum_driver_branch"].get(str(cuda[0]))
    if minimum is not None and native[0] == cuda[0] and driver_branch >= int(minimum):
        return "minor_version"
    return None


@cache
def host_data(package: str) -> dict[str, Any]:
    """A target's ``hosts.json``, as its package holds it."""
    data: dict[str, Any] = json.loads(resources.files(package).joinpath("hosts.json").read_text(encoding="utf-8"))
    return data


@cache
def hosts(rule: HostRule) -> tuple[Host, ...]:
    """The host images a target offers, oldest driver first."""
    rows = [
        Host(
            platform=rule.platform,
            setting=h["setting"],
            driver_branch=int(h["driver_branch"]),
            # Where the data gives no CUDA, the newest the driver runs natively.
            cuda=parse_cuda(h["cuda"]) if "cuda" in h else driver_cuda(int(h["driver_branch"])),
            cuda_compat_mounting=bool(h.get("cuda_compat_mounting", False)),
        )
        for h in host_data(rule.package)["hosts"]
    ]
    if not rows:
        raise KvfleetError(f"{rule.package}/hosts.json lists no {rule.platform} host")
    return tuple(sorted(rows, key=lambda h: (h.driver_branch, h.setting)))


def host_for_image(
    *,
    rule: HostRule,
    image: str,
    cuda: CudaVersion | None = None,
    pinned: str | None = None,
    gpu: tuple[str, float] | None = None,
) -> HostChoice:
    """The host setting that runs ``image`` among the hosts ``rule`` lists: the pinned one if it runs the image,
    else the host with the newest driver that does. ``cuda`` is the image's CUDA when the caller knows it better than
    the tag (a kvfleet image inherits its base DLC's); None and an uninformative tag mean unknown, and the
    newest host is chosen. ``gpu`` (name, compute capability) is checked against the CUDA major's supported
    architectures. Raises KvfleetError (one line: the image's CUDA, what the hosts offer, what to
    change) when no host runs it."""
    offered = hosts(rule)
    platform, field = rule.platform, rule.field
    if pinned is not None:
        matching = [h for h in offered if h.setting == pinned]
        if not matching:
            raise KvfleetError(
                f"{pinned!r} is not a known {platform} host; known: {', '.join(h.setting for h in offered)}",
                field=field,
            )
        offered = tuple(matching)
    need = cuda if cuda is not None else image_cuda(image)
    if need is not None and gpu is not None:
        minimum = _data()["architectures"]["minimum_compute_capability"].get(str(need[0]))
        if minimum is not None and gpu[1] < float(minimum):
            raise KvfleetError(
                f"the image {image} needs CUDA {format_cuda(need)}, which does not support the {gpu[0]} (compute "
                f"capability {gpu[1]}, CUDA {need[0]} needs {minimum}); pin an engine.version whose image is built "
                f"for an older CUDA, or plan for a newer GPU",
                field="engine.version",
            )
    if need is None:
        return HostChoice(host=offered[-1], image_cuda=None, compatibility="image_cuda_unknown")
    for host in reversed(offered):
        how = compatibility(host.driver_branch, need)
        if how is not None:
            return HostChoice(host=host, image_cuda=need, compatibility=how)
    listed = "; ".join(h.describe() for h in offered)
    newest = max(h.cuda for h in hosts(rule))
    if pinned is not None:
        fix = f"set {field} to a host that runs CUDA {format_cuda(need)} or leave it unset"
    else:
        fix = f"pin an engine.version whose image is built for CUDA {format_cuda(newest)} or older"
    raise KvfleetError(
        f"the image {image} needs CUDA {format_cuda(need)}, and no {platform} host runs it ({listed}); {fix}",
        field=field if pinned is not None else "engine.version",
    )


def nvidia_gpu(r: ResolvedDeployment) -> tuple[str, float] | None:
    """The NVIDIA GPU (name, compute capability) the plan runs on; None for other accelerators (no CUDA host)."""
    acc = r.candidate.instance.accelerator
    if acc.kind != AcceleratorKind.GPU or acc.compute_capability is None:
        return None
    return acc.model, acc.compute_capability
