"""Per-GPU memory terms that do not depend on the engine: KV bytes per token and weight bytes.

KV cache, per token per GPU and per layer:
  * full / sliding / chunked attention: 2 (K and V) x KV heads on this rank x head_dim x dtype bytes.
    KV heads are split across tensor-parallel ranks; with fewer KV heads than ranks each rank holds
    one head (replicated), as vLLM and TensorRT-LLM do.
  * MLA (DeepSeek-V2/V3): one latent of (kv_lora_rank + qk_rope_head_dim) x dtype bytes, held by
    every rank (the latent is not split by heads).
  * layers without attention: nothing per token.
Sliding-window and chunked layers hold at most their window per sequence; how that caps a
request's memory is the engine's business (``engines.py``).

Linear-attention / state-space layers (Qwen3-Next's gated delta net, Mamba-2) hold one fixed-size state
per sequence: a conv state and an SSM state, shaped as vLLM's ``MambaStateShapeCalculator`` shapes them
(vllm/model_executor/layers/mamba/mamba_utils.py, 0.32.0), sharded across TP ranks.

Weights, per GPU: each parameter part (``models.ParamGroup``) at the scheme's bytes per parameter;
shardable parts divide by TP (embeddings and lm_head after padding the vocabulary to a multiple of
64 per rank, vLLM's VocabParallelEmbedding), replicated parts (norms, routers) do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.errors import SizingError
from kvfleet.sizing.models import AttentionKind, ModelSpec, StateKind
from kvfleet.sizing.precision import KvDtype, Part, WeightScheme
from kvfleet.sizing.units import cdiv

# vLLM pads the whole vocabulary to a multiple of 64 rows and gives each TP rank an equal share of that
# (vllm/model_executor/layers/vocab_parallel_embedding.py at 0.32.0: pad_vocab_size, DEFAULT_VOCAB_PADDING_SIZE = 64,
# then divide(num_embeddings_padded, tp_size)).
VOCAB_PADDING = 64


def validate_tp(model: ModelSpec, tp: int, *, field: str = "tensor_parallel_size") -> None:
    """Raise SizingError unless ``tp`` is a degree the engines accept for this model."""
    if tp < 1:
        raise SizingError(f"must be at least 1, got {tp}", field=field)
    heads = model.num_attention_heads
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= 64]
        raise SizingError(
            f"{tp} does not divide the model's {heads} attention heads; use one of {', '.join(map(str, divisors))}",
            field=field,
        )
    kv = model.num_kv_heads
    if model.mla is None and kv % tp and tp % kv:
        raise SizingError(
            f"{tp} ranks cannot split {kv} KV heads (one must divide the other)",
            field=field,
        )
    st = model.state
    if st is not None and st.num_heads % tp:
        # mamba_utils.py divide(): the state's heads split evenly across ranks or the engine refuses.
        divisors = [d for d in range(1, st.num_heads + 1) if st.num_heads % d == 0 and d <= 64]
        raise SizingError(
            f"{tp} does not divide the model's {st.num_heads} {st.kind.value} heads; use one of "
            f"{', '.join(map(str, divisors))}",
            field=field,
        )


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    return max(1, model.num_kv_heads // tp)


@dataclass(frozen=True, kw_only=True)
class KvGroup:
    """Layers that cache alike: same attention kind and window."""

    attention: AttentionKind
    window_tokens: int | None
    num_layers: int
    bytes_per_token_per_layer: int
    draft: bool = False  # a speculative drafter's layers, in the target's cache pool

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer


# vLLM's mamba dtype names (vllm/config/cache.py MambaDType) and their sizes.
MAMBA_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """One state layer's cache on one TP rank (vLLM ``MambaSpec`` before page padding)."""

    kind: StateKind
    num_layers: int
    conv_shape: tuple[int, int]  # (kernel - 1 + speculative tokens, conv dim / tp): the "SD" layout
    ssm_shape: tuple[int, int, int]
    conv_dtype_bytes: int
    ssm_dtype_bytes: int

    @property
    def bytes_per_layer(self) -> int:
        """``MambaSpec.page_size_bytes`` unpadded: conv plus SSM state of one sequence in one layer."""
        conv = self.conv_shape[0] * self.conv_shape[1] * self.conv_dtype_bytes
        ssm = self.ssm_shape[0] * self.ssm_shape[1] * self.ssm_shape[2] * self.ssm_dtype_bytes
        return conv + ssm

    @property
    def bytes_per_sequence(self) -> int:
        return self.num_layers * self.bytes_per_layer


def _mamba_dtype_bytes(name: str, *, auto_bytes: int, field: str) -> int:
    if name == "auto":
        return auto_bytes
    try:
        return MAMBA_DTYPE_BYTES[name]
    except KeyError:
        raise SizingError(f"unknown dtype {name!r}; use auto, {', '.join(MAMBA_DTYPE_BYTES)}", field=field) from None


