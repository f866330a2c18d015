"""What the serving agent costs: throughput and time to first token through the agent vs. straight to the engine.

One agent process (which starts the engine) serves both paths in the same run: the load generator
alternates rounds against the engine's own port and the agent's port, so drift hits both equally.
Targets: the agent keeps at least 97% of the throughput and adds at most 2 ms to the median TTFT.

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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvfleet import contract  # noqa: E402
from kvfleet.engines import EngineArgs  # noqa: E402
from tests.agent.harness import fake_engine_command, free_port  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("KVFLEET_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


async def one(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> tuple[float, int, float]:
    body = {"model": model, "prompt": "the cache holds", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with http.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        # Count events without parsing them: the load generator shares the CPUs with what it measures.
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tokens += chunk.count(b"data: {")
    end = time.perf_counter()
    return (first or end) - t0, tokens, end - t0


async def round_(url: str, model: str, *, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def bounded() -> tuple[float, int, float]:
            async with sem:
                return await one(http, url, model, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded() for _ in range(requests)))
        wall = time.perf_counter() - t0
    return {
        "tokens_per_s": sum(r[1] for r in results) / wall,
        "ttft": [r[0] for r in results],  # type: ignore[dict-item]
    }


def start_agent(engine: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int, int, str]:
    port, engine_port = free_port(), free_port()
    env = {
        **os.environ,
        contract.ENV_HOST: "127.0.0.1",
        contract.ENV_PORT: str(port),
        contract.ENV_ENGINE_PORT: str(engine_port),
        contract.ENV_DEPLOYMENT: "bench",
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


async def bench(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, engine_port, model = start_agent(args.engine, Path(tmp))
        try:
            agent_url, engine_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
            try:
                await wait_ready(agent_url, 300)
            except SystemExit:
                sys.stderr.write((Path(tmp) / "agent.log").read_text(errors="replace")[-3000:])
                raise
            kw = {"concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens}
            await round_(engine_url, model, **kw)  # warm-up (both paths share the engine)
            await round_(agent_url, model, **kw)
            direct: list[dict[str, Any]] = []
            proxied: list[dict[str, Any]] = []
            again: list[dict[str, Any]] = []  # direct once more: the noise floor of the comparison
            for _ in range(args.rounds):
                direct.append(await round_(engine_url, model, **kw))
                proxied.append(await round_(agent_url, model, **kw))
                again.append(await round_(engine_url, model, **kw))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    tput_direct = statistics.median(r["tokens_per_s"] for r in direct)
    tput_agent = statistics.median(r["tokens_per_s"] for r in proxied)
    ttft_direct = statistics.median(t for r in direct for t in r["ttft"]) * 1e3
    ttft_agent = statistics.median(t for r in proxied for t in r["ttft"]) * 1e3
    ttft_again = statistics.median(t for r in again for t in r["ttft"]) * 1e3
    tput_again = statistics.median(r["tokens_per_s"] for r in again)
    ratio = tput_agent / tput_direct
    added = ttft_agent - ttft_direct
    print(f"engine: {args.engine}; {args.rounds} rounds of {args.requests} streams x {args.max_tokens} tokens")
    print(f"throughput direct {tput_direct:,.0f} tok/s, through the agent {tput_agent:,.0f} tok/s: ratio {ratio:.3f}")
    print(f"median TTFT direct {ttft_direct:.2f} ms, through the agent {ttft_agent:.2f} ms: added {added:+.2f} ms")
    print(
        f"noise floor (direct vs direct again): throughput ratio {tput_again / tput_direct:.3f}, "
        f"median TTFT {ttft_again - ttft_direct:+.2f} ms"
    )
    ok = ratio >= 0.97 and added <= 2.0
    print("targets (ratio >= 0.97, added TTFT <= 2 ms):", "met" if ok else "NOT met")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm" if VLLM_PYTHON.exists() else "fake")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    sys.exit(asyncio.run(bench(p.parse_args())))


if __name__ == "__main__":
    main()
