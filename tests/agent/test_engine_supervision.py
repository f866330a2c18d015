"""What an engine leaves when it dies, and when the agent does: nothing.

The fake engine forks a grandchild that ignores SIGTERM, as vLLM's EngineCore outlives its API server. A
crash of the engine (SIGKILL of the agent's child) must not leave it running past the restart, a stop must
not leave it running past the agent, and on a GPU host the restart waits until the driver has let go of
the old engine's memory (a fake ``nvidia-smi`` on PATH stands in for the driver).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet import contract
from kvfleet.agent import __main__ as agent_main
from kvfleet.agent import engine
from kvfleet.agent.engine import EngineSupervisor, Proc
from kvfleet.agent.server import Agent
from tests.agent.harness import fake_engine_command, free_ports, run, settings

REPO = Path(__file__).resolve().parents[2]

if not sys.platform.startswith("linux"):
    pytest.skip("process groups, /proc and prctl: the image is Linux", allow_module_level=True)


def tree(pid: int) -> dict[int, Proc]:
    table = engine.processes()
    return {p: table[p] for p in engine.descendants(table, [pid]) if p in table}


def alive(p: Proc) -> bool:
    now = engine.read_proc(p.pid)
    return now is not None and now.start == p.start and now.alive


def survivors(procs: dict[int, Proc]) -> list[Proc]:
    return [p for p in procs.values() if alive(p)]


async def until(cond: Callable[[], object], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def engine_tree(sup: EngineSupervisor, size: int) -> dict[int, Proc]:
    """The running engine's process tree, once it has ``size`` processes (the engine and its grandchild)."""
    pid = sup.pid
    assert pid is not None
    await until(lambda: len(tree(pid)) >= size, what="the grandchild")
    return tree(pid)


def supervisor(*extra: str, **overrides: Any) -> EngineSupervisor:
    return EngineSupervisor(
        settings(engine_command=(*fake_engine_command(), *extra), engine_kill_grace_s=0.5, **overrides)
    )


