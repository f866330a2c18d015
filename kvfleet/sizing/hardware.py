"""Accelerator and instance catalog, loaded from the package's data files into typed records.

Every figure carries its source (see ``data/SOURCES.md``). Memory is per GPU as AWS reports it
(DescribeInstanceTypes), which is what the engine sees — an A10G is 22.35 GiB, not 24.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib import resources

from kvfleet.errors import CatalogError
from kvfleet.sizing.hosting import PriceList
from kvfleet.sizing.units import GiB


class AcceleratorKind(StrEnum):
    GPU = "gpu"
    NEURON = "neuron"


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    name: str  # catalog key, e.g. "A10G"
    model: str  # e.g. "NVIDIA A10G"
    kind: AcceleratorKind
    architecture: str
    compute_capability: float | None
    memory_bytes: int | None  # as AWS reports it (DescribeInstanceTypes)
    # What CUDA reports as total memory, where a real engine log shows it (slightly below AWS's figure).
    engine_memory_bytes: int | None
    hbm_bandwidth_bytes_per_s: float | None
    bf16_flops: float | None  # dense, per second
    fp16_flops: float | None
    fp8_flops: float | None
    fp8_support: bool
    bf16_support: bool
    nvlink: str
    sources: str
    notes: str

    @property
    def memory_gib(self) -> float | None:
        return None if self.memory_bytes is None else self.memory_bytes / GiB

    @property
    def usable_memory_bytes(self) -> int | None:
        """The total the engine budgets against: CUDA's figure where known, else AWS's."""
        return self.engine_memory_bytes or self.memory_bytes


@dataclass(frozen=True, kw_only=True)
class Price:
    usd_per_hour: float
    region: str
    as_of: str
    source: str


@dataclass(frozen=True, kw_only=True)
class InstanceType:
    name: str  # EC2 name, e.g. "g5.12xlarge"
    family: str
    accelerator: Accelerator
    accelerator_count: int
    gpu_fraction: float | None  # vGPU slices (g6f): a fraction of one GPU
    gpu_memory_bytes: int | None  # per accelerator, as AWS reports it
    vcpus: int | None
    ram_gib: float | None
    nvlink: bool
    network_gbps: float | None
    efa: bool
    local_nvme_gb: int
    ec2_price: Price | None
    sagemaker_name: str | None  # "ml.g5.12xlarge"
    sagemaker_endpoint: bool  # accepted by SageMaker real-time endpoints
    sagemaker_price: Price | None
    spec_source: str
    notes: str

    @property
    def gpu_memory_gib(self) -> float | None:
        return None if self.gpu_memory_bytes is None else self.gpu_memory_bytes / GiB

    @property
    def usable_gpu_memory_bytes(self) -> int | None:
        """Per GPU, what the engine budgets against: CUDA's total where a log shows it, else AWS's."""
        if self.gpu_memory_bytes is None or self.gpu_fraction is not None:
            return self.gpu_memory_bytes
        return self.accelerator.engine_memory_bytes or self.gpu_memory_bytes

    def price(self, prices: PriceList) -> Price | None:
        """The on-demand price on a price list (the catalog's column for it)."""
        return self.sagemaker_price if prices is PriceList.SAGEMAKER else self.ec2_price


def _f(v: str) -> float | None:
    v = v.strip()
    return float(v) if v else None


def _rows(name: str) -> list[dict[str, str]]:
    text = resources.files("kvfleet.sizing").joinpath("data", name).read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


@cache
def accelerators() -> dict[str, Accelerator]:
    out: dict[str, Accelerator] = {}
    for r in _rows("accelerators.csv"):
        mem = _f(r["memory_gib"])
        engine_mem = _f(r["engine_memory_gib"])
        bw = _f(r["hbm_bandwidth_gbs"])
        out[r["accelerator"]] = Accelerator(
            name=r["accelerator"],
            model=r["model"],
            kind=AcceleratorKind(r["kind"]),
            architecture=r["architecture"],
            compute_capability=_f(r["compute_capability"]),
            memory_bytes=None if mem is None else round(mem * GiB),
            engine_memory_bytes=None if engine_mem is None else round(engine_mem * GiB),
            hbm_bandwidth_bytes_per_s=None if bw is None else bw * 1e9,
            bf16_flops=_tflops(r["bf16_tflops"]),
            fp16_flops=_tflops(r["fp16_tflops"]),
            fp8_flops=_tflops(r["fp8_tflops"]),
            fp8_support=r["fp8_support"] == "yes",
            bf16_support=r["bf16_support"] == "yes",
            nvlink=r["nvlink"],
            sources=r["sources"],
            notes=r["notes"],
        )
    return out


def _tflops(v: str) -> float | None:
    x = _f(v)
    return None if x is None else x * 1e12


@cache
def instances() -> dict[str, InstanceType]:
    accs = accelerators()
    out: dict[str, InstanceType] = {}
    for r in _rows("instances.csv"):
        mem = _f(r["gpu_memory_gib"])
        ec2 = _f(r["price_usd_hour"])
        sm = _f(r["sagemaker_price_usd_hour"])
        out[r["instance_type"]] = InstanceType(
            name=r["instance_type"],
            family=r["family"],
            accelerator=accs[r["accelerator"]],
            accelerator_count=int(r["accelerator_count"] or 0),
            gpu_fraction=_f(r["gpu_fraction"]),
            gpu_memory_bytes=None if mem is None else round(mem * GiB),
            vcpus=int(r["vcpus"]) if r["vcpus"] else None,
            ram_gib=_f(r["ram_gib"]),
            nvlink=r["nvlink"] == "yes",
            network_gbps=_f(r["network_gbps"]),
            efa=r["efa_supported"] == "yes",
            local_nvme_gb=int(float(r["local_nvme_gb"] or 0)),
            ec2_price=None
            if ec2 is None
            else Price(usd_per_hour=ec2, region=r["price_region"], as_of=r["price_as_of"], source=r["price_source"]),
            sagemaker_name=r["sagemaker_type"] or None,
            sagemaker_endpoint=r["sagemaker_endpoint"] == "yes",
            sagemaker_price=None
            if sm is None
            else Price(
                usd_per_hour=sm,
                region=r["sagemaker_price_region"],
                as_of=r["sagemaker_price_as_of"],
                source=r["sagemaker_price_source"],
            ),
            spec_source=r["spec_source"],
            notes=r["notes"],
        )
    return out


@dataclass(frozen=True, kw_only=True)
class RegionHint:
    key: str  # an instance type or a family
    regions: tuple[str, ...]
    purchase_mode: str
    as_of: str
    source: str


@cache
def region_hints() -> tuple[RegionHint, ...]:
    out = []
    for r in _rows("regions.csv"):
        regions = tuple(x.strip() for x in r["regions"].split(";") if "-" in x and " " not in x.strip())
        out.append(
            RegionHint(
                key=r["instance_or_family"],
                regions=regions,
                purchase_mode=r["purchase_mode"],
                as_of=r["as_of"],
                source=r["source"],
            )
        )
    return tuple(out)


def offered_in_region(it: InstanceType, region: str) -> bool | None:
    """True/False where the catalog has a region list for the type or its family; None where unknown."""
    hints = [h for h in region_hints() if h.key in (it.name, it.family) and h.regions]
    if not hints:
        return None
    return any(region in h.regions for h in hints)


def accelerator(name: str) -> Accelerator:
    accs = accelerators()
    for key, acc in accs.items():
        if name.lower() in (key.lower(), acc.model.lower()):
            return acc
    raise CatalogError(
        f"unknown accelerator {name!r}; known: {', '.join(accs)} (or give --gpu-memory-gib)", field="gpu"
    )


def instance(name: str) -> InstanceType:
    """Look up an EC2 (``g5.xlarge``) or SageMaker (``ml.g5.xlarge``) instance type."""
    key = name.removeprefix("ml.")
    its = instances()
    if key in its:
        return its[key]
    close = [n for n in its if n.split(".")[0] == key.split(".")[0]] or sorted(its)[:8]
    raise CatalogError(f"unknown instance type {name!r}; e.g. {', '.join(close[:8])}", field="instance_type")
