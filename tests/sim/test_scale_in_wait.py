"""The scale-in wait is searched, not typed: a longer wait is kept when the floor would scale in during a lull
and relaunch after it.

The workload is synthetic on purpose (the Azure traces never lull for 15 minutes): four 15-minute bursts of
Poisson arrivals at 3.5 requests/s (planned for a peak of 6), each followed by a 1,000 s lull at 0.2 requests/s,
on Llama-3.1-8B on g6e (6.5 min from launch to serving), one replica pinned, TTFT 2 s for 80% of requests.
At the 15-minute floor the fleet scales in 100 s before each burst and relaunches into it (cold start paid,
queue built: $10.23 over the replay); a 22-minute wait holds the replicas through the lull ($8.83).
"""

from __future__ import annotations

import pytest

from kvfleet.sim.policy import derive, wait_grid
from kvfleet.tuning import fleet_spec
from kvfleet.workload.traces import Trace, poisson_trace

from .test_standby import TEXT, resolved

LULLS = (
    TEXT.replace("min_replicas: 0", "min_replicas: 1")
    .replace("max_replicas: 2", "max_replicas: 4")
    .replace("peak_requests_per_s: 0.5", "peak_requests_per_s: 6")
)
PINNED = {"min_replicas": 1.0}


@pytest.fixture(scope="module")
def lulls() -> Trace:
    phases = ((900.0, 3.5), (1000.0, 0.2)) * 4
    return poisson_trace(phases, input_tokens=600, output_tokens=200, source="bursts and lulls", seed=2)


def test_the_wait_grid_starts_at_the_floor_and_stops_at_the_hour() -> None:
    assert wait_grid(900) == (900, 1320, 1800, 2700)
    assert wait_grid(1500) == (1500, 2280, 3000, 3600)
    assert wait_grid(3600) == (3600,)


def test_a_longer_wait_is_chosen_when_the_floor_relaunches_after_each_lull(lulls: Trace) -> None:
    spec = fleet_spec(resolved(LULLS))
    assert spec.scaling.scale_in_cooldown_s == 900  # the floor on EC2: 15 min, twice the 300 s drain budget
    d = derive(lulls, spec, ttft_slo_s=2.0, goal=0.8, pinned=PINNED)
    assert d.feasible and d.policy.scale_in_wait_s == 1320
    [wait] = [c for c in d.choices if c.setting == "scale_in_wait_s"]
    assert "at the floor 15 min the fleet scales in during lulls and relaunches after" in wait.reason
    assert f"$10.23 against {d.outcome.cost_text()} over the replay" in wait.reason


def test_a_pinned_wait_is_held_and_what_it_costs_is_reported(lulls: Trace) -> None:
    spec = fleet_spec(resolved(LULLS))
    d = derive(lulls, spec, ttft_slo_s=2.0, goal=0.8, pinned={**PINNED, "scale_in_wait_s": 900.0})
    assert d.policy.scale_in_wait_s == 900
    [cost] = [p for p in d.pin_costs if p.setting == "scale_in_wait_s"]
    assert cost.best is not None and cost.best.policy.scale_in_wait_s == 1320
    assert cost.best.cost < cost.pinned.cost


def test_on_steady_traffic_the_floor_is_kept() -> None:
    spec = fleet_spec(resolved(LULLS))
    steady = poisson_trace(((1800.0, 2.0),), input_tokens=600, output_tokens=200, source="steady", seed=3)
    d = derive(steady, spec, ttft_slo_s=2.0, goal=0.8, pinned=PINNED)
    assert d.policy.scale_in_wait_s == 900
    [wait] = [c for c in d.choices if c.setting == "scale_in_wait_s"]
    assert wait.reason.startswith("the floor (15 min and twice the drain budget)")