@pytest.fixture(autouse=True)
def _no_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host with an nvidia-smi on PATH would otherwise answer for these CPU-only tests."""
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    (tmp_path / "bin").mkdir()


# ---- the process table ---------------------------------------------------------------------------


def test_the_process_table_reads_this_process() -> None:
    me = engine.read_proc(os.getpid())
    assert me is not None and me.alive
    assert (me.ppid, me.pgid) == (os.getppid(), os.getpgrp())
    assert engine.read_proc(2**22 + 1) is None  # above pid_max: no such process
    table = engine.processes()
    assert os.getpid() in engine.descendants(table, [os.getppid()])


def test_read_proc_takes_the_name_up_to_the_last_parenthesis(tmp_path: Path) -> None:
    # A process may name itself "a) (b"; the fields after the name must still line up.
    script = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'a) (b', 0, 0, 0); print(1, flush=True); time.sleep(30)"
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline()
            p = engine.read_proc(child.pid)
            assert p is not None and p.name == "a) (b" and p.ppid == os.getpid() and p.state in "RS"
        finally:
            child.kill()


# ---- a crash -------------------------------------------------------------------------------------


def test_a_crash_kills_what_the_engine_left_in_its_group_before_the_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvfleet.agent.engine")

    async def go() -> None:
        sup = supervisor("--grandchild")
        sup.start()
        try:
            assert await sup.wait_ready(30)
            first = sup.pid
            assert first is not None
            old = await engine_tree(sup, 2)
            [grandchild] = [p for p in old if p != first]
            assert old[grandchild].pgid == first  # in the engine's own group
            os.kill(first, signal.SIGKILL)  # the engine's API server alone, as an OOM kill would
            await until(lambda: sup.ready and sup.pid != first, what="the restart")
            assert survivors(old) == []
            assert sup.restarts == 1
            [line] = [r.getMessage() for r in caplog.records if "behind; killed" in r.getMessage()]
            # A grandchild that ignores SIGTERM gets SIGKILL after the grace.
            assert line.startswith(f"engine (pid {first}) left 1 process behind; killed: {grandchild} ")
            assert line.endswith("(SIGKILL)")
        finally:
            await sup.stop(timeout=5)

    run(go)


@pytest.mark.parametrize("slow_scan", [False, True], ids=["scan", "slow-scan"])
def test_a_descendant_that_left_the_group_is_killed_too(slow_scan: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if slow_scan:
        # On a loaded host the supervisor's read of the process table (off the event loop) can finish after
        # the engine is gone: the engine must not be called ready before its tree is recorded.
        scan = EngineSupervisor._scan

        async def slow() -> dict[int, Proc]:
            await asyncio.sleep(0.5)
            return await scan()

        monkeypatch.setattr(EngineSupervisor, "_scan", staticmethod(slow))

    async def go() -> None:
        sup = supervisor("--grandchild", "--grandchild-setsid")
        sup.start()
        try:
            assert await sup.wait_ready(30)
            first = sup.pid
            assert first is not None
            old = await engine_tree(sup, 2)
            [grandchild] = [p for p in old if p != first]
            assert old[grandchild].pgid != first  # out of the group: found by the tree recorded at ready
            os.kill(first, signal.SIGKILL)
            await until(lambda: sup.ready and sup.pid != first, what="the restart")
            assert survivors(old) == []
            assert [p.pid for p in sup.last_killed] == [grandchild]
        finally:
            await sup.stop(timeout=5)

    run(go)


def test_the_resource_tracker_goes_last_and_unlinks_the_shared_memory_the_engine_leaked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvfleet.agent.engine")
    segment = Path("/dev/shm") / f"kvfleet-test-{os.getpid()}-{time.monotonic_ns()}"

    async def go() -> None:
        sup = supervisor("--shared-memory", segment.name, "--grandchild")
        sup.start()
        try:
            assert await sup.wait_ready(30)
            first = sup.pid
            assert first is not None and segment.exists()
            old = await engine_tree(sup, 3)  # the engine, its resource tracker, the grandchild
            [tracker] = [p for p in old.values() if engine._is_resource_tracker(p.pid)]
            os.kill(first, signal.SIGKILL)
            # The new engine creates the segment anew (create=True fails where it exists): it is ready only
            # because the old one was unlinked.
            await until(lambda: sup.ready and sup.pid != first, what="the restart")
            assert survivors(old) == []
            [line, *_] = [r.getMessage() for r in caplog.records if "behind; killed" in r.getMessage()]
            # Both ignore SIGTERM. The grandchild gets SIGKILL; the tracker, its last client gone, unlinks the
            # segment the engine leaked and exits on its own.
            # (The tracker's name is its interpreter's: python or python3, as the venv spells it.)
            assert f"{tracker.pid} {tracker.name} (SIGTERM)" in line and "(SIGKILL)" in line, line
        finally:
            await sup.stop(timeout=5)
            segment.unlink(missing_ok=True)

    run(go)


def test_a_stop_leaves_no_engine_process_behind() -> None:
    async def go() -> None:
        sup = supervisor("--grandchild")
        sup.start()
        assert await sup.wait_ready(30)
        procs = await engine_tree(sup, 2)
        # SIGTERM reaches the whole group; the grandchild ignores it and is killed after the grace.
        code = await sup.stop(timeout=5)
        assert code == -signal.SIGTERM
        assert survivors(procs) == []
        assert len(sup.last_killed) == 1

    run(go)


def test_the_last_resort_kills_every_live_engine_group() -> None:
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    engine._LIVE_GROUPS.add(child.pid)
    engine.kill_all()
    assert child.wait(5) == -signal.SIGKILL
    assert set() == engine._LIVE_GROUPS


def test_an_exception_in_serve_still_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[int, Proc] = {}
    start = Agent.start

    async def failing_start(self: Agent, *, serve: bool = True) -> None:
        await start(self, serve=serve)
        assert await self.engine.wait_ready(30)
        seen.update(await engine_tree(self.engine, 2))
        raise RuntimeError("boom")

    monkeypatch.setattr(Agent, "start", failing_start)
    monkeypatch.setattr(engine, "become_subreaper", lambda: False)  # not the test runner's own behaviour
    with pytest.raises(RuntimeError, match="boom"):
        run(
            lambda: agent_main.serve(
                settings(engine_command=(*fake_engine_command(), "--grandchild"), engine_kill_grace_s=0.5)
            )
        )
    assert len(seen) == 2 and survivors(seen) == []


# ---- the accelerator's memory --------------------------------------------------------------------


def fake_nvidia_smi(bin_dir: Path) -> tuple[Path, Path, Path]:
    """An nvidia-smi that prints ``held`` (pid, MiB lines) while it has been called at most ``limit`` times."""
    calls, held, limit = bin_dir / "calls", bin_dir / "held", bin_dir / "limit"
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$*" = "--query-compute-apps=pid,used_memory --format=csv,noheader,nounits" ] || exit 9\n'
        f"echo call >> {calls}\n"
        f"[ -f {held} ] && [ -f {limit} ] || exit 0\n"
        f'[ "$(wc -l < {calls})" -le "$(cat {limit})" ] && cat {held}\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    return calls, held, limit


def n_calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_a_restart_waits_until_the_old_engines_gpu_memory_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvfleet.agent.engine")
    calls, held, limit = fake_nvidia_smi(tmp_path / "bin")

    async def go() -> None:
        sup = supervisor("--grandchild", gpu_release_timeout_s=30)
        sup.start()
        try:
            assert await sup.wait_ready(30)
            first = sup.pid
            assert first is not None
            old = await engine_tree(sup, 2)
            await until(lambda: n_calls(calls) >= 1, what="the snapshot at ready")
            # The old engine's processes stay listed for three more queries, then the driver lets go.
            held.write_text("".join(f"{pid}, {1000 + i}\n" for i, pid in enumerate(sorted(old))))
            limit.write_text(str(n_calls(calls) + 3))
            os.kill(first, signal.SIGKILL)
            await until(lambda: sup.ready and sup.pid != first, what="the restart")
            assert n_calls(calls) >= 5
        finally:
            await sup.stop(timeout=5)

    run(go)
    messages = [r.getMessage() for r in caplog.records]
    free = next(i for i, m in enumerate(messages) if m.startswith("the old engine's GPU memory is free after"))
    starts = [i for i, m in enumerate(messages) if m.startswith("starting engine")]
    assert len(starts) == 2 and starts[0] < free < starts[1]


def test_a_gpu_that_stays_held_delays_the_restart_only_until_the_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, held, limit = fake_nvidia_smi(tmp_path / "bin")

    async def go() -> None:
        sup = supervisor(gpu_release_timeout_s=1)
        sup.start()
        try:
            assert await sup.wait_ready(30)
            first = sup.pid
            assert first is not None
            held.write_text(f"{first}, 40000\n")
            limit.write_text("1000000")
            os.kill(first, signal.SIGKILL)
            await until(lambda: sup.ready and sup.pid != first, what="the restart")
        finally:
            await sup.stop(timeout=5)

    run(go)
    [line] = [r.getMessage() for r in caplog.records if "still held" in r.getMessage()]
    assert line.startswith("the old engine's GPU memory is still held after 1 s (pid ")
    assert line.endswith(": 40000 MiB); restarting anyway")


def test_no_nvidia_smi_no_wait(caplog: pytest.LogCaptureFixture) -> None:
    sup = supervisor()
    assert run(lambda: sup._await_gpu_release({os.getpid()})) < 1.0
    assert caplog.records == []


# ---- the agent's own process ---------------------------------------------------------------------


def _agent_env(*extra: str, ports: list[int]) -> dict[str, str]:
    port, engine_port = ports
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")},
        contract.ENV_MODEL: "fake",
        contract.ENV_HOST: "127.0.0.1",
        contract.ENV_PORT: str(port),
        contract.ENV_ENGINE_PORT: str(engine_port),
        contract.ENV_ENGINE_COMMAND: json.dumps([*fake_engine_command(), *extra]),
        contract.ENV_DRAIN_BUDGET_S: "2",
    }


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Path]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        err = tmp_path / f"agent-{len(started)}.log"
        with err.open("wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet.agent"],
                cwd=REPO,
                env=_agent_env(*extra, ports=free_ports(2)),
                stdout=subprocess.DEVNULL,
                stderr=f,
            )
        started.append(proc)
        return proc, err

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_log(log: Path, text: str, count: int = 1, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while (found := log.read_text(errors="replace")).count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} in the agent's log:\n{found[-3000:]}"
        time.sleep(0.05)
    return found


def _child(proc: subprocess.Popen[bytes]) -> int:
    [pid] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(pid)


def _wait_tree(pid: int, size: int) -> dict[int, Proc]:
    deadline = time.monotonic() + 30
    while len(procs := tree(pid)) < size:
        assert time.monotonic() < deadline, "the engine's grandchild did not appear"
        time.sleep(0.02)
    return procs


def test_the_agent_reaps_orphans_re_parented_to_it_and_leaves_nothing_when_it_exits(
    agent_process: Callable[..., tuple[subprocess.Popen[bytes], Path]],
) -> None:
    # Forked a second after the engine is up, in a session of its own: neither in the engine's group nor in
    # the tree recorded at ready. Only the agent being a child subreaper finds it once the engine is dead.
    # (It obeys SIGTERM: the agent's grace before SIGKILL is ten seconds, and the escalation is tested above.)
    proc, log = agent_process(
        "--grandchild", "--grandchild-setsid", "--grandchild-delay", "1", "--grandchild-obeys-term"
    )
    _wait_log(log, "engine ready (pid")
    first = _child(proc)
    old = _wait_tree(first, 2)
    [grandchild] = [p for p in old if p != first]
    os.kill(first, signal.SIGKILL)
    text = _wait_log(log, "engine ready (pid", count=2)
    assert survivors(old) == []
    assert f"engine (pid {first}) left 1 process behind; killed: {grandchild} " in text
    # Killed and reaped: no zombie is left parented to the agent either.
    second = _child(proc)
    assert second != first
    new = _wait_tree(second, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert survivors(new) == []


def test_an_agent_killed_with_sigkill_takes_its_engine_with_it(
    agent_process: Callable[..., tuple[subprocess.Popen[bytes], Path]],
) -> None:
    # Nothing of the agent runs after SIGKILL: the engine gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
    # and, as vLLM's API server does, takes its own grandchild down.
    proc, log = agent_process("--grandchild", "--term-takes-group")
    _wait_log(log, "engine ready (pid")
    procs = _wait_tree(_child(proc), 2)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while survivors(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert survivors(procs) == []


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of a process, but the io_uring submission threads the kernel runs for
    libuv (``iou-sqp-*``), which are the kernel's."""
    tasks = Path(f"/proc/{pid}/task")
    return {
        os.sched_getscheduler(int(t.name)) for t in tasks.iterdir() if not (t / "comm").read_text().startswith("iou-")
    }


