"""What the serving agent costs: throughput and time to first token through the agent vs. straight to the engine.

One agent process (which starts the engine) serves both paths in the same run: the load generator
alternates rounds against the engine's own port and the agent's port, so drift hits both equally.
Targets: the agent keeps at least 97% of the throughput and adds at most 2 ms to the median TTFT. Both are read
per round: each proxied round against the mean of the direct rounds either side of it, and the median over rounds.

Phases: a burst (16 concurrent streams) for throughput and TTFT under load, and one request at a time for the
hop alone. The agent's own CPU time per request and per streamed event is read from /proc (schedstat). With the
fake engine, bursts that send every other stream through the agent as well: on a 2-core host the burst TTFT of
separate rounds moves by a few ms from one run to the next (the noise floor line), more than the 2 ms it is held
to, and within one burst that noise is common to both halves. With vLLM that comparison is biased (see
``mixed_round``), so its TTFT target is read from the separate rounds, whose noise floor there is a few ms: read it
with that floor.

A bare TCP relay (``relay.py``) runs beside the agent against the same engine as a reference: one more process on
the token path, no HTTP work. Its throughput and CPU are the floor any proxy pays on this host. Its burst TTFT is
not a floor with vLLM: a relay spreads a burst's arrivals at the API server, which takes them one at a time, and
that alone can move the burst's median TTFT below direct.

The load generator is a raw keep-alive HTTP/1.1 client (``_Stream``) on uvloop: it shares the cores with what it
measures, and aiohttp's client cost more CPU per streamed event than the agent itself.

Core layout (vLLM): on a GPU host the forward pass runs on the GPU, and the agent, the engine's API server and
the clients share the host's cores. vLLM's CPU build instead runs the forward pass on OpenMP threads that
spin at their barriers, so any process scheduled onto one of their cores stalls the whole step, and the
benchmark would measure that stall, not the proxy. By default ("pinned") the forward pass gets the last
core (VLLM_CPU_OMP_THREADS_BIND) and everything else the others, as on a GPU host; "shared" lets them mix.

    python benchmarks/agent_overhead.py                 # a real vLLM (CPU build) with a tiny Llama
    python benchmarks/agent_overhead.py --engine fake   # the test suite's fake engine (proxy cost only)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvfleet import contract  # noqa: E402
from kvfleet.engines import EngineArgs  # noqa: E402
from tests.agent.harness import VLLM_PYTHON, VLLM_VERSION, fake_engine_command, free_port  # noqa: E402


class _Stream(asyncio.Protocol):
    """One keep-alive client connection that sends a streaming request and notes when its first body bytes and its
    last chunk arrive. Nothing is parsed beyond that: the load generator shares the CPUs with what it measures, and
    aiohttp's client (a response object, a reader and a task wake-up per chunk) cost more of the shared core per
    event than the agent does, so it slowed both paths and widened the comparison's noise."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.body_at = -1  # where the body starts in buf, once the head is in
        self.first = 0.0
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.body_at < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            if buf[9:12] != b"200" or b"chunked" not in buf[:end].lower():
                self._end(RuntimeError(f"unexpected response: {bytes(buf[:200])!r}"))
                return
            self.body_at = end + 4
        if not self.first and len(buf) > self.body_at:
            self.first = time.perf_counter()
        if buf.endswith(b"0\r\n\r\n") and (len(buf) - self.body_at == 5 or buf.endswith(b"\r\n0\r\n\r\n")):
            self._end(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError(f"connection closed mid-response: {exc}"))

    def _end(self, exc: BaseException | None) -> None:
        if self.done is not None and not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    async def stream(self, request: bytes) -> tuple[float, int, float]:
        """TTFT, events with a token, end to end."""
        assert self.transport is not None
        self.buf, self.body_at, self.first = bytearray(), -1, 0.0
        self.done = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        self.transport.write(request)
        await self.done
        end = time.perf_counter()
        return (self.first or end) - t0, self.buf.count(b"data: {", self.body_at), end - t0


