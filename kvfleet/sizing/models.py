"""Model architectures: typed specs parsed from Hugging Face ``config.json`` fields.

The built-in catalog (``data/models.json``) stores each model's config.json fields verbatim with a
source, so one parser serves both the catalog and any local config.json a user points at.
Parameter counts are computed per part (attention, MLP, experts, router, embeddings, norms) because
tensor parallelism shards some parts and replicates others, and quantization schemes treat them
differently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvfleet.engines.capacity import RopeLengthRules
from kvfleet.errors import ModelConfigError
from kvfleet.sizing.precision import Part, WeightScheme, weight_scheme


class AttentionKind(StrEnum):
    FULL = "full"
    SLIDING = "sliding"  # holds at most `window_tokens` per sequence
    CHUNKED = "chunked"  # chunked local attention (Llama 4): at most one chunk per sequence
    MLA = "mla"  # multi-head latent attention: one latent per token, held by every TP rank
    STATE = "state"  # linear attention / state-space mixer: a fixed-size recurrent state per sequence
    NONE = "none"  # no token mixer at all (an MLP-only block of Nemotron-H)


class StateKind(StrEnum):
    GATED_DELTA_NET = "gated_delta_net"  # Qwen3-Next linear attention
    MAMBA2 = "mamba2"  # Mamba-2 mixers (Nemotron-H)


@dataclass(frozen=True, kw_only=True)
class StateSpec:
    """Geometry of a linear-attention / state-space mixer, in the terms of vLLM's
    ``MambaStateShapeCalculator`` (vllm/model_executor/layers/mamba/mamba_utils.py, 0.32.0).

    Gated delta net: ``num_heads`` value heads of ``head_dim``, ``num_groups`` key heads of ``group_dim``.
    Mamba-2: ``num_heads`` heads of ``head_dim`` (their product is the mixer's intermediate size),
    ``num_groups`` B/C groups of ``group_dim`` = ssm_state_size.
    """

    kind: StateKind
    num_heads: int
    head_dim: int
    num_groups: int
    group_dim: int
    conv_kernel: int
    # The SSM state's dtype when mamba_ssm_cache_dtype is "auto"; None: the conv state's dtype (the model's).
    # vLLM sets it per model (model_executor/models/config.py NemotronHForCausalLMConfig: the config's
    # mamba_ssm_cache_dtype, else float32).
    ssm_dtype: str | None = None
    conv_bias: bool = True
    proj_bias: bool = False


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    attention: AttentionKind
    window_tokens: int | None = None
    moe: bool = False
    mlp: bool = True  # False: the block has no feed-forward part (Nemotron-H's mixer-only blocks)


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    expert_bias: bool = False


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the compressed KV latent plus the decoupled RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """What the checkpoint's ``quantization_config`` says."""

    method: str  # the config's quant_method
    scheme: WeightScheme
    detail: str = ""
    kv_cache_fp8: bool = False  # checkpoint ships fp8 KV scales (compressed-tensors kv_cache_scheme)
    # quantization_config.weight_block_size ([block_n, block_k]) of block-quantized FP8 checkpoints: each rank's
    # shard must be whole blocks (kvfleet.sizing.parallel).
    weight_block_size: tuple[int, int] | None = None


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """A config's ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (>= 5), as engines read it for length.

    ``rope_type`` is the config's ``rope_type``, else its legacy ``type``; the legacy ``su`` is read as
    ``longrope`` (vllm/transformers_utils/config.py ``patch_legacy_rope_type``, 0.32.0)."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_theta: float | None = None
    key: str = "rope_scaling"  # where the config holds it, for messages

    def as_override(self) -> dict[str, object]:
        """The ``rope_scaling`` object of an engine's config override (vLLM ``--hf-overrides``)."""
        out: dict[str, object] = {"rope_type": self.rope_type}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_theta is not None:
            # transformers 5 keeps rope_theta inside rope_parameters: an override that replaces the object
            # without it would lose the base frequency.
            out["rope_theta"] = self.rope_theta
        return out


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """Parameters of one part. ``shardable`` ones split across TP ranks; the others are replicated."""

    part: Part
    count: int
    shardable: bool


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """The vision encoder and projector of a vision-language model, as the engine builds them.

    ``params`` counts the encoder and the projector by module (``_vision_tower``); the rest is what
    vLLM's start-up profiling needs: how many language-model tokens one image (and, for Qwen-VL, one
    video) becomes at the processor's default size, and how many encoder patches make one token.
    """

    kind: str  # the tower: qwen2_vl, qwen2_5_vl, siglip, clip, pixtral, llama4
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    gated_mlp: bool
    patches_per_token: int  # spatial merge (Qwen-VL, Pixtral 2x2), 1 where every patch is a token
    image_tokens: int  # language-model tokens of the largest default-size image
    params: int
    video_frame_tokens: int = 0  # Qwen-VL: tokens per pair of video frames (temporal patch 2); 0: no video
    pixel_unit: int = 0  # Qwen-VL: patch x merge pixels per token side, for a max_pixels override; 0: fixed size
    video_tokens: int = 0  # Qwen3-VL: tokens of vLLM's dummy video, whatever max_model_len (two frames)
    embeds_per_token: int = 1  # LM-width vectors the encoder hands over per token (Qwen3-VL: 1 + deepstack levels)

    def image_tokens_at(self, max_pixels: int | None) -> int:
        """Tokens of the largest image under a processor max_pixels (Qwen-VL's --mm-processor-kwargs)."""
        if max_pixels is None or not self.pixel_unit:
            return self.image_tokens
        return qwen_vl_tokens(max_pixels, self.pixel_unit)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    model_id: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    layers: tuple[LayerSpec, ...]
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    state: StateSpec | None = None
    quantization: Quantization | None = None
    attention_bias: bool = False
    gated_mlp: bool = True
    norms_per_layer: int = 2
    vision_params: int = 0
    vision: VisionSpec | None = None
    # Speculative decoding: the multi-token-prediction layers the checkpoint ships after its decoder layers
    # (num_nextn_predict_layers, or mtp_num_hidden_layers), and an EAGLE-3 head's reduced output vocabulary.
    mtp_layers: int = 0
    draft_vocab_size: int | None = None
    # config.json "architectures": the classes vLLM may build, which some engine defaults are keyed on.
    architectures: tuple[str, ...] = ()
    source: str = ""
    family: str = ""
    aliases: tuple[str, ...] = field(default=())
    rope_scaling: RopeScaling | None = None
    # Phi-3 keeps the pre-extension length beside rope_scaling, not in it.
    original_max_position_embeddings: int | None = None
    max_position_embeddings_key: str = "max_position_embeddings"  # the config key the length was read from
    rope_theta: float | None = None
    rope_override: bool = False  # rope_scaling was set by the user (an engine config override), not the checkpoint
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions RoPE rotates

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def param_groups(self) -> tuple[ParamGroup, ...]:
        return _param_groups(self)

    @property
    def total_params(self) -> int:
        return sum(g.count for g in self.param_groups)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with: routed experts count only ``experts_per_token`` of
        them, and the input embedding (a lookup, not a matmul) not at all — as OpenAI counts gpt-oss's
        5.1B active parameters. A tied embedding still counts once, as the lm_head."""
        total = 0
        for g in self.param_groups:
            if g.part is Part.EMBEDDING and not self.tie_word_embeddings:
                continue
            if g.part is Part.EXPERTS and self.moe is not None:
                routed = self.moe.num_experts
                total += g.count * self.moe.experts_per_token // routed
            elif g.part is not Part.VISION:
                total += g.count
        return total

    @property
    def native_scheme(self) -> WeightScheme:
        if self.quantization is not None:
            return self.quantization.scheme
        return weight_scheme("fp16" if self.torch_dtype in ("float16", "fp16") else "bf16")

    @property
    def attention_layers(self) -> int:
        """Layers that hold a per-token KV cache."""
        return sum(1 for layer in self.layers if layer.attention not in _NO_KV)

    @property
    def state_layers(self) -> int:
        """Linear-attention / state-space layers: one fixed-size state per sequence each."""
        return sum(1 for layer in self.layers if layer.attention is AttentionKind.STATE)

    @property
    def is_hybrid(self) -> bool:
        """More than one kind of cache layer (sliding-window plus full, or state plus attention)."""
        kinds = {(lay.attention, lay.window_tokens) for lay in self.layers}
        kinds.discard((AttentionKind.NONE, None))
        return len(kinds) > 1

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for lay in self.layers:
            key = lay.attention.value + (f"({lay.window_tokens})" if lay.window_tokens else "")
            kinds[key] = kinds.get(key, 0) + 1
        attn = ", ".join(f"{n} {k}" for k, n in kinds.items())
        moe = f", MoE {self.moe.num_experts}x top-{self.moe.experts_per_token}" if self.moe else ""
        return (
            f"{self.num_layers} layers ({attn}), {self.num_attention_heads} heads / {self.num_kv_heads} KV "
            f"heads x {self.head_dim}{moe}, {self.total_params / 1e9:.2f}B params"
        )


_NO_KV = frozenset({AttentionKind.NONE, AttentionKind.STATE})


# ---------------------------------------------------------------------------------------------
# Parsing Hugging Face config.json
# ---------------------------------------------------------------------------------------------

# Model types this parser understands, each mapped to its attention/MLP layout.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "phi",
        "phi3",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
        "llama4",
        "llama4_text",
        "mistral3",
        "granite",
        "olmo2",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "nemotron_h",
        "qwen2_vl",
        "qwen2_5_vl",
        "llava",
        "llava_next",
        "qwen3_vl",
        "qwen3_vl_moe",
    }
)

# Qwen3-VL-MoE (vLLM qwen3_vl_moe.py) is Qwen3-VL's vision tower in front of a Qwen3-MoE language model: its text
# layers are Qwen3MoeDecoderLayer (gate, routed experts of moe_intermediate_size, no shared expert, q/k norms).
QWEN3_MOE_TYPES = frozenset({"qwen3_moe", "qwen3_vl_moe"})
QWEN3_VL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_moe"})

# Gated-delta-net hybrids: Qwen3-Next and the Qwen3.5 family built on its layers (vLLM qwen3_next.py,
# qwen3_5.py: the same GatedDeltaNetAttention, gated attention output, q/k norms, shared-expert MoE).
GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})

# Served by vLLM once, no longer: model type -> why, and what to serve instead.
UNSUPPORTED_MODEL_TYPES = {
    "mllama": (
        "Llama 3.2 Vision (mllama) is not served by vLLM 0.32.0: its cross-attention encoder-decoder model was "
        "removed with V0's encoder-decoder support (vllm-project/vllm PR 24907, merged 2025-09-15, before 0.11.0); "
        "serve Qwen/Qwen2.5-VL-7B-Instruct, google/gemma-3-12b-it or meta-llama/Llama-4-Scout-17B-16E-Instruct instead"
    ),
}

# HF defaults for tie_word_embeddings where a config omits it (each model's configuration_*.py).
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})

# Class defaults that published configs rely on by leaving keys out. Gemma 3's config.json files
# are sparse: transformers' Gemma3TextConfig supplies the rest (configuration_gemma3.py).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    # LLaVA configs nest a sparse Llama text_config; transformers' LlamaConfig supplies the rest
    # (configuration_llama.py: 32 layers, hidden 4096, intermediate 11008, 32 heads, vocab 32000).
    "llava_llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}


def _int(cfg: Mapping[str, Any], key: str, *, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelConfigError(f"missing required field {key!r}", field=where + key)
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ModelConfigError(f"expected an integer, got {value!r}", field=where + key)
    if value < 0:
        raise ModelConfigError(f"must not be negative, got {value!r}", field=where + key)
    return int(value)


def _first(cfg: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _text_config(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """Multimodal configs (Gemma 3, Llama 4, Mistral 3) nest the language model under text_config."""
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" in text:
        return text, "text_config."
    if isinstance(text, Mapping) and cfg.get("model_type") in ("llava", "llava_next"):
        if text.get("model_type", "llama") == "llama":
            return {**_CLASS_DEFAULTS["llava_llama"], **text}, "text_config."
        return text, "text_config."
    return cfg, ""


def _layer_kinds(model_type: str, t: Mapping[str, Any], n_layers: int, where: str) -> list[LayerSpec]:
    layer_types = t.get("layer_types")
    if isinstance(layer_types, list):
        return _listed_layers(model_type, t, layer_types, n_layers, where)
    if model_type in GDN_MODEL_TYPES:
        # transformers Qwen3NextConfig: layer i is full attention when (i + 1) % full_attention_interval == 0.
        interval = _int(t, "full_attention_interval", where=where, default=4) or 1
        full = LayerSpec(attention=AttentionKind.FULL)
        return [full if (i + 1) % interval == 0 else LayerSpec(attention=AttentionKind.STATE) for i in range(n_layers)]
    if model_type == "nemotron_h":
        return _nemotron_h_layers(t, n_layers, where)
    if model_type in ("llama4", "llama4_text") and t.get("attention_chunk_size"):
        return _llama4_layers(t, n_layers)
    return _windowed_layers(model_type, t, n_layers)


def _listed_layers(
    model_type: str, t: Mapping[str, Any], layer_types: list[Any], n_layers: int, where: str
) -> list[LayerSpec]:
    """Layers as the config's ``layer_types`` lists them, one entry a layer."""
    window = t.get("sliding_window")
    if len(layer_types) != n_layers:
        raise ModelConfigError(
            f"has {len(layer_types)} entries but num_hidden_layers is {n_layers}",
            field=where + "layer_types",
        )
    out = []
    for kind in layer_types:
        if kind == "full_attention":
            out.append(LayerSpec(attention=AttentionKind.FULL))
        elif kind == "sliding_attention":
            if not window:
                raise ModelConfigError(
                    "layer_types has sliding_attention but sliding_window is not set",
                    field=where + "sliding_window",
                )
            out.append(LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window)))
        elif kind == "chunked_attention":
            chunk = _int(t, "attention_chunk_size", where=where)
            out.append(LayerSpec(attention=AttentionKind.CHUNKED, window_tokens=chunk))
        elif kind == "linear_attention" and model_type in GDN_MODEL_TYPES:
            out.append(LayerSpec(attention=AttentionKind.STATE))
        elif kind in ("linear_attention", "mamba", "conv"):
            raise ModelConfigError(
                f"layer type {kind!r} of model type {model_type!r} is not modelled (its state shape is "
                "unknown here); supported hybrids with state layers: qwen3_next, nemotron_h",
                field=where + "layer_types",
            )
        else:
            raise ModelConfigError(f"unknown layer type {kind!r}", field=where + "layer_types")
    return out


