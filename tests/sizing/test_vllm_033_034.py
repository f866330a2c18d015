"""vLLM 0.33 and 0.34 as their sdists show them (kvfleet/sizing/data/SOURCES.md, data/vllm_release_markers.json):
0.33's fuller profiling sampler and its dtype rule for 16-bit KV caches, 0.34's extensible KV cache and 64-token
blocks, and what a plan then tells the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.deployments import engine_args
from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import Capacity, EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import (
    ACTIVATIONS,
    EXTENSIBLE_MARGIN_FLOOR_BYTES,
    EngineName,
    batch_defaults,
    engine_profile,
    extensible_kv_bytes,
    sizing_step_transient_bytes,
)
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.sizing.planner import PlanRequest, Workload, plan
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.units import GiB
from tests.sizing.conftest import make_model

LLAMA = "meta-llama/Llama-3.1-8B"
H100 = int(79.22 * GiB)  # what CUDA reports on an H100 80GB


def _cap(settings: EngineSettings) -> Capacity:
    s = replace(settings, max_model_len=8192)
    return capacity(catalog_model(LLAMA), gpu_memory_bytes=H100, settings=s, accelerator_name="H100")


# ---- 0.34: the extensible KV cache -------------------------------------------------------------------------------


def test_the_extensible_cache_keeps_the_context_a_margin_and_the_transient_out() -> None:
    cap = _cap(EngineSettings(version="0.34.0"))
    assert cap.extensible_kv_cache and cap.gpu_memory_utilization == 1.0 and not cap.gpu_memory_utilization_given
    assert cap.block_size == 64 and cap.cuda_graph_counted
    # Model Runner V2's penalty state is resident too (sizing/engines.py v2_penalty_buffer_bytes).
    used = cap.weights_bytes_per_gpu + cap.runner_buffer_bytes + cap.non_torch_bytes + cap.cuda_graph_bytes
    t = cap.transient_bytes
    assert t == cap.activation_peak_bytes  # the sampler run's peak is the larger here
    margin = max(EXTENSIBLE_MARGIN_FLOOR_BYTES, int(0.75 * t))
    assert cap.kv_margin_bytes == margin
    # measure_kv_cache_bytes at utilization 1.0: the device's headroom less the margin binds, then the transient.
    assert cap.kv_cache_bytes_per_gpu == H100 - ACTIVATIONS.cuda_context_bytes - used - margin - t
    assert cap.num_blocks == cap.kv_cache_bytes_per_gpu // (64 * 131072)
    # Against 0.33's estimate at 0.92 the cache gains what the 8% headroom held, less the context and the margin.
    old = _cap(EngineSettings(version="0.33.0"))
    assert not old.extensible_kv_cache and old.gpu_memory_utilization == 0.92 and old.block_size == 16
    assert old.activation_peak_bytes == cap.activation_peak_bytes
    gained = cap.kv_cache_bytes_per_gpu - old.kv_cache_bytes_per_gpu
    assert gained == pytest.approx(H100 - int(H100 * 0.92) - ACTIVATIONS.cuda_context_bytes - margin, abs=1)


def test_an_explicit_utilization_caps_the_extensible_cache() -> None:
    base = EngineSettings(version="0.34.0")
    free = _cap(base)
    capped = _cap(replace(base, gpu_memory_utilization=0.92))
    assert capped.extensible_kv_cache and capped.gpu_memory_utilization_given
    used = capped.weights_bytes_per_gpu + capped.runner_buffer_bytes + capped.non_torch_bytes + capped.cuda_graph_bytes
    # min(utilization x total - non-KV used, headroom - margin) - transient: here the budget binds.
    assert capped.kv_cache_bytes_per_gpu == int(H100 * 0.92) - used - capped.transient_bytes
    assert capped.kv_cache_bytes_per_gpu < free.kv_cache_bytes_per_gpu
    assert any("keeps" in n and "vLLM warns" in n for n in capped.notes)
    # A cap above what the device leaves changes nothing, and draws no warning.
    loose = _cap(replace(base, gpu_memory_utilization=0.99))
    assert loose.kv_cache_bytes_per_gpu == free.kv_cache_bytes_per_gpu
    assert not any("vLLM warns" in n for n in loose.notes)


def test_a_fixed_cache_size_turns_the_extensible_cache_off() -> None:
    cap = _cap(EngineSettings(version="0.34.0", kv_cache_memory_bytes=20 * GiB))
    assert not cap.extensible_kv_cache
    # CacheConfig.resolved_gpu_memory_utilization: 0.92 without the extensible cache.
    assert cap.gpu_memory_utilization == 0.92
    assert cap.kv_cache_bytes_per_gpu == 20 * GiB


def test_extensible_budget_arithmetic() -> None:
    # measure_kv_cache_bytes (vllm/v1/worker/extensible_kv_cache.py, 0.34.0) with a small transient: the floor.
    b = extensible_kv_bytes(
        gpu_memory_bytes=80 * GiB, gpu_memory_utilization=1.0, used_bytes=20 * GiB, transient_bytes=GiB // 2
    )
    assert b.margin_bytes == GiB and not b.capped_by_utilization
    assert b.kv_bytes == 80 * GiB - ACTIVATIONS.cuda_context_bytes - 20 * GiB - GiB - GiB // 2
    # A large transient: 0.75 of it.
    b = extensible_kv_bytes(
        gpu_memory_bytes=80 * GiB, gpu_memory_utilization=1.0, used_bytes=20 * GiB, transient_bytes=4 * GiB
    )
    assert b.margin_bytes == 3 * GiB
    # A utilization that withholds more than the context and the margin binds.
    b = extensible_kv_bytes(
        gpu_memory_bytes=80 * GiB, gpu_memory_utilization=0.5, used_bytes=20 * GiB, transient_bytes=GiB
    )
    assert b.capped_by_utilization and b.kv_bytes == 40 * GiB - 20 * GiB - GiB
    assert b.withheld_bytes == (80 * GiB - ACTIVATIONS.cuda_context_bytes - 20 * GiB - GiB) - 20 * GiB


def test_the_sizing_step_prompt_logprobs_chunk_can_set_the_transient() -> None:
    """A short vocabulary-heavy case: few sampled rows (max_num_seqs 8), so the sizing step's 1,024-row logits
    chunk outweighs the profile run's sampler."""
    m = make_model(num_hidden_layers=2, vocab_size=256_000, hidden_size=1024)
    s = EngineSettings(version="0.34.0", max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=4096)
    cap = capacity(m, gpu_memory_bytes=24 * GiB, settings=s)
    step = sizing_step_transient_bytes(m, max_num_batched_tokens=4096, max_model_len=4096)
    assert step == 4096 * 1024 * 2 + 1024 * 256_000 * 2 + ACTIVATIONS.workspace_bytes
    assert cap.transient_bytes == max(cap.activation_peak_bytes, step) == step


