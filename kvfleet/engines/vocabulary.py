"""The words engine settings are written in, once: KV-cache dtypes, speculative-decoding methods, encoder modes.

``EngineArgs`` checks settings against these, each adapter renders them in its engine's terms, and the sizing core
sizes them (kvfleet.sizing imports them from here). Standard library only: the serving image carries it.
"""

from __future__ import annotations

from enum import StrEnum


class KvDtype(StrEnum):
    """kvfleet's KV-cache dtype names (vLLM's are bfloat16 and float16 for bf16 and fp16; the adapters map them)."""

    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def is_fp8(self) -> bool:
        return self.value.startswith("fp8")

    def bytes_per_element(self, *, activation_bytes: int = 2) -> int:
        """``auto`` follows the model's activation dtype (bf16/fp16 -> 2 bytes)."""
        if self is KvDtype.AUTO:
            return activation_bytes
        return 1 if self.is_fp8 else 2


class SpecMethod(StrEnum):
    """kvfleet's speculative-decoding methods (each adapter renders them; an engine may run only some)."""

    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"


# Methods whose drafter is a checkpoint of its own (an EAGLE head or a smaller model); mtp drafts with the target's
# own MTP layers and ngram with no model at all.
DRAFTS_FROM_CHECKPOINT: tuple[SpecMethod, ...] = (SpecMethod.EAGLE, SpecMethod.EAGLE3, SpecMethod.DRAFT_MODEL)

# How a vision tower is spread over the tensor-parallel ranks (vllm/config/multimodal.py MMEncoderTPMode; default
# "weights"): weights sharded, or the whole tower on every rank with the items split ("data").
MM_ENCODER_TP_MODES = ("weights", "data")
