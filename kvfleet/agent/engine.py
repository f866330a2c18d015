"""The engine as a supervised child process: start, wait until healthy, restart when it dies, stop cleanly.

An engine is a tree, not a process: vLLM's API server (the agent's child) starts a multiprocessing resource
tracker and ``EngineCore``, which starts its workers, and those hold the accelerator's memory. Killed alone,
the API server leaves the rest running, re-parented away from the agent (measured on vLLM 0.32: EngineCore,
its worker and the tracker outlived the restart and the agent). So the child starts in a process group of
its own, the agent is a child subreaper (orphans of the engine become the agent's children, not PID 1's),
and after any exit of the child the agent kills what is left of the tree (the group, the descendants it
recorded while the engine ran, and orphans parented to it), reaps them, and on a GPU host waits until the
driver no longer lists the old processes before it starts the next engine.

When the agent itself is SIGKILLed nothing of it runs: the child then gets SIGTERM from the kernel
(``PR_SET_PDEATHSIG``) and takes its own tree down (vLLM's API server stops its EngineCore on SIGTERM); an
engine process that outlives its API server after that is beyond the agent's reach. In the image the agent
is PID 1 of the container's PID namespace, and its death makes the kernel kill every process in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import aiohttp

from kvfleet.agent.settings import AgentSettings

log = logging.getLogger(__name__)

# linux/prctl.h
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

GPU_POLL_S = 0.5  # between nvidia-smi queries while the old engine's memory is still held
_SMI_TIMEOUT_S = 15.0  # a wedged driver must not hang the restart
_HEALTH_TICK_S = 5.0
_TRACKER_GRACE_S = 5.0  # a resource tracker whose clients are gone: time to unlink what they leaked
_SIGKILL_WAIT_S = 5.0  # after SIGKILL, how long the sweep waits for the processes to be gone


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "prctl") else None


# Loaded here, in the parent: the pre-exec hook runs between fork and exec, where loading a library is unsafe.
_LIBC = _load_libc()


def _prctl(option: int, arg: int | ctypes._Pointer[ctypes.c_int]) -> bool:
    if _LIBC is None:
        return False
    # prctl takes unsigned longs: spelled out, so no argument goes through varargs as a 32-bit int.
    value = arg if isinstance(arg, ctypes._Pointer) else ctypes.c_ulong(arg)
    zero = ctypes.c_ulong(0)
    return int(_LIBC.prctl(ctypes.c_int(option), value, zero, zero, zero)) == 0


def become_subreaper() -> bool:
    """Orphaned descendants (an engine's EngineCore after its API server died) become this process's children."""
    ok = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if not ok:
        log.warning(
            "not a child subreaper (%s): orphaned engine processes are found by process group only",
            "not Linux" if _LIBC is None else os.strerror(ctypes.get_errno()),
        )
    return ok


def is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag)) and flag.value != 0


# The scheduling policy the agent had before ``defer_to_engine`` changed it (empty until then): the engine's.
_ENGINE_POLICY: list[int] = []


def defer_to_engine() -> bool:
    """Runs the agent under SCHED_BATCH, which never preempts a running task when it wakes.

    Every streamed token crosses the agent. Where it shares a core with the engine's API server (a busy host, or
    a small instance), each token the API server wrote woke the agent, which preempted the API server for that one
    event: a context switch in and out per token, on the engine's bottleneck. Deferred, the agent runs when the API
    server yields, and passes on everything that arrived in one wake-up; with an idle core there is no difference.
    Measured on 2 cores with vLLM's CPU build (``benchmarks/agent_overhead.py``): the agent's CPU per streamed event
    fell from 24 to 14 us and the throughput through it from 0.87 of direct to 1.0. Unprivileged (lowering a
    policy needs no capability); threads the agent starts later inherit it, the engine does not (``_die_with``)."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:  # not Linux
        return False
    try:
        policy = os.sched_getscheduler(0)
        if policy != batch:
            os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError as err:
        log.warning("running under the default scheduling policy (SCHED_BATCH refused: %s)", err)
        return False
    if policy != batch:
        _ENGINE_POLICY[:] = [policy]
    return True


def _die_with(parent: int) -> Callable[[], None]:
    """The child's pre-exec hook: SIGTERM when the agent's thread that started it dies (so, the agent), and the
    scheduling policy the agent had before it deferred to the engine."""
    policy = _ENGINE_POLICY[0] if _ENGINE_POLICY else None

    def hook() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if policy is not None:
            with contextlib.suppress(OSError):  # lowering back to the default is never refused on Linux >= 2.6.39
                os.sched_setscheduler(0, policy, os.sched_param(0))
        if os.getppid() != parent:  # the agent died between fork and prctl: nobody would signal this child
            os._exit(1)

    return hook