def _llama4_layers(t: Mapping[str, Any], n_layers: int) -> list[LayerSpec]:
    """Llama 4: chunked local attention on its RoPE layers, full attention on the NoPE ones."""
    chunk = int(t["attention_chunk_size"])
    nope = t.get("no_rope_layers")
    if not isinstance(nope, list) or len(nope) != n_layers:
        interval = int(t.get("no_rope_layer_interval") or 4)
        nope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    full = LayerSpec(attention=AttentionKind.FULL)
    # no_rope_layers[i] == 1: RoPE layer with chunked local attention; 0: NoPE global layer.
    return [
        LayerSpec(attention=AttentionKind.CHUNKED, window_tokens=chunk) if nope[i] else full for i in range(n_layers)
    ]


def _windowed_layers(model_type: str, t: Mapping[str, Any], n_layers: int) -> list[LayerSpec]:
    """Sliding-window layers where the family's pattern puts them, full attention elsewhere (and everywhere without
    a window)."""
    window = t.get("sliding_window")
    full = [LayerSpec(attention=AttentionKind.FULL) for _ in range(n_layers)]
    if model_type in ("gemma2",) and window:
        # HF Gemma2DecoderLayer: even layers are sliding (is_sliding = not bool(layer_idx % 2)).
        return [
            LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window)) if i % 2 == 0 else full[i]
            for i in range(n_layers)
        ]
    if model_type in ("gemma3", "gemma3_text") and window:
        # HF Gemma3: every `sliding_window_pattern`-th layer is global, the rest local.
        pattern = int(t.get("sliding_window_pattern") or t.get("_sliding_window_pattern") or 6)
        return [
            full[i] if (i + 1) % pattern == 0 else LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window))
            for i in range(n_layers)
        ]
    if model_type == "gpt_oss" and window:
        # gpt-oss alternates sliding (even layers) and full attention.
        return [
            LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window)) if i % 2 == 0 else full[i]
            for i in range(n_layers)
        ]
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen2_vl", "qwen2_5_vl") or model_type in (
        QWEN3_MOE_TYPES | QWEN3_VL_TYPES
    ):
        if t.get("use_sliding_window") and window:
            first_full = int(t.get("max_window_layers") or n_layers)
            return [
                LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window))
                if i >= first_full
                # Qwen2 applies the window to layers at index >= max_window_layers.
                else full[i]
                for i in range(n_layers)
            ]
        return full
    if model_type in ("mistral", "mixtral", "phi3") and window:
        return [LayerSpec(attention=AttentionKind.SLIDING, window_tokens=int(window)) for _ in range(n_layers)]
    return full


