"""`kvfleet instances`: the accelerator and instance catalog."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvfleet.targets import TARGETS

if TYPE_CHECKING:
    from kvfleet.sizing.hardware import InstanceType
    from kvfleet.sizing.hosting import PriceList

from kvfleet.cli.args import (
    _console,
)


def add_parser(sub: Any) -> None:
    i = sub.add_parser("instances", help="the accelerator and instance catalog")
    i.add_argument("--platform", choices=list(TARGETS))
    i.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    from kvfleet.sizing.hardware import instances
    from kvfleet.sizing.hosting import PriceList

    # The target's hosting says whose names and prices apply and which types it takes; no target: EC2's.
    hosting = TARGETS[a.platform].hosting if a.platform else None
    prices = hosting.price_list if hosting is not None else PriceList.EC2
    rows = [
        _row(it, prices)
        for it in instances().values()
        if not (hosting is not None and hosting.endpoint_types_only and not it.sagemaker_endpoint)
    ]
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    _console().print(_table(rows, a.platform))
    return 0


def _row(it: InstanceType, prices: PriceList) -> dict[str, Any]:
    from kvfleet.sizing.hosting import PriceList

    acc = it.accelerator
    price = it.price(prices)
    return {
        "instance_type": it.sagemaker_name if prices is PriceList.SAGEMAKER else it.name,
        "accelerator": acc.name,
        "kind": acc.kind.value,
        "count": it.accelerator_count,
        "gpu_fraction": it.gpu_fraction,
        "gpu_memory_gib": None if it.gpu_memory_gib is None else round(it.gpu_memory_gib, 3),
        "hbm_bandwidth_gbs": None if acc.hbm_bandwidth_bytes_per_s is None else acc.hbm_bandwidth_bytes_per_s / 1e9,
        "bf16_tflops": None if acc.bf16_flops is None else acc.bf16_flops / 1e12,
        "fp8_tflops": None if acc.fp8_flops is None else acc.fp8_flops / 1e12,
        "fp8_support": acc.fp8_support,
        "vcpus": it.vcpus,
        "ram_gib": it.ram_gib,
        "sagemaker_endpoint": it.sagemaker_endpoint,
        "usd_per_hour": None if price is None else price.usd_per_hour,
        "price_as_of": None if price is None else price.as_of,
        "price_source": None if price is None else price.source,
    }


def _table(rows: list[dict[str, Any]], platform: str | None) -> Any:
    from rich.table import Table

    t = Table(title=f"{len(rows)} instance types" + (f" ({platform})" if platform else ""))
    columns = ("type", "accelerator", "n", "GiB/GPU", "GB/s", "bf16 TF", "fp8", "vCPU", "$/h", "as of", "SageMaker")
    for col in columns:
        t.add_column(col, justify="left" if col in ("type", "accelerator") else "right")

    def fmt(v: object) -> str:
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

    for r in rows:
        t.add_row(
            str(r["instance_type"]),
            str(r["accelerator"]),
            fmt(r["count"]),
            fmt(r["gpu_memory_gib"]),
            fmt(r["hbm_bandwidth_gbs"]),
            fmt(r["bf16_tflops"]),
            "yes" if r["fp8_support"] else "no",
            fmt(r["vcpus"]),
            fmt(r["usd_per_hour"]),
            fmt(r["price_as_of"]),
            "yes" if r["sagemaker_endpoint"] else "no",
        )
    return t
