"""What `kvfleet bench` runs: the plan's own load, the limits test, a trace, a rate sweep or closed-loop levels (with
--calibrate, enough of them to fit the step model)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING

from kvfleet.cli.bench_checks import limits_levels
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.bench.client import LevelSpec
    from kvfleet.deployments import ResolvedDeployment


def bench_levels(
    a: argparse.Namespace, planned: ResolvedDeployment | None, limits: tuple[int, int, int] | None
) -> list[LevelSpec]:
    """The levels to run: the plan's own load, the limits test, or the flags' levels, refusing flags they ignore."""
    from kvfleet.bench.client import poisson_level

    if a.trace is not None and a.rate is not None:
        raise KvfleetError("--trace replays the trace's own arrivals; drop --rate (or use --rate-scale)", field="rate")
    if a.trace is None:
        for flag in ("trace_format", "duration_s"):
            if getattr(a, flag) is not None:
                raise KvfleetError(f"--{flag.replace('_', '-')} applies to --trace only; drop it", field=flag)
        if a.start_s or a.rate_scale != 1.0:
            flag = "start_s" if a.start_s else "rate_scale"
            raise KvfleetError(f"--{flag.replace('_', '-')} applies to --trace only; drop it", field=flag)
    if limits is not None and (a.trace is not None or a.rate is not None):
        raise KvfleetError("--limits runs its own two levels; drop --trace and --rate", field="limits")
    if a.calibrate and planned is None:
        raise KvfleetError(
            "--calibrate measures a planned deployment; give --env FILE [--deployment NAME]", field="calibrate"
        )
    if not a.planned_load:
        return limits_levels(*limits) if limits is not None else _flag_levels(a)
    if planned is None:
        raise KvfleetError("--planned-load replays the plan of --env; give --env FILE", field="planned_load")
    if a.trace is not None or a.rate is not None or limits is not None:
        raise KvfleetError("--planned-load is its own level; drop --trace, --rate and --limits", field="planned_load")
    w = planned.deployment.workload
    if w.peak_requests_per_s is None:
        raise KvfleetError(
            "the plan has no arrival rate; set workload.peak_requests_per_s (or workload.trace)", field="planned_load"
        )
    return [
        poisson_level(
            w.peak_requests_per_s,
            requests=a.requests,
            prompt_tokens=w.avg_input_tokens or w.max_input_tokens,
            output_tokens=w.avg_output_tokens or w.max_output_tokens,
        )
    ]


def _flag_levels(a: argparse.Namespace) -> list[LevelSpec]:
    from kvfleet.bench.client import LevelSpec, concurrency_levels, poisson_level

    if a.trace is not None:
        from kvfleet.workload.traces import read_trace

        t = read_trace(a.trace, fmt=a.trace_format, start_s=a.start_s, duration_s=a.duration_s, rate_scale=a.rate_scale)
        return [
            LevelSpec(
                label=f"trace x{a.rate_scale:g}",
                arrivals_s=tuple(t.arrival_s),
                lengths=tuple(zip(t.input_tokens, (max(1, o) for o in t.output_tokens), strict=True)),
                rate_per_s=len(t) / t.duration_s if t.duration_s > 0 else None,
            )
        ]
    if a.rate is not None:
        return [
            poisson_level(r, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens)
            for r in a.rate
        ]
    levels = concurrency_levels(
        a.concurrency, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens
    )
    if a.calibrate:
        # Enough levels to fit each term of the step model: the batch sizes asked for (and one request alone), each
        # with the prompt asked for and a short one (per prefill token against per step and per request).
        short = max(16, a.input_tokens // 8)
        sizes = sorted({1, *a.concurrency})
        levels = [
            *concurrency_levels(
                sizes, requests=a.requests, prompt_tokens=a.input_tokens, output_tokens=a.output_tokens
            ),
            *concurrency_levels(sizes, requests=a.requests, prompt_tokens=short, output_tokens=a.output_tokens),
        ]
        levels = [replace(lv, label=f"{lv.label}, {lv.lengths[0][0]} in") for lv in levels]
    return levels