# Nemotron-H's hybrid_override_pattern: one character per block (vllm/model_executor/models/nemotron_h.py
# ALL_DECODER_LAYER_TYPES): M a Mamba-2 mixer, * attention, - an MLP; E (MoE) is not modelled here.
_NEMOTRON_BLOCKS = {
    "M": LayerSpec(attention=AttentionKind.STATE, mlp=False),
    "*": LayerSpec(attention=AttentionKind.FULL, mlp=False),
    "-": LayerSpec(attention=AttentionKind.NONE),
}


def _nemotron_h_layers(t: Mapping[str, Any], n_layers: int, where: str) -> list[LayerSpec]:
    pattern = t.get("hybrid_override_pattern")
    f = where + "hybrid_override_pattern"
    if not isinstance(pattern, str) or len(pattern) != n_layers:
        raise ModelConfigError(f"must be a string of num_hidden_layers ({n_layers}) block letters", field=f)
    unknown = sorted(set(pattern) - set(_NEMOTRON_BLOCKS))
    if unknown:
        raise ModelConfigError(
            f"block letters {''.join(unknown)!r} are not modelled (E: MoE blocks of Nemotron 3); supported: M "
            "(Mamba-2), * (attention), - (MLP), as in the dense Nemotron-H and Nemotron Nano 2 models",
            field=f,
        )
    return [_NEMOTRON_BLOCKS[c] for c in pattern]


def _state(model_type: str, t: Mapping[str, Any], where: str) -> StateSpec | None:
    if model_type in GDN_MODEL_TYPES:
        # Qwen3.5 names its SSM state dtype in the config (mamba_ssm_dtype), which vLLM takes when
        # mamba_ssm_cache_dtype is auto (model_executor/models/config.py Qwen3_5ForConditionalGenerationConfig).
        ssm_dtype = t.get("mamba_ssm_dtype") if model_type != "qwen3_next" else None
        return StateSpec(
            kind=StateKind.GATED_DELTA_NET,
            ssm_dtype=str(ssm_dtype) if ssm_dtype else None,
            num_heads=_int(t, "linear_num_value_heads", where=where),
            head_dim=_int(t, "linear_value_head_dim", where=where),
            num_groups=_int(t, "linear_num_key_heads", where=where),
            group_dim=_int(t, "linear_key_head_dim", where=where),
            conv_kernel=_int(t, "linear_conv_kernel_dim", where=where),
            conv_bias=False,
        )
    if model_type == "nemotron_h":
        ssm = t.get("mamba_ssm_cache_dtype") or "float32"
        return StateSpec(
            kind=StateKind.MAMBA2,
            num_heads=_int(t, "mamba_num_heads", where=where),
            head_dim=_int(t, "mamba_head_dim", where=where),
            num_groups=_int(t, "n_groups", where=where),
            group_dim=_int(t, "ssm_state_size", where=where),
            conv_kernel=_int(t, "conv_kernel", where=where),
            ssm_dtype=str(ssm),
            conv_bias=bool(t.get("use_conv_bias", True)),
            proj_bias=bool(t.get("use_bias", False)),
        )
    return None


def _quantization(cfg: Mapping[str, Any], where: str) -> Quantization | None:
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ModelConfigError("must be an object", field=where + "quantization_config")
    method = str(q.get("quant_method", "")).lower()
    f = where + "quantization_config"
    if method in ("awq", "awq_marlin", "gptq", "gptq_marlin"):
        bits = int(q.get("bits", q.get("w_bit", 4)))
        group = int(q.get("group_size", q.get("q_group_size", 128)))
        base = weight_scheme("awq" if method.startswith("awq") else "gptq")
        if bits not in (4, 8):
            raise ModelConfigError(f"{method} with {bits} bits is not supported (4 or 8)", field=f + ".bits")
        scheme = WeightScheme(
            name=base.name if bits == 4 else f"{base.name}-int8",
            weight_bits=bits,
            group_size=group if group > 0 else 0,
            scale_bytes=2,
            zero_bits=bits,
            needs_quantized_checkpoint=True,
            description=f"{bits}-bit {method.split('_')[0].upper()}, group {group}",
        )
        return Quantization(method=method, scheme=scheme, detail=f"{bits}-bit, group {group}")
    if method in ("fp8", "fbgemm_fp8", "modelopt"):
        block = q.get("weight_block_size")
        detail = f"block {block[0]}x{block[1]}" if isinstance(block, list) and len(block) == 2 else "per-tensor"
        if method == "modelopt" and "FP4" in str(q.get("quant_algo", "")).upper():
            return Quantization(method=method, scheme=weight_scheme("nvfp4"), detail="NVFP4")
        blocks = (int(block[0]), int(block[1])) if isinstance(block, list) and len(block) == 2 else None
        return Quantization(method=method, scheme=weight_scheme("fp8"), detail=detail, weight_block_size=blocks)
    if method == "mxfp4":
        return Quantization(method=method, scheme=weight_scheme("mxfp4"), detail="MoE experts in MXFP4")
    if method == "bitsandbytes":
        if q.get("load_in_8bit"):
            return Quantization(method=method, scheme=weight_scheme("bnb-8bit"), detail="LLM.int8")
        double = bool(q.get("bnb_4bit_use_double_quant", False))
        base = weight_scheme("bnb-4bit")
        scheme = (
            base
            if double
            else WeightScheme(
                name="bnb-4bit",
                weight_bits=4,
                group_size=64,
                scale_bytes=4,
                description="bitsandbytes 4-bit, fp32 absmax per 64",
            )
        )
        kind = str(q.get("bnb_4bit_quant_type", "fp4"))
        return Quantization(method=method, scheme=scheme, detail=f"{kind}, double quant {double}")
    if method == "compressed-tensors":
        return _compressed_tensors(q, f)
    raise ModelConfigError(
        f"quant_method {method!r} is not supported; supported: awq, gptq, fp8, compressed-tensors, bitsandbytes, mxfp4",
        field=f + ".quant_method",
    )


