"""Waiting for traffic: a warm minimum, an EC2 warm pool or scale to zero, replayed on a bursty workload.

The workload is synthetic on purpose (the Azure traces never idle for the 15-minute wait): three 20-minute
bursts of Poisson arrivals at 0.5 requests/s, an hour apart, on Llama-3.1-8B on one g6e.xlarge per replica
(6.5 min from launch to serving, 4.7 min from a stopped warm pool).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvfleet.config.loader import parse_environment
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.scaling import WAKE_S
from kvfleet.sim.fleet import simulate
from kvfleet.sim.policy import replay
from kvfleet.tuning import exposed_requests, fleet_spec, idle_gaps, standby_comparison
from kvfleet.workload.traces import Trace, poisson_trace

TEXT = """\
name: tools
region: us-east-1
deployments:
  - name: assistant
    model:
      id: meta-llama/Llama-3.1-8B
      s3_uri: s3://model-bucket/llama/8b/
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
      peak_requests_per_s: 0.5
      avg_input_tokens: 600
      avg_output_tokens: 200
      ttft_ms: 2000
    target:
      platform: ec2
    scaling:
      min_replicas: 0
      max_replicas: 2
    sizing:
      families: [g6e]
"""
BURST_S = 1200.0
GAP_S = 3600.0


def resolved(text: str = TEXT) -> ResolvedDeployment:
    [r] = resolve_environment(parse_environment(text, source="tools.yaml"))
    return r


@pytest.fixture(scope="module")
def zero() -> ResolvedDeployment:
    return resolved()


@pytest.fixture(scope="module")
def bursts() -> Trace:
    phases = ((BURST_S, 0.5), (GAP_S, 0.0)) * 3
    return poisson_trace(phases, input_tokens=600, output_tokens=200, source="three bursts", seed=1)


def test_the_fleet_goes_to_zero_when_idle_and_the_first_refused_request_wakes_it(
    zero: ResolvedDeployment, bursts: Trace
) -> None:
    spec = fleet_spec(zero)
    assert spec.scaling.min_replicas == 0 and spec.scaling.idle_to_zero_s == zero.idle_to_zero_s
    result = simulate(bursts, spec)
    kinds = [why for _, _, why in result.scale_events]
    assert kinds == ["to zero", "wake", "to zero", "wake"]
    a = bursts.arrival_s
    for (t_zero, n_zero, _), (t_wake, n_wake, _), burst in zip(
        result.scale_events[::2], result.scale_events[1::2], (1, 2), strict=True
    ):
        burst_start = burst * (BURST_S + GAP_S)
        last_before = max(x for x in a if x < burst_start)
        first_after = min(x for x in a if x >= burst_start)
        # To zero one idle wait after the last request (at the next one-minute evaluation).
        assert last_before + zero.idle_to_zero_s <= t_zero < last_before + zero.idle_to_zero_s + 60
        # The wake: the first refused request's alarm, then one replica.
        assert first_after + WAKE_S <= t_wake < first_after + WAKE_S + 60
        assert (n_zero, n_wake) == (0, 1)
    # Everything that arrived before a woken replica served was refused, and nothing else was.
    delay = spec.scaling.wake_s + spec.cold_start_s
    exposed = exposed_requests(bursts, float(zero.idle_to_zero_s), delay)
    assert exposed > 0
    assert abs(result.stats.rejected_503 - exposed) <= 0.1 * exposed + 5  # the wake lands on a minute tick
    warm = simulate(bursts, replace(spec, scaling=replace(spec.scaling, min_replicas=1)))
    assert warm.stats.rejected_503 == 0
    assert result.replica_seconds < 0.6 * warm.replica_seconds


def test_the_comparison_prices_each_way_of_waiting(zero: ResolvedDeployment, bursts: Trace) -> None:
    """When this was written: scale to zero (as configured) 72.2% in time for $2.67; one warm replica 100% for
    $5.59; one warm + a stopped pool of one 100% for $5.62 (the pool's volume, $0.013/h); scale to zero from the
    pool 77.4% for $2.71. Zero costs half, but 498 of the 1,789 requests arrive in the 8.5 minutes between a
    burst's start and the woken replica serving (404 in 6.7 minutes from the pool), so it can never reach the 95%
    goal here: both zero options serve exactly their ceiling, every other request in time."""
    cmp = standby_comparison(zero, bursts)
    by = {o.label: o for o in cmp.options}
    assert list(by) == [
        "scale to zero",
        "1 warm",
        "1 warm + stopped warm pool of 1",
        "scale to zero + stopped warm pool of 1",
    ]
    assert by["scale to zero"].configured and not any(o.configured for o in cmp.options[1:])
    cold, warm = by["scale to zero"], by["1 warm"]
    pooled, zero_pooled = by["1 warm + stopped warm pool of 1"], by["scale to zero + stopped warm pool of 1"]
    assert warm.outcome.meets and warm.outcome.attainment > 0.99
    assert not cold.outcome.meets and not zero_pooled.outcome.meets
    assert cold.outcome.cost < 0.6 * warm.outcome.cost
    # The pool starts a replica sooner, so fewer requests wait out a cold start; its volumes cost a little.
    assert zero_pooled.cold_start_s < cold.cold_start_s
    assert zero_pooled.outcome.attainment > cold.outcome.attainment
    assert 0 < pooled.standby_usd_per_hour < 0.01 * zero.candidate.usd_per_hour_per_instance
    assert pooled.outcome.cost > warm.outcome.cost
    # The ceiling is what the attainment can never pass: the requests of each wake and cold start are lost.
    for o in (cold, zero_pooled):
        assert o.ceiling is not None and o.outcome.attainment <= o.ceiling + 1e-9
        assert o.ceiling < cmp.goal
    assert cmp.best is warm
    assert cmp.gaps.count == 2 and cmp.gaps.wait_s == zero.idle_to_zero_s
    assert cmp.gaps.idle_s == pytest.approx(2 * (GAP_S - zero.idle_to_zero_s), rel=0.05)
    assert cold.outcome.cost == pytest.approx(2.67, rel=0.25) and warm.outcome.cost == pytest.approx(5.59, rel=0.25)


def test_targets_that_cannot_wake_from_zero_say_so() -> None:
    r = resolved(TEXT.replace("      min_replicas: 0\n", "      min_replicas: 1\n").replace("ec2", "eks"))
    trace = poisson_trace(((600.0, 0.5),), input_tokens=600, output_tokens=200, source="steady", seed=1)
    cmp = standby_comparison(r, trace)
    assert [o.label for o in cmp.options] == ["1 warm"]
    assert cmp.unavailable == (
        "warm pools: ec2 only, not eks",
        "scale to zero: not on eks: KEDA scales on the pods' own signals, and with no pod there is none to wake on",
    )
    assert cmp.gaps.count == 0


def test_a_replay_does_not_depend_on_what_was_replayed_before(zero: ResolvedDeployment, bursts: Trace) -> None:
    # The step model prices each pure-decode bucket at a fixed point: a cache that kept the first value it saw
    # made the same policy's attainment depend on the replays before it (0.3 points on staging's derivation).
    spec = fleet_spec(zero)
    first = replay(bursts, spec, ttft_slo_s=2.0, goal=0.95)
    replay(bursts, replace(spec, scaling=replace(spec.scaling, min_replicas=2)), ttft_slo_s=2.0, goal=0.95)
    again = replay(bursts, spec, ttft_slo_s=2.0, goal=0.95)
    fresh = replay(bursts, fleet_spec(zero), ttft_slo_s=2.0, goal=0.95)
    assert first == again == fresh


def test_idle_gaps_and_exposure_on_a_hand_made_trace() -> None:
    t = poisson_trace(((10.0, 1.0),), input_tokens=1, output_tokens=1, source="x", seed=0)
    arrivals = [0.0, 10.0, 1000.0, 1001.0, 1500.0, 3000.0]
    t = replace(t, arrival_s=type(t.arrival_s)("d", arrivals))
    g = idle_gaps(t, 900.0)
    assert (g.count, g.idle_s) == (2, (990 - 900) + (1500 - 900))
    # After 10 -> 1000: 1000 and 1001 fall in the next 100 s; after 1500 -> 3000: 3000 alone.
    assert exposed_requests(t, 900.0, 100.0) == 3


def test_plan_prints_the_comparison_for_a_file_that_scales_to_zero(tmp_path: Path, bursts: Trace) -> None:
    csv = tmp_path / "bursts.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for a in bursts.arrival_s:
        h, rem = divmod(a, 3600)
        m, s = divmod(rem, 60)
        rows.append(f"2026-01-01 {int(h):02d}:{int(m):02d}:{s:010.7f},600,200")
    csv.write_text("\n".join(rows) + "\n")
    env = tmp_path / "tools.yaml"
    env.write_text(
        TEXT.replace("      ttft_ms: 2000\n", f"      ttft_ms: 2000\n      trace:\n        path: {csv.name}\n")
    )
    kvfleet = str(Path(sys.executable).parent / "kvfleet")
    out = subprocess.run([kvfleet, "plan", str(env)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "standby: replaying " in text
    assert "  scale to zero (as configured): TTFT in time for " in text
    assert "  cheapest that meets the goal: 1 warm\n" in text
    assert "  idle: 2 spells without a request longer than the 15 min wait" in text
    assert "so it can never serve more than " in text
    js = subprocess.run([kvfleet, "plan", str(env), "--json"], capture_output=True, text=True, check=False)
    assert js.returncode == 0, js.stderr
    [row] = json.loads(js.stdout)
    standby = row["scaling"]["standby"]
    assert [o["min_replicas"] for o in standby["options"]] == [0, 1, 1, 0]
    assert standby["best"]["min_replicas"] == 1 and standby["best"]["warm_pool"] is None
    assert standby["options"][0]["attainment_ceiling"] < 0.95
    assert standby["idle_spells"] == 2


def test_a_warm_pool_starts_only_as_many_replicas_as_it_holds(zero: ResolvedDeployment) -> None:
    from kvfleet.sim.fleet import Fleet, WarmPool

    spec = fleet_spec(zero)
    assert spec.warm_pool is None  # the file has none
    pool = WarmPool(size=1, start_s=60.0, refill_s=600.0)
    fleet = Fleet(replace(spec, warm_pool=pool, scaling=replace(spec.scaling, max_replicas=6)))
    fleet._scale_to(100.0, 4, "scale-out")  # three launches at once from the fleet's one replica
    starts = sorted(m.replica.ready_s - m.started_s for m in fleet.members if m.started_s == 100.0)
    assert starts == [60.0, spec.cold_start_s, spec.cold_start_s]  # one from the pool, the rest from nothing
    assert fleet.pool_launches == 1
    # The pool's replacement is prepared a whole cold start later; until then a launch starts from nothing.
    fleet._scale_to(500.0, 5, "scale-out")
    assert fleet.members[-1].replica.ready_s - 500.0 == spec.cold_start_s
    fleet._launch(700.0)
    assert fleet.members[-1].replica.ready_s - 700.0 == 60.0 and fleet.pool_launches == 2
