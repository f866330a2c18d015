"""The vLLM / TensorRT-LLM memory budget, version semantics and hybrid KV grouping."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, engine_profile
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.units import GiB, cdiv
from tests.sizing.conftest import make_model

LLAMA = "meta-llama/Llama-3.1-8B"


def test_vllm_budget_is_total_times_utilization_minus_non_kv() -> None:
    cap = capacity(
        catalog_model(LLAMA),
        gpu_memory_bytes=80 * GiB,
        settings=EngineSettings(version="0.11.0", gpu_memory_utilization=0.9, max_model_len=8192),
    )
    assert cap.requested_bytes == int(80 * GiB * 0.9)
    non_kv = cap.weights_bytes_per_gpu + cap.activation_peak_bytes + cap.non_torch_bytes
    assert cap.kv_cache_bytes_per_gpu == cap.requested_bytes - non_kv  # graphs not counted before 0.20
    assert cap.num_blocks == cap.kv_cache_bytes_per_gpu // (16 * 131072)
    assert cap.kv_cache_tokens == cap.num_blocks * 16
    assert cap.max_concurrency == pytest.approx(cap.num_blocks / (8192 // 16))


def test_cuda_graphs_counted_from_0_20() -> None:
    # 0.20.0's vllm/envs.py turns VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on, though its log line says "default
    # since v0.21.0".
    m = catalog_model(LLAMA)
    s = EngineSettings(gpu_memory_utilization=0.9, max_model_len=8192)
    old = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.19.1"))
    new = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.20.0"))
    assert not old.cuda_graph_counted and new.cuda_graph_counted
    assert old.kv_cache_bytes_per_gpu - new.kv_cache_bytes_per_gpu == new.cuda_graph_bytes
    eager = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.20.0", enforce_eager=True))
    assert eager.kv_cache_bytes_per_gpu == old.kv_cache_bytes_per_gpu


def test_default_utilization_follows_the_version() -> None:
    assert engine_profile(EngineName.VLLM, "0.19.1").gpu_memory_utilization == 0.90
    assert engine_profile(EngineName.VLLM, "0.20.0").gpu_memory_utilization == 0.92
    assert engine_profile(EngineName.VLLM, "0.32.0").gpu_memory_utilization == 0.92
    with pytest.raises(SizingError, match="older than the oldest modelled"):
        engine_profile(EngineName.VLLM, "0.4.0")
    with pytest.raises(SizingError, match="engine_version"):
        engine_profile(EngineName.VLLM, "latest")


def test_scheduler_defaults_depend_on_gpu_size_and_a100() -> None:
    m = catalog_model(LLAMA)
    s = EngineSettings(version="0.11.0", max_model_len=8192)
    h100 = capacity(m, gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="H100")
    a100 = capacity(m, gpu_memory_bytes=80 * GiB, settings=s, accelerator_name="A100-80GB")
    l40s = capacity(m, gpu_memory_bytes=int(44.7 * GiB), settings=s, accelerator_name="L40S")
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    assert (l40s.max_num_batched_tokens, l40s.max_num_seqs) == (2048, 256)


def test_v0_profiles_the_whole_context() -> None:
    # V0 without chunked prefill: max_num_batched_tokens = max_model_len (vllm issue 10517).
    cap = capacity(
        catalog_model(LLAMA), gpu_memory_bytes=24 * GiB, settings=EngineSettings(version="0.6.4", max_model_len=20000)
    )
    assert cap.max_num_batched_tokens == 20000


def test_activation_peak_grows_with_batched_tokens() -> None:
    m = catalog_model(LLAMA)
    s = EngineSettings(version="0.11.0", max_model_len=8192, max_num_seqs=256)
    small = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, max_num_batched_tokens=2048))
    large = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, max_num_batched_tokens=32768))
    assert large.activation_peak_bytes > small.activation_peak_bytes
    assert large.kv_cache_tokens < small.kv_cache_tokens


def test_request_that_does_not_fit_reports_the_longest_that_does() -> None:
    cap = capacity(
        catalog_model(LLAMA),
        gpu_memory_bytes=24 * GiB,
        settings=EngineSettings(version="0.11.0", gpu_memory_utilization=0.9, max_model_len=131072),
    )
    assert cap.max_concurrency < 1
    assert cap.problems and "largest max_model_len that fits is" in cap.problems[0]
    fits = cap.max_model_len_that_fits
    assert 0 < fits < 131072 and fits % 16 == 0
    assert cdiv(fits, 16) <= cap.num_blocks < cdiv(fits + 16, 16) + 1


def test_no_memory_left_says_needed_vs_available() -> None:
    cap = capacity(
        catalog_model("meta-llama/Llama-3.1-70B"), gpu_memory_bytes=int(22.352 * GiB), settings=EngineSettings()
    )
    assert cap.kv_cache_bytes_per_gpu == 0 and cap.kv_cache_tokens == 0
    assert "GiB per GPU" in cap.problems[0] and "available" in cap.problems[0]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        (EngineSettings(max_model_len=-1), "max_model_len"),
        (EngineSettings(max_model_len=200_000), "max_model_len"),
        (EngineSettings(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (EngineSettings(tensor_parallel_size=3), "tensor_parallel_size"),
        (EngineSettings(max_num_seqs=512, max_num_batched_tokens=256), "max_num_batched_tokens"),
        (EngineSettings(block_size=0), "block_size"),
        (EngineSettings(quantization="int3"), "quantization"),
    ],
)
def test_bad_settings_name_the_field(settings: EngineSettings, field: str) -> None:
    with pytest.raises(Exception, match=field):
        capacity(catalog_model(LLAMA), gpu_memory_bytes=80 * GiB, settings=settings)


def test_quantized_checkpoint_keeps_its_precision() -> None:
    with pytest.raises(SizingError, match="already quantized as mxfp4"):
        capacity(
            catalog_model("openai/gpt-oss-20b"), gpu_memory_bytes=80 * GiB, settings=EngineSettings(quantization="fp8")
        )


def test_online_fp8_halves_linear_weights() -> None:
    m = catalog_model(LLAMA)
    bf16 = capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(max_model_len=8192))
    fp8 = capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(max_model_len=8192, quantization="fp8"))
    embed = 2 * 128256 * 4096 * 2  # embeddings + lm_head stay bf16
    rope = bf16.weights.buffer_bytes  # the RoPE cache stays in the model dtype
    assert rope == fp8.weights.buffer_bytes > 0
    assert fp8.weights_bytes_per_gpu - rope == pytest.approx(
        (bf16.weights_bytes_per_gpu - rope - embed) / 2 + embed, rel=0.001
    )


# --- hybrid models (vllm/v1/core/kv_cache_utils.py grouping) ---------------------------------------


def test_gpt_oss_groups_and_window_per_request() -> None:
    # 12 sliding (128) + 12 full layers: two groups of 12 share one block pool.
    m = catalog_model("openai/gpt-oss-20b")
    s = EngineSettings(version="0.11.0", max_model_len=8192, kv_cache_memory_bytes=4 * GiB, max_num_batched_tokens=2048)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    page = 16 * 2 * 8 * 64 * 2  # block x K,V x KV heads x head dim x bf16
    assert cap.num_blocks == 4 * GiB // (page * 12)
    full_blocks = 8192 // 16
    window_blocks = cdiv(min(128 - 1 + 2048, 8192), 16) + 1  # SlidingWindowSpec.max_memory_usage_bytes
    assert cap.blocks_per_max_len_request == full_blocks + window_blocks
    assert cap.max_concurrency == pytest.approx(cap.num_blocks / (full_blocks + window_blocks))
    assert cap.kv_cache_tokens == cap.num_blocks // 2 * 16  # older releases: blocks per group x block size
    newer = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.21.0"))
    assert newer.kv_cache_tokens == int(newer.max_concurrency * 8192)  # group-aware capacity


def test_gemma3_five_to_one_grouping() -> None:
    # Gemma-3-12B: 40 sliding (1024) + 8 full layers -> group size 8: 5 sliding groups + 1 full group.
    m = catalog_model("google/gemma-3-12b-it")
    s = EngineSettings(
        version="0.11.0", max_model_len=32768, kv_cache_memory_bytes=8 * GiB, max_num_batched_tokens=2048
    )
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    page = 16 * 2 * 8 * 256 * 2
    assert cap.num_blocks == 8 * GiB // (page * 8)
    window_blocks = cdiv(1024 - 1 + 2048, 16) + 1
    assert cap.blocks_per_max_len_request == 32768 // 16 + 5 * window_blocks


def test_hybrid_holds_more_than_full_attention_would() -> None:
    # Gemma-3-12B: 40 of 48 layers keep a 1,024-token window (plus the prefill chunk).
    m = catalog_model("google/gemma-3-12b-it")
    s = EngineSettings(max_model_len=32768, kv_cache_memory_bytes=8 * GiB)
    hybrid = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.11.0"))
    v1_no_hybrid = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.8.0"))
    assert hybrid.max_concurrency > 2 * v1_no_hybrid.max_concurrency
    assert any("no hybrid allocator" in n for n in v1_no_hybrid.notes)


def test_window_saves_nothing_when_the_prefill_chunk_covers_the_context() -> None:
    # vLLM keeps window - 1 + max_num_batched_tokens per sliding layer: at 8,192 tokens of context and
    # 8,192 batched tokens, Gemma-2's 4,096 window holds the whole sequence anyway.
    m = catalog_model("google/gemma-2-9b")
    s = EngineSettings(version="0.11.0", max_model_len=8192, max_num_batched_tokens=8192, kv_cache_memory_bytes=8 * GiB)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    assert cap.blocks_per_max_len_request == 8192 // 16 + (8192 // 16 + 1)


def test_example_architecture_capacity_breakdown_is_consistent() -> None:
    m = make_model()
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(max_model_len=8192))
    d = cap.as_dict()
    for key in (
        "kv_bytes_per_token_per_gpu",
        "weights_gib_per_gpu",
        "activation_peak_gib",
        "kv_cache_gib_per_gpu",
        "kv_cache_tokens",
        "max_concurrency",
    ):
        assert key in d
    assert d["kv_bytes_per_token_per_gpu"] == 131072
    assert d["kv_cache_dtype"] == KvDtype.AUTO.value


def test_a_large_rope_cache_is_named_in_the_notes() -> None:
    # Llama 4 Scout's 10,485,760 positions x 128 rotary dims x bf16: 2.5 GiB per GPU, whatever max_model_len is
    # (vLLM sizes the cache by the model's positions; vllm PR 44738 proposed clamping it and was closed).
    scout = catalog_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    cap = capacity(
        scout, gpu_memory_bytes=80 * GiB, settings=EngineSettings(tensor_parallel_size=8, max_model_len=8192)
    )
    assert cap.weights.buffer_bytes == 10485760 * 128 * 2
    assert any("RoPE cos/sin cache takes 2.50 GiB per GPU" in n and "10,485,760 positions" in n for n in cap.notes)
    small = capacity(catalog_model(LLAMA), gpu_memory_bytes=80 * GiB, settings=EngineSettings(max_model_len=8192))
    assert not any("RoPE" in n for n in small.notes)  # 32 MiB: not worth a line
