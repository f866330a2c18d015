"""A scale-in drains as long as its target lets it, and the simulator counts what it cuts.

EC2's lifecycle hook and EKS's grace period wait the deployment's drain budget out; SageMaker kills a container 30 s
after the SIGTERM of a scale-in (its record's scale_in_drain, with the source), so the fleet it simulates drains
for what the agent gets of those 30 s and cuts the generations still running then."""

from __future__ import annotations

import pytest

from kvfleet.deployments import resolve_environment
from kvfleet.sim.fleet import simulate
from kvfleet.sim.report import render, summarize
from kvfleet.targets import STREAM_CLOSE_S, TARGETS
from kvfleet.tuning import fleet_spec
from tests.envs import environment
from tests.sim.synthetic import steady
from tests.sim.test_fleet import spec

from .test_standby import TEXT, resolved


def test_only_sagemaker_kills_before_the_budget() -> None:
    kills = {name: t.scale_in_drain for name, t in TARGETS.items() if t.scale_in_drain is not None}
    assert set(kills) == {"sagemaker"}
    stop = kills["sagemaker"]
    assert stop.kill_after_s == 30 and "thirty seconds later" in stop.source
    assert stop.drain_s(420) == 30 - STREAM_CLOSE_S == 25
    assert stop.drain_s(10) == 10  # a shorter budget is kept
    assert stop.drain_s(0) == 0


def test_the_simulated_drain_is_what_the_target_allows() -> None:
    [sm] = resolve_environment(environment())
    assert sm.scaling.drain_budget_s == 420
    assert fleet_spec(sm).scaling.drain_budget_s == 25
    ec2 = resolved(TEXT)  # the lifecycle hook waits the whole budget
    assert fleet_spec(ec2).scaling.drain_budget_s == ec2.scaling.drain_budget_s == 300


@pytest.mark.parametrize(("drain_s", "cut"), [(3600.0, False), (25.0, True)])
def test_a_scale_in_cuts_what_outlives_the_drain_and_counts_it(drain_s: float, cut: bool) -> None:
    """Three replicas, one long generation every 10 s for 30 min (5,000 tokens, about 50 s each): target
    tracking scales in after its 15 low minutes and waits the budget out, or with SageMaker's 25 s cuts what the
    removed replicas still run."""
    long = steady(0.1, 1800, prompt=200, output=5000)
    fleet = spec("target_tracking", initial=3, scale_in_cooldown_s=300, drain_budget_s=drain_s)
    result = simulate(long, fleet)
    assert [e for e in result.scale_events if e[2] == "scale-in"]
    s = result.stats
    assert (s.cut_by_scale_in > 0) is cut
    assert s.cut_by_scale_in <= s.aborted
    assert len(s.finished) + s.aborted + s.rejected_429 + s.rejected_503 == len(long)
    report = summarize(result, fleet)
    assert report.cut_by_scale_in == s.cut_by_scale_in
    text = render(report)
    assert ("cut by a scale-in" in text) is cut
