"""KV bytes per token and weight bytes per GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.errors import SizingError
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.memory import kv_layout, rope_cache_bytes, validate_tp, weight_bytes
from kvfleet.sizing.models import ModelSpec, RopeScaling
from kvfleet.sizing.precision import KvDtype, Part, weight_scheme
from kvfleet.sizing.units import GiB, KiB
from tests.sizing.conftest import make_model


def test_brief_example_128_kib_per_token(example_model: ModelSpec) -> None:
    # The brief: 2 x 32 layers x 8 KV heads x 128 dim x 2 bytes = 128 KiB per token;
    # an 8,192-token sequence = 1 GiB; 32 of them = 32 GiB.
    kv = kv_layout(example_model, tp=1, kv_dtype=KvDtype.AUTO)
    assert kv.kv_bytes_per_token_per_gpu == 131072 == 128 * KiB
    assert kv.bytes_per_sequence(8192) == 1 * GiB
    assert 32 * kv.bytes_per_sequence(8192) == 32 * GiB


@pytest.mark.parametrize(
    ("model_id", "tp", "expected"),
    [
        # engines.md: per-token bytes from real vLLM logs match the textbook formula for these.
        ("meta-llama/Llama-3.1-8B", 1, 131072),
        ("Qwen/Qwen2.5-7B", 1, 57344),
        ("Qwen/Qwen2.5-1.5B-Instruct", 1, 28672),  # a log showed 28,697 B/token (within 0.1%)
        ("microsoft/phi-4", 1, 204800),  # a log showed 204,792 B/token
        ("Qwen/Qwen3-30B-A3B", 1, 98304),
        ("mistralai/Mistral-7B-Instruct-v0.3", 1, 131072),
        # Qwen3-235B at TP4: 4 KV heads, one per rank: 2 x 94 x 1 x 128 x 2.
        ("Qwen/Qwen3-235B-A22B", 4, 48128),
        # LMCache issue 1739: Qwen3-14B 6.51 GiB held 42,656 tokens = 160 KiB per token.
        ("Qwen/Qwen3-14B", 1, 163840),
        ("meta-llama/Llama-3.1-70B", 4, 81920),
    ],
)
def test_per_token_bytes_match_engine_logs(model_id: str, tp: int, expected: int) -> None:
    kv = kv_layout(catalog_model(model_id), tp=tp, kv_dtype=KvDtype.AUTO)
    assert kv.kv_bytes_per_token_per_gpu == expected


def test_mla_caches_one_latent_held_by_every_rank() -> None:
    # DeepSeek-V3: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70,272.
    m = catalog_model("deepseek-ai/DeepSeek-V3")
    for tp in (1, 8):
        assert kv_layout(m, tp=tp, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu == 70272
    assert kv_layout(m, tp=8, kv_dtype=KvDtype.FP8).kv_bytes_per_token_per_gpu == 35136


def test_deepseek_v2_lite_matches_vllm_error_message() -> None:
    # vllm issue 15871: "(0.95 GiB KV cache is needed ...)" for max_model_len 32768 on DeepSeek-V2-Lite.
    kv = kv_layout(catalog_model("deepseek-ai/DeepSeek-V2-Lite"), tp=1, kv_dtype=KvDtype.AUTO)
    assert kv.kv_bytes_per_token_per_gpu == 27 * 576 * 2
    assert round(kv.bytes_per_sequence(32768) / GiB, 2) == 0.95


def test_kv_heads_split_then_replicated() -> None:
    m = make_model()  # 8 KV heads
    per_head = 2 * 32 * 128 * 2
    assert kv_layout(m, tp=2, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu == 4 * per_head
    assert kv_layout(m, tp=8, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu == 1 * per_head
    # 16 ranks > 8 KV heads: each rank keeps one (replicated) head.
    wide = make_model(num_attention_heads=32, num_key_value_heads=8)
    assert kv_layout(wide, tp=16, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu == per_head


def test_sliding_window_layers_hold_at_most_the_window() -> None:
    g = catalog_model("google/gemma-2-9b")  # 21 sliding (4096) + 21 full layers
    kv = kv_layout(g, tp=1, kv_dtype=KvDtype.AUTO)
    per_layer = 2 * 8 * 256 * 2
    assert kv.kv_bytes_per_token_per_gpu == 42 * per_layer
    assert kv.bytes_per_sequence(2000) == 2000 * 42 * per_layer
    assert kv.bytes_per_sequence(8192) == 8192 * 21 * per_layer + 4096 * 21 * per_layer


def test_invalid_tp_names_the_field_and_divisors() -> None:
    with pytest.raises(
        SizingError, match=r"tensor_parallel_size: 3 does not divide .* 32 attention heads; use one of 1, 2, 4, 8"
    ):
        validate_tp(make_model(), 3)
    with pytest.raises(SizingError, match="at least 1"):
        validate_tp(make_model(), 0)
    # 6 ranks and 4 KV heads: neither divides the other.
    with pytest.raises(SizingError, match="cannot split 4 KV heads"):
        validate_tp(make_model(num_attention_heads=24, num_key_value_heads=4), 6)


def test_llama_8b_bf16_weights_match_vllm_log() -> None:
    # vllm PR 10511 (H100): "Model loading took 14.96 GiB" for Meta-Llama-3-8B in bf16.
    w = weight_bytes(catalog_model("meta-llama/Meta-Llama-3-8B"), tp=1, scheme=weight_scheme("bf16"))
    assert w.weights_bytes_per_gpu / GiB == pytest.approx(14.96, rel=0.01)
    # ... and 7.48 GiB per rank at TP2 (same PR).
    w2 = weight_bytes(catalog_model("meta-llama/Meta-Llama-3-8B"), tp=2, scheme=weight_scheme("bf16"))
    assert w2.weights_bytes_per_gpu / GiB == pytest.approx(7.48, rel=0.01)


def test_tied_embeddings_are_counted_once() -> None:
    untied = weight_bytes(make_model(), tp=1, scheme=weight_scheme("bf16")).weights_bytes_per_gpu
    tied = weight_bytes(make_model(tie_word_embeddings=True), tp=1, scheme=weight_scheme("bf16")).weights_bytes_per_gpu
    assert untied - tied == 128256 * 4096 * 2


def test_replicated_parts_do_not_shrink_with_tp() -> None:
    m = catalog_model("Qwen/Qwen3-30B-A3B")
    one = dict(weight_bytes(m, tp=1, scheme=weight_scheme("bf16")).bytes_by_part)
    four = dict(weight_bytes(m, tp=4, scheme=weight_scheme("bf16")).bytes_by_part)
    assert four[Part.ROUTER] == one[Part.ROUTER]
    assert four[Part.NORM] == one[Part.NORM]
    assert four[Part.EXPERTS] == pytest.approx(one[Part.EXPERTS] / 4, rel=1e-6)


@pytest.mark.parametrize(
    ("scheme", "bytes_per_param"),
    [
        ("bf16", 2.0),
        ("fp8", 1.0),
        ("int8", 1.0),
        ("awq", 0.5 + 2 / 128 + 0.5 / 128),  # int4 + fp16 scale + 4-bit zero per 128
        ("gptq", 0.5 + 2 / 128 + 0.5 / 128),
        ("bnb-4bit", 0.5 + 1 / 64 + 4 / (64 * 256)),  # nf4 with double quantization
        ("mxfp4", 0.5 + 1 / 32),  # e2m1 + e8m0 scale per 32 (OCP MX)
        ("nvfp4", 0.5 + 1 / 16),
    ],
)
def test_bytes_per_quantized_param(scheme: str, bytes_per_param: float) -> None:
    s = weight_scheme(scheme)
    part = Part.EXPERTS if scheme == "mxfp4" else Part.MLP
    assert s.bytes_per_param(part, unquantized_bytes=2.0) == pytest.approx(bytes_per_param)
    assert s.bytes_per_param(Part.EMBEDDING, unquantized_bytes=2.0) == 2.0  # embeddings stay 16-bit


def test_moe_experts_are_all_resident() -> None:
    m = catalog_model("mistralai/Mixtral-8x7B-v0.1")
    w = weight_bytes(m, tp=1, scheme=weight_scheme("bf16"))
    assert w.weights_bytes_per_gpu / 1e9 == pytest.approx(46.7 * 2, rel=0.01)  # 46.7B parameters
    assert m.active_params / 1e9 == pytest.approx(12.9, rel=0.02)  # ~12.9B active (Mistral AI)


# --- vLLM's RoPE cos/sin cache (vllm/model_executor/layers/rotary_embedding, 0.32.0) --------------------------


def test_rope_cache_is_positions_by_rotary_dim_in_the_model_dtype() -> None:
    # Llama 3.1 8B: llama3 scaling keeps max_position 131,072; 128 rotary dims; bf16: 32 MiB. The public start-up log
    # of this model on an RTX 3090 (vllm #10517, tests/sizing/data/engine_logs.json) was 0.031 GiB above the
    # parameters alone, and is exact with it.
    assert rope_cache_bytes(catalog_model("meta-llama/Llama-3.1-8B")) == 131072 * 128 * 2
    assert rope_cache_bytes(catalog_model("meta-llama/Meta-Llama-3-8B")) == 8192 * 128 * 2


def test_rope_cache_lengths_follow_the_scaling_type() -> None:
    base = catalog_model("meta-llama/Meta-Llama-3-8B")
    yarn = replace(base, rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096))
    linear = replace(base, rope_scaling=RopeScaling(rope_type="linear", factor=2.0))
    longrope = replace(base, rope_scaling=RopeScaling(rope_type="longrope", original_max_position_embeddings=4096))
    assert rope_cache_bytes(yarn) == 4096 * 4 * 128 * 2  # YaRNScalingRotaryEmbedding: original x factor
    assert rope_cache_bytes(linear) == 8192 * 2 * 128 * 2  # LinearScalingRotaryEmbedding: max_position x factor
    assert rope_cache_bytes(longrope) == (4096 + 8192) * 128 * 2  # Phi-3's short and long caches
    partial = replace(base, partial_rotary_factor=0.25)
    assert rope_cache_bytes(partial) == 8192 * 32 * 2


def test_rope_cache_per_family() -> None:
    # Qwen3-Next rotates a quarter of its 256-dim heads; Nemotron-H's attention takes no positions; Gemma 3 builds its
    # local layers' rope beside its scaled global one.
    nxt = catalog_model("Qwen/Qwen3-Next-80B-A3B-Thinking")
    assert nxt.partial_rotary_factor == 0.25
    assert rope_cache_bytes(nxt) == nxt.max_position_embeddings * 64 * 2
    assert rope_cache_bytes(catalog_model("nvidia/Nemotron-H-56B-Base-8K")) == 0
    g = catalog_model("google/gemma-3-12b-it")
    assert g.rope_scaling is not None and g.rope_scaling.factor == 8.0
    assert rope_cache_bytes(g) == (g.max_position_embeddings * 8 + g.max_position_embeddings) * g.head_dim * 2