def _request(url: str, model: str, max_tokens: int) -> bytes:
    body = {"model": model, "prompt": "the cache holds", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    data = json.dumps(body).encode()
    host = url.removeprefix("http://")
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def _connect(url: str) -> _Stream:
    host, port = url.removeprefix("http://").split(":")
    _, stream = await asyncio.get_running_loop().create_connection(_Stream, host, int(port))
    return stream


async def round_(url: str, model: str, *, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    """``requests`` streams over ``concurrency`` keep-alive connections, opened for the round (as a client pool
    would be), each sending its next request when its last one ended."""
    raw = _request(url, model, max_tokens)
    conns = [await _connect(url) for _ in range(min(concurrency, requests))]
    left = requests
    results: list[tuple[float, int, float]] = []

    async def worker(conn: _Stream) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            results.append(await conn.stream(raw))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            if c.transport is not None:
                c.transport.close()
    wall = time.perf_counter() - t0
    return {
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "tokens": sum(r[1] for r in results),
        "ttft": [r[0] for r in results],  # type: ignore[dict-item]
    }


async def mixed_round(urls: tuple[str, str], model: str, *, streams: int, max_tokens: int) -> tuple[float, float]:
    """One burst, every other stream through the agent: the difference of the halves' median TTFTs is what the hop
    adds, without the round-to-round noise. Only where the engine takes requests in parallel (the fake engine): vLLM's
    API server takes a burst one request at a time, so a half that arrives a millisecond later queues behind the
    whole other half, and the difference measures queue position instead."""
    conns = [await _connect(urls[i % 2]) for i in range(streams)]
    raws = [_request(u, model, max_tokens) for u in urls]
    try:
        results = await asyncio.gather(*(c.stream(raws[i % 2]) for i, c in enumerate(conns)))
    finally:
        for c in conns:
            if c.transport is not None:
                c.transport.close()
    direct = [r[0] for i, r in enumerate(results) if i % 2 == 0]
    proxied = [r[0] for i, r in enumerate(results) if i % 2 == 1]
    return statistics.median(direct) * 1e3, statistics.median(proxied) * 1e3


def host_cores(layout: str) -> tuple[set[int], int | None]:
    """The cores the agent, its clients and the engine's API server run on, and the one vLLM's forward pass gets."""
    cores = sorted(os.sched_getaffinity(0))
    if layout == "shared" or len(cores) < 2:
        return set(cores), None
    return set(cores[:-1]), cores[-1]


def start_agent(engine: str, workdir: Path, layout: str) -> tuple[subprocess.Popen[bytes], int, int, str]:
    port, engine_port = free_port(), free_port()
    # The agent and the engine inherit the load generator's cores (bench sets them); vLLM's OpenMP threads re-bind.
    _, compute = host_cores(layout)
    env = {
        **os.environ,
        contract.ENV_HOST: "127.0.0.1",
        contract.ENV_PORT: str(port),
        contract.ENV_ENGINE_PORT: str(engine_port),
        contract.ENV_DEPLOYMENT: "bench",
        contract.ENV_ENGINE_VERSION: VLLM_VERSION,  # the fake engine stands in for the same release
        contract.ENV_PUBLISH_INTERVAL_S: "10",
        contract.ENV_ADMISSION: "0",
    }
    if engine == "fake":
        env[contract.ENV_MODEL] = "fake"
        env[contract.ENV_ENGINE_COMMAND] = json.dumps(list(fake_engine_command(token_delay=0.01, capacity=64)))
        model = "fake"
    else:
        model_dir = workdir / "tiny"
        subprocess.run([str(VLLM_PYTHON), str(REPO / "tests/agent/make_tiny_llama.py"), str(model_dir)], check=True)
        env[contract.ENV_MODEL] = str(model_dir)
        env[contract.ENV_ENGINE_PYTHON] = str(VLLM_PYTHON)
        env[contract.ENV_ENGINE_ARGS] = EngineArgs(
            max_model_len=1024,
            max_num_seqs=64,
            enforce_eager=True,
            served_model_name="tiny",
            kv_cache_memory_bytes=64 * 1024 * 1024,
        ).to_json()
        model = "tiny"
        if compute is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(compute)
    log = (workdir / "agent.log").open("wb")
    # The console script the image runs; KVFLEET_BENCH_AGENT_CMD replaces it (another build of the agent, say).
    default = str(Path(sys.executable).parent / contract.AGENT_COMMAND)
    agent = os.environ.get("KVFLEET_BENCH_AGENT_CMD", "").split() or [default]
    proc = subprocess.Popen(
        agent,
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=log,
    )
    return proc, port, engine_port, model


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of one process (not its children: the engine is measured on both paths alike), all its threads, to
    the nanosecond (schedstat; /proc/PID/stat counts 10 ms ticks), and the part of it in the kernel (ticks)."""
    total = sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir())
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return total / 1e9, int(fields[12]) / os.sysconf("SC_CLK_TCK")


async def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/ping") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"agent not ready after {timeout:.0f} s")


async def phase(
    proc: subprocess.Popen[bytes],
    engine_url: str,
    agent_url: str,
    relay_url: str,
    model: str,
    *,
    relay: subprocess.Popen[bytes],
    rounds: int,
    **kw: int,
) -> dict[str, float]:
    """Rounds alternating direct, through the agent, through the bare relay, and direct again (the noise floor of
    the comparison)."""
    direct: list[dict[str, Any]] = []
    proxied: list[dict[str, Any]] = []
    relayed: list[dict[str, Any]] = []
    again: list[dict[str, Any]] = []
    cpu_s = sys_s = relay_s = 0.0  # the agent's own CPU time over the proxied rounds, the relay's over its own
    for _ in range(rounds):
        direct.append(await round_(engine_url, model, **kw))
        before = cpu_seconds(proc.pid)
        proxied.append(await round_(agent_url, model, **kw))
        after = cpu_seconds(proc.pid)
        cpu_s += after[0] - before[0]
        sys_s += after[1] - before[1]
        before = cpu_seconds(relay.pid)
        relayed.append(await round_(relay_url, model, **kw))
        relay_s += cpu_seconds(relay.pid)[0] - before[0]
        again.append(await round_(engine_url, model, **kw))

    def tput(rs: list[dict[str, Any]]) -> float:
        return float(statistics.median(r["tokens_per_s"] for r in rs))

    def ttft_ms(rs: list[dict[str, Any]]) -> float:
        return float(statistics.median(t for r in rs for t in r["ttft"])) * 1e3

    # Each proxied round against the direct rounds either side of it: load from elsewhere on the host that drifts
    # over a phase hits the pair alike (the medians of whole phases do not cancel it).
    def tput_paired(rs: list[dict[str, Any]]) -> float:
        return float(
            statistics.median(
                p["tokens_per_s"] / ((d["tokens_per_s"] + a["tokens_per_s"]) / 2)
                for d, p, a in zip(direct, rs, again, strict=True)
            )
        )

    # The same for the median TTFT: a round's median against the mean of the direct medians either side of it.
    def ttft_paired(rs: list[dict[str, Any]]) -> float:
        return float(
            statistics.median(
                (statistics.median(p["ttft"]) - (statistics.median(d["ttft"]) + statistics.median(a["ttft"])) / 2) * 1e3
                for d, p, a in zip(direct, rs, again, strict=True)
            )
        )

    return {
        "tput_paired": tput_paired(proxied),
        "ttft_paired": ttft_paired(proxied),
        "relay_tput_paired": tput_paired(relayed),
        "relay_ttft_paired": ttft_paired(relayed),
        "tput_direct": tput(direct),
        "tput_agent": tput(proxied),
        "tput_again": tput(again),
        "ttft_direct": ttft_ms(direct),
        "ttft_agent": ttft_ms(proxied),
        "ttft_again": ttft_ms(again),
        "cpu_per_request_ms": cpu_s / (rounds * kw["requests"]) * 1e3,
        "cpu_per_event_us": cpu_s / max(sum(r["tokens"] for r in proxied), 1) * 1e6,
        "kernel_share": min(sys_s / max(cpu_s, 1e-9), 1.0),
        "relay_cpu_per_request_ms": relay_s / (rounds * kw["requests"]) * 1e3,
    }


def report(name: str, r: dict[str, float]) -> tuple[float, float]:
    ratio = r["tput_paired"]
    added = r["ttft_paired"]
    print(f"{name}:")
    print(
        f"  throughput direct {r['tput_direct']:,.0f} tok/s, through the agent {r['tput_agent']:,.0f}: "
        f"{r['tput_agent'] / r['tput_direct']:.3f}; median of each round against the direct rounds either side "
        f"{ratio:.3f}"
    )
    print(
        f"  median TTFT direct {r['ttft_direct']:.2f} ms, through the agent {r['ttft_agent']:.2f}: "
        f"{r['ttft_agent'] - r['ttft_direct']:+.2f} ms; median of each round against the direct rounds either side "
        f"{added:+.2f} ms"
    )
    print(
        f"  bare relay (the extra hop alone, no HTTP work; benchmarks/relay.py), the same way: throughput "
        f"{r['relay_tput_paired']:.3f}, median TTFT {r['relay_ttft_paired']:+.2f} ms; the agent's own share "
        f"{added - r['relay_ttft_paired']:+.2f} ms"
    )
    print(
        f"  noise floor (direct vs direct again): throughput ratio {r['tput_again'] / r['tput_direct']:.3f}, "
        f"median TTFT {r['ttft_again'] - r['ttft_direct']:+.2f} ms"
    )
    print(
        f"  agent CPU {r['cpu_per_request_ms']:.2f} ms per request, {r['cpu_per_event_us']:.0f} us per streamed "
        f"event ({r['kernel_share']:.0%} in the kernel); the relay's {r['relay_cpu_per_request_ms']:.2f} ms per request"
    )
    return ratio, added


async def bench(args: argparse.Namespace) -> int:
    if args.engine == "fake":
        args.layout = "shared"  # no forward pass to keep apart
    host, compute = host_cores(args.layout)
    os.sched_setaffinity(0, host)  # the load generator runs where clients of a GPU host would
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, engine_port, model = start_agent(args.engine, Path(tmp), args.layout)
        relay_port = free_port()
        relay = subprocess.Popen([sys.executable, str(REPO / "benchmarks/relay.py"), str(relay_port), str(engine_port)])
        try:
            agent_url, engine_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
            relay_url = f"http://127.0.0.1:{relay_port}"
            await wait_ready(agent_url, 300)
            kw = {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens}
            for url in (engine_url, agent_url, relay_url):  # warm-up (all paths share the engine)
                await round_(url, model, **kw)
            burst = await phase(proc, engine_url, agent_url, relay_url, model, relay=relay, rounds=args.rounds, **kw)
            mixed = [
                await mixed_round((engine_url, agent_url), model, streams=args.concurrency, max_tokens=args.max_tokens)
                for _ in range(args.rounds * 4 if args.engine == "fake" else 0)
            ]
            alone = await phase(
                proc,
                engine_url,
                agent_url,
                relay_url,
                model,
                relay=relay,
                rounds=args.rounds,
                concurrency=1,
                requests=8,
                max_tokens=8,
            )
        except (Exception, SystemExit):
            # Why the engine or the agent went away is in the agent's log (the engine's lines are in it too).
            sys.stderr.write((Path(tmp) / "agent.log").read_text(errors="replace")[-3000:])
            raise
        finally:
            relay.terminate()
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
            relay.wait(10)
    cores = f"cores {sorted(host)} for agent, API server and clients" + (
        f", core {compute} for the forward pass" if compute is not None else ""
    )
    print(f"engine: {args.engine}; {os.cpu_count()} cores, layout {args.layout} ({cores})")
    ratio, added = report(
        f"burst: {args.rounds} rounds of {args.requests} streams x {args.max_tokens} tokens, "
        f"{args.concurrency} at a time",
        burst,
    )
    if mixed:
        paired = statistics.median(a - d for d, a in mixed)
        print(
            f"mixed: {len(mixed)} bursts of {args.concurrency} streams x {args.max_tokens} tokens, "
            "every other one through the agent:"
        )
        print(
            f"  median TTFT direct {statistics.median(d for d, _ in mixed):.2f} ms, through the agent "
            f"{statistics.median(a for _, a in mixed):.2f}: {paired:+.2f} ms (median of the bursts' differences)"
        )
    report(f"alone: {args.rounds} rounds of 8 streams x 8 tokens, one at a time", alone)
    # The TTFT target is read from the same bursts where they are valid (see mixed_round), else from the rounds.
    ttft, how = (paired, "same bursts") if mixed else (added, "separate rounds")
    ok = ratio >= 0.97 and ttft <= 2.0
    print(
        f"targets under the burst (paired throughput ratio >= 0.97, added median TTFT <= 2 ms): {ratio:.3f}, "
        f"{ttft:+.2f} ms ({how}):",
        "met" if ok else "NOT met",
    )
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm" if VLLM_PYTHON.exists() else "fake")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--layout", choices=("pinned", "shared"), default="pinned", help="see the module docstring")
    sys.exit(uvloop.run(bench(p.parse_args())))


if __name__ == "__main__":
    main()
