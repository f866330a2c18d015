"""Planner and capacity timings (``make bench``; not collected by ``make test``).

Each benchmark also checks its result, so a fast wrong answer does not pass as a speed-up.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.hardware import accelerator, instances
from kvfleet.sizing.planner import PlanRequest, Workload, enumerate_candidates
from kvfleet.sizing.precision import KvDtype
from kvfleet.targets import TARGETS

WORKLOAD = Workload(max_input_tokens=4096, max_output_tokens=1024, concurrency_per_replica=16, peak_requests_per_s=2)


def _request(model_id: str, **kw: Any) -> PlanRequest:
    # EC2 accepts every instance type and several engines per instance: the widest enumeration.
    return PlanRequest(model=catalog_model(model_id), workload=WORKLOAD, hosting=TARGETS["ec2"].hosting, **kw)


def test_enumerate_llama_8b(benchmark: Any) -> None:
    req = _request("meta-llama/Llama-3.1-8B")
    result = benchmark(enumerate_candidates, req)
    assert result.candidates
    assert len(result.candidates) + len(result.rejections) >= len(instances())
    prices = [c.fleet_usd_per_hour for c in result.candidates]
    assert prices == sorted(prices)


def test_enumerate_llama_70b_fp8_and_bf16(benchmark: Any) -> None:
    req = _request(
        "meta-llama/Llama-3.3-70B-Instruct",
        kv_cache_dtypes=(KvDtype.FP8, KvDtype.AUTO),
        weight_precisions=("bf16", "fp8"),
    )
    result = benchmark(enumerate_candidates, req)
    assert result.candidates
    assert {c.weight_scheme.name for c in result.candidates} == {"bf16", "fp8"}
    assert {c.kv_cache_dtype for c in result.candidates} == {KvDtype.FP8, KvDtype.AUTO}


@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.1-8B", "google/gemma-3-12b-it"])
def test_capacity_one_model(benchmark: Any, model_id: str) -> None:
    model = catalog_model(model_id)
    acc = accelerator("H100")
    assert acc.memory_bytes is not None
    settings = EngineSettings(max_model_len=8192)
    cap = benchmark(capacity, model, gpu_memory_bytes=acc.memory_bytes, settings=settings, accelerator_name=acc.name)
    assert cap.kv_cache_tokens > 0
    assert not cap.problems
