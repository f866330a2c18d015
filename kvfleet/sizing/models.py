"""Model architectures: typed specs parsed from Hugging Face ``config.json`` fields.

The built-in catalog (``data/models.json``) stores each model's config.json fields verbatim with a
source, so one parser serves both the catalog and any local config.json a user points at.
Parameter counts are computed per part (attention, MLP, experts, router, embeddings, norms) because
tensor parallelism shards some parts and replicates others, and quantization schemes treat them
differently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvfleet.errors import ModelConfigError
from kvfleet.sizing.precision import Part, WeightScheme, weight_scheme


class AttentionKind(StrEnum):
    FULL = "full"
    SLIDING = "sliding"  # holds at most `window_tokens` per sequence
    CHUNKED = "chunked"  # chunked local attention (Llama 4): at most one chunk per sequence
    MLA = "mla"  # multi-head latent attention: one latent per token, held by every TP rank
    NONE = "none"  # no KV cache (linear attention / state-space layers)


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    attention: AttentionKind
    window_tokens: int | None = None
    moe: bool = False


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
class ParamGroup:
    """Parameters of one part. ``shardable`` ones split across TP ranks; the others are replicated."""

    part: Part
    count: int
    shardable: bool


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
    quantization: Quantization | None = None
    attention_bias: bool = False
    gated_mlp: bool = True
    norms_per_layer: int = 2
    vision_params: int = 0
    source: str = ""
    family: str = ""
    aliases: tuple[str, ...] = field(default=())

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
        return sum(1 for layer in self.layers if layer.attention is not AttentionKind.NONE)

    @property
    def is_hybrid(self) -> bool:
        """More than one kind of KV-cache layer (e.g. sliding-window plus full)."""
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
    }
)

# HF defaults for tie_word_embeddings where a config omits it (each model's configuration_*.py).
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})

# Class defaults that published configs rely on by leaving keys out. Gemma 3's config.json files
# are sparse: transformers' Gemma3TextConfig supplies the rest (configuration_gemma3.py).
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
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
    return cfg, ""


def _layer_kinds(model_type: str, t: Mapping[str, Any], n_layers: int, where: str) -> list[LayerSpec]:
    window = t.get("sliding_window")
    layer_types = t.get("layer_types")
    if isinstance(layer_types, list):
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
            elif kind in ("linear_attention", "mamba", "conv"):
                out.append(LayerSpec(attention=AttentionKind.NONE))
            else:
                raise ModelConfigError(f"unknown layer type {kind!r}", field=where + "layer_types")
        return out

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
    if model_type in ("llama4", "llama4_text") and t.get("attention_chunk_size"):
        chunk = int(t["attention_chunk_size"])
        nope = t.get("no_rope_layers")
        if not isinstance(nope, list) or len(nope) != n_layers:
            interval = int(t.get("no_rope_layer_interval") or 4)
            nope = [int((i + 1) % interval != 0) for i in range(n_layers)]
        # no_rope_layers[i] == 1: RoPE layer with chunked local attention; 0: NoPE global layer.
        return [
            LayerSpec(attention=AttentionKind.CHUNKED, window_tokens=chunk) if nope[i] else full[i]
            for i in range(n_layers)
        ]
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
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
    elif model_type == "qwen2_moe":
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
    if model_type in ("qwen2_moe", "qwen3_moe"):
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


def _vision_params(cfg: Mapping[str, Any]) -> int:
    """Rough ViT size from vision_config: per layer 4 h^2 (attention) + 2 h i (MLP)."""
    v = cfg.get("vision_config")
    if not isinstance(v, Mapping):
        return 0
    h = v.get("hidden_size") or v.get("width")
    i = v.get("intermediate_size") or (4 * h if h else None)
    n = v.get("num_hidden_layers") or v.get("depth")
    if not (h and i and n):
        return 0
    return int(n) * (4 * int(h) * int(h) + 2 * int(h) * int(i))


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
    t, where = _text_config(cfg)
    model_type = str(t.get("model_type") or cfg.get("model_type") or "")
    if not model_type:
        raise ModelConfigError("missing required field 'model_type'", field="model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}",
            field=where + "model_type",
        )
    if model_type in _CLASS_DEFAULTS:
        t = {**_CLASS_DEFAULTS[model_type], **{k: v for k, v in t.items() if v is not None}}
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
    head_dim = _int(t, "head_dim", where=where, default=default_head)
    intermediate = _int(t, "intermediate_size", where=where, default=4 * hidden)
    vocab = _int(t, "vocab_size", where=where)
    max_pos = int(_first(t, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length") or 4096)
    tied_default = model_type in _TIED_BY_DEFAULT
    tied = bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", tied_default)))
    dtype = str(t.get("torch_dtype") or t.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")

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

    moe = _moe(model_type, t, where)
    moe_flags = _moe_layers(model_type, t, n_layers) if moe else [False] * n_layers
    layers = tuple(
        LayerSpec(attention=k.attention, window_tokens=k.window_tokens, moe=m)
        for k, m in zip(kinds, moe_flags, strict=True)
    )
    # Dense layers of Llama 4 use intermediate_size_mlp; MoE experts use intermediate_size.
    dense_inter = (
        int(t.get("intermediate_size_mlp") or intermediate) if model_type.startswith("llama4") else intermediate
    )
    bias = bool(t.get("attention_bias", model_type in ("qwen2", "qwen2_moe", "gpt_oss", "phi")))
    return ModelSpec(
        model_id=model_id,
        model_type=model_type,
        num_layers=n_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=dense_inter,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tied,
        torch_dtype=dtype,
        layers=layers,
        moe=moe,
        mla=mla,
        quantization=_quantization(cfg, ""),
        attention_bias=bias,
        gated_mlp=model_type != "phi",
        norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
        vision_params=_vision_params(cfg),
        source=source,
        family=family,
        aliases=aliases,
    )


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
    kv = 2 * h * m.num_kv_heads * m.head_dim
    o = m.num_attention_heads * m.head_dim * h
    total = q + kv + o
    if m.attention_bias:
        total += (m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim
    if m.model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"):
        total += 2 * m.head_dim  # q_norm / k_norm
    if m.model_type == "gpt_oss":
        total += m.num_attention_heads + h  # attention sinks, o_proj bias
    return total


def _mlp_params(m: ModelSpec, inter: int) -> int:
    h = m.hidden_size
    if m.gated_mlp:
        return 3 * h * inter
    return 2 * h * inter + inter + h  # fc1/fc2 with biases (Phi-2)


def _param_groups(m: ModelSpec) -> tuple[ParamGroup, ...]:
    h = m.hidden_size
    attn = 0
    mlp = 0
    experts = 0
    router = 0
    for layer in m.layers:
        # Linear-attention / state-space layers (no KV cache) are counted at attention's projection
        # budget, roughly; no catalog model has them.
        attn += _attention_params(m)
        if layer.moe and m.moe is not None:
            e = m.moe
            per_expert = 3 * h * e.expert_intermediate_size
            if e.expert_bias:
                per_expert += 3 * e.expert_intermediate_size + h
            experts += e.num_experts * per_expert
            router += h * e.num_experts + (e.num_experts if e.expert_bias else 0)
            if e.shared_expert_intermediate_size:
                mlp += 3 * h * e.shared_expert_intermediate_size
                if m.model_type == "qwen2_moe":
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
        groups.append(ParamGroup(part=Part.VISION, count=m.vision_params, shardable=False))
    return tuple(groups)