def test_a_model_that_does_not_fit_says_what_to_change_without_utilization() -> None:
    cap = capacity(
        catalog_model(LLAMA),
        gpu_memory_bytes=int(22.35 * GiB),
        settings=EngineSettings(version="0.34.0"),
        accelerator_name="A10G",
    )
    assert cap.problems and "raise gpu_memory_utilization" not in cap.problems[0]
    assert "more GPUs" in cap.problems[0]


# ---- 0.33: the profiling sampler and the 16-bit KV dtype rule ---------------------------------------------------


def test_0_33_sampler_adds_what_pr_57926_measured() -> None:
    """FIT: the 7.1 B per logit comes from this case (vLLM PR 57926, Qwen2.5-0.5B-Instruct on an L4 at utilization
    0.98, 256 sequences, max_model_len 2048): 1,733,440 -> 1,710,928 KV tokens across the 0.33 change. kvfleet
    gives the same step, to within a block of each side's rounding."""
    m = catalog_model("Qwen/Qwen2.5-0.5B")
    s = EngineSettings(gpu_memory_utilization=0.98, max_num_seqs=256, max_model_len=2048)
    l4 = int(22.35 * GiB)
    before = capacity(m, gpu_memory_bytes=l4, settings=replace(s, version="0.32.0"), accelerator_name="L4")
    after = capacity(m, gpu_memory_bytes=l4, settings=replace(s, version="0.33.0"), accelerator_name="L4")
    assert before.activation_peak_bytes < after.activation_peak_bytes  # the sampler's peak sets both
    assert before.kv_cache_tokens - after.kv_cache_tokens == pytest.approx(1_733_440 - 1_710_928, abs=32)
    assert engine_profile(before.engine, "0.32.0").sampler_extra_bytes_per_logit == 0