# ---- the process table ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    start: int  # clock ticks after boot: a reused pid has another
    name: str

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")  # a zombie holds no memory, only a table slot

    def __str__(self) -> str:
        return f"{self.pid} {self.name}"


def read_proc(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # The name is in parentheses and may itself hold spaces and parentheses: split at the last one.
    name = raw[raw.find("(") + 1 : raw.rfind(")")]
    f = raw[raw.rfind(")") + 2 :].split()
    try:
        return Proc(pid=pid, ppid=int(f[1]), pgid=int(f[2]), state=f[0], start=int(f[19]), name=name)
    except (IndexError, ValueError):
        return None


def processes() -> dict[int, Proc]:
    """Every process this one can see, from /proc (empty where there is none)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    table = {}
    for n in names:
        if n.isdigit() and (p := read_proc(int(n))) is not None:
            table[p.pid] = p
    return table


def descendants(table: Mapping[int, Proc], roots: Iterable[int]) -> set[int]:
    """``roots`` and everything below them in ``table``."""
    found = set(roots)
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _is_resource_tracker(pid: int) -> bool:
    """Python's multiprocessing resource tracker (vLLM's processes each start one)."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


# Engine process groups alive in this process, whichever supervisor runs them: an orphan sweep spares them,
# and the last-resort ``kill_all`` at exit reaches them.
_LIVE_GROUPS: set[int] = set()


