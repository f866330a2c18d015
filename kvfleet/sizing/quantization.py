"""Which weight precisions each engine release loads (each engine's quantization.py, ``EngineCapacity.quantization``).

A plan that sizes weights the engine then refuses to load is worse than no plan: vLLM no longer registers
``bitsandbytes`` from 0.28.0 (RFC vllm-project/vllm#39583), so ``--quantization bitsandbytes`` and a bitsandbytes
checkpoint both fail at start-up there, and TensorRT-LLM's PyTorch backend quantizes nothing at load (it runs
pre-quantized ModelOpt checkpoints). Two questions, both answered from the release's own method list:

- a checkpoint that names its method in ``quantization_config``: does the release load that ``quant_method``?
- a weight scheme asked of an unquantized checkpoint: does the release apply it at load (``online``), or, for a
  scheme that only comes as a checkpoint, does it load a checkpoint of that scheme?

A refusal is one line naming the release and the nearest scheme the release does load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from kvfleet.errors import SizingError
from kvfleet.sizing.engines import (
    EngineName,
    default_version,
    engine_capacity,
    engine_title,
    engine_traits,
    parse_version,
)
from kvfleet.sizing.precision import WEIGHT_SCHEMES, WeightScheme
from kvfleet.versions import Version

# The schemes to offer in place of a refused one, closest first: same bits per weight before more, a checkpoint
# format before an online one only where the bits match. bf16 (the unquantized checkpoint) always loads.
NEAREST: dict[str, tuple[str, ...]] = {
    "bnb-4bit": ("awq", "gptq", "w4a16", "nvfp4", "fp8"),
    "bnb-8bit": ("fp8", "int8"),
    "int8": ("fp8",),
    "w4a16": ("awq", "gptq", "nvfp4", "fp8"),
    "awq": ("gptq", "w4a16", "nvfp4", "fp8"),
    "gptq": ("awq", "w4a16", "nvfp4", "fp8"),
    "nvfp4": ("awq", "gptq", "fp8"),
    "mxfp4": ("fp8",),
    "fp8": ("int8",),
}


@dataclass(frozen=True, kw_only=True)
class QuantizationRelease:
    """One row of the table: what an engine loads from its ``since`` release on."""

    engine: EngineName
    since: Version
    methods: frozenset[str]  # quant_method values it loads from a checkpoint's quantization_config
    online: frozenset[str]  # what its quantization option applies to an unquantized checkpoint
    deprecated: frozenset[str]  # listed, but refused without an opt-in flag kvfleet does not set
    approx: bool
    source: str
    # kvfleet scheme name -> the release's method for it: the engine's table with the row's own names over it
    # (vLLM 0.8.x called ModelOpt NVFP4 "nvfp4", later releases "modelopt_fp4").
    schemes: Mapping[str, str] = field(default_factory=dict, compare=False)

    def loads(self, method: str) -> bool:
        return method in self.methods and method not in self.deprecated

    def applies(self, method: str) -> bool:
        return method in self.online and method not in self.deprecated


@cache
def _table(engine: EngineName) -> tuple[QuantizationRelease, ...]:
    """The engine's release rows, oldest first."""
    raw: Mapping[str, Any] = engine_capacity(engine).quantization
    rows = []
    for r in raw["releases"]:
        methods = frozenset(r["methods"])
        rows.append(
            QuantizationRelease(
                engine=engine,
                since=parse_version(r["since"]),
                methods=methods,
                online=frozenset(r["online"]) if "online" in r else methods,
                deprecated=frozenset(r.get("deprecated", ())),
                approx=bool(r.get("approx", False)),
                source=r["source"],
                schemes={**raw["schemes"], **r.get("schemes", {})},
            )
        )
    rows.sort(key=lambda row: row.since)
    return tuple(rows)


def quantization_release(engine: EngineName, version: str | None = None) -> QuantizationRelease:
    """The row for ``version`` (the engine's default release when None)."""
    table = _table(engine)
    v = parse_version(version or default_version(engine))
    rows = [r for r in table if r.since <= v]
    if not rows:
        oldest = ".".join(map(str, table[0].since))
        raise SizingError(
            f"{engine_title(engine)} {version}: which weight precisions it loads is known from {oldest} on",
            field="engine_version",
        )
    return rows[-1]


def scheme_method(scheme: WeightScheme, release: QuantizationRelease) -> str | None:
    """The release's method for a kvfleet weight scheme, by the name that release gives it; None for an unquantized
    one (a dtype, not a method)."""
    return release.schemes.get(scheme.name) if scheme.is_quantized else None