def _compressed_tensors(q: Mapping[str, Any], f: str) -> Quantization:
    groups = q.get("config_groups")
    kv = q.get("kv_cache_scheme")
    kv_fp8 = isinstance(kv, Mapping) and kv.get("type") == "float" and kv.get("num_bits") == 8
    if not isinstance(groups, Mapping) or not groups:
        raise ModelConfigError("compressed-tensors config has no config_groups", field=f + ".config_groups")
    first = next(iter(groups.values()))
    weights = first.get("weights") if isinstance(first, Mapping) else None
    if not isinstance(weights, Mapping):
        raise ModelConfigError("config group has no weights scheme", field=f + ".config_groups")
    bits = int(weights.get("num_bits", 8))
    wtype = str(weights.get("type", "int"))
    strategy = str(weights.get("strategy", "tensor"))
    group = int(weights.get("group_size") or 0)
    detail = f"{wtype}{bits} weights, {strategy}" + (f" {group}" if group else "")
    if bits == 8:
        name = "fp8" if wtype == "float" else "int8"
        return Quantization(method="compressed-tensors", scheme=weight_scheme(name), detail=detail, kv_cache_fp8=kv_fp8)
    if bits == 4 and wtype == "float":
        return Quantization(
            method="compressed-tensors", scheme=weight_scheme("nvfp4"), detail=detail, kv_cache_fp8=kv_fp8
        )
    if bits == 4:
        scheme = WeightScheme(
            name="w4a16",
            weight_bits=4,
            group_size=group,
            scale_bytes=2 if group else 0,
            needs_quantized_checkpoint=True,
            description=f"4-bit weight-only, {strategy}" + (f" group {group}" if group else ""),
        )
        return Quantization(method="compressed-tensors", scheme=scheme, detail=detail, kv_cache_fp8=kv_fp8)
    raise ModelConfigError(f"{bits}-bit {wtype} weights are not supported", field=f + ".config_groups")


def _moe(model_type: str, t: Mapping[str, Any], where: str) -> MoESpec | None:
    n_experts = _first(t, "num_local_experts", "num_experts", "n_routed_experts")
    if not n_experts:
        return None
    top_k = _first(t, "num_experts_per_tok", "experts_per_token", "num_experts_per_token")
    if not top_k:
        raise ModelConfigError("MoE config without num_experts_per_tok", field=where + "num_experts_per_tok")
    inter_raw = _first(t, "moe_intermediate_size", "intermediate_size")
    if not inter_raw:
        raise ModelConfigError("MoE config without moe_intermediate_size", field=where + "moe_intermediate_size")
    inter = int(inter_raw)
    shared = 0
    shared_inter = 0
    if model_type in ("deepseek_v2", "deepseek_v3"):
        shared = int(t.get("n_shared_experts") or 0)
        shared_inter = shared * inter
    elif model_type == "qwen2_moe" or model_type in GDN_MODEL_TYPES:
        shared_inter = int(t.get("shared_expert_intermediate_size") or 0)
        shared = 1 if shared_inter else 0
    elif model_type in ("llama4", "llama4_text"):
        shared, shared_inter = 1, inter  # Llama 4 MoE layers always carry one shared expert
    return MoESpec(
        num_experts=int(n_experts),
        experts_per_token=int(top_k),
        expert_intermediate_size=inter,
        num_shared_experts=shared,
        shared_expert_intermediate_size=shared_inter,
        expert_bias=model_type == "gpt_oss",
    )


def _moe_layers(model_type: str, t: Mapping[str, Any], n_layers: int) -> list[bool]:
    if model_type in ("deepseek_v2", "deepseek_v3"):
        first_dense = int(t.get("first_k_dense_replace") or 0)
        freq = int(t.get("moe_layer_freq") or 1)
        return [i >= first_dense and i % freq == 0 for i in range(n_layers)]
    if model_type == "qwen2_moe" or model_type in QWEN3_MOE_TYPES or model_type in GDN_MODEL_TYPES:
        step = int(t.get("decoder_sparse_step") or 1)
        dense = set(t.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]
    if model_type in ("llama4", "llama4_text"):
        step = int(t.get("interleave_moe_layer_step") or 1)
        moe_layers = t.get("moe_layers")
        if isinstance(moe_layers, list):
            return [i in set(moe_layers) for i in range(n_layers)]
        return [(i + 1) % step == 0 for i in range(n_layers)]
    return [True] * n_layers


# Qwen3-VL's processors (preprocessor_config.json / video_preprocessor_config.json of Qwen3VLProcessor checkpoints,
# e.g. Qwen/Qwen3.5-2B-Base): images up to "longest_edge" 16777216 pixels, videos up to 25165824 over two frames;
# vLLM 0.32.0 qwen3_vl.py get_max_video_tokens profiles two frames of longest_edge // temporal_patch_size pixels.
QWEN3_VL_IMAGE_MAX_PIXELS = 16_777_216
QWEN3_VL_VIDEO_MAX_PIXELS = 25_165_824

# The Qwen-VL image processor's default largest image (preprocessor_config.json of Qwen/Qwen2-VL-7B-Instruct
# and Qwen/Qwen2.5-VL-7B-Instruct: "max_pixels": 12845056); vLLM profiles the image with the most patches under
# it (vllm/model_executor/models/qwen2_vl.py get_image_size_with_most_features, 0.32.0).
QWEN_VL_MAX_PIXELS = 12_845_056


def _vit_layer(h: int, i: int, *, bias: bool, gated: bool, norm_bias: bool) -> int:
    """One pre-norm ViT block: two norms, q/k/v/o projections and the MLP."""
    norms = 2 * (2 * h if norm_bias else h)
    attn = 4 * h * h + (4 * h if bias else 0)
    mlp = (3 * h * i + (2 * i + h if bias else 0)) if gated else (2 * h * i + (i + h if bias else 0))
    return norms + attn + mlp


def _vint(v: Mapping[str, Any], key: str, default: int | None = None) -> int:
    return _int(v, key, where="vision_config.", default=default)


