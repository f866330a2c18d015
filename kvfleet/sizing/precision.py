"""Weight precisions and KV-cache dtypes, and what each costs in bytes.

Quantized formats store scales (and zero points) beside the packed weights; those are counted here
because they are what makes a 4-bit checkpoint 0.52 bytes per weight, not 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfleet.engines import vocabulary
from kvfleet.errors import KvfleetError

# KV-cache dtypes are the engines' vocabulary, defined once there; the sizing core's settings name them as this.
KvDtype = vocabulary.KvDtype


class Part(StrEnum):
    """What a group of parameters is, for deciding whether a scheme quantizes it."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"
    ROUTER = "router"
    NORM = "norm"
    VISION = "vision"


_LINEAR_PARTS = frozenset({Part.ATTENTION, Part.MLP, Part.EXPERTS})


@dataclass(frozen=True, kw_only=True)
class WeightScheme:
    """One way of storing weights: bits per weight plus per-group scale and zero-point overhead."""

    name: str
    weight_bits: float
    group_size: int = 0  # 0: per-tensor or per-channel scales, negligible
    scale_bytes: float = 0.0  # bytes of scale per group
    zero_bits: float = 0.0  # bits of zero point per group
    quantized_parts: frozenset[Part] = _LINEAR_PARTS
    needs_fp8_hardware: bool = False
    needs_quantized_checkpoint: bool = False
    expert_intermediate_pad: int = 1  # kernels that pad each expert's intermediate size per rank
    description: str = ""

    def bytes_per_param(self, part: Part, *, unquantized_bytes: float) -> float:
        if part not in self.quantized_parts:
            return unquantized_bytes
        per = self.weight_bits / 8
        if self.group_size:
            per += (self.scale_bytes + self.zero_bits / 8) / self.group_size
        return per

    @property
    def is_quantized(self) -> bool:
        return self.weight_bits < 16


def _scheme(**kw: object) -> WeightScheme:
    return WeightScheme(**kw)  # type: ignore[arg-type]


# Layouts as the engines store them (vLLM quantization/ kernels; HF quantization_config docs):
# AWQ/GPTQ: int4 packed in int32, fp16 scale and a 4-bit zero per group of 128 input channels.
# bitsandbytes nf4: 4-bit codes, absmax per 64 weights; double quantization stores that absmax as
#   uint8 plus an fp32 scale per 256 absmax blocks (QLoRA paper, section 3).
# mxfp4 (OCP MX spec v1.0): 4-bit e2m1 with one e8m0 scale byte per 32 weights; gpt-oss quantizes
#   only the MoE experts.
# nvfp4: e2m1 with an fp8 scale per 16 weights.
WEIGHT_SCHEMES: dict[str, WeightScheme] = {
    s.name: s
    for s in (
        _scheme(name="bf16", weight_bits=16, quantized_parts=frozenset(), description="bfloat16"),
        _scheme(name="fp16", weight_bits=16, quantized_parts=frozenset(), description="float16"),
        _scheme(
            name="fp8",
            weight_bits=8,
            needs_fp8_hardware=True,
            description="FP8 e4m3 weights (checkpoint, or vLLM online --quantization fp8)",
        ),
        _scheme(
            name="int8",
            weight_bits=8,
            needs_quantized_checkpoint=True,
            description="INT8 W8A8 (SmoothQuant / compressed-tensors int8)",
        ),
        _scheme(
            name="awq",
            weight_bits=4,
            group_size=128,
            scale_bytes=2,
            zero_bits=4,
            needs_quantized_checkpoint=True,
            description="4-bit AWQ, group 128",
        ),
        _scheme(
            name="gptq",
            weight_bits=4,
            group_size=128,
            scale_bytes=2,
            zero_bits=4,
            needs_quantized_checkpoint=True,
            description="4-bit GPTQ, group 128",
        ),
        _scheme(
            name="w4a16",
            weight_bits=4,
            group_size=128,
            scale_bytes=2,
            needs_quantized_checkpoint=True,
            description="4-bit weight-only (compressed-tensors pack-quantized), group 128",
        ),
        _scheme(
            name="bnb-4bit",
            weight_bits=4,
            group_size=64,
            scale_bytes=1 + 4 / 256,
            description="bitsandbytes NF4 with double quantization",
        ),
        _scheme(name="bnb-8bit", weight_bits=8, group_size=0, description="bitsandbytes LLM.int8 (8-bit)"),
        _scheme(
            name="mxfp4",
            weight_bits=4,
            group_size=32,
            scale_bytes=1,
            quantized_parts=frozenset({Part.EXPERTS}),
            needs_quantized_checkpoint=True,
            # vLLM's mxfp4 MoE pads the expert intermediate size (gpt-oss: 2880 -> 3072 on Hopper
            # kernels); gpt-oss-120b then loads as 64.4 GiB (vllm issue 33155) instead of 60.7.
            expert_intermediate_pad=256,
            description="MXFP4 MoE experts (gpt-oss); attention and embeddings stay bf16",
        ),
        _scheme(
            name="nvfp4",
            weight_bits=4,
            group_size=16,
            scale_bytes=1,
            needs_fp8_hardware=True,
            needs_quantized_checkpoint=True,
            description="NVFP4, fp8 scale per 16 weights (Blackwell)",
        ),
    )
}


def weight_scheme(name: str, *, field: str = "quantization") -> WeightScheme:
    key = name.strip().lower().replace("_", "-")
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "awq-marlin": "awq"}.get(key, key)
    key = {"gptq-marlin": "gptq", "bitsandbytes": "bnb-4bit", "w8a8": "int8", "none": "bf16"}.get(key, key)
    if key not in WEIGHT_SCHEMES:
        raise KvfleetError(f"unknown weight precision {name!r}; choose one of {', '.join(WEIGHT_SCHEMES)}", field=field)
    return WEIGHT_SCHEMES[key]


def kv_dtype(name: str, *, field: str = "kv_cache_dtype") -> KvDtype:
    key = name.strip().lower()
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(key, key)
    try:
        return KvDtype(key)
    except ValueError:
        allowed = ", ".join(d.value for d in KvDtype)
        raise KvfleetError(f"unknown KV-cache dtype {name!r}; choose one of {allowed}", field=field) from None