def state_layout(
    model: ModelSpec,
    *,
    tp: int,
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    num_speculative_tokens: int = 0,
) -> StateLayout | None:
    """The per-layer state of the model's linear-attention / Mamba layers on one rank, or None.

    Dtypes follow ``MambaStateDtypeCalculator._mamba_state_dtype``: the conv state takes
    mamba_cache_dtype ("auto": the model's dtype); the SSM state takes mamba_ssm_cache_dtype, whose
    "auto" means the conv state's dtype unless the model's own rule says otherwise (``StateSpec.ssm_dtype``).
    """
    st = model.state
    if st is None or model.state_layers == 0:
        return None
    validate_tp(model, tp)
    model_bytes = 4 if model.torch_dtype in ("float32", "fp32") else 2
    conv_bytes = _mamba_dtype_bytes(mamba_cache_dtype, auto_bytes=model_bytes, field="mamba_cache_dtype")
    ssm_name = mamba_ssm_cache_dtype
    if ssm_name == "auto" and st.ssm_dtype is not None:
        ssm_name = st.ssm_dtype
    ssm_bytes = _mamba_dtype_bytes(ssm_name, auto_bytes=conv_bytes, field="mamba_ssm_cache_dtype")
    groups = st.num_groups
    if st.kind is StateKind.MAMBA2 and groups % tp:
        groups = tp  # extra_groups_for_head_shards: groups are replicated so each rank holds its heads' groups
    conv_dim = st.num_heads * st.head_dim + 2 * groups * st.group_dim
    if conv_dim % tp:
        raise SizingError(f"{tp} ranks cannot split the {conv_dim}-wide conv state", field="tensor_parallel_size")
    conv_shape = (st.conv_kernel - 1 + num_speculative_tokens, conv_dim // tp)
    # gated delta net: (v heads, head_v_dim, head_k_dim); Mamba-2: (heads, head_dim, ssm_state_size).
    ssm_shape = (st.num_heads // tp, st.head_dim, st.group_dim)
    return StateLayout(
        kind=st.kind,
        num_layers=model.state_layers,
        conv_shape=conv_shape,
        ssm_shape=ssm_shape,
        conv_dtype_bytes=conv_bytes,
        ssm_dtype_bytes=ssm_bytes,
    )


@dataclass(frozen=True, kw_only=True)
class KvLayout:
    tp: int
    kv_dtype: KvDtype
    dtype_bytes: int
    groups: tuple[KvGroup, ...]
    state: StateLayout | None = None  # linear-attention / Mamba layers: a fixed state per sequence

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """Bytes one token costs on one GPU if every KV layer held it (full-attention equivalent)."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes per token of the layers that hold the whole sequence (full attention and MLA)."""
        return sum(g.bytes_per_token for g in self.groups if g.window_tokens is None)

    def bytes_per_sequence(self, tokens: int) -> int:
        """KV bytes on one GPU for one sequence of ``tokens`` (windowed layers capped, no blocks)."""
        total = self.state.bytes_per_sequence if self.state is not None else 0
        for g in self.groups:
            held = tokens if g.window_tokens is None else min(tokens, g.window_tokens)
            total += held * g.bytes_per_token
        return total


def kv_layout(
    model: ModelSpec,
    *,
    tp: int,
    kv_dtype: KvDtype,
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
) -> KvLayout:
    validate_tp(model, tp)
    dtype_bytes = kv_dtype.bytes_per_element()
    per_layer_attn = 2 * kv_heads_per_rank(model, tp) * model.head_dim * dtype_bytes
    counts: dict[tuple[AttentionKind, int | None], int] = {}
    for layer in model.layers:
        if layer.attention in (AttentionKind.NONE, AttentionKind.STATE):
            continue
        key = (layer.attention, layer.window_tokens)
        counts[key] = counts.get(key, 0) + 1
    groups = []
    for (kind, window), n in counts.items():
        if kind is AttentionKind.MLA:
            assert model.mla is not None
            per_layer = model.mla.latent_dim * dtype_bytes
        else:
            per_layer = per_layer_attn
        groups.append(KvGroup(attention=kind, window_tokens=window, num_layers=n, bytes_per_token_per_layer=per_layer))
    state = state_layout(model, tp=tp, mamba_cache_dtype=mamba_cache_dtype, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)
    return KvLayout(tp=tp, kv_dtype=kv_dtype, dtype_bytes=dtype_bytes, groups=tuple(groups), state=state)


@dataclass(frozen=True, kw_only=True)
class WeightBreakdown:
    tp: int
    scheme: WeightScheme
    bytes_by_part: tuple[tuple[Part, int], ...]
    # Buffers the model allocates beside its parameters while it loads (vLLM's RoPE cos/sin cache), in what the
    # engine reports as the model's memory.
    buffer_bytes: int = 0

    @property
    def weights_bytes_per_gpu(self) -> int:
        return sum(b for _, b in self.bytes_by_part) + self.buffer_bytes


# Models whose attention has no rotary embedding (Nemotron-H's attention layers take no positions).
_NO_ROPE = frozenset({"nemotron_h"})
# Multimodal RoPE caches this many positions per max_position_embeddings: Qwen2-VL and Qwen2.5-VL pass get_rope's
# default mrope_positions_factor 4 (video positions run past the token count); Qwen3-VL passes 1 unless video pruning
# is on (vllm/model_executor/models/qwen3_vl.py mrope_positions_factor, 0.32.0).
_MROPE_POSITIONS = {"qwen2_vl": 4, "qwen2_5_vl": 4}


def rope_cache_bytes(model: ModelSpec, dtype_bytes: int = 2) -> int:
    """vLLM's RoPE cos/sin cache on each GPU: one buffer of (positions x rotary_dim) in the model dtype, shared by
    every layer with the same rope parameters (get_rope caches instances: vllm/model_executor/layers/rotary_embedding,
    0.32.0). Positions by scaling type: YaRN original x factor (YaRNScalingRotaryEmbedding,
    DeepseekScalingRotaryEmbedding), linear max_position x factor, LongRoPE its short and long caches (original +
    max_position), the rest max_position; Gemma 3 builds two, its local layers' unscaled one and its global layers'.
    The length is the model's, not ``max_model_len``: vllm-project/vllm PR 44738 (closed unmerged) proposed clamping it
    and measured what that would save (224 MB for Qwen3-VL at 32k). Llama 4 Scout's 10M positions make 2.5 GiB."""
    if model.mla is not None:
        rotary_dim = model.mla.qk_rope_head_dim  # MLA rotates only its decoupled RoPE key
    else:
        rotary_dim = int(model.head_dim * model.partial_rotary_factor)
    return rope_cache_positions(model) * rotary_dim * dtype_bytes


def rope_cache_positions(model: ModelSpec) -> int:
    """The positions vLLM's RoPE caches hold together (``rope_cache_bytes``); 0 where the model has no rope."""
    if model.model_type in _NO_ROPE or model.attention_layers == 0:
        return 0
    rope = model.rope_scaling
    kind = rope.rope_type if rope is not None else "default"
    factor = (rope.factor if rope is not None else None) or 1.0
    max_pos = model.max_position_embeddings
    original = (rope.original_max_position_embeddings if rope is not None else None) or (
        model.original_max_position_embeddings or max_pos
    )
    if kind in ("yarn", "deepseek_yarn"):
        positions = int(original * factor)
    elif kind == "linear":
        positions = int(max_pos * factor)
    elif kind == "longrope":
        positions = original + max_pos
    else:
        positions = max_pos
    positions *= _MROPE_POSITIONS.get(model.model_type, 1)
    caches = [positions]
    if model.model_type in ("gemma3", "gemma3_text"):
        caches.append(max_pos)  # the sliding layers' rope: its own base, no scaling
    return sum(caches)


def weight_bytes(
    model: ModelSpec, *, tp: int, scheme: WeightScheme, ep: bool = False, without: frozenset[Part] = frozenset()
) -> WeightBreakdown:
    """Weight bytes one TP rank holds under ``scheme``. MoE experts are all resident: split in width over the ranks,
    or with ``ep`` (expert parallelism) whole, the fullest rank holding ceil(experts / tp) of them (vLLM's
    determine_expert_map). ``without``: parts this GPU does not hold (a pipeline stage without the embedding)."""
    validate_tp(model, tp)
    unq = 2.0  # unquantized parts stay in the activation dtype (bf16/fp16)
    out: list[tuple[Part, int]] = []
    for g in model.param_groups:
        if g.part in without:
            continue
        per_param = scheme.bytes_per_param(g.part, unquantized_bytes=unq)
        if g.part in (Part.EMBEDDING, Part.LM_HEAD):
            rows = cdiv(cdiv(model.vocab_size, VOCAB_PADDING) * VOCAB_PADDING, tp)
            count = rows * model.hidden_size
        elif g.part is Part.ATTENTION and model.mla is None:
            # K/V projections are replicated when there are fewer KV heads than ranks.
            kv = 2 * model.hidden_size * model.num_kv_heads * model.head_dim * model.attention_layers
            kv_rank = 2 * model.hidden_size * kv_heads_per_rank(model, tp) * model.head_dim * model.attention_layers
            count = (g.count - kv) // tp + kv_rank
        elif g.part is Part.EXPERTS and model.moe is not None and ep:
            inter = model.moe.expert_intermediate_size
            pad = max(1, scheme.expert_intermediate_pad)
            padded = cdiv(inter, pad) * pad
            count = g.count * cdiv(model.moe.num_experts, tp) // model.moe.num_experts * padded // inter
        elif g.part is Part.EXPERTS and model.moe is not None and scheme.expert_intermediate_pad > 1:
            inter = cdiv(model.moe.expert_intermediate_size, tp)
            padded = cdiv(inter, scheme.expert_intermediate_pad) * scheme.expert_intermediate_pad
            count = cdiv(g.count, tp) * padded // inter
        elif g.shardable:
            count = cdiv(g.count, tp)
        else:
            count = g.count
        out.append((g.part, round(count * per_param)))
    return WeightBreakdown(tp=tp, scheme=scheme, bytes_by_part=tuple(out))