def qwen_vl_tokens(max_pixels: int, unit: int) -> int:
    """Tokens of the image vLLM profiles under max_pixels (qwen2_vl.py get_image_size_with_most_features): the most
    merged patches, max_pixels // unit^2 or fewer, that factor into a grid no more than 200 times wider than tall."""
    for n in range(max(1, max_pixels // (unit * unit)), 0, -1):
        h = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
        if (n // h) / h <= 200:
            return n
    return 1


def _qwen_vl_tokens(patch: int, merge: int) -> int:
    """Tokens of the largest default image (a 128 x 128 grid of merged patches)."""
    return qwen_vl_tokens(QWEN_VL_MAX_PIXELS, patch * merge)


def _qwen3_vl_vision(v: Mapping[str, Any], text_hidden: int) -> VisionSpec:
    """Qwen3-VL's tower (vLLM qwen3_vl.py): Conv3d patch embed with bias, learned position embeddings, LayerNorm
    blocks with biased projections and fc1/fc2 MLP, a merger (LayerNorm over the patch, Linear(4h, 4h),
    Linear(4h, out)) and one more merger, normed after the shuffle, per deepstack level."""
    h, i, n = _vint(v, "hidden_size"), _vint(v, "intermediate_size"), _vint(v, "depth")
    p, m, tp_ = _vint(v, "patch_size", 16), _vint(v, "spatial_merge_size", 2), _vint(v, "temporal_patch_size", 2)
    c, npos = _vint(v, "in_channels", 3), _vint(v, "num_position_embeddings")
    out = _vint(v, "out_hidden_size", text_hidden)
    deepstack = v.get("deepstack_visual_indexes") or []
    if not isinstance(deepstack, list):
        raise ModelConfigError("must be a list of layer indexes", field="vision_config.deepstack_visual_indexes")
    merged = h * m * m
    fc = merged * merged + merged + merged * out + out
    tower = c * tp_ * p * p * h + h + npos * h + n * _vit_layer(h, i, bias=True, gated=False, norm_bias=True)
    params = tower + (2 * h + fc) + len(deepstack) * (2 * merged + fc)
    unit = p * m
    return VisionSpec(
        kind="qwen3_vl",
        hidden_size=h,
        intermediate_size=i,
        num_layers=n,
        num_heads=_vint(v, "num_heads", 16),
        gated_mlp=False,
        patches_per_token=m * m,
        image_tokens=qwen_vl_tokens(QWEN3_VL_IMAGE_MAX_PIXELS, unit),
        params=params,
        pixel_unit=unit,
        video_tokens=qwen_vl_tokens(QWEN3_VL_VIDEO_MAX_PIXELS // tp_, unit),
        embeds_per_token=1 + len(deepstack),
    )


def _llava_next_tokens(cfg: Mapping[str, Any], *, base: int, tile: int, side: int) -> int:
    """LLaVA-NeXT's largest image (vLLM llava_next.py get_image_size_with_most_features): over the grid pinpoints,
    the base image's tokens plus, for an image the size of the pinpoint, its tiles' patch grid and one newline per
    row (the pinpoint fits itself exactly, so nothing is unpadded away)."""
    pinpoints = cfg.get("image_grid_pinpoints")
    if not isinstance(pinpoints, list) or not pinpoints:
        raise ModelConfigError("LLaVA-NeXT config without image_grid_pinpoints", field="image_grid_pinpoints")
    best = 0
    for point in pinpoints:
        if not (isinstance(point, list | tuple) and len(point) == 2):
            raise ModelConfigError(f"expected [height, width], got {point!r}", field="image_grid_pinpoints")
        rows, cols = int(point[0]) // tile * side, int(point[1]) // tile * side
        best = max(best, base + rows * cols + rows)
    return best


def _qwen_vl_tower(
    v: Mapping[str, Any], *, kind: str, width: int, inter: int, out: int, channels: int, gated: bool, norm_bias: bool
) -> VisionSpec:
    """Qwen2-VL and Qwen2.5-VL towers: a Conv3d patch embed without bias over temporal_patch_size frames, ``depth``
    ViT blocks and the PatchMerger: its norm ln_q over the tower's width (with a bias where the blocks' norms have
    one), then Linear(m^2 w, m^2 w) and Linear(m^2 w, out), both with biases."""
    n = _vint(v, "depth")
    p, m, frames = _vint(v, "patch_size", 14), _vint(v, "spatial_merge_size", 2), _vint(v, "temporal_patch_size", 2)
    merged = width * m * m
    params = (
        channels * frames * p * p * width
        + n * _vit_layer(width, inter, bias=True, gated=gated, norm_bias=norm_bias)
        + (2 if norm_bias else 1) * width
        + merged * merged
        + merged
        + merged * out
        + out
    )
    tokens = _qwen_vl_tokens(p, m)
    return VisionSpec(
        kind=kind,
        hidden_size=width,
        intermediate_size=inter,
        num_layers=n,
        num_heads=_vint(v, "num_heads", 16),
        gated_mlp=gated,
        patches_per_token=m * m,
        image_tokens=tokens,
        params=params,
        video_frame_tokens=tokens,
        pixel_unit=p * m,
    )


def _vision(cfg: Mapping[str, Any], *, text_hidden: int) -> VisionSpec | None:
    """The vision tower of a vision-language config, counted by module as the model files define it.

    Sources (module layouts; vLLM 0.32.0 vllm/model_executor/models/ and the transformers modeling files):
    qwen2_vl.py (Qwen2VisionTransformer: Conv3d patch embed without bias, LayerNorm blocks, fc1/fc2 MLP of
    embed_dim x mlp_ratio, PatchMerger LayerNorm + Linear(4e, 4e) + Linear(4e, hidden)); qwen2_5_vl.py (RMSNorm
    blocks, gated SiLU MLP with biases, merger RMSNorm + Linear(4e, 4e) + Linear(4e, out_hidden_size)); siglip.py
    with gemma3_mm.py (Conv2d patch embed with bias, learned positions, LayerNorm blocks with biased projections,
    post_layernorm; projector mm_input_projection_weight and mm_soft_emb_norm); clip.py with llava.py (class
    embedding, patch embed without bias, positions for patches + 1, pre/post LayerNorm; projector linear_1/linear_2
    with biases); pixtral.py with mistral3.py (Conv2d without bias, RMSNorm, gated MLP and projections without bias;
    projector norm, patch merger Linear(4h, h) and linear_1/linear_2 with multimodal_projector_bias).
    """
    v = cfg.get("vision_config")
    if not isinstance(v, Mapping):
        return None
    outer = str(cfg.get("model_type") or "")
    vtype = str(v.get("model_type") or "")
    if outer == "qwen2_5_vl":
        # RMSNorm blocks (one weight, no bias), gated SiLU MLP; the merger maps to out_hidden_size.
        return _qwen_vl_tower(
            v,
            kind=outer,
            width=_vint(v, "hidden_size"),
            inter=_vint(v, "intermediate_size"),
            out=_vint(v, "out_hidden_size", text_hidden),
            channels=_vint(v, "in_chans", _vint(v, "in_channels", 3)),
            gated=True,
            norm_bias=False,
        )
    if outer in QWEN3_VL_TYPES:
        return _qwen3_vl_vision(v, text_hidden)
    if outer == "qwen2_vl":
        # LayerNorm blocks (weight and bias), fc1/fc2 MLP of embed_dim x mlp_ratio; the merger maps to hidden_size.
        e = _vint(v, "embed_dim")
        return _qwen_vl_tower(
            v,
            kind=outer,
            width=e,
            inter=e * _vint(v, "mlp_ratio", 4),
            out=_vint(v, "hidden_size", text_hidden),
            channels=_vint(v, "in_chans", 3),
            gated=False,
            norm_bias=True,
        )
    if vtype in ("siglip_vision_model", "clip_vision_model"):
        return _siglip_clip_vision(cfg, v, text_hidden, vtype=vtype, outer=outer)
    if vtype == "pixtral" and outer == "mistral3":
        return _pixtral_vision(cfg, v, text_hidden)
    if vtype == "llama4_vision_model":
        return _llama4_vision(v, text_hidden)
    return _rough_vision(v, text_hidden)


def _siglip_clip_vision(
    cfg: Mapping[str, Any], v: Mapping[str, Any], text_hidden: int, *, vtype: str, outer: str
) -> VisionSpec | None:
    """A SigLIP or CLIP tower with Gemma 3's or LLaVA's projector (other models' projectors: ``_rough_vision``)."""
    h, i, n = _vint(v, "hidden_size"), _vint(v, "intermediate_size"), _vint(v, "num_hidden_layers")
    p, size = _vint(v, "patch_size"), _vint(v, "image_size")
    c = _vint(v, "num_channels", 3)
    grid = (size // p) ** 2
    layers = n * _vit_layer(h, i, bias=True, gated=False, norm_bias=True)
    if vtype == "siglip_vision_model":
        tower = c * p * p * h + h + grid * h + layers + 2 * h  # post_layernorm; vision_use_head false
    else:
        tower = h + c * p * p * h + (grid + 1) * h + 2 * h + layers + 2 * h  # class token, pre/post LayerNorm
    if outer == "gemma3":
        tokens = _int(cfg, "mm_tokens_per_image", where="", default=256)
        projector = h * text_hidden + h
        kind = "siglip"
    elif outer in ("llava", "llava_next"):
        # "default" feature selection drops the class token, "full" keeps it.
        tokens = grid + (1 if cfg.get("vision_feature_select_strategy") == "full" else 0)
        projector = h * text_hidden + text_hidden + text_hidden * text_hidden + text_hidden
        if outer == "llava_next":
            projector += text_hidden  # image_newline
            tokens = _llava_next_tokens(cfg, base=tokens, tile=size, side=size // p)
        kind = "clip" if vtype == "clip_vision_model" else "siglip"
    else:
        return _rough_vision(v, text_hidden)
    return VisionSpec(
        kind=kind,
        hidden_size=h,
        intermediate_size=i,
        num_layers=n,
        num_heads=_vint(v, "num_attention_heads", 16),
        gated_mlp=False,
        patches_per_token=max(1, grid // tokens),
        image_tokens=tokens,
        params=tower + projector,
    )


def _pixtral_vision(cfg: Mapping[str, Any], v: Mapping[str, Any], text_hidden: int) -> VisionSpec:
    """Mistral 3's Pixtral tower, its patch merger and projector."""
    h, i, n = _vint(v, "hidden_size"), _vint(v, "intermediate_size"), _vint(v, "num_hidden_layers")
    p, size = _vint(v, "patch_size"), _vint(v, "image_size")
    c = _vint(v, "num_channels", 3)
    m = _int(cfg, "spatial_merge_size", where="", default=2)
    bias = bool(cfg.get("multimodal_projector_bias", False))
    tower = c * p * p * h + h + n * _vit_layer(h, i, bias=False, gated=True, norm_bias=False)
    projector = h + h * m * m * h + h * text_hidden + text_hidden * text_hidden + (2 * text_hidden if bias else 0)
    side = size // (p * m)
    return VisionSpec(
        kind="pixtral",
        hidden_size=h,
        intermediate_size=i,
        num_layers=n,
        num_heads=_vint(v, "num_attention_heads", 16),
        gated_mlp=True,
        patches_per_token=m * m,
        image_tokens=side * side,  # vLLM pixtral.py PixtralHFEncoderInfo: ncols x nrows
        params=tower + projector,
    )


# transformers' Llama4ImageProcessorFast: max_patches 16 tiles of image_size; vLLM profiles the 16:1 image that
# fills them (mllama4.py get_image_size_with_most_features), plus the global tile added when there is more than one.
LLAMA4_MAX_TILES = 16


def _llama4_vision(v: Mapping[str, Any], text_hidden: int) -> VisionSpec:
    """Llama 4's tower (vLLM mllama4.py): an unfold patch embed without bias, class and position embeddings, pre/post
    LayerNorm, biased ViT blocks, the pixel-shuffle MLP adapter and a bias-free projector to the text model."""
    h, i, n = _vint(v, "hidden_size"), _vint(v, "intermediate_size"), _vint(v, "num_hidden_layers")
    p, size, c = _vint(v, "patch_size"), _vint(v, "image_size"), _vint(v, "num_channels", 3)
    proj_in, proj_out = _vint(v, "projector_input_dim"), _vint(v, "projector_output_dim")
    out_dim = _vint(v, "vision_output_dim", proj_out)
    bias = bool(v.get("multi_modal_projector_bias", False))
    grid = (size // p) ** 2
    tower = c * p * p * h + h + (grid + 1) * h + 2 * 2 * h
    tower += n * _vit_layer(h, i, bias=True, gated=False, norm_bias=True)
    adapter = i * proj_in + proj_in * proj_out + ((proj_in + proj_out) if bias else 0)
    projector = out_dim * text_hidden
    ratio = float(v.get("pixel_shuffle_ratio") or 0.5)
    per_tile = int(grid * ratio * ratio)
    return VisionSpec(
        kind="llama4",
        hidden_size=h,
        intermediate_size=i,
        num_layers=n,
        num_heads=_vint(v, "num_attention_heads", 16),
        gated_mlp=False,
        patches_per_token=max(1, grid // per_tile),
        image_tokens=per_tile * (LLAMA4_MAX_TILES + 1),
        params=tower + adapter + projector,
    )


def _rough_vision(v: Mapping[str, Any], text_hidden: int) -> VisionSpec | None:
    """Towers not modelled module by module (Llama 4's): per layer 4 h^2 (attention) + 2 h i (MLP)."""
    h = v.get("hidden_size") or v.get("width")
    i = v.get("intermediate_size") or (4 * h if h else None)
    n = v.get("num_hidden_layers") or v.get("depth")
    if not (h and i and n):
        return None
    h, i, n = int(h), int(i), int(n)
    p = int(v.get("patch_size") or 14)
    size = int(v.get("image_size") or 336)
    return VisionSpec(
        kind=str(v.get("model_type") or "vision"),
        hidden_size=h,
        intermediate_size=i,
        num_layers=n,
        num_heads=int(v.get("num_attention_heads") or v.get("num_heads") or 16),
        gated_mlp=False,
        patches_per_token=1,
        image_tokens=(size // p) ** 2,
        params=n * (4 * h * h + 2 * h * i),
    )


# transformers >= 4.52 writes Qwen-VL's language model as a text_config of its own type; it is parsed as its outer type.
_VL_TEXT_TYPES = {
    "qwen2_5_vl_text": "qwen2_5_vl",
    "qwen2_vl_text": "qwen2_vl",
    "qwen3_vl_text": "qwen3_vl",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
}


def _architectures(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    archs = cfg.get("architectures")
    if not isinstance(archs, list):
        return ()
    return tuple(a for a in archs if isinstance(a, str))


def parse_hf_config(
    cfg: Mapping[str, Any],
    *,
    model_id: str,
    source: str = "",
    family: str = "",
    aliases: tuple[str, ...] = (),
) -> ModelSpec:
    """Turn a config.json mapping into a ModelSpec, or raise ModelConfigError naming the field."""
    if not isinstance(cfg, Mapping):
        raise ModelConfigError("config.json must hold a JSON object")
    t, where, model_type = _language_config(cfg)
    dims = _text_dims(cfg, t, model_type, where)
    mla, moe, layers = _decoder_layers(model_type, t, dims.num_layers, where)
    intermediate = _dense_intermediate(model_type, t, dims.intermediate_size)
    vision = _vision(cfg, text_hidden=dims.hidden_size)
    return ModelSpec(
        model_id=model_id,
        model_type=model_type,
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        intermediate_size=intermediate,
        vocab_size=dims.vocab_size,
        max_position_embeddings=dims.max_position_embeddings,
        tie_word_embeddings=dims.tie_word_embeddings,
        torch_dtype=dims.torch_dtype,
        layers=layers,
        moe=moe,
        mla=mla,
        state=_state(model_type, t, where),
        quantization=_quantization(cfg, ""),
        attention_bias=dims.attention_bias,
        # Nemotron-H's MLP is up_proj -> relu2 -> down_proj (nemotron_h.py NemotronHMLP).
        gated_mlp=model_type not in ("phi", "nemotron_h"),
        norms_per_layer=_NORMS_PER_LAYER.get(model_type, 2),
        vision_params=vision.params if vision is not None else 0,
        vision=vision,
        mtp_layers=_int(t, "num_nextn_predict_layers", where=where, default=int(t.get("mtp_num_hidden_layers") or 0)),
        draft_vocab_size=_int(cfg, "draft_vocab_size", where="") if cfg.get("draft_vocab_size") else None,
        architectures=_architectures(cfg),
        source=source,
        family=family,
        aliases=aliases,
        rope_scaling=_rope_scaling(t, where),
        original_max_position_embeddings=(
            _int(t, "original_max_position_embeddings", where=where)
            if t.get("original_max_position_embeddings")
            else None
        ),
        max_position_embeddings_key=where + dims.max_position_embeddings_key,
        rope_theta=_theta(t.get("rope_theta")),
        partial_rotary_factor=_partial_rotary(t),
    )


def _language_config(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], str, str]:
    """The language model's config with its class defaults filled in, the prefix of its keys (``text_config.`` where
    it is nested) and its model type; ModelConfigError for a type that is not modelled."""
    t, where = _text_config(cfg)
    model_type = str(t.get("model_type") or cfg.get("model_type") or "")
    model_type = _VL_TEXT_TYPES.get(model_type, model_type)
    if not model_type:
        raise ModelConfigError("missing required field 'model_type'", field="model_type")
    outer_type = str(cfg.get("model_type") or "")
    if outer_type in UNSUPPORTED_MODEL_TYPES or model_type in UNSUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            UNSUPPORTED_MODEL_TYPES.get(outer_type) or UNSUPPORTED_MODEL_TYPES[model_type], field="model_type"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
            field=where + "model_type",
        )
    if model_type in _CLASS_DEFAULTS:
        t = {**_CLASS_DEFAULTS[model_type], **{k: v for k, v in t.items() if v is not None}}
    return t, where, model_type


@dataclass(frozen=True, kw_only=True)
class _TextDims:
    """The language model's sizes as its config gives them (defaults filled in), checked."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the experts' in Llama 4, whose dense layers have intermediate_size_mlp
    vocab_size: int
    max_position_embeddings: int
    max_position_embeddings_key: str  # the key the length was read from
    tie_word_embeddings: bool
    torch_dtype: str
    attention_bias: bool


def _text_dims(cfg: Mapping[str, Any], t: Mapping[str, Any], model_type: str, where: str) -> _TextDims:
    n_layers = _int(t, "num_hidden_layers", where=where)
    hidden = _int(t, "hidden_size", where=where)
    heads = _int(t, "num_attention_heads", where=where)
    if n_layers == 0 or hidden == 0 or heads == 0:
        raise ModelConfigError("num_hidden_layers, hidden_size and num_attention_heads must be positive")
    kv_heads = _int(t, "num_key_value_heads", where=where, default=heads)
    if kv_heads == 0 or heads % kv_heads:
        raise ModelConfigError(
            f"{kv_heads} KV heads must divide {heads} attention heads", field=where + "num_key_value_heads"
        )
    default_head = hidden // heads
    if model_type in ("deepseek_v2", "deepseek_v3") and t.get("qk_nope_head_dim"):
        default_head = int(t["qk_nope_head_dim"]) + int(t.get("qk_rope_head_dim") or 0)
    head_dim = _int(t, "head_dim", where=where, default=t.get("attention_head_dim") or default_head)
    intermediate = _int(t, "intermediate_size", where=where, default=4 * hidden)
    vocab = _int(t, "vocab_size", where=where)
    max_pos_key = next(
        (k for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length") if t.get(k)),
        "max_position_embeddings",
    )
    max_pos = int(t.get(max_pos_key) or 4096)
    tied_default = model_type in _TIED_BY_DEFAULT
    return _TextDims(
        num_layers=n_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        max_position_embeddings_key=max_pos_key,
        tie_word_embeddings=bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", tied_default))),
        torch_dtype=str(
            t.get("torch_dtype") or t.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        ),
        attention_bias=bool(
            t.get("attention_bias", model_type in ("qwen2", "qwen2_moe", "gpt_oss", "phi", "qwen2_vl", "qwen2_5_vl"))
        ),
    )


def _decoder_layers(
    model_type: str, t: Mapping[str, Any], n_layers: int, where: str
) -> tuple[MLASpec | None, MoESpec | None, tuple[LayerSpec, ...]]:
    """Each decoder layer's attention kind and whether its MLP is a mixture of experts; MLA and MoE shapes."""
    mla: MLASpec | None = None
    if model_type in ("deepseek_v2", "deepseek_v3"):
        mla = MLASpec(
            kv_lora_rank=_int(t, "kv_lora_rank", where=where),
            qk_rope_head_dim=_int(t, "qk_rope_head_dim", where=where),
            qk_nope_head_dim=_int(t, "qk_nope_head_dim", where=where),
            v_head_dim=_int(t, "v_head_dim", where=where),
            q_lora_rank=(int(t["q_lora_rank"]) if t.get("q_lora_rank") else None),
        )
        kinds = [LayerSpec(attention=AttentionKind.MLA) for _ in range(n_layers)]
    else:
        kinds = _layer_kinds(model_type, t, n_layers, where)
    moe = None if model_type == "nemotron_h" else _moe(model_type, t, where)
    moe_flags = _moe_layers(model_type, t, n_layers) if moe else [False] * n_layers
    layers = tuple(
        LayerSpec(attention=k.attention, window_tokens=k.window_tokens, moe=m and k.mlp, mlp=k.mlp)
        for k, m in zip(kinds, moe_flags, strict=True)
    )
    return mla, moe, layers


def _dense_intermediate(model_type: str, t: Mapping[str, Any], intermediate: int) -> int:
    """Dense layers of Llama 4 use intermediate_size_mlp; MoE experts use intermediate_size."""
    return int(t.get("intermediate_size_mlp") or intermediate) if model_type.startswith("llama4") else intermediate


def _partial_rotary(t: Mapping[str, Any]) -> float:
    """``partial_rotary_factor`` beside the other keys or inside ``rope_parameters`` (vLLM's get_rope reads it from
    the rope parameters its config patch gathers); 1 when absent or not a number in (0, 1]."""
    for where in (t, t.get("rope_parameters"), t.get("rope_scaling")):
        if isinstance(where, Mapping):
            value = where.get("partial_rotary_factor")
            if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1:
                return float(value)
    return 1.0


# Norms per block: Gemma 2/3 wrap attention and MLP in two each; a Nemotron-H block has one.
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3": 4, "gemma3_text": 4, "nemotron_h": 1}


def _theta(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _rope_scaling(t: Mapping[str, Any], where: str) -> RopeScaling | None:
    """``rope_scaling`` or ``rope_parameters``; nested per layer type (Gemma 3 under transformers 5), the full-attention
    layers' entry, the one that sets the context."""
    key = "rope_scaling" if isinstance(t.get("rope_scaling"), Mapping) else "rope_parameters"
    raw = t.get(key)
    if not isinstance(raw, Mapping) or not raw:
        return None
    if "full_attention" in raw and isinstance(raw["full_attention"], Mapping):
        raw, key = raw["full_attention"], key + ".full_attention"
    return rope_scaling_from(raw, field=where + key, rope_theta=t.get("rope_theta"))


def rope_scaling_from(raw: Mapping[str, Any], *, field: str, rope_theta: object = None) -> RopeScaling:
    """A rope_scaling object from a config or a user's override; ModelConfigError names what is wrong."""
    kind = raw.get("rope_type") or raw.get("type")
    if not isinstance(kind, str) or not kind:
        raise ModelConfigError("needs a 'rope_type' (or legacy 'type'), e.g. yarn, linear, dynamic", field=field)
    kind = "longrope" if kind == "su" else kind
    factor = raw.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0):
        raise ModelConfigError(f"factor must be a positive number, got {factor!r}", field=field + ".factor")
    original = raw.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original <= 0):
        raise ModelConfigError(
            f"original_max_position_embeddings must be a positive integer, got {original!r}",
            field=field + ".original_max_position_embeddings",
        )
    theta = _theta(raw.get("rope_theta", rope_theta))
    return RopeScaling(
        rope_type=kind,
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=original,
        rope_theta=theta,
        key=field,
    )


def with_rope_scaling(model: ModelSpec, rope: RopeScaling) -> ModelSpec:
    """The model as the engine loads it with a rope-scaling override (vLLM ``--hf-overrides``): the scaling
    replaced and, for YaRN, ``max_position_embeddings`` set to the extended length, which every release derives
    its limit from (see ``context_limit``)."""
    max_pos, key = model.max_position_embeddings, model.max_position_embeddings_key
    original = rope.original_max_position_embeddings or model.max_position_embeddings
    if rope.factor is not None and rope.rope_type in ("yarn", "deepseek_yarn"):
        max_pos, key = int(original * rope.factor), "max_position_embeddings (override)"
    if rope.rope_type in ("yarn", "deepseek_yarn", "longrope", "llama3"):
        # transformers 5 fills this in from max_position_embeddings; the override keeps the config's own length.
        rope = replace(rope, original_max_position_embeddings=original)
    return replace(
        model,
        rope_scaling=replace(rope, key="rope_scaling (override)", rope_theta=rope.rope_theta or model.rope_theta),
        max_position_embeddings=max_pos,
        max_position_embeddings_key=key,
        rope_override=True,
    )


def config_overrides(model: ModelSpec) -> dict[str, object] | None:
    """The config.json changes the engine must start with for this spec (its ``--hf-overrides``), or None.

    ``rope_scaling`` is the key under transformers 4 and an alias of ``rope_parameters`` under 5
    (configuration_utils.py), so one spelling serves every release; the length goes with it because vLLM derives
    its limit from ``max_position_embeddings`` alone for YaRN from 0.32.0 on."""
    if not model.rope_override or model.rope_scaling is None:
        return None
    return {"max_position_embeddings": model.max_position_embeddings, "rope_scaling": model.rope_scaling.as_override()}


@dataclass(frozen=True, kw_only=True)
class ContextLimit:
    """The longest ``max_model_len`` an engine release accepts for a model, what it uses when none is given, and why."""

    max_len_tokens: int
    default_len_tokens: int
    source: str


def context_limit(model: ModelSpec, rules: RopeLengthRules) -> ContextLimit:
    """vLLM's ``_get_and_verify_max_len`` (vllm/config/model.py) / TensorRT-LLM's ``infer_max_seq_len`` on this
    model under ``rules``."""
    key = model.max_position_embeddings_key
    base = model.max_position_embeddings
    rope = model.rope_scaling
    if rope is None or rope.rope_type in rules.no_factor_types:
        limit, source = base, f"{key} {base:,}"
        if rope is not None:
            source += f" ({rope.rope_type} scaling leaves it as is)"
    elif rules.gemma3_exempt and "gemma3" in model.model_type:
        limit, source = base, f"{key} {base:,} (Gemma 3's is already scaled)"
    elif rope.rope_type in ("yarn",) and rules.yarn_from_original:
        original = rope.original_max_position_embeddings or base
        factor = rope.factor or 1.0
        limit = int(original * factor)
        source = f"{rope.key}.original_max_position_embeddings {original:,} x factor {factor:g} (yarn)"
    elif rope.factor is None or rope.factor == 1:
        limit, source = base, f"{key} {base:,}"
    else:
        limit = int(base * rope.factor)
        source = f"{key} {base:,} x {rope.key}.factor {rope.factor:g} ({rope.rope_type})"
    default = limit
    if rules.longrope_default_original and rope is not None and rope.rope_type == "longrope":
        pretrained = model.original_max_position_embeddings or rope.original_max_position_embeddings
        if pretrained:
            default = pretrained
    return ContextLimit(max_len_tokens=limit, default_len_tokens=default, source=source)


def load_config_file(path: str | Path) -> ModelSpec:
    """Load a local config.json (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"no config.json at {path}", field="model")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ModelConfigError(f"cannot read {p}: {err}", field="model") from None
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{p} is not valid JSON (line {err.lineno}: {err.msg})", field="model") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{p} must hold a JSON object", field="model")
    name = cfg.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem)
    try:
        return parse_hf_config(cfg, model_id=str(name), source=str(p))
    except ModelConfigError as err:
        raise ModelConfigError(f"{p}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Parameter counting
# ---------------------------------------------------------------------------------------------


def _attention_params(m: ModelSpec) -> int:
    h = m.hidden_size
    if m.mla is not None:
        a = m.mla
        qk_head = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_attention_heads * qk_head
        else:
            q = h * m.num_attention_heads * qk_head
        kv_a = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv_b = a.kv_lora_rank * m.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
        o = m.num_attention_heads * a.v_head_dim * h
        return q + kv_a + kv_b + o
    q = h * m.num_attention_heads * m.head_dim
    if m.model_type in GDN_MODEL_TYPES:
        q *= 2  # the output gate rides on q_proj (qwen3_next.py Qwen3NextAttention, attn_output_gate)
    kv = 2 * h * m.num_kv_heads * m.head_dim
    o = m.num_attention_heads * m.head_dim * h
    total = q + kv + o
    if m.attention_bias:
        total += (m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim
    qk_norm = ("qwen3", "gemma3", "gemma3_text", "olmo2")
    if m.model_type in qk_norm or m.model_type in QWEN3_MOE_TYPES | QWEN3_VL_TYPES | GDN_MODEL_TYPES:
        total += 2 * m.head_dim  # q_norm / k_norm
    if m.model_type == "gpt_oss":
        total += m.num_attention_heads + h  # attention sinks, o_proj bias
    return total


def _state_params(m: ModelSpec) -> int:
    """One linear-attention / Mamba-2 mixer, as vLLM 0.32.0 builds it."""
    st = m.state
    assert st is not None
    h = m.hidden_size
    heads_dim = st.num_heads * st.head_dim
    groups_dim = st.num_groups * st.group_dim
    conv_dim = heads_dim + 2 * groups_dim
    conv = conv_dim * st.conv_kernel + (conv_dim if st.conv_bias else 0)
    if st.kind is StateKind.GATED_DELTA_NET:
        # layers/mamba/gdn/qwen_gdn_linear_attn.py: in_proj_qkvz (q, k, v, z), in_proj_ba (b, a per value
        # head), conv1d, dt_bias and A_log per value head, a gated RMSNorm of head_v_dim, out_proj.
        proj = h * (2 * groups_dim + 2 * heads_dim) + h * 2 * st.num_heads
        return proj + conv + 2 * st.num_heads + st.head_dim + heads_dim * h
    # layers/mamba/mamba_mixer2.py: in_proj (gate, x, B, C, dt), conv1d over x/B/C, A, D, dt_bias per head,
    # a gated RMSNorm over the intermediate size, out_proj.
    proj = h * (2 * heads_dim + 2 * groups_dim + st.num_heads)
    bias = (2 * heads_dim + 2 * groups_dim + st.num_heads + h) if st.proj_bias else 0
    return proj + conv + 3 * st.num_heads + heads_dim + heads_dim * h + bias


def _mlp_params(m: ModelSpec, inter: int) -> int:
    h = m.hidden_size
    if m.gated_mlp:
        return 3 * h * inter
    if m.model_type == "nemotron_h":
        return 2 * h * inter  # up_proj, down_proj without bias (mlp_bias false)
    return 2 * h * inter + inter + h  # fc1/fc2 with biases (Phi-2)


def _param_groups(m: ModelSpec) -> tuple[ParamGroup, ...]:
    h = m.hidden_size
    attn = 0
    mlp = 0
    experts = 0
    router = 0
    for layer in m.layers:
        # State mixers count under attention: they are the block's token mixer, quantized alike.
        if layer.attention is AttentionKind.STATE:
            attn += _state_params(m)
        elif layer.attention is not AttentionKind.NONE:
            attn += _attention_params(m)
        if not layer.mlp:
            continue
        if layer.moe and m.moe is not None:
            e = m.moe
            per_expert = 3 * h * e.expert_intermediate_size
            if e.expert_bias:
                per_expert += 3 * e.expert_intermediate_size + h
            experts += e.num_experts * per_expert
            router += h * e.num_experts + (e.num_experts if e.expert_bias else 0)
            if e.shared_expert_intermediate_size:
                mlp += 3 * h * e.shared_expert_intermediate_size
                if m.model_type == "qwen2_moe" or m.model_type in GDN_MODEL_TYPES:
                    router += h  # shared_expert_gate
        else:
            mlp += _mlp_params(m, m.intermediate_size)
    embed = m.vocab_size * h
    groups = [
        ParamGroup(part=Part.EMBEDDING, count=embed, shardable=True),
        ParamGroup(part=Part.ATTENTION, count=attn, shardable=True),
        ParamGroup(part=Part.MLP, count=mlp, shardable=True),
        ParamGroup(part=Part.NORM, count=(m.num_layers * m.norms_per_layer + 1) * h, shardable=False),
    ]
    if not m.tie_word_embeddings:
        groups.append(ParamGroup(part=Part.LM_HEAD, count=embed, shardable=True))
    if experts:
        groups.append(ParamGroup(part=Part.EXPERTS, count=experts, shardable=True))
        groups.append(ParamGroup(part=Part.ROUTER, count=router, shardable=False))
    if m.vision_params:
        # vLLM builds the towers from its parallel linear layers (QKVParallelLinear, Column/RowParallelLinear in
        # qwen2_5_vl.py, siglip.py, clip.py, pixtral.py): with the default --mm-encoder-tp-mode weights, each TP rank
        # holds its share. Part.VISION is in no scheme's quantized parts: vLLM hands the towers the checkpoint's
        # quant_config, but quantized VL checkpoints leave them out (AWQ modules_to_not_convert ["visual"],
        # compressed-tensors ignore lists); online --quantization fp8 would quantize them, so 16-bit is the upper bound.
        groups.append(ParamGroup(part=Part.VISION, count=m.vision_params, shardable=True))
    return tuple(groups)
