"""The liveness route (contract.LIVENESS_ROUTE): what EC2's host watchdog polls to tell an engine restart from a dead
host. 200 while the engine serves, restarts within the budget, or the replica drains; 503 once the engine has been
down past the budget and the supervisor's own restart overhead. Run against the fake engine, killed as a crash would."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvfleet import contract
from kvfleet.agent import engine
from kvfleet.agent.engine import EngineState, EngineSupervisor
from kvfleet.agent.settings import from_env
from tests.agent.harness import Running, fake_engine_command, run, running, settings


async def alive(r: Running) -> tuple[int, dict[str, Any]]:
    async with r.http.get(r.url + contract.LIVENESS_ROUTE) as resp:
        return resp.status, await resp.json()


async def ping(r: Running) -> int:
    async with r.http.get(r.url + contract.HEALTH_ROUTE) as resp:
        return resp.status


async def until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_the_engines_down_time_is_counted_from_when_it_last_served() -> None:
    sup = EngineSupervisor(settings())
    assert sup.down_s() > 0  # not started: down since the agent began
    sup.state = EngineState.READY
    assert sup.down_s() == 0.0
    sup.state = EngineState.DEAD
    time.sleep(0.05)
    sup.state = EngineState.STARTING  # a restart in progress does not reset the clock
    assert sup.down_s() >= 0.05
    # The supervisor's own restart overhead: the sweep, the GPU's release and the longest backoff step.
    s = sup.settings
    assert sup.restart_overhead_s == (
        s.engine_kill_grace_s + engine._TRACKER_GRACE_S + engine._SIGKILL_WAIT_S + s.gpu_release_timeout_s + 0.2
    )


def test_a_restart_within_the_budget_keeps_the_replica_alive_but_out_of_rotation() -> None:
    async def go() -> None:
        # A slow restart (the fake engine takes a second to answer), well inside the budget.
        s = settings(engine_command=fake_engine_command(startup_delay=1.0), restart_budget_s=60.0)
        async with running(s) as r:
            status, body = await alive(r)
            assert (status, body["status"], body["down_s"], body["restarts"]) == (200, "ready", 0.0, 0)
            assert body["budget_s"] == pytest.approx(60.0 + r.agent.engine.restart_overhead_s, abs=0.1)
            first = r.agent.engine.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)  # the engine dies, as an OOM kill or a CUDA error would end it
            seen: list[tuple[int, str]] = []

            async def back() -> bool:
                status, body = await alive(r)
                seen.append((status, body["status"]))
                if body["status"] == "restarting":
                    assert await ping(r) == 503  # the load balancer takes it out of rotation meanwhile
                return r.agent.engine.ready and r.agent.engine.pid != first

            await until(back)
            assert (200, "restarting") in seen and all(status == 200 for status, _ in seen)
            status, body = await alive(r)
            assert (status, body["status"], body["down_s"], body["restarts"]) == (200, "ready", 0.0, 1)

    run(go)


def test_a_restart_that_fails_fails_the_route_once_the_budget_is_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep's fixed waits made short, so the budget plus the overhead is about a second.
    monkeypatch.setattr(engine, "_TRACKER_GRACE_S", 0.1)
    monkeypatch.setattr(engine, "_SIGKILL_WAIT_S", 0.1)
    started = tmp_path / "started"
    # The engine starts once; every restart exits at once (a GPU gone bad: a crash loop the agent cannot fix).
    script = f"if [ -e {started} ]; then exit 1; fi; touch {started}; exec {shlex.join(fake_engine_command())}"

    async def go() -> None:
        s = settings(
            engine_command=("bash", "-c", script),
            restart_budget_s=0.5,
            engine_kill_grace_s=0.2,
            gpu_release_timeout_s=0.0,
        )
        async with running(s) as r:
            budget = 0.5 + r.agent.engine.restart_overhead_s
            assert budget < 2
            pid = r.agent.engine.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await until(lambda: asyncio.sleep(0, r.agent.engine.restarts >= 1))
            status, body = await alive(r)
            assert (status, body["status"]) == (200, "restarting")
            await asyncio.sleep(budget + 0.2)
            status, body = await alive(r)
            assert (status, body["status"]) == (503, "failed") and body["down_s"] > budget
            assert r.agent.engine.restarts >= 2  # it kept trying: the route reports, the supervisor never gives up
            # Polled every few seconds by the watchdog: a deliberate answer, not counted as a server error.
            counted: list[str] = []
            monkeypatch.setattr(r.agent.collector, "record", lambda name, value: counted.append(name))
            assert (await alive(r))[0] == 503 and contract.SERVER_ERRORS.name not in counted
            # A replica that drains (its instance is being terminated) is the group's own doing: alive.
            r.agent.request_shutdown()
            assert (await alive(r))[0] == 200

    run(go)


def test_the_budget_is_read_from_the_container_environment() -> None:
    env = {contract.ENV_MODEL: "m", contract.ENV_RESTART_BUDGET_S: "420"}
    assert from_env(env).restart_budget_s == 420.0
    assert from_env({contract.ENV_MODEL: "m"}).restart_budget_s == 3600.0
