"""Predictions against what real engines printed at start-up.

Each case cites the thread or file the log lines come from. Terms are compared one by one where the
log prints them (weights, activation peak, non-torch), and the block arithmetic exactly: given the
logged "Available KV cache memory", the token count must come out as the engine printed it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.errors import SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import ACTIVATIONS, EngineName, activation_peak_bytes, engine_profile, runs_v2_runner
from kvfleet.sizing.memory import kv_layout, weight_bytes
from kvfleet.sizing.models import ModelSpec, parse_hf_config
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.units import GiB

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}


def _quantized(model_id: str, q: dict[str, object], **overrides: object) -> ModelSpec:
    from kvfleet.sizing.catalog import _index

    cfg = dict(_index()[model_id.lower()].config)
    cfg.update(overrides)
    cfg["quantization_config"] = q
    return parse_hf_config(cfg, model_id=model_id + "-q")


def _tokens_from_available(model: ModelSpec, tp: int, available_gib: float, block: int = 16) -> int:
    kv = kv_layout(model, tp=tp, kv_dtype=KvDtype.AUTO)
    return int(available_gib * GiB) // (kv.kv_bytes_per_token_per_gpu * block) * block


# --- block arithmetic: logged available memory -> logged token count ------------------------------


@pytest.mark.parametrize(
    ("model_id", "tp", "available_gib", "logged_tokens"),
    [
        # LMCache issue 1739: Qwen3-14B "Available KV cache memory: 6.51 GiB", "GPU KV cache size: 42,656 tokens".
        ("Qwen/Qwen3-14B", 1, 6.51, 42656),
        # Qwen2.5-7B-Instruct-AWQ on an RTX 4080, vLLM 0.26.0: 8.0 GiB -> 149,712 tokens (log rounds the GiB).
        ("Qwen/Qwen2.5-7B", 1, 8.0, 149712),
        # Qwen3-235B-A22B-FP8, TP8 on L40S, vLLM 0.10.2: 10.64 GiB on the smallest rank -> 237,344 tokens.
        ("Qwen/Qwen3-235B-A22B", 8, 10.64, 237344),
        # Mistral-7B-Instruct-v0.2-GPTQ, vLLM 0.11.0: 102.56 GiB -> 840,160 tokens (52,510 blocks).
        ("mistralai/Mistral-7B-Instruct-v0.3", 1, 102.56, 840160),
    ],
)
def test_tokens_follow_available_memory(model_id: str, tp: int, available_gib: float, logged_tokens: int) -> None:
    predicted = _tokens_from_available(catalog_model(model_id), tp, available_gib)
    # "Available KV cache memory" is printed to 2 decimals: allow that rounding (<= 0.005 GiB).
    kv = kv_layout(catalog_model(model_id), tp=tp, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu
    slack = int(0.005 * GiB / kv) + 16
    assert abs(predicted - logged_tokens) <= slack


# --- weights ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "tp", "logged_gib", "source"),
    [
        (lambda: catalog_model("meta-llama/Meta-Llama-3-8B"), 1, 14.96, "vllm PR 10511, H100"),
        (lambda: catalog_model("meta-llama/Llama-3.1-8B"), 1, 14.9888, "vllm issue 10517, RTX 3090"),
        (lambda: catalog_model("Qwen/Qwen3-235B-A22B-FP8"), 8, 27.7183, "Qwen3-235B-FP8 TP8 on L40S, vLLM 0.10.2"),
        (lambda: catalog_model("openai/gpt-oss-120b"), 1, 64.38, "vllm issue 33155, H100, vLLM 0.14.1"),
        (lambda: _quantized("Qwen/Qwen2.5-7B", AWQ), 1, 5.29, "Qwen2.5-7B-Instruct-AWQ, vLLM 0.26.0"),
        (
            lambda: _quantized("mistralai/Mistral-7B-Instruct-v0.3", GPTQ, vocab_size=32000),
            1,
            3.8844,
            "Mistral-7B-Instruct-v0.2-GPTQ, vLLM 0.11.0 (v0.2 has a 32,000-token vocabulary)",
        ),
    ],
)
def test_weights_within_a_few_percent(model: object, tp: int, logged_gib: float, source: str) -> None:
    m = model()  # type: ignore[operator]
    w = weight_bytes(m, tp=tp, scheme=m.native_scheme)
    assert w.weights_bytes_per_gpu / GiB == pytest.approx(logged_gib, rel=0.03), source


# --- activation peak -------------------------------------------------------------------------------


def test_activation_peak_slope_matches_v0_profiles() -> None:
    # vllm issue 10517 (Llama-3.1-8B, V0 profiles max_model_len tokens): peak torch memory 17.06 GiB at
    # 20,000 tokens and 17.98 GiB at 29,000 over 14.99 GiB of weights: +0.92 GiB for 9,000 tokens.
    m = catalog_model("meta-llama/Llama-3.1-8B")
    a = activation_peak_bytes(m, tp=1, max_num_batched_tokens=20000, max_num_seqs=256)
    b = activation_peak_bytes(m, tp=1, max_num_batched_tokens=29000, max_num_seqs=256)
    assert (b - a) / GiB == pytest.approx(0.92, rel=0.05)
    assert a / GiB == pytest.approx(17.06 - 14.99, rel=0.10)


def test_the_sampler_term_follows_the_runner_the_release_takes() -> None:
    # Qwen2.5-7B (dense), 2,048 batched tokens, 256 sequences. vLLM 0.25 samples on the V1 runner (bf16 and fp32
    # logits, probabilities, noise: 14 B per logit, which sets the peak here); 0.26 runs it on Model Runner V2,
    # whose profile run works on the bf16 logits in place, so the forward pass sets the peak.
    m = catalog_model("Qwen/Qwen2.5-7B")
    s = EngineSettings(max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256, kv_cache_memory_bytes=GiB)
    v1 = capacity(m, gpu_memory_bytes=24 * GiB, settings=replace(s, version="0.25.0"))
    v2 = capacity(m, gpu_memory_bytes=24 * GiB, settings=replace(s, version="0.26.0"))
    logits = 256 * m.vocab_size
    assert v1.activation_peak_bytes == int(logits * ACTIVATIONS.sampler_bytes_per_logit) + ACTIVATIONS.workspace_bytes
    forward = activation_peak_bytes(m, tp=1, max_num_batched_tokens=2048, max_num_seqs=0)
    assert v2.activation_peak_bytes == forward > logits * ACTIVATIONS.v2_sampler_bytes_per_logit
    # A MoE model stays on the V1 runner at 0.26 (vllm/config/vllm.py _is_default_v2_model_runner_model).
    moe = catalog_model("Qwen/Qwen3-30B-A3B")
    assert not runs_v2_runner(engine_profile(EngineName.VLLM, "0.26.0"), moe)
    assert runs_v2_runner(engine_profile(EngineName.VLLM, "0.29.0"), moe)


# --- end to end ------------------------------------------------------------------------------------


def test_qwen3_235b_fp8_tp8_on_l40s_end_to_end() -> None:
    # vLLM 0.10.2, TP8 on L40S (torch sees 44.42 GiB), gpu_memory_utilization 0.9, max_model_len 32768,
    # default 2,048 batched tokens on a < 70 GiB GPU. Log: requested 39.98 GiB, weights 27.72, activation
    # 1.40, non-torch 0.17-0.21, "Available KV cache memory: 10.64 GiB", "GPU KV cache size: 237,344
    # tokens", "Maximum concurrency for 32,768 tokens per request: 7.24x". 0.10.2 refuses this checkpoint at TP 8
    # without expert parallelism (the 192-wide expert shards are not whole FP8 blocks before 0.29.0), so it ran with
    # --enable-expert-parallel; 128 experts over 8 ranks hold what tensor parallelism would.
    m = catalog_model("Qwen/Qwen3-235B-A22B-FP8")
    settings = EngineSettings(
        version="0.10.2",
        tensor_parallel_size=8,
        gpu_memory_utilization=0.9,
        max_model_len=32768,
        enable_expert_parallel=True,
    )
    with pytest.raises(SizingError, match="192"):
        capacity(m, gpu_memory_bytes=int(44.42 * GiB), settings=replace(settings, enable_expert_parallel=False))
    cap = capacity(m, gpu_memory_bytes=int(44.42 * GiB), settings=settings, accelerator_name="L40S")
    assert cap.requested_bytes / GiB == pytest.approx(39.98, abs=0.01)
    assert cap.max_num_batched_tokens == 2048
    assert cap.kv_bytes_per_token_per_gpu == 48128
    assert cap.kv_cache_tokens == pytest.approx(237344, rel=0.05)
    assert cap.max_concurrency == pytest.approx(7.24, rel=0.05)
    assert not cap.cuda_graph_counted  # 0.10.x captured graphs after sizing the cache


def test_fixed_cache_size_gives_exact_tokens() -> None:
    # --kv-cache-memory-bytes skips profiling: tokens are pure block arithmetic.
    m = catalog_model("meta-llama/Llama-3.1-8B")
    settings = EngineSettings(max_model_len=8192, kv_cache_memory_bytes=4 * GiB)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=settings)
    assert cap.kv_cache_tokens == 4 * GiB // 131072 // 16 * 16 == 32768
    assert cap.max_concurrency == pytest.approx(4.0)
    fp8 = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(settings, kv_cache_dtype=KvDtype.FP8))
    assert fp8.kv_cache_tokens == 2 * cap.kv_cache_tokens


def test_trtllm_uses_fraction_of_free_memory_and_max_tokens_cap() -> None:
    m = catalog_model("meta-llama/Llama-3.1-8B")
    base = EngineSettings(engine=EngineName.TRTLLM, max_model_len=8192, gpu_memory_utilization=0.9)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=base)
    used = (
        cap.weights_bytes_per_gpu
        + cap.activation_peak_bytes
        + cap.non_torch_bytes
        + cap.cuda_graph_bytes
        + 512 * 1024**2  # CUDA context
    )
    # _cal_max_tokens floors to tokens; calculate_max_num_blocks rounds them up to whole 32-token blocks.
    tokens = int((80 * GiB - used) * 0.9) // 131072
    assert cap.kv_cache_tokens == -(-tokens // 32) * 32
    assert cap.kv_cache_bytes_per_gpu == cap.kv_cache_tokens * 131072
    assert cap.block_size == 32  # tokens_per_block
    capped = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(base, max_tokens=100_000))
    assert capped.kv_cache_tokens <= 100_000
    assert capped.kv_cache_bytes_per_gpu == 100_000 * 131072
