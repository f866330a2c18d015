"""Flags `kvfleet capacity` and `kvfleet plan` share: engine settings, speculative decoding, RoPE scaling."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import (
    _mm_limits,
    _positive_int,
)
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.sizing.models import ModelSpec
    from kvfleet.sizing.speculative import Speculative


def engine_setting_flags(p: argparse.ArgumentParser) -> None:
    """The engine settings kvfleet capacity and kvfleet plan both take (an environment file's `engine:` section has
    them by the same names)."""
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM prefix caching (default: the release's); for Mamba hybrids it sets mamba_cache_mode",
    )
    for flag, what in (("--mamba-cache-dtype", "conv and SSM state"), ("--mamba-ssm-cache-dtype", "SSM state")):
        p.add_argument(
            flag,
            default="auto",
            choices=("auto", "float32", "bfloat16", "float16"),
            help=f"vLLM: the {what}'s dtype in linear-attention / Mamba layers",
        )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limits,
        default=(),
        help="vLLM, vision-language models: items per prompt, e.g. image=4,video=0 (image=0,video=0: text only)",
    )
    p.add_argument(
        "--mm-encoder-tp-mode", choices=["weights", "data"], default="weights", help="vLLM: vision encoder sharding"
    )
    p.add_argument(
        "--mm-max-pixels", type=_positive_int, help="vLLM --mm-processor-kwargs max_pixels: Qwen-VL's largest image"
    )


def engine_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The flags' engine settings, by the names EngineSettings and PlanRequest give them."""
    return {
        "enable_prefix_caching": a.prefix_caching,
        "mamba_cache_dtype": a.mamba_cache_dtype,
        "mamba_ssm_cache_dtype": a.mamba_ssm_cache_dtype,
        "limit_mm_per_prompt": a.limit_mm_per_prompt,
        "mm_encoder_tp_mode": a.mm_encoder_tp_mode,
        "mm_max_pixels": a.mm_max_pixels,
    }


def speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        metavar="METHOD",
        help="speculative decoding: eagle, eagle3 or draft_model (with --draft-model), mtp (the model's own MTP "
        "layers), ngram",
    )
    p.add_argument("--draft-model", help="the EAGLE head or draft model: catalog id/alias, or a path to config.json")
    p.add_argument("--num-speculative-tokens", type=_positive_int, help="tokens drafted per step (mtp: its layers)")
    p.add_argument(
        "--acceptance-length",
        type=float,
        metavar="TAU",
        help="mean tokens accepted per step, bonus token included (1 to K+1): what the speed model credits "
        "(default: a published measurement for eagle/eagle3 K 2-7 and mtp with one layer; else 1, no gain)",
    )


def speculative_from(a: argparse.Namespace) -> Speculative | None:
    from kvfleet.sizing.speculative import Speculative, parse_method

    if a.speculative is None:
        if a.draft_model is not None or a.num_speculative_tokens is not None or a.acceptance_length is not None:
            raise KvfleetError(
                "--draft-model, --num-speculative-tokens and --acceptance-length need --speculative METHOD",
                field="speculative",
            )
        return None
    return Speculative(
        method=parse_method(a.speculative, field="speculative"),
        draft_model=a.draft_model,
        num_speculative_tokens=a.num_speculative_tokens,
        acceptance_length=a.acceptance_length,
    )


def with_rope_flag(model: ModelSpec, text: str | None) -> ModelSpec:
    """``model`` under a --rope-scaling override (a JSON object), as the engine would load it."""
    if text is None:
        return model
    from kvfleet.sizing.models import rope_scaling_from, with_rope_scaling

    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise KvfleetError(
            f'not JSON ({err.msg}); e.g. \'{{"rope_type": "yarn", "factor": 4}}\'', field="rope_scaling"
        ) from None
    if not isinstance(raw, dict):
        raise KvfleetError('must be a JSON object, e.g. {"rope_type": "yarn", "factor": 4}', field="rope_scaling")
    return with_rope_scaling(model, rope_scaling_from(raw, field="rope_scaling"))