def test_the_agent_defers_to_its_engine_and_the_engine_keeps_the_default_policy(
    agent_process: Callable[..., tuple[subprocess.Popen[bytes], Path]],
) -> None:
    # The agent's threads never preempt the engine's API server when a token wakes them; the engine (first start
    # and restart alike) runs with the policy the agent itself was started with.
    proc, log = agent_process()
    _wait_log(log, "engine ready (pid")
    assert _policies(proc.pid) == {os.SCHED_BATCH}
    first = _child(proc)
    started_with = os.sched_getscheduler(0)  # the agent's, before it deferred
    assert started_with != os.SCHED_BATCH and _policies(first) == {started_with}
    os.kill(first, signal.SIGKILL)
    _wait_log(log, "engine ready (pid", count=2)
    second = _child(proc)
    assert second != first and _policies(second) == {started_with}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def test_the_gpu_release_wait_is_read_from_its_contract_variable() -> None:
    from kvfleet.agent.settings import SettingsError, from_env

    base = {contract.ENV_MODEL: "m"}
    assert from_env(base).gpu_release_timeout_s == 120.0
    assert from_env({**base, contract.ENV_GPU_RELEASE_TIMEOUT_S: "0"}).gpu_release_timeout_s == 0.0
    with pytest.raises(SettingsError, match=f"^{contract.ENV_GPU_RELEASE_TIMEOUT_S}: "):
        from_env({**base, contract.ENV_GPU_RELEASE_TIMEOUT_S: "soon"})


def test_a_process_that_dies_between_the_reap_and_the_read_is_reaped_anyway(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep asks "still running?" by reaping (WNOHANG), then reading /proc. A process that exits between the two
    # reads as a zombie; unless it is reaped then, nothing looks at it again and it stays parented to the agent.
    child = subprocess.Popen(["sleep", "0.3"])
    seen = engine.read_proc(child.pid)
    assert seen is not None and seen.alive
    deadline = time.monotonic() + 10
    while (now := engine.read_proc(child.pid)) is not None and now.alive:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    calls: list[int] = []
    real = engine._reap

    def late_reap(pid: int) -> None:  # the first reap comes before the exit
        calls.append(pid)
        if len(calls) > 1:
            real(pid)

    monkeypatch.setattr(engine, "_reap", late_reap)
    assert not EngineSupervisor._is_running(seen)
    assert engine.read_proc(child.pid) is None  # reaped: no zombie left
    child.returncode = 0  # already collected above; keep Popen from waiting on it
