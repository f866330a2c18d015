"""Hybrid models with linear-attention / Mamba-2 layers, against vLLM 0.32.0's own arithmetic.

Expected numbers are worked by hand from vLLM's source, not from kvfleet's code:
  * state shapes: vllm/model_executor/layers/mamba/mamba_utils.py MambaStateShapeCalculator
    (gated_delta_net_state_shape, mamba2_state_shape) and MambaStateDtypeCalculator;
  * the block size: vllm/platforms/interface.py _align_hybrid_block_size (FlashAttention kernel blocks
    MultipleOf(16));
  * groups and pages per request: vllm/v1/core/kv_cache_utils.py _get_kv_cache_groups_uniform_page_size,
    get_max_concurrency_for_kv_cache_config; vllm/v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes.

Model geometries: Qwen3-Next's is transformers' Qwen3NextConfig defaults (configuration_qwen3_next.py, which
mirror Qwen3-Next-80B-A3B); the Nemotron-H one is a small test geometry; the Qwen3.6 one is described where it
is built. None is a catalog entry (no verbatim config.json was at hand).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvfleet.errors import ModelConfigError, SizingError
from kvfleet.sizing.capacity import EngineSettings, capacity, hybrid_block_size
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.engines import EngineName, engine_profile, in_flight_batches
from kvfleet.sizing.memory import kv_layout, state_layout, weight_bytes
from kvfleet.sizing.models import AttentionKind, ModelSpec, StateKind, parse_hf_config
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.units import GiB, cdiv


def qwen3_next_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def nemotron_h_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M*-M-M-M*-",
        "num_hidden_layers": 14,
        "hidden_size": 4096,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "use_conv_bias": True,
        "use_bias": False,
        "vocab_size": 131072,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def qwen3_next(**overrides: Any) -> ModelSpec:
    return parse_hf_config(qwen3_next_config(**overrides), model_id="test/qwen3-next")


def nemotron_h(**overrides: Any) -> ModelSpec:
    return parse_hf_config(nemotron_h_config(**overrides), model_id="test/nemotron-h")


# --- layers and parameters --------------------------------------------------------------------------


def test_qwen3_next_layout_is_three_delta_net_layers_to_one_attention_layer() -> None:
    m = qwen3_next()
    kinds = [lay.attention for lay in m.layers]
    assert kinds[:4] == [AttentionKind.STATE] * 3 + [AttentionKind.FULL]
    assert m.attention_layers == 12 and m.state_layers == 36
    assert m.state is not None and m.state.kind is StateKind.GATED_DELTA_NET
    assert m.is_hybrid


def test_qwen3_next_parameter_count_matches_the_checkpoint() -> None:
    # CHECK: llama.cpp's loader prints "model params = 79.67 B" for Qwen3 Next 80B A3B Instruct
    # (ggml-org/llama.cpp PR 16095); its GGUF leaves out the MTP layer, which vLLM does not load either
    # (qwen3_next.py maps "mtp." to None unless a speculative config asks for it).
    assert qwen3_next().total_params / 1e9 == pytest.approx(79.67, abs=0.02)


def test_nemotron_h_blocks_carry_one_mixer_or_one_mlp() -> None:
    m = nemotron_h()
    assert [lay.attention for lay in m.layers][:3] == [AttentionKind.STATE, AttentionKind.NONE, AttentionKind.STATE]
    assert not m.layers[0].mlp and m.layers[1].mlp
    assert m.attention_layers == 2 and m.state_layers == 6
    h, heads_dim, groups_dim = 4096, 128 * 64, 8 * 128
    conv_dim = heads_dim + 2 * groups_dim
    # mamba_mixer2.py: in_proj, conv1d (+bias), A, D, dt_bias, gated norm, out_proj.
    mamba = h * (2 * heads_dim + 2 * groups_dim + 128) + conv_dim * 4 + conv_dim + 3 * 128 + heads_dim + heads_dim * h
    attention = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h
    mlp = 2 * h * 21504
    embed = 2 * 131072 * h
    norms = (14 + 1) * h
    assert m.total_params == 6 * mamba + 2 * attention + 6 * mlp + embed + norms


def test_unmodelled_hybrid_blocks_are_refused_with_the_field() -> None:
    with pytest.raises(ModelConfigError, match="hybrid_override_pattern") as err:
        nemotron_h(hybrid_override_pattern="M-M-M*-M-M-ME-")
    assert "Nemotron 3" in str(err.value)
    cfg = qwen3_next_config()
    cfg["model_type"] = "qwen3"
    cfg["layer_types"] = ["linear_attention"] * 47 + ["full_attention"]
    with pytest.raises(ModelConfigError, match="not modelled"):
        parse_hf_config(cfg, model_id="x")


# --- state shapes per TP rank -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "conv", "ssm"),
    [
        # gated_delta_net_state_shape: conv (K - 1, (2 x 16 x 128 + 32 x 128) / tp), ssm (32 / tp, 128, 128).
        (1, (3, 8192), (32, 128, 128)),
        (4, (3, 2048), (8, 128, 128)),
    ],
)
def test_gated_delta_net_state_shape(tp: int, conv: tuple[int, int], ssm: tuple[int, int, int]) -> None:
    st = state_layout(qwen3_next(), tp=tp)
    assert st is not None
    assert (st.conv_shape, st.ssm_shape) == (conv, ssm)
    # Both states bf16: gated_delta_net_state_dtype with mamba_cache_dtype / mamba_ssm_cache_dtype auto.
    assert st.bytes_per_layer == (conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]) * 2


def test_mamba2_state_shape_and_dtypes() -> None:
    m = nemotron_h()
    st = state_layout(m, tp=1)
    assert st is not None
    # mamba2_state_shape: conv dim 128 x 64 + 2 x 8 x 128 = 10,240; ssm (heads, head_dim, state size).
    assert st.conv_shape == (3, 10240) and st.ssm_shape == (128, 64, 128)
    # NemotronHForCausalLMConfig: mamba_ssm_cache_dtype "auto" becomes the config's value, else float32.
    assert (st.conv_dtype_bytes, st.ssm_dtype_bytes) == (2, 4)
    assert st.bytes_per_layer == 3 * 10240 * 2 + 128 * 64 * 128 * 4
    bf16 = state_layout(m, tp=1, mamba_ssm_cache_dtype="bfloat16")
    assert bf16 is not None and bf16.ssm_dtype_bytes == 2
    # n_groups 8 on 16 ranks: extra_groups_for_head_shards replicates the groups up to 16.
    wide = state_layout(m, tp=16)
    assert wide is not None and wide.conv_shape == (3, (8192 + 2 * 16 * 128) // 16)


def test_state_heads_must_split_across_ranks() -> None:
    with pytest.raises(SizingError, match="gated_delta_net heads") as err:
        weight_bytes(
            qwen3_next(linear_num_value_heads=24, num_attention_heads=16), tp=16, scheme=qwen3_next().native_scheme
        )
    assert err.value.field == "tensor_parallel_size"


# --- block size and the pool --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "block"),
    [
        # TP1: state 1,097,728 B, attention 2 x 2 x 256 x 2 = 2,048 B/token: 16 x cdiv(1,097,728, 16 x 2,048) = 544.
        (1, 544),
        # TP4: state 274,432 B, one (replicated) KV head: 1,024 B/token: 16 x cdiv(274,432, 16,384) = 272.
        (4, 272),
    ],
)
def test_attention_block_is_raised_to_hold_a_state_page(tp: int, block: int) -> None:
    kv = kv_layout(qwen3_next(), tp=tp, kv_dtype=KvDtype.AUTO)
    assert hybrid_block_size(kv, block_size=16) == block
    # It overrides a smaller --block-size, and keeps a larger one.
    assert hybrid_block_size(kv, block_size=1024) == 1024


def test_qwen3_next_pool_groups_and_pages_per_request() -> None:
    m = qwen3_next()
    s = EngineSettings(version="0.32.0", max_model_len=32768, kv_cache_memory_bytes=40 * GiB, tensor_parallel_size=4)
    cap = capacity(m, gpu_memory_bytes=141 * GiB, settings=s)
    page = 272 * 1024
    assert cap.block_size == 272
    # 12 attention + 36 state layers: group size 12, one attention group and three state groups.
    assert cap.num_blocks == 40 * GiB // (page * 12)
    # Prefix caching is on by default at 0.32.0, so mamba_cache_mode "align": two pages per state group.
    assert cap.state_pages_per_request == 2
    assert cap.blocks_per_max_len_request == cdiv(32768, 272) + 3 * 2
    assert cap.max_concurrency == pytest.approx(cap.num_blocks / (cdiv(32768, 272) + 6))
    assert cap.kv_cache_tokens == int(cap.max_concurrency * 32768)
    no_cache = capacity(m, gpu_memory_bytes=141 * GiB, settings=replace(s, enable_prefix_caching=False))
    assert no_cache.blocks_per_max_len_request == cdiv(32768, 272) + 3
    assert no_cache.as_dict()["state_layers"] == {
        "kind": "gated_delta_net",
        "layers": 36,
        "bytes_per_layer": 274432,
        "pages_per_request": 1,
    }


def test_nemotron_h_groups_by_the_smaller_count() -> None:
    # 2 attention + 6 Mamba layers: group size 2, one attention group and three Mamba groups.
    m = nemotron_h()
    s = EngineSettings(version="0.32.0", max_model_len=8192, kv_cache_memory_bytes=8 * GiB, enable_prefix_caching=False)
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    state = 3 * 10240 * 2 + 128 * 64 * 128 * 4
    per_token = 2 * 8 * 128 * 2
    block = 16 * cdiv(state, 16 * per_token)
    assert cap.block_size == block
    assert cap.num_blocks == 8 * GiB // (block * per_token * 2)
    assert cap.blocks_per_max_len_request == cdiv(8192, block) + 3


def test_engines_without_a_modelled_state_cache_are_refused() -> None:
    with pytest.raises(SizingError, match="TensorRT-LLM") as err:
        capacity(qwen3_next(), gpu_memory_bytes=141 * GiB, settings=EngineSettings(engine=EngineName.TRTLLM))
    assert err.value.field == "engine"
    with pytest.raises(SizingError) as old:
        capacity(qwen3_next(), gpu_memory_bytes=141 * GiB, settings=EngineSettings(version="0.8.0"))
    assert old.value.field == "engine_version"


# --- sliding windows at 0.32.0 ------------------------------------------------------------------------


def test_sliding_window_reserves_two_in_flight_batches_at_0_32() -> None:
    # SlidingWindowSpec.max_admission_blocks_per_request: min(window - 1 + max_in_flight_tokens, max_len)
    # with max_in_flight_tokens = 2 x max_num_batched_tokens under async scheduling (vllm/config/vllm.py).
    m = catalog_model("openai/gpt-oss-20b")
    s = EngineSettings(
        version="0.32.0", max_model_len=32768, kv_cache_memory_bytes=4 * GiB, max_num_batched_tokens=2048
    )
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    assert cap.blocks_per_max_len_request == 32768 // 16 + cdiv(128 - 1 + 2 * 2048, 16) + 1
    # 0.34.0: 64-token blocks by default; the same rule.
    cap = capacity(m, gpu_memory_bytes=80 * GiB, settings=replace(s, version="0.34.0"))
    assert cap.block_size == 64
    assert cap.blocks_per_max_len_request == 32768 // 64 + cdiv(128 - 1 + 2 * 2048, 64) + 1


# Groups one request holds blocks in: gpt-oss-20b alternates sliding (128) and full layers, one group of each kind;
# Gemma 3 12B has 5 sliding (1,024) layers per full one, grouped by the full count: 1 full and 5 sliding groups.
# A pipeline stage holds half or a quarter of the layers in the same proportions, so the same groups.
_GROUPS = {"openai/gpt-oss-20b": (1, 1, 128), "google/gemma-3-12b-it": (1, 5, 1024)}


@pytest.mark.parametrize(
    ("model_id", "version", "pp", "batches"),
    [
        # VllmConfig.max_concurrent_batches (vllm/config/vllm.py, the same function in 0.26.0, 0.28.0, 0.29.0 and
        # 0.32.0): under async scheduling pp + 1 where Model Runner V2 runs; the V1 runner keeps pp (async
        # scheduling is turned off for it under pipeline parallelism). MRV2 ran dense models by default from 0.26
        # (_is_default_v2_model_runner_model: not MoE) and every model from 0.29 (use_v2_model_runner).
        ("openai/gpt-oss-20b", "0.28.0", 2, 2),  # MoE on the V1 runner
        ("openai/gpt-oss-20b", "0.28.0", 4, 4),
        ("openai/gpt-oss-20b", "0.29.0", 2, 3),  # MoE on Model Runner V2
        ("openai/gpt-oss-20b", "0.32.0", 4, 5),
        ("google/gemma-3-12b-it", "0.28.0", 2, 3),  # dense: Model Runner V2 already
        ("google/gemma-3-12b-it", "0.25.0", 2, 1),  # before max_in_flight_tokens: one batch, whatever pp
        ("google/gemma-3-12b-it", "0.32.0", 1, 2),
    ],
)
def test_sliding_window_in_flight_batches_follow_the_pipeline(
    model_id: str, version: str, pp: int, batches: int
) -> None:
    s = EngineSettings(
        version=version,
        max_model_len=32768,
        kv_cache_memory_bytes=4 * GiB,
        max_num_batched_tokens=2048,
        pipeline_parallel_size=pp,
    )
    cap = capacity(catalog_model(model_id), gpu_memory_bytes=80 * GiB, settings=s)
    full_groups, sliding_groups, window = _GROUPS[model_id]
    sliding = cdiv(min(window - 1 + batches * 2048, 32768), 16) + 1  # max_admission_blocks_per_request
    assert cap.blocks_per_max_len_request == full_groups * cdiv(32768, 16) + sliding_groups * sliding


def test_listed_moe_architectures_run_model_runner_v2_before_0_29() -> None:
    # 0.26.0-0.28.0 _is_default_v2_model_runner_model: a MoE model stays on the V1 runner unless its architecture
    # is in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES (Qwen2MoeForCausalLM is, from 0.26.0; DeepseekV4ForCausalLM
    # from 0.28.0).
    moe = catalog_model("openai/gpt-oss-20b")
    for archs, version, batches in (
        (("GptOssForCausalLM",), "0.28.0", 2),
        (("Qwen2MoeForCausalLM",), "0.26.0", 3),
        (("DeepseekV4ForCausalLM",), "0.26.0", 2),
        (("DeepseekV4ForCausalLM",), "0.28.0", 3),
    ):
        m = replace(moe, architectures=archs)
        assert in_flight_batches(engine_profile(EngineName.VLLM, version), m, pipeline_parallel_size=2) == batches
    assert catalog_model("openai/gpt-oss-20b").architectures == ("GptOssForCausalLM",)  # read from config.json


# --- real start-up logs (CHECK cases: nothing here was fitted to them) ---------------------------------


def qwen36_35b_a3b() -> ModelSpec:
    """The Qwen3.5/3.6-35B-A3B language tower (model_type qwen3_5_moe_text): 40 layers, every fourth full
    attention, 2 KV heads x 256, gated delta net with 16 key / 32 value heads x 128, conv kernel 4, SSM state
    in float32 (mamba_ssm_dtype). Taken from third-party transcriptions of the family's config.json (public
    test fixtures), not from the checkpoint itself: a test geometry, not a catalog entry. The logs below agree
    with it to the token."""
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 10
    cfg = qwen3_next_config(
        model_type="qwen3_5_moe_text",
        num_hidden_layers=40,
        layer_types=layer_types,
        num_experts=256,
        num_experts_per_tok=8,
        mamba_ssm_dtype="float32",
    )
    return parse_hf_config({"model_type": "qwen3_5_moe", "text_config": cfg}, model_id="test/qwen3.6-35b-a3b")


@pytest.mark.parametrize(
    ("available_gib", "logged_tokens", "logged_concurrency", "source"),
    [
        (5.98, 567_978, 4.33, "noonghunna/club-3090 issue 612"),
        (6.01, 569_878, 4.35, "noonghunna/club-3090 issue 652"),
    ],
)
def test_qwen36_hybrid_pool_matches_vllm_logs(
    available_gib: float, logged_tokens: int, logged_concurrency: float, source: str
) -> None:
    # vLLM 0.24.0 on an RTX 5090, Qwen3.6-35B-A3B NVFP4, kv_cache_dtype fp8, prefix caching on, max_model_len
    # 131,072, 8,192 batched tokens: "Available KV cache memory: X GiB", "GPU KV cache size: N tokens",
    # "Maximum concurrency for 131,072 tokens per request: C". Worked: fp8 attention 2 x 2 x 256 = 1,024 B per
    # token; state (3 x 8,192) bf16 + (32 x 128 x 128) fp32 = 2,146,304 B -> block 16 x cdiv(2,146,304,
    # 16 x 1,024) = 2,096 tokens; 10 attention + 30 state layers -> 4 groups of 10; a request holds
    # cdiv(131,072, 2,096) = 63 attention blocks + 3 x 2 state pages ("align").
    settings = EngineSettings(
        version="0.24.0",
        max_model_len=131072,
        max_num_batched_tokens=8192,
        max_num_seqs=1,
        kv_cache_dtype=KvDtype.FP8,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(available_gib * GiB),
    )
    cap = capacity(qwen36_35b_a3b(), gpu_memory_bytes=141 * GiB, settings=settings)
    assert cap.block_size == 2096, source
    assert cap.blocks_per_max_len_request == 63 + 6, source
    assert round(cap.max_concurrency, 2) == logged_concurrency, source
    assert cap.kv_cache_tokens == logged_tokens, source
