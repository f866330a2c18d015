"""The accelerator and instance catalog: AWS-reported memory, sources, prices with dates."""

from __future__ import annotations

import pytest

from kvfleet.errors import CatalogError
from kvfleet.sizing.hardware import AcceleratorKind, accelerator, accelerators, instance, instances, offered_in_region
from kvfleet.sizing.units import GiB


def test_memory_is_what_aws_reports() -> None:
    # DescribeInstanceTypes (Karpenter instance-types.md): A10G and L4 22,888 MiB, L40S 45,776 MiB.
    assert instance("g5.xlarge").gpu_memory_bytes == round(22.352 * GiB)
    assert instance("g6.xlarge").gpu_memory_gib == pytest.approx(22888 / 1024, abs=1e-3)
    assert instance("g6e.xlarge").gpu_memory_gib == pytest.approx(45776 / 1024, abs=1e-3)
    assert instance("p5.48xlarge").accelerator_count == 8 and instance("p5.48xlarge").gpu_memory_gib == 80.0
    assert instance("ml.p5e.48xlarge").gpu_memory_gib == 141.0


def test_every_row_has_sources_and_dated_prices() -> None:
    for it in instances().values():
        assert it.spec_source, it.name
        for price in (it.ec2_price, it.sagemaker_price):
            if price is not None:
                assert price.usd_per_hour > 0 and price.as_of and price.source and price.region, it.name
    for acc in accelerators().values():
        assert acc.sources, acc.name


def test_sagemaker_endpoint_types() -> None:
    assert instance("g5.12xlarge").sagemaker_endpoint and instance("g5.12xlarge").sagemaker_name == "ml.g5.12xlarge"
    assert not instance("gr6.4xlarge").sagemaker_endpoint  # not in ProductionVariantInstanceType


def test_neuron_devices_are_listed_as_such() -> None:
    assert instance("inf2.48xlarge").accelerator.kind is AcceleratorKind.NEURON
    assert instance("trn1.32xlarge").accelerator_count == 16


def test_gpu_facts() -> None:
    h100 = accelerator("H100")
    assert h100.hbm_bandwidth_bytes_per_s == 3350e9 and h100.bf16_flops == 989e12 and h100.fp8_support
    assert not accelerator("A100-80GB").fp8_support
    assert accelerator("nvidia h200 141gb (sxm)").name == "H200"


def test_unknown_names_suggest_known_ones() -> None:
    with pytest.raises(CatalogError, match="unknown accelerator 'H300'; known: T4, A10G"):
        accelerator("H300")
    with pytest.raises(CatalogError, match=r"unknown instance type 'g5\.3xlarge'; e\.g\. g5\.xlarge"):
        instance("g5.3xlarge")


def test_region_hints() -> None:
    p5 = instance("p5.48xlarge")
    assert offered_in_region(p5, "us-east-1") is True
    assert offered_in_region(p5, "sa-east-1") is False
    assert offered_in_region(instance("g5.xlarge"), "us-east-1") is None  # no list: unknown, not refused
