"""`kvfleet bench --predict`: each level the benchmark runs, simulated beside it on one replica.

The replica is the plan's (``--env``), priced by the plan's step model or by a calibration's fitted one
(``--calibration``); a calibration alone (version 2: it carries the engine's limits and its fitted steps) predicts an
endpoint that no environment file describes. Each level runs in the simulator as the client runs it: a closed loop
of the same clients and requests, or the same arrivals.
"""

from __future__ import annotations

import argparse
from array import array
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvfleet.errors import KvfleetError

# What a prediction reports of the simulator's run, in the bench's own keys (percentiles with their means).
SIMULATED_KEYS = ("ttft_s", "itl_s", "tpot_s", "e2e_s", "output_tokens_per_s", "requests_per_s", "preemptions")
# Tokens per sequence an unknown cache is given room for (it then never binds a benchmark's lengths).
UNBOUNDED_CONTEXT_TOKENS = 1 << 20

if TYPE_CHECKING:
    from kvfleet.bench.client import LevelSpec
    from kvfleet.calibration import Calibration
    from kvfleet.deployments import ResolvedDeployment
    from kvfleet.sim.fleet import FleetSpec


def prediction_fleet(a: argparse.Namespace, planned: ResolvedDeployment | None) -> tuple[FleetSpec, str]:
    """The replica the levels are simulated on, and where its figures come from."""
    from kvfleet.calibration import read_calibration
    from kvfleet.sim.shapes import fixed
    from kvfleet.tuning import fleet_spec

    cal = read_calibration(a.calibration) if a.calibration else None
    if planned is not None:
        what = f"the plan of {planned.deployment.name}" + (f", calibrated by {a.calibration}" if cal else "")
        return fixed(fleet_spec(planned, calibration=cal), 1), what
    if cal is None:
        raise KvfleetError(
            "--predict simulates a plan or a calibration: give --env FILE or --calibration FILE", field="predict"
        )
    kv = "" if cal.kv_cache_tokens else "; its KV cache unknown, so never full"
    return fixed(calibrated_fleet(cal, a.calibration), 1), f"the steps fitted in {a.calibration}{kv}"


def calibrated_fleet(cal: Calibration, source: str) -> FleetSpec:
    """One replica from a calibration alone: its engine's limits and scheduler, its fitted steps."""
    from kvfleet.engines import adapter
    from kvfleet.engines.base import EngineArgs
    from kvfleet.sim.candidate import ONE_FIXED
    from kvfleet.sim.fit import linear_model
    from kvfleet.sim.fleet import FleetSpec
    from kvfleet.sim.replica import EngineLimits

    s, lim = cal.steps, cal.engine_limits
    if s is None or lim is None:
        raise KvfleetError(
            f"{source} has no fitted step model or engine limits to simulate; measure again with kvfleet bench "
            "--calibrate (version 2), or give --env FILE",
            field="calibration",
        )
    # An endpoint that hid its cache (no /metrics) is simulated with one that never runs out: max_num_seqs of the
    # longest context the cache would need to bind (prediction_fleet's caller says so).
    kv_tokens = cal.kv_cache_tokens or lim.max_num_seqs * UNBOUNDED_CONTEXT_TOKENS
    return FleetSpec(
        limits=EngineLimits(
            max_num_seqs=lim.max_num_seqs,
            max_num_batched_tokens=lim.max_num_batched_tokens,
            kv_blocks=max(1, kv_tokens // lim.block_tokens),
            block_tokens=lim.block_tokens,
            prefix_caching=False,  # benchmark prompts share nothing
        ),
        model=linear_model(asdict(s)),
        scheduler=adapter(cal.engine).scheduler(EngineArgs(tensor_parallel_size=cal.tensor_parallel_size)),
        scaling=ONE_FIXED,
        initial_replicas=1,
        cold_start_s=0.0,
        usd_per_replica_hour=None,
        request_overhead_s=s.request_overhead_s,
    )


def predict_level(spec: FleetSpec, level: LevelSpec) -> dict[str, Any]:
    """What ``level`` would measure on ``spec``: the simulator's report in the bench's own keys."""
    from kvfleet.sim.fleet import simulate
    from kvfleet.sim.report import summarize
    from kvfleet.sim.shapes import closed_loop
    from kvfleet.workload.shapes import ClosedLoop, Lengths
    from kvfleet.workload.traces import Trace

    if level.concurrency is not None:
        first = level.lengths[0]
        loop = ClosedLoop(
            concurrency=level.concurrency,
            requests=len(level.lengths),
            lengths=Lengths(input_tokens=first[0], output_tokens=first[1]),
        )
        result = closed_loop(spec, loop, pairs=level.lengths)
    else:
        assert level.arrivals_s is not None
        trace = Trace(
            source=level.label,
            fmt="poisson",
            arrival_s=array("d", level.arrivals_s),
            input_tokens=array("q", (i for i, _ in level.lengths)),
            output_tokens=array("q", (o for _, o in level.lengths)),
        )
        result = simulate(trace, spec)
    report = summarize(result, spec).as_dict()
    return {k: report[k] for k in SIMULATED_KEYS}


def prediction_lines(rows: list[dict[str, Any]], source: str) -> list[str]:
    """Predicted beside measured, per level, with the error."""
    out = [f"predicted on one replica ({source}), against measured:"]
    for row in rows:
        p = row.get("predicted")
        if p is None:
            continue
        parts = []
        for name, key, stat in (
            ("TTFT p50", "ttft_s", "p50"),
            ("TTFT p90", "ttft_s", "p90"),
            ("ITL mean", "itl_s", "mean"),
        ):
            pred, meas = p[key], row[key]
            if pred is not None and meas is not None:
                x, y = pred[stat], meas[stat]
                parts.append(f"{name} {x * 1e3:,.1f} ms (measured {y * 1e3:,.1f}, {_err(x, y)})")
        pt, mt = p["output_tokens_per_s"], row["output_tokens_per_s"]
        parts.append(f"{pt:,.0f} output tokens/s (measured {mt:,.0f}, {_err(pt, mt)})")
        out.append(f"  {row['level']}: " + "; ".join(parts))
    return out


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.0f}%" if measured > 0 else "n/a"
