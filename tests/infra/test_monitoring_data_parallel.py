"""CacheBindsFirst on a data-parallel replica: the agent's RequestsRunning sums the engine cores, so the alarm's
"slots free" threshold is every core's max_num_seqs, not one core's."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import resolve_environment
from kvfleet.infra.monitoring import SLOTS_IDLE_FRACTION, ServingMonitoring
from tests.envs import SAGEMAKER_ENV
from tests.infra.helpers import environment, make_app
from tests.infra.test_monitoring import evaluate

KV = f"{contract.KV_CACHE_UTILIZATION.name}/Average"
RUNNING = f"{contract.REQUESTS_RUNNING.name}/Average"


def alarm(*, max_num_seqs: int, data_parallel_size: int | None) -> dict[str, object]:
    """The alarm as synthesized; ``data_parallel_size`` None: the argument left out."""
    [r] = resolve_environment(environment(SAGEMAKER_ENV))
    stack = cdk.Stack(make_app(), "Monitored")
    if data_parallel_size is None:
        ServingMonitoring(
            stack, "Monitoring", deployment_id="d", scaling=r.scaling, max_num_seqs=max_num_seqs, slots_bind=True
        )
    else:
        ServingMonitoring(
            stack,
            "Monitoring",
            deployment_id="d",
            scaling=r.scaling,
            max_num_seqs=max_num_seqs,
            slots_bind=True,
            data_parallel_size=data_parallel_size,
        )
    alarms = Template.from_stack(stack).find_resources("AWS::CloudWatch::Alarm")
    [found] = [a["Properties"] for k, a in alarms.items() if "CacheBindsFirst" in k]
    return dict(found)


def test_the_slots_are_the_replicas() -> None:
    """4 cores of 12 sequences: 12 running is a quarter of the replica's 48 slots, so a full cache at 12 running
    means slots are free (read against one core's 12 it looked like every slot full, and the alarm never fired)."""
    a = alarm(max_num_seqs=12, data_parallel_size=4)
    assert 48 * SLOTS_IDLE_FRACTION > 12
    assert evaluate(a, {KV: 0.97, RUNNING: 12.0}) == 1
    assert evaluate(a, {KV: 0.97, RUNNING: 48.0}) == 0  # every core's slots full: saturation's alarm
    assert "of 48 sequences" in str(a["AlarmDescription"])


def test_one_core_keeps_its_threshold() -> None:
    one, default = alarm(max_num_seqs=12, data_parallel_size=1), alarm(max_num_seqs=12, data_parallel_size=None)
    assert one == default
    assert evaluate(one, {KV: 0.97, RUNNING: 12.0}) == 0
    assert "of 12 sequences" in str(one["AlarmDescription"])
