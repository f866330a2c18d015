"""A measured calibration of one deployment: what `kvfleet bench --calibrate` writes and `kvfleet plan` and
`kvfleet simulate --calibration` read (the loop from a live endpoint back to the simulated fleet).

It holds the KV cache the engine allocated and how much slower (or faster) its steps ran than the step model
predicts at the same lengths and concurrency, for one instance type, engine release, model and precision. A file
measured on another of those is refused: a scale measured on an H100 says nothing about an L40S.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfleet.errors import KvfleetError
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.planner import Measured

KIND = "kvfleet.calibration"
# 2 adds the fitted step model (kvfleet.sim.fit); a version 1 file (a step-time scale alone) is still read.
VERSION = 2
READS = (1, 2)


@dataclass(frozen=True, kw_only=True)
class Point:
    concurrency: int
    input_tokens: int
    output_tokens: int
    itl_s: float  # measured mean gap
    predicted_itl_s: float
    output_tokens_per_s: float
    predicted_output_tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class FittedSteps:
    """The step model fitted on the levels (kvfleet.sim.fit): seconds per step, per prefill token, per decoding
    sequence and per KV token read, and a request's time outside the steps."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    request_overhead_s: float


@dataclass(frozen=True, kw_only=True)
class EngineLimitsRecord:
    """The limits the measured engine ran with: what a simulation of it needs besides its steps and cache."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_tokens: int


@dataclass(frozen=True, kw_only=True)
class FitResidual:
    """One measured level and what the fitted model predicts for it."""

    concurrency: int
    input_tokens: int
    output_tokens: int
    ttft_p50_s: float
    predicted_ttft_p50_s: float
    itl_s: float
    predicted_itl_s: float
    output_tokens_per_s: float
    predicted_output_tokens_per_s: float


@dataclass(frozen=True, kw_only=True)
class Calibration:
    measured_at: str  # ISO 8601, UTC
    instance_type: str
    engine: str
    engine_version: str
    model: str
    tensor_parallel_size: int
    kv_cache_tokens: int | None  # what the engine allocated per replica (None: the endpoint did not say)
    points: tuple[Point, ...]
    steps: FittedSteps | None = None  # None: a version 1 file, or too few levels to fit
    residuals: tuple[FitResidual, ...] = ()
    engine_limits: EngineLimitsRecord | None = None

    @property
    def step_time_scale(self) -> float:
        """Measured over predicted ITL, the median over the points (1.0 without any)."""
        ratios = [p.itl_s / p.predicted_itl_s for p in self.points if p.predicted_itl_s > 0 and p.itl_s > 0]
        return statistics.median(ratios) if ratios else 1.0

    def measured(self, source: str) -> Measured:
        """The calibration as the planner takes it (``source``: where it came from, for the plan's notes)."""
        try:
            engine = EngineName(self.engine)
        except ValueError:
            raise KvfleetError(f"{source}: unknown engine {self.engine!r}", field="calibration") from None
        return Measured(
            instance_type=self.instance_type,
            tensor_parallel_size=self.tensor_parallel_size,
            model_id=self.model,
            engine=engine,
            engine_version=self.engine_version,
            kv_cache_tokens=self.kv_cache_tokens,
            step_time_scale=self.step_time_scale,
            source=f"{source}, measured {self.measured_at}",
        )

    def to_json(self) -> str:
        return json.dumps({"kind": KIND, "version": VERSION, **asdict(self)}, indent=2) + "\n"

    def check_matches(self, *, instance_type: str, engine: str, engine_version: str, model: str, tp: int) -> None:
        want = {"instance_type": instance_type, "engine": engine, "engine_version": engine_version, "model": model}
        have = {k: getattr(self, k) for k in want}
        wrong = [f"{k} {have[k]} (the plan has {want[k]})" for k in want if have[k] != want[k]]
        if tp != self.tensor_parallel_size:
            wrong.append(f"tensor_parallel_size {self.tensor_parallel_size} (the plan has {tp})")
        if wrong:
            raise KvfleetError(
                "the calibration was measured on another deployment: " + "; ".join(wrong) + "; measure this one "
                "(kvfleet bench --env ... --calibrate FILE)",
                field="calibration",
            )


def read_calibration(path: str | Path) -> Calibration:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as err:
        raise KvfleetError(f"cannot read {p}: {err.strerror or err}", field="calibration") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise KvfleetError(f"{p}: not JSON ({err})", field="calibration") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise KvfleetError(
            f"{p}: not a kvfleet calibration (kvfleet bench --calibrate writes one)", field="calibration"
        )
    if data.get("version") not in READS:
        raise KvfleetError(
            f"{p}: calibration version {data.get('version')!r}; this kvfleet reads {', '.join(map(str, READS))}",
            field="calibration",
        )
    try:
        points = tuple(Point(**pt) for pt in data["points"])
        steps = FittedSteps(**data["steps"]) if data.get("steps") is not None else None
        residuals = tuple(FitResidual(**r) for r in data.get("residuals", ()))
        limits = EngineLimitsRecord(**data["engine_limits"]) if data.get("engine_limits") is not None else None
        cal = Calibration(
            measured_at=str(data["measured_at"]),
            instance_type=str(data["instance_type"]),
            engine=str(data["engine"]),
            engine_version=str(data["engine_version"]),
            model=str(data["model"]),
            tensor_parallel_size=int(data["tensor_parallel_size"]),
            kv_cache_tokens=None if data["kv_cache_tokens"] is None else int(data["kv_cache_tokens"]),
            points=points,
            steps=steps,
            residuals=residuals,
            engine_limits=limits,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise KvfleetError(f"{p}: a field is missing or malformed ({err})", field="calibration") from None
    for pt in cal.points:
        values: list[Any] = [pt.itl_s, pt.predicted_itl_s, pt.output_tokens_per_s, pt.predicted_output_tokens_per_s]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise KvfleetError(f"{p}: a point holds a negative or non-finite figure", field="calibration")
    if cal.steps is not None:
        terms: list[Any] = list(asdict(cal.steps).values())
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in terms):
            raise KvfleetError(f"{p}: the fitted steps hold a negative or non-finite figure", field="calibration")
    if cal.kv_cache_tokens is not None and cal.kv_cache_tokens <= 0:
        raise KvfleetError(f"{p}: kv_cache_tokens must be positive", field="calibration")
    return cal
