"""`kvfleet bench --calibrate`: the measured levels fitted to the step model and written as a calibration."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.bench.client import KvCapacity
    from kvfleet.calibration import Calibration, FitResidual, FittedSteps
    from kvfleet.deployments import ResolvedDeployment


def write_calibration(
    path: str, r: ResolvedDeployment, rows: list[dict[str, Any]], capacity: KvCapacity | None
) -> None:
    from datetime import UTC, datetime
    from pathlib import Path

    from kvfleet.calibration import Calibration, Point

    measured = [row for row in rows if row.get("planned") and row["itl_s"] is not None and row["completed"]]
    points = tuple(
        Point(
            concurrency=row["concurrency"],
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens_each"],
            itl_s=row["itl_s"]["mean"],
            predicted_itl_s=row["planned"]["itl_s"],
            output_tokens_per_s=row["output_tokens_per_s"],
            predicted_output_tokens_per_s=row["planned"]["output_tokens_per_s"],
        )
        for row in measured
    )
    from kvfleet.calibration import EngineLimitsRecord
    from kvfleet.tuning import fleet_spec

    kv_tokens = capacity.tokens if capacity is not None else None
    steps, residuals = _fit_steps(r, measured, kv_tokens)
    lim = fleet_spec(r).limits
    cal = Calibration(
        measured_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        instance_type=r.candidate.name,
        engine=r.engine,
        engine_version=r.deployment.engine.version,
        model=r.model_id,
        tensor_parallel_size=r.candidate.tensor_parallel_size,
        kv_cache_tokens=kv_tokens,
        points=points,
        steps=steps,
        residuals=residuals,
        engine_limits=EngineLimitsRecord(
            max_num_seqs=lim.max_num_seqs,
            max_num_batched_tokens=lim.max_num_batched_tokens,
            block_tokens=lim.block_tokens,
        ),
    )
    try:
        Path(path).write_text(cal.to_json(), encoding="utf-8")
    except OSError as err:
        print(f"kvfleet: cannot write {path}: {err.strerror or err}", file=sys.stderr)
        return
    kv = f"{cal.kv_cache_tokens:,} KV tokens" if cal.kv_cache_tokens else "no KV size (the endpoint hides /metrics)"
    print(f"calibration written to {path}: steps x{cal.step_time_scale:.2f} the plan's, {kv}", file=sys.stderr)
    for line in _fit_lines(cal):
        print(line, file=sys.stderr)


def _fit_steps(
    r: ResolvedDeployment, rows: list[dict[str, Any]], kv_tokens: int | None
) -> tuple[FittedSteps | None, tuple[FitResidual, ...]]:
    """The step model fitted on the measured closed-loop levels (kvfleet.sim.fit), with each level's residual;
    (None, ()) where the levels do not hold two batch sizes and two prompt lengths."""
    from dataclasses import replace as with_fields

    from kvfleet.calibration import FitResidual, FittedSteps
    from kvfleet.sim.fit import MeasuredLevel, fit
    from kvfleet.tuning import fleet_spec

    levels = [
        MeasuredLevel(
            concurrency=row["concurrency"],
            input_tokens=row["input_tokens"],
            output_tokens=row["output_tokens_each"],
            requests=row["completed"],
            ttft_p50_s=row["ttft_s"]["p50"] if row["ttft_s"] else 0.0,
            itl_mean_s=row["tpot_s"]["mean"] if row["tpot_s"] else 0.0,
            output_tokens_per_s=row["output_tokens_per_s"],
        )
        for row in rows
    ]
    spec = fleet_spec(r)
    if kv_tokens is not None:  # the cache the engine allocated, as the simulator will replay it
        spec = with_fields(
            spec, limits=with_fields(spec.limits, kv_blocks=max(1, kv_tokens // spec.limits.block_tokens))
        )
    try:
        result = fit(spec, levels)
    except ValueError:
        return None, ()
    steps = FittedSteps(**result.terms())
    residuals = tuple(
        FitResidual(
            concurrency=lf.level.concurrency,
            input_tokens=lf.level.input_tokens,
            output_tokens=lf.level.output_tokens,
            ttft_p50_s=lf.level.ttft_p50_s,
            predicted_ttft_p50_s=lf.ttft_p50_s,
            itl_s=lf.level.itl_mean_s,
            predicted_itl_s=lf.itl_mean_s,
            output_tokens_per_s=lf.level.output_tokens_per_s,
            predicted_output_tokens_per_s=lf.output_tokens_per_s,
        )
        for lf in result.levels
    )
    return steps, residuals


def _fit_lines(cal: Calibration) -> list[str]:
    """The fitted terms and each level's residual, for the person who ran the calibration."""
    s = cal.steps
    if s is None:
        return ["no step model fitted: that needs closed-loop levels at two batch sizes and two prompt lengths"]
    out = [
        f"fitted step model: {s.fixed_s * 1e3:.3f} ms per step + {s.per_prefill_token_s * 1e6:.3f} us per prefill "
        f"token + {s.per_decode_seq_s * 1e6:.2f} us per decoding sequence + {s.per_kv_token_s * 1e9:.3f} ns per KV "
        f"token read; {s.request_overhead_s * 1e3:.2f} ms per request outside the steps"
    ]
    for x in cal.residuals:
        out.append(
            f"  concurrency {x.concurrency}, {x.input_tokens} in: "
            f"TTFT p50 {_pct(x.predicted_ttft_p50_s, x.ttft_p50_s)}, "
            f"ITL {_pct(x.predicted_itl_s, x.itl_s)}, output tokens/s "
            f"{_pct(x.predicted_output_tokens_per_s, x.output_tokens_per_s)} (fitted against measured)"
        )
    return out


def _pct(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.0f}%" if measured > 0 else "n/a"
