"""The engine as a supervised child process: start, wait until healthy, restart when it dies, stop cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Mapping
from enum import StrEnum

import aiohttp

from kvfleet.agent.settings import AgentSettings

log = logging.getLogger(__name__)


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
        self.state = EngineState.STOPPED
        self.restarts = 0
        self._extra_env = dict(extra_env or {})
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self._options_file: str | None = None

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

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
        self._task = asyncio.create_task(self._run(), name="engine-supervisor")

    async def _run(self) -> None:
        backoff = self.settings.restart_backoff_s
        attempt = 0
        while not self._stopping:
            started = time.monotonic()
            await self._spawn()
            code = await self._watch()
            self._ready.clear()
            if self._stopping:
                break
            self.state = EngineState.DEAD
            # A long healthy run resets the backoff; a crash loop backs off up to the last step.
            attempt = 0 if time.monotonic() - started > 300 else attempt
            delay = backoff[min(attempt, len(backoff) - 1)]
            attempt += 1
            self.restarts += 1
            log.error("engine exited with status %s; restarting in %.0f s (restart %d)", code, delay, self.restarts)
            await asyncio.sleep(delay)
        self.state = EngineState.STOPPED

    async def _spawn(self) -> None:
        cmd = command(self.settings, options_file=self._options_file)
        env = {**os.environ, **self._extra_env}
        self.state = EngineState.STARTING
        log.info("starting engine: %s", " ".join(cmd))
        # Own process group: vLLM forks engine-core workers, and a stop must reach all of them.
        self._proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)

    async def _watch(self) -> int:
        proc = self._proc
        assert proc is not None
        health = asyncio.create_task(self._await_healthy(proc))
        code = await proc.wait()
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        return code

    async def _await_healthy(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.settings.engine_ready_timeout_s
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while proc.returncode is None and time.monotonic() < deadline:
                try:
                    async with session.get(self.settings.engine_url + self.settings.health_path) as r:
                        if r.status == 200:
                            self.state = EngineState.READY
                            self._ready.set()
                            log.info("engine ready (pid %d)", proc.pid)
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.5)
            else:
                if proc.returncode is None:
                    log.error("engine not healthy after %.0f s; killing it", self.settings.engine_ready_timeout_s)
                    self._signal(signal.SIGKILL)
                return
            # Keep checking: an engine that hangs without exiting is as dead as one that exited.
            failures = 0
            while proc.returncode is None:
                await asyncio.sleep(5)
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
        """SIGTERM the engine, SIGKILL after ``timeout``; returns its exit status."""
        self._stopping = True
        self.state = EngineState.STOPPING
        self._ready.clear()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                log.warning("engine did not stop within %.0f s; killing it", timeout)
                self._signal(signal.SIGKILL)
                await proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.state = EngineState.STOPPED
        if self._options_file:
            with contextlib.suppress(OSError):
                os.unlink(self._options_file)
        return proc.returncode if proc is not None else None
