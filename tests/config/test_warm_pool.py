"""EC2 warm pools in the states EC2 can put a GPU instance in."""

from __future__ import annotations

import pytest

from kvfleet.config.loader import parse_environment
from kvfleet.errors import ConfigError
from tests.infra.ec2.envs import EC2_ENV

POOL = "        min_size: 1\n"


def with_state(state: str) -> str:
    assert POOL in EC2_ENV
    return EC2_ENV.replace(POOL, f"{POOL}        state: {state}\n", 1)


@pytest.mark.parametrize("state", ["Stopped", "Running"])
def test_stopped_and_running_pools_are_accepted(state: str) -> None:
    env = parse_environment(with_state(state), source="e.yaml")
    assert env.deployments[0].target.warm_pool.state == state  # type: ignore[union-attr]


def test_a_hibernated_pool_of_gpu_instances_is_refused_in_one_line_with_the_fix() -> None:
    text = with_state("Hibernated")
    with pytest.raises(ConfigError) as err:
        parse_environment(text, source="e.yaml")
    [line] = err.value.lines
    state_line = next(i for i, x in enumerate(text.splitlines(), start=1) if "state: Hibernated" in x)
    assert line.startswith(f"e.yaml:{state_line}: deployments[0].target.warm_pool.state: ")
    assert "no GPU instance type" in line and "Stopped" in line
