"""What `kvfleet bench` checks a run against: the plan's speed, and the limits test's verdict."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.bench.client import KvCapacity, LevelSpec
    from kvfleet.deployments import ResolvedDeployment


def predicted_speed(r: ResolvedDeployment, n_in: int, n_out: int, concurrency: int) -> dict[str, Any]:
    """What the plan's step model predicts for one replica at this level: ``concurrency`` clients in a closed loop
    sending ``n_in`` + ``n_out`` tokens, as many running as max_num_seqs lets."""
    from kvfleet.sim.steps import RooflineSteps
    from kvfleet.sizing.step import Limits, Workload, steady_state

    c = r.candidate
    rep = RooflineSteps.for_candidate(c, r.model).replica  # the replica the planner and the simulator price
    seqs = r.engine_args.max_num_seqs or c.capacity.max_num_seqs
    st = steady_state(
        rep,
        Workload(input_tokens=n_in, output_tokens=n_out, concurrency=concurrency),
        limits=Limits(max_num_batched_tokens=c.capacity.max_num_batched_tokens, max_running=min(concurrency, seqs)),
    )
    return {
        "itl_s": st.itl_s,
        "ttft_s": st.ttft_service_s + st.queue_wait_s,
        "output_tokens_per_s": st.output_tokens_per_s,
        "instance_type": c.name,
    }


def speed_drift_lines(row: dict[str, Any], tolerance: float) -> list[str]:
    """A level slower than the plan predicts (faster passes: the plan is a floor, and a fleet behind a load
    balancer serves more than one replica's tokens)."""
    p = row["planned"]
    out = []
    itl = row["itl_s"]
    if itl is not None and itl["mean"] > p["itl_s"] * (1 + tolerance):
        out.append(
            f"{row['level']}: mean ITL {itl['mean'] * 1e3:.1f} ms against the plan's {p['itl_s'] * 1e3:.1f} ms on "
            f"{p['instance_type']} ({itl['mean'] / p['itl_s']:.2f}x, tolerance {tolerance:.0%})"
        )
    tps = row["output_tokens_per_s"]
    if row["completed"] and tps < p["output_tokens_per_s"] * (1 - tolerance):
        out.append(
            f"{row['level']}: {tps:,.0f} output tokens/s against the plan's {p['output_tokens_per_s']:,.0f} "
            f"({tps / p['output_tokens_per_s']:.2f}x, tolerance {tolerance:.0%})"
        )
    return out


def bench_limits(a: argparse.Namespace, planned: ResolvedDeployment | None) -> tuple[int, int, int]:
    """(max input, max output, planned concurrency) for --limits: the flags, else the plan's."""
    w = planned.deployment.workload if planned is not None else None
    n_in = a.max_input_tokens or (w.max_input_tokens if w else None)
    n_out = a.max_output_tokens or (w.max_output_tokens if w else None)
    c = a.max_concurrency or (planned.engine_args.max_num_seqs if planned is not None else None)
    missing = [
        f for f, v in (("--max-input-tokens", n_in), ("--max-output-tokens", n_out), ("--max-concurrency", c)) if not v
    ]
    if missing:
        raise KvfleetError(f"--limits needs {', '.join(missing)} (or --env with the plan)", field="limits")
    assert n_in and n_out and c
    return n_in, n_out, c


def limits_levels(n_in: int, n_out: int, c: int) -> list[LevelSpec]:
    from kvfleet.bench.client import LevelSpec

    return [
        LevelSpec(label=f"limits at {c}", concurrency=c, lengths=((n_in, n_out),) * (2 * c)),
        LevelSpec(label=f"above, at {2 * c}", concurrency=2 * c, lengths=((n_in, n_out),) * (4 * c)),
    ]


def limits_verdict(rows: list[dict[str, Any]], goal: float) -> dict[str, Any]:
    at, above = rows
    problems = []
    if at["failed"]:
        problems.append(f"{sum(at['failed'].values())} requests failed ({_failures(at)})")
    if at["preemptions"]:
        problems.append(f"the engine preempted {at['preemptions']:g} times (the cache ran short)")
    if at["ttft_attainment"] is not None and at["ttft_attainment"] < goal:
        problems.append(f"TTFT target met by {at['ttft_attainment']:.1%} < {goal:.0%} (--slo-attainment)")
    others = {k: n for k, n in above["failed"].items() if k != "429"}
    lines = []
    if problems:
        lines.append(f"kvfleet: limits: at the planned concurrency {at['level']}: " + "; ".join(problems))
    else:
        unknown = " (no preemption counter on this endpoint)" if at["preemptions"] is None else ""
        lines.append(f"limits: {at['level']}: every request completed, none preempted{unknown}")
    if others:
        lines.append(
            f"kvfleet: limits: {above['level']}: {sum(others.values())} failed otherwise than 429 "
            f"({_failures(above)}): the endpoint falls over above its plan instead of refusing what it cannot admit"
        )
    elif above["failed"]:
        lines.append(f"limits: {above['level']}: {above['failed']['429']} refused with 429 (admission), none failed")
    else:
        lines.append(f"limits: {above['level']}: every request completed (admission let them queue)")
    return {"passed": not problems and not others, "lines": lines}


def limits_fill(limits: tuple[int, int, int], capacity: KvCapacity | None) -> str:
    """Whether the levels could have filled the cache the engine reports: a test that could not says nothing of
    what the engine does when its cache is full."""
    n_in, n_out, c = limits
    most = 2 * c * (n_in + n_out)  # the level above the plan, every request at its longest
    if capacity is None:
        return "limits: the endpoint reports no KV cache: whether the test could fill it is unknown"
    if most < capacity.tokens:
        return (
            f"limits: note: the test holds at most {most:,} tokens at once and the engine's cache has "
            f"{capacity.tokens:,}: it could not have filled the cache (raise --max-concurrency or the lengths to "
            "test a full one)"
        )
    return f"limits: the test holds up to {most:,} tokens at once, past the engine's cache of {capacity.tokens:,}"


def _failures(row: dict[str, Any]) -> str:
    return ", ".join(f"{n} x {k}" for k, n in sorted(row["failed"].items()))
