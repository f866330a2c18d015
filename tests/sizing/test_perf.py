"""The roofline: decode reads weights + KV from HBM, prefill is bound by FLOPs."""

from __future__ import annotations

import pytest

from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.hardware import accelerator
from kvfleet.sizing.memory import kv_layout, weight_bytes
from kvfleet.sizing.perf import BW_EFFICIENCY, STEP_OVERHEAD_S, estimate
from kvfleet.sizing.precision import KvDtype, weight_scheme


def _est(model_id: str, gpu: str, *, tp: int = 1, batch: int = 1, inp: int = 1024, out: int = 256, q: str = "bf16"):  # type: ignore[no-untyped-def]
    m = catalog_model(model_id)
    scheme = weight_scheme(q)
    w = weight_bytes(m, tp=tp, scheme=scheme)
    experts = sum(b for p, b in w.bytes_by_part if p.value == "experts")
    return estimate(
        model=m,
        acc=accelerator(gpu),
        tp=tp,
        nvlink=True,
        scheme=scheme,
        weights_bytes_per_gpu=w.weights_bytes_per_gpu,
        expert_bytes_per_gpu=experts,
        kv=kv_layout(m, tp=tp, kv_dtype=KvDtype.AUTO),
        batch=batch,
        input_tokens=inp,
        output_tokens=out,
    )


def test_single_sequence_decode_reads_the_weights_once() -> None:
    e = _est("meta-llama/Llama-3.1-8B", "H100")
    weights = 8.03e9 * 2
    kv = (1024 + 128) * 131072
    assert e.bound == "memory"
    assert e.decode_step_s == pytest.approx((weights + kv) / (3350e9 * BW_EFFICIENCY) + STEP_OVERHEAD_S, rel=0.02)


def test_decode_slows_with_batch_and_context_but_throughput_grows() -> None:
    one = _est("meta-llama/Llama-3.1-8B", "L40S", batch=1)
    many = _est("meta-llama/Llama-3.1-8B", "L40S", batch=32)
    longer = _est("meta-llama/Llama-3.1-8B", "L40S", batch=32, inp=8192)
    assert one.itl_s < many.itl_s < longer.itl_s
    assert many.decode_tokens_per_s > 10 * one.decode_tokens_per_s


def test_tensor_parallelism_and_fp8_speed_up() -> None:
    base = _est("meta-llama/Llama-3.1-70B", "H100", tp=4)
    wide = _est("meta-llama/Llama-3.1-70B", "H100", tp=8)
    fp8 = _est("meta-llama/Llama-3.1-70B", "H100", tp=4, q="fp8")
    assert wide.itl_s < base.itl_s and fp8.itl_s < base.itl_s
    assert wide.prefill_s < base.prefill_s and fp8.prefill_s < base.prefill_s


def test_prefill_is_compute_bound() -> None:
    short = _est("meta-llama/Llama-3.1-8B", "H100", inp=1000)
    long_ = _est("meta-llama/Llama-3.1-8B", "H100", inp=4000)
    assert 4 <= long_.prefill_s / short.prefill_s < 5  # linear in tokens plus the quadratic attention term


def test_moe_decode_reads_only_touched_experts() -> None:
    one = _est("Qwen/Qwen3-30B-A3B", "H100", batch=1)
    dense_equiv = _est("Qwen/Qwen3-32B", "H100", batch=1)
    assert one.itl_s < dense_equiv.itl_s / 3
