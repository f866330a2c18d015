"""SageMaker's scale-in: the container is killed 30 s after its SIGTERM, whatever the drain budget, so the agent is
told to drain for what fits and end the rest with an error event; updates keep the whole budget as the old fleet's
termination wait, where traffic has already moved."""

from __future__ import annotations

from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.agent.server import ABORT_GRACE_S
from kvfleet.deployments import resolve_environment
from kvfleet.targets import STREAM_CLOSE_S
from kvfleet.targets.sagemaker import TARGET
from kvfleet.targets.sagemaker.infra.endpoint import agent_drain_s
from tests.envs import environment
from tests.infra.helpers import only, props


def test_the_agent_closes_its_streams_within_the_margin_the_record_leaves() -> None:
    # The record's margin between the end of the drain and the kill is the agent's grace for error events.
    assert STREAM_CLOSE_S == ABORT_GRACE_S


def test_the_agent_drains_for_what_the_kill_leaves_and_updates_keep_the_budget() -> None:
    [r] = resolve_environment(environment())
    stop = TARGET.scale_in_drain
    assert stop is not None
    t: Template = only()
    [model] = props(t, "AWS::SageMaker::Model")
    env = model["PrimaryContainer"]["Environment"]
    assert r.scaling.drain_budget_s == 420
    assert env[contract.ENV_DRAIN_BUDGET_S] == str(agent_drain_s(r)) == str(stop.kill_after_s - STREAM_CLOSE_S)
    # The blue/green update waits the whole budget before stopping the old fleet: traffic has moved by then.
    [endpoint] = props(t, "AWS::SageMaker::Endpoint")
    policy = endpoint["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TerminationWaitInSeconds"] == 420
