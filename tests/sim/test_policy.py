"""The scaling thresholds derived by replaying a workload (kvfleet.sim.policy) and what they buy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.config.loader import environment_path, load_located
from kvfleet.deployments import ResolvedDeployment, plan_requests, resolve
from kvfleet.sim.fleet import FleetSpec
from kvfleet.sim.policy import Policy, derive
from kvfleet.tuning import fleet_spec
from kvfleet.workload.traces import Trace, poisson_trace, read_trace
from tests.envs import REPO

DEFAULTS = Policy(saturation_target=0.75, queue_target=2.0, min_replicas=1)  # ScalingConfig's hand-set defaults


@pytest.fixture(scope="module")
def chat() -> ResolvedDeployment:
    """Llama-3.1-8B on one ml.g6e.xlarge per replica (the chat-trace example), 1-4 replicas, target tracking."""
    loaded = load_located(environment_path(str(REPO / "environments" / "chat-trace.yaml")))
    [dr] = plan_requests(loaded.environment)
    return resolve(loaded.environment, dr)


def _poisson(rate: float, seconds: float, prompt: int = 600, output: int = 200) -> Trace:
    return poisson_trace(((seconds, rate),), input_tokens=prompt, output_tokens=output, source="poisson", seed=3)


@pytest.mark.parametrize(
    ("name", "slo_s", "usd", "defaults_attain"),
    [("conv", 0.5, (2.02, 1.59), (0.0, 0.92)), ("code", 2.0, (3.27, 3.57), (0.0, 0.85))],
)
def test_derived_policy_beats_the_defaults_on_azure_traces(
    chat: ResolvedDeployment, name: str, slo_s: float, usd: tuple[float, float], defaults_attain: tuple[float, float]
) -> None:
    """25 minutes of each Azure 2023 trace (from minute 15, real rate) on the chat example's replica, goal 95% of
    requests with a first token within the target. When this was written:

    - conversation (9,752 requests, TTFT <= 0.5 s): derived saturation 0.5, queue 1, min 1 replica: 98.3% in time
      for $2.02; the defaults (0.75, 2, min 1): 88.4% for $1.59, cheaper and well below the goal. At 1 s one
      replica nearly carries the trace's short prompts and the defaults sit on the goal's edge (94.9-95.1% as the
      step constants are refitted), so that target tells nothing; it was the case here until a prefill step was
      priced with every prompt it carries (the old model's 34 ms per prefill step made one replica lose the burst).
    - code (4,893 requests, TTFT <= 2 s): derived 0.5, 1, min 3: 99.98% for $3.27; defaults 70.7% for $3.57.
      The defaults are both dearer and far below the goal: they wait for the queue to pass 2 for three minutes,
      then pay for the replicas the burst made them launch long after it ended.

    The dollar figures may move with the step model; the test holds the ordering (the derived policy meets the
    goal and costs no more) and where the defaults' attainment lies.
    """
    trace = read_trace(
        REPO / "traces" / "azure2023" / f"AzureLLMInferenceTrace_{name}.csv",
        fmt="azure",
        start_s=900,
        duration_s=1500,
    )
    d = derive(trace, fleet_spec(chat), ttft_slo_s=slo_s, goal=0.95, compare=DEFAULTS)
    assert d.feasible and d.outcome.meets and d.outcome.attainment >= 0.95
    assert d.compared is not None and d.compared.stopped_s is None  # the comparison ran to the end
    low, high = defaults_attain
    assert low <= d.compared.attainment <= high, d.compared
    if d.compared.meets:
        assert d.outcome.cost <= d.compared.cost  # where both meet it, the derived policy costs no more
    # Near the figures in the docstring (a moved model should be noticed, not silently accepted).
    derived_usd, default_usd = usd
    assert d.outcome.cost == pytest.approx(derived_usd, rel=0.25)
    assert d.compared.cost == pytest.approx(default_usd, rel=0.25)
    # Each setting says why: the minimum names the value below it and how that one fails.
    reasons = {c.setting: c.reason for c in d.choices}
    if d.policy.min_replicas > 1:
        assert reasons["min_replicas"].startswith(f"at {d.policy.min_replicas - 1} replicas more than 5% of requests")
    else:
        assert reasons["min_replicas"] == "the floor (1 on this target)"


def test_pins_are_held_and_their_cost_reported(chat: ResolvedDeployment) -> None:
    trace = _poisson(1.0, 900)
    d = derive(trace, fleet_spec(chat), ttft_slo_s=1.0, goal=0.95, pinned={"min_replicas": 3.0})
    assert d.policy.min_replicas == 3
    [choice] = [c for c in d.choices if c.setting == "min_replicas"]
    assert choice.pinned and choice.reason == "pinned in the file"
    [pin] = d.pin_costs
    # One replica carries a steady 1 request/s: the pin at 3 costs about two replicas more over the replay.
    assert pin.best is not None and pin.best.policy.min_replicas == 1
    assert pin.pinned.cost > 2.5 * pin.best.cost


def test_a_policy_that_misses_is_dropped_early_and_says_where(chat: ResolvedDeployment) -> None:
    """A load one replica cannot carry: the one-replica candidate stops once 5% have missed, and the search
    reports that as the minimum's reason."""
    trace = _poisson(6.0, 1200, prompt=1500, output=300)
    d = derive(trace, fleet_spec(chat), ttft_slo_s=1.0, goal=0.95)
    assert d.policy.min_replicas > 1
    [choice] = [c for c in d.choices if c.setting == "min_replicas"]
    assert "more than 5% of requests miss TTFT 1 s" in choice.reason and "by minute" in choice.reason


def test_no_policy_within_max_replicas(chat: ResolvedDeployment) -> None:
    base = fleet_spec(chat)
    one: FleetSpec = replace(base, scaling=replace(base.scaling, max_replicas=1), initial_replicas=1)
    d = derive(_poisson(8.0, 600, prompt=2000, output=300), one, ttft_slo_s=0.5, goal=0.95)
    assert not d.feasible and not d.outcome.meets
    assert all("no policy meets the goal" in c.reason for c in d.choices)