def _loads_scheme(release: QuantizationRelease, scheme: WeightScheme) -> bool:
    method = scheme_method(scheme, release)
    if method is None:
        return not scheme.is_quantized
    # A scheme asked of an unquantized checkpoint is applied at load where the release can, else sized as a
    # checkpoint of that scheme (as AWQ or GPTQ always are), which the release must then load.
    return release.loads(method) or (not scheme.needs_quantized_checkpoint and release.applies(method))


def _as_loaded(release: QuantizationRelease, scheme: WeightScheme) -> str:
    method = scheme_method(scheme, release)
    if not scheme.is_quantized or method is None:
        return f"{scheme.name} (the unquantized checkpoint)"
    if scheme.needs_quantized_checkpoint:
        return f"{scheme.name} ({method} checkpoint)"
    return f"{scheme.name} (quantized at load)"


def _nearest(release: QuantizationRelease, scheme: WeightScheme) -> str:
    """The nearest scheme the release loads, in words."""
    for name in NEAREST.get(scheme.name, ()):
        alt = WEIGHT_SCHEMES[name]
        if _loads_scheme(release, alt):
            return _as_loaded(release, alt)
    return "bf16 (the unquantized checkpoint)"


def _label(release: QuantizationRelease, version: str | None) -> str:
    return f"{engine_title(release.engine)} {version or default_version(release.engine)}"


def scheme_refusal(scheme: WeightScheme, *, engine: EngineName, version: str | None) -> str | None:
    """Why the release cannot run an unquantized checkpoint at ``scheme`` (applied at load, or as that scheme's
    checkpoint where it only comes as one), or None when it can."""
    release = quantization_release(engine, version)
    if _loads_scheme(release, scheme):
        return None
    method = scheme_method(scheme, release) or scheme.name
    label = _label(release, version)
    if method in release.deprecated:
        why = f"refuses the deprecated method {method} ({scheme.name}) without a flag kvfleet does not set"
    elif scheme.needs_quantized_checkpoint or not release.online:
        why = f"does not load {method} checkpoints ({scheme.name})"
    else:
        why = f"does not load {method} weights ({scheme.name}): {method} is not among its quantization methods"
    return f"{label} {why}; nearest it loads: {_nearest(release, scheme)}"


def checkpoint_note(scheme: WeightScheme, *, engine: EngineName, version: str | None) -> str | None:
    """Where the release loads ``scheme`` only as a checkpoint though kvfleet could ask for it at load: the
    plan is sized for that checkpoint, which the deployment must then name."""
    release = quantization_release(engine, version)
    method = scheme_method(scheme, release)
    if method is None or scheme.needs_quantized_checkpoint or release.applies(method) or not release.loads(method):
        return None
    return (
        f"{_label(release, version)} quantizes no weights at load: sized as a {method} {scheme.name} checkpoint of "
        "this model, which the deployment must name"
    )


def checkpoint_refusal(method: str, scheme: WeightScheme, *, engine: EngineName, version: str | None) -> str | None:
    """Why the release cannot load a checkpoint whose quantization_config names ``method``, or None."""
    release = quantization_release(engine, version)
    if release.loads(method):
        return None
    label = _label(release, version)
    if method in release.deprecated:
        why = f"{label} refuses the deprecated quant_method {method!r} without a flag kvfleet does not set"
    else:
        why = f"{label} does not load this checkpoint's quant_method {method!r} ({scheme.name})"
    return f"{why}; use a checkpoint of this model in {_nearest_checkpoint(release, scheme, method)}"


def _nearest_checkpoint(release: QuantizationRelease, scheme: WeightScheme, refused: str) -> str:
    """The same scheme in a format the release loads, else the nearest other scheme's checkpoint."""
    for name in (scheme.name, *NEAREST.get(scheme.name, ())):
        alt = WEIGHT_SCHEMES.get(name)
        if alt is None or not alt.is_quantized:
            continue
        method = scheme_method(alt, release)
        if method is not None and method != refused and release.loads(method):
            return f"{name} (quant_method {method})"
    return "bf16 (the unquantized checkpoint)"


def as_loaded(scheme: WeightScheme, *, engine: EngineName, version: str | None) -> WeightScheme:
    """``scheme`` as the engine release holds it in GPU memory, where that differs from the checkpoint's layout:
    bitsandbytes 4-bit absmax held as fp32 from the release the engine's traits name (``bnb_fp32_absmax_since``)."""
    since = engine_traits(engine).bnb_fp32_absmax_since
    if scheme.name != "bnb-4bit" or since is None:
        return scheme
    if parse_version(version or default_version(engine)) < since or scheme.scale_bytes == 4:
        return scheme
    return replace(
        scheme, scale_bytes=4.0, description="bitsandbytes 4-bit, double-quantized absmax held as fp32 per 64"
    )