@pytest.mark.parametrize(
    ("torch_dtype", "quantization", "kv", "refused"),
    [
        ("float16", None, KvDtype.BF16, True),
        ("bfloat16", None, KvDtype.FP16, True),
        ("bfloat16", None, KvDtype.BF16, False),
        ("bfloat16", "fp16", KvDtype.FP16, False),  # --dtype float16: the model dtype is the cast's
        ("bfloat16", "fp16", KvDtype.BF16, True),
        ("float16", None, KvDtype.FP8, False),  # only the 16-bit dtypes are checked
        ("float16", None, KvDtype.AUTO, False),
        ("float32", None, KvDtype.BF16, False),  # auto resolves float32 by device; not checked
    ],
)
def test_0_33_refuses_a_16_bit_kv_dtype_other_than_the_model_dtype(
    torch_dtype: str, quantization: str | None, kv: KvDtype, refused: bool
) -> None:
    m = replace(make_model(num_hidden_layers=4), torch_dtype=torch_dtype)
    s = EngineSettings(version="0.33.0", max_model_len=4096, kv_cache_dtype=kv, quantization=quantization)
    if refused:
        with pytest.raises(SizingError) as err:
            capacity(m, gpu_memory_bytes=24 * GiB, settings=s)
        assert err.value.field == "kv_cache_dtype" and "0.33.0" in err.value.message
        assert "\n" not in err.value.message
    else:
        capacity(m, gpu_memory_bytes=24 * GiB, settings=s)
    # 0.32 starts with any of them.
    capacity(m, gpu_memory_bytes=24 * GiB, settings=replace(s, version="0.32.0"))


def test_gb10_keeps_the_small_scheduler_defaults_from_0_33() -> None:
    gb10 = 119 * GiB  # unified memory above the 70 GiB tier
    vllm = EngineName.VLLM
    assert batch_defaults(vllm, "0.32.0", gpu_memory_bytes=gb10, accelerator_name="NVIDIA GB10").max_num_seqs == 1024
    small = batch_defaults(vllm, "0.33.0", gpu_memory_bytes=gb10, accelerator_name="NVIDIA GB10")
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)
    assert batch_defaults(vllm, "0.34.0", gpu_memory_bytes=80 * GiB, accelerator_name="H100").max_num_seqs == 1024


@pytest.mark.parametrize(
    ("version", "given", "written"), [("0.32.0", None, 0.92), ("0.34.0", None, None), ("0.34.0", 0.9, 0.9)]
)
def test_the_engine_is_told_a_utilization_only_where_it_sizes_the_cache(
    version: str, given: float | None, written: float | None
) -> None:
    req = PlanRequest(
        model=catalog_model(LLAMA),
        workload=Workload(max_input_tokens=4096, max_output_tokens=512, concurrency_per_replica=8),
        engine_version=version,
        hosting=Hosting(price_list=PriceList.EC2, routing=Routing.LEAST_OUTSTANDING),
        instance_types=("p5.4xlarge",),
        gpu_memory_utilization=given,
    )
    best = plan(req).best
    assert best is not None
    assert engine_args(best).gpu_memory_utilization == written