def kill_all() -> None:
    """SIGKILL every engine group still alive: the agent's last act when it leaves by an unexpected way."""
    for pgid in sorted(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            continue
        log.error("killed engine process group %d on the way out", pgid)
    _LIVE_GROUPS.clear()


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"  # exited; a restart is pending
    STOPPING = "stopping"
    STOPPED = "stopped"


def command(s: AgentSettings, *, options_file: str | None = None) -> list[str]:
    """The engine's command line: the adapter's server command, or ``engine_command`` with {port} and {model}."""
    if s.engine_command is not None:
        return [c.replace("{port}", str(s.engine_port)).replace("{model}", s.model) for c in s.engine_command]
    return s.adapter.server_command(
        s.engine_args, model=s.model, port=s.engine_port, python=s.engine_python, options_file=options_file
    )


class EngineSupervisor:
    def __init__(self, settings: AgentSettings, *, extra_env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self._down_since: float | None = time.monotonic()  # when the engine last stopped serving; None: serving
        self._state = EngineState.STOPPED
        self.restarts = 0
        self._extra_env = dict(extra_env or {})
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self._options_file: str | None = None
        # The running engine's tree as last seen (pid -> start time): finds a descendant that left the group.
        self._tree: dict[int, int] = {}
        self._gpu_pids: set[int] = set()  # what nvidia-smi listed while the engine was ready
        self._spawning: asyncio.Task[asyncio.subprocess.Process] | None = None
        self._sweeping: asyncio.Task[set[int]] | None = None
        self._swept: int | None = None  # the pid whose leftovers ``_sweeping`` clears
        self.last_killed: list[Proc] = []  # what the last sweep found left behind (tests, logs)

    @property
    def state(self) -> EngineState:
        return self._state

    @state.setter
    def state(self, value: EngineState) -> None:
        # Every change of state goes through here, so the time the engine has been down is never missed.
        if value is EngineState.READY:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()
        self._state = value

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    def down_s(self) -> float:
        """Seconds since the engine last served (or since it was first started); 0 while it serves."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    @property
    def restart_overhead_s(self) -> float:
        """The most one restart spends before the new engine starts loading: the sweep of the old tree (SIGTERM grace,
        the resource trackers' grace, the SIGKILL wait), the wait for its GPU memory, the longest backoff step."""
        s = self.settings
        sweep = s.engine_kill_grace_s + _TRACKER_GRACE_S + _SIGKILL_WAIT_S
        return sweep + s.gpu_release_timeout_s + max(s.restart_backoff_s, default=0.0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def start(self) -> None:
        text = self.settings.adapter.options_file(self.settings.engine_args)
        if text is not None:
            fd, path = tempfile.mkstemp(prefix=f"{self.settings.engine}-options-", suffix=".yaml")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            self._options_file = path
        self._down_since = time.monotonic()  # the first start is held to the same budget as a restart
        self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def _run(self) -> None:
        backoff = self.settings.restart_backoff_s
        attempt = 0
        while not self._stopping:
            started = time.monotonic()
            proc = await self._spawn()
            code = await self._watch(proc)
            self._ready.clear()
            if self._stopping:
                break  # the stop clears what the engine left
            self.state = EngineState.DEAD
            # A long healthy run resets the backoff; a crash loop backs off up to the last step.
            attempt = 0 if time.monotonic() - started > 300 else attempt
            delay = backoff[min(attempt, len(backoff) - 1)]
            attempt += 1
            self.restarts += 1
            log.error("engine exited with status %s; restarting in %.0f s (restart %d)", code, delay, self.restarts)
            # Nothing of the old engine may run, or hold the accelerator's memory, when the new one starts.
            old = await self._clear(proc)
            waited = await self._await_gpu_release(old | self._gpu_pids)
            await asyncio.sleep(max(0.0, delay - waited))
        self.state = EngineState.STOPPED

    async def _spawn(self) -> asyncio.subprocess.Process:
        cmd = command(self.settings, options_file=self._options_file)
        env = {**os.environ, **self.settings.engine_environment, **self._extra_env}
        self.state = EngineState.STARTING
        self._tree = {}
        self._gpu_pids = set()
        log.info("starting engine: %s", " ".join(cmd))

        async def create() -> asyncio.subprocess.Process:
            # Own session and process group: a stop or a crash must reach every process the engine forks.
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, start_new_session=True, preexec_fn=_die_with(os.getpid())
            )
            _LIVE_GROUPS.add(proc.pid)
            return proc

        # Shielded: a stop cancelling the supervisor mid-spawn still gets the process, to stop it.
        self._spawning = asyncio.create_task(create(), name="engine-spawn")
        self._proc = await asyncio.shield(self._spawning)
        return self._proc

    async def _watch(self, proc: asyncio.subprocess.Process) -> int:
        health = asyncio.create_task(self._await_healthy(proc))
        try:
            return await proc.wait()
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health

    async def _clear(self, proc: asyncio.subprocess.Process) -> set[int]:
        """Sweep what the exited ``proc`` left, once; every pid its tree had. A stop arriving mid-sweep waits
        for it (shielded from the cancellation) instead of leaving half a tree or sweeping twice."""
        if self._sweeping is None or self._swept != proc.pid:
            self._swept = proc.pid
            self._sweeping = asyncio.create_task(self._sweep(proc.pid), name="engine-sweep")
        return await asyncio.shield(self._sweeping)

    @staticmethod
    async def _scan() -> dict[int, Proc]:
        """The process table, read off the event loop: /proc on a GPU host has hundreds of entries, and reading
        them takes milliseconds that every stream through the agent would otherwise wait for."""
        return await asyncio.to_thread(processes)

    def _record_tree(self, pid: int, table: Mapping[int, Proc]) -> None:
        for p in descendants(table, [pid]) | {p.pid for p in table.values() if p.pgid == pid}:
            if p in table:
                self._tree[p] = table[p].start

    def _leftovers(self, pgid: int) -> dict[int, Proc]:
        """What is left of the engine whose group is ``pgid``, found every way the agent can."""
        me = os.getpid()
        table = processes()
        spared = {me, os.getppid()} | {p.pid for p in table.values() if p.pgid in _LIVE_GROUPS - {pgid}}
        found = {p.pid for p in table.values() if p.pgid == pgid}
        found |= {pid for pid, start in self._tree.items() if pid in table and table[pid].start == start}
        if is_subreaper():
            # Orphans re-parented here. The agent's own short-lived children (nvidia-smi) stay in its group.
            mine = os.getpgrp()
            found |= {p.pid for p in table.values() if p.ppid == me and p.pgid != mine}
        return {pid: table[pid] for pid in descendants(table, found) - spared if pid in table}

    async def _sweep(self, pgid: int) -> set[int]:
        """SIGTERM what is left of the engine, SIGKILL it after the grace, reap it; one line names it all."""
        _LIVE_GROUPS.discard(pgid)
        left = self._leftovers(pgid)
        old = set(self._tree) | set(left) | {pgid}
        self.last_killed = [p for p in left.values() if p.alive]
        for p in left.values():
            if not p.alive:
                _reap(p.pid)  # zombies parented here: nothing to kill, only a slot to free
        alive = {p.pid: p for p in self.last_killed}
        if not alive:
            log.info("engine (pid %d) left no process behind", pgid)
            return old
        how: dict[int, str] = {}
        for pid, p in alive.items():
            how[pid] = signal.SIGTERM.name
            self._kill(p, signal.SIGTERM)
        alive = await self._wait_gone(alive, self.settings.engine_kill_grace_s)
        # SIGKILL, the resource trackers last: they ignore SIGTERM by design and, once every process they
        # serve is gone, unlink the shared memory those leaked (else /dev/shm fills up, crash after crash).
        trackers = {pid: p for pid, p in alive.items() if _is_resource_tracker(pid)}
        await self._sigkill({pid: p for pid, p in alive.items() if pid not in trackers}, how)
        if trackers:
            await self._sigkill(await self._wait_gone(trackers, _TRACKER_GRACE_S), how)
        # A process forked while the sweep ran (a worker EngineCore was still starting) goes the same way.
        late = {pid: p for pid, p in self._leftovers(pgid).items() if pid not in how and p.alive}
        await self._sigkill(late, how)
        self.last_killed += late.values()
        alive = {pid: p for pid, p in (alive | late).items() if self._is_running(p)}
        n = len(self.last_killed)
        what = f"engine (pid {pgid}) left {n} process{'es' if n > 1 else ''} behind; killed: " + ", ".join(
            f"{p} ({how[p.pid]})" for p in self.last_killed
        )
        if alive:
            log.error("%s; still there: %s", what, ", ".join(map(str, alive.values())))
        else:
            log.warning("%s", what)
        return old

    @staticmethod
    def _kill(p: Proc, sig: signal.Signals) -> None:
        now = read_proc(p.pid)
        if now is None or now.start != p.start:
            return  # gone, or the pid now names another process
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as err:
            log.error("cannot kill engine process %s: %s", p, err)

    async def _sigkill(self, procs: dict[int, Proc], how: dict[int, str]) -> None:
        for pid, p in procs.items():
            how[pid] = signal.SIGKILL.name
            self._kill(p, signal.SIGKILL)
        await self._wait_gone(procs, _SIGKILL_WAIT_S)

    @staticmethod
    def _is_running(p: Proc) -> bool:
        _reap(p.pid)  # an orphan parented here turns into a zombie until reaped
        now = read_proc(p.pid)
        if now is not None and now.start == p.start and not now.alive:
            # It exited between the reap and the read: reap it now, or nothing looks at it again and the zombie
            # stays parented here (a full run once found one beside the restarted engine).
            _reap(p.pid)
        return now is not None and now.start == p.start and now.alive

    @classmethod
    async def _wait_gone(cls, procs: dict[int, Proc], grace: float) -> dict[int, Proc]:
        """Those of ``procs`` still running after at most ``grace`` seconds."""
        deadline = time.monotonic() + grace
        while True:
            alive = {pid: p for pid, p in procs.items() if cls._is_running(p)}
            if not alive or time.monotonic() >= deadline:
                return alive
            await asyncio.sleep(0.05)

    def _reap_orphans(self, table: Mapping[int, Proc]) -> None:
        """Orphans that exited on their own while the engine runs stay zombies here until reaped."""
        me, mine = os.getpid(), os.getpgrp()
        for p in table.values():
            if p.ppid == me and not p.alive and p.pgid != mine and p.pgid not in _LIVE_GROUPS:
                _reap(p.pid)

    # ---- the accelerator's memory ------------------------------------------------------------------

    async def _gpu_holders(self) -> dict[int, int] | None:
        """pid -> MiB for every compute process nvidia-smi lists; None when there is no nvidia-smi or it fails."""
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            proc = await asyncio.create_subprocess_exec(
                smi,
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader,nounits",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as err:
            log.warning("nvidia-smi: %s", err)
            return None
        try:
            out, errout = await asyncio.wait_for(proc.communicate(), _SMI_TIMEOUT_S)
        except TimeoutError:
            log.warning("nvidia-smi did not answer within %.0f s", _SMI_TIMEOUT_S)
            return None
        finally:
            if proc.returncode is None:  # timed out, or the wait was cancelled by a stop
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.shield(proc.wait())
        if proc.returncode != 0:
            log.warning("nvidia-smi exited %s: %s", proc.returncode, errout.decode(errors="replace").strip()[:200])
            return None
        held: dict[int, int] = {}
        for line in out.decode(errors="replace").splitlines():
            pid, _, mib = (f.strip() for f in line.partition(","))
            if pid.isdigit():
                held[int(pid)] = int(mib) if mib.isdigit() else 0  # "[N/A]" where the driver cannot tell
        return held

    async def _await_gpu_release(self, old: set[int]) -> float:
        """Wait, within the bound, until the driver lists none of ``old``; the seconds waited.

        nvidia-smi in a container may name processes by the host's pids, so ``old`` also holds what it
        listed while the engine was ready (the engine's own processes, by whatever pids the driver uses)."""
        timeout = self.settings.gpu_release_timeout_s
        if timeout <= 0:
            return 0.0
        t0 = time.monotonic()
        while True:
            held = await self._gpu_holders()
            if held is None:
                return time.monotonic() - t0
            still = {pid: mib for pid, mib in held.items() if pid in old}
            waited = time.monotonic() - t0
            if not still:
                if waited > 0.1:
                    log.info("the old engine's GPU memory is free after %.1f s", waited)
                return waited
            if waited >= timeout:
                log.error(
                    "the old engine's GPU memory is still held after %.0f s (%s); restarting anyway",
                    timeout,
                    ", ".join(f"pid {pid}: {mib} MiB" for pid, mib in sorted(still.items())),
                )
                return waited
            await asyncio.sleep(GPU_POLL_S)

    # ---- health ------------------------------------------------------------------------------------

    async def _note_engine(self, pid: int) -> None:
        """Record the engine's tree and what nvidia-smi lists: a crash then knows what to kill and wait for."""
        self._record_tree(pid, await self._scan())
        self._gpu_pids |= set(await self._gpu_holders() or ())

    async def _await_healthy(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.settings.engine_ready_timeout_s
        timeout = aiohttp.ClientTimeout(total=2)
        noted = time.monotonic()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while proc.returncode is None and time.monotonic() < deadline:
                if time.monotonic() - noted >= _HEALTH_TICK_S:  # a model can load for many minutes
                    await self._note_engine(proc.pid)
                    noted = time.monotonic()
                try:
                    async with session.get(self.settings.engine_url + self.settings.health_path) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.5)
            else:
                if proc.returncode is None:
                    log.error("engine not healthy after %.0f s; killing it", self.settings.engine_ready_timeout_s)
                    self._signal(signal.SIGKILL)
                return
            # The engine has allocated what it holds by now. Recorded before it is called ready: a crash
            # in the instant after must still find a descendant that left the group (a fast start has
            # had no loading tick to record it).
            await self._note_engine(proc.pid)
            if proc.returncode is not None:
                return
            self.state = EngineState.READY
            self._ready.set()
            log.info("engine ready (pid %d)", proc.pid)
            # Keep checking: an engine that hangs without exiting is as dead as one that exited.
            failures = 0
            while proc.returncode is None:
                await asyncio.sleep(_HEALTH_TICK_S)
                table = await self._scan()
                self._record_tree(proc.pid, table)
                self._reap_orphans(table)
                try:
                    async with session.get(self.settings.engine_url + self.settings.health_path) as r:
                        failures = 0 if r.status == 200 else failures + 1
                except (aiohttp.ClientError, TimeoutError):
                    failures += 1
                if failures >= 6 and not self._stopping:
                    log.error("engine %s failed for 30 s; killing it", self.settings.health_path)
                    self.state = EngineState.DEAD
                    self._ready.clear()
                    self._signal(signal.SIGKILL)
                    return

    def _signal(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.send_signal(sig)

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the engine's group, SIGKILL after ``timeout``, then clear what it left; its exit status."""
        self._stopping = True
        self.state = EngineState.STOPPING
        self._ready.clear()
        if self._task is not None:
            # Stop supervising first, so no restart races the stop; a sweep in progress finishes (shielded).
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # its failure must not keep the engine from being stopped
                log.exception("the engine supervisor failed")
        if self._spawning is not None and not self._spawning.done():
            with contextlib.suppress(Exception):
                self._proc = await self._spawning
        proc = self._proc
        if proc is not None:
            if proc.returncode is None:
                self._signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                except TimeoutError:
                    log.warning("engine did not stop within %.0f s; killing it", timeout)
                    self._signal(signal.SIGKILL)
                    await proc.wait()
            await self._clear(proc)
        self.state = EngineState.STOPPED
        if self._options_file:
            with contextlib.suppress(OSError):
                os.unlink(self._options_file)
        return proc.returncode if proc is not None else None
