"""The agent in front of a REAL vLLM server (vLLM's CPU build, pinned, in its own virtualenv).

One agent process serves the whole module, in order: a saturated cache shows up in the signals; the
engine's API server is killed and the agent restarts it, leaving none of the old engine's processes
(EngineCore, its worker, the resource tracker) running; then SIGTERM during ten streaming generations
drains them all, the agent exits 0 and no engine process is left. A second agent, the module's last test,
is killed with SIGKILL and its engine goes with it. The model is a tiny Llama built locally (random
weights; ``ignore_eos`` makes every generation run to its limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet import contract
from kvfleet.engines import EngineArgs
from tests.agent.harness import (
    VLLM_PYTHON,
    VLLM_VERSION,
    free_ports,
    make_tiny_model,
    require_vllm,
    stream_completion,
    yield_forward_pass,
)

REPO = Path(__file__).resolve().parents[2]
AGENT = Path(sys.executable).parent / contract.AGENT_COMMAND
DRAIN_BUDGET_S = 120
STREAM_TOKENS = 380  # ten of these and their prompts fit the cache, so none is preempted
CACHE_BYTES = 4 * 1024 * 1024  # 4,096 tokens of the tiny model: 32 concurrent requests saturate it
_Look = tuple[float | None, float | None, float | None]  # the agent's cache use, requests waiting and running

require_vllm()


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    url: str
    stdout: Path
    stderr: Path
    port: int
    engine_port: int = 0

    def emf(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout.read_text(errors="replace").splitlines():
            if line.startswith('{"_aws"') or (line.startswith("{") and '"_aws"' in line):
                out.append(json.loads(line))
        return out

    def engine_pids(self) -> list[int]:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()] if children.exists() else []


def _stat(pid: int) -> tuple[int, int, str, int, str] | None:
    """(ppid, pgid, state, start time, name) from /proc/<pid>/stat, read here independently of the agent."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    f = raw[raw.rfind(")") + 2 :].split()
    return int(f[1]), int(f[2]), f[0], int(f[19]), raw[raw.find("(") + 1 : raw.rfind(")")]


def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """``root``, its descendants and its process group: pid -> (start time, name)."""
    table = {int(n): st for n in os.listdir("/proc") if n.isdigit() and (st := _stat(int(n))) is not None}
    found = {root} | {pid for pid, st in table.items() if st[1] == root}
    grew = True
    while grew:
        more = {pid for pid, st in table.items() if st[0] in found} - found
        found |= more
        grew = bool(more)
    return {pid: (table[pid][3], table[pid][4]) for pid in found if pid in table}


def running(tree: dict[int, tuple[int, str]]) -> list[str]:
    """The processes of ``tree`` still running (the same pid and start time, not a zombie)."""
    out = []
    for pid, (start, name) in tree.items():
        st = _stat(pid)
        if st is not None and st[3] == start and st[2] not in ("Z", "X"):
            out.append(f"{pid} {name}")
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_model(out)


def wait_ready(url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ping", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"agent not ready after {timeout:.0f} s")


@pytest.fixture(scope="module")
def agent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    with started_agent(tiny_model, tmp_path_factory.mktemp("agent")) as a:
        yield a


@contextlib.contextmanager
def started_agent(tiny_model: Path, logs: Path) -> Iterator[AgentProcess]:
    port, engine_port = free_ports(2)
    stdout = logs / "stdout.log"
    env = {
        **os.environ,
        contract.ENV_CONTRACT_VERSION: str(contract.CONTRACT_VERSION),
        contract.ENV_ENGINE: "vllm",
        contract.ENV_ENGINE_VERSION: VLLM_VERSION,
        contract.ENV_MODEL: str(tiny_model),
        contract.ENV_ENGINE_ARGS: EngineArgs(
            max_model_len=1024,
            max_num_seqs=32,
            enforce_eager=True,
            kv_cache_memory_bytes=CACHE_BYTES,
            served_model_name="tiny",
        ).to_json(),
        contract.ENV_ENGINE_PYTHON: str(VLLM_PYTHON),
        contract.ENV_HOST: "127.0.0.1",
        contract.ENV_PORT: str(port),
        contract.ENV_ENGINE_PORT: str(engine_port),
        contract.ENV_DEPLOYMENT: "it-tiny",
        contract.ENV_REPLICA: "it-1",
        contract.ENV_DRAIN_BUDGET_S: str(DRAIN_BUDGET_S),
        contract.ENV_PUBLISH_INTERVAL_S: "1",
        # The saturation test wants the engine's own queue to build, so admission stays out of the way.
        contract.ENV_ADMISSION: "0",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
    }
    # The console script the image's ENTRYPOINT runs, not a module path.
    with stdout.open("wb") as out, (logs / "stderr.log").open("wb") as err:
        proc = subprocess.Popen([str(AGENT)], cwd=REPO, env=env, stdout=out, stderr=err)
    a = AgentProcess(
        proc=proc,
        url=f"http://127.0.0.1:{port}",
        stdout=stdout,
        stderr=logs / "stderr.log",
        port=port,
        engine_port=engine_port,
    )
    try:
        wait_ready(a.url, 240)
        yield_forward_pass()
        yield a
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        sys.stderr.write((logs / "stderr.log").read_text(errors="replace")[-4000:])


async def agent_gauge(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """One gauge of the agent's /metrics (None where it is absent)."""
    async with http.get(url + "/metrics") as m:
        text = await m.text()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


async def in_flight(http: aiohttp.ClientSession, url: str) -> int:
    """The requests the agent is serving, by its own gauge."""
    return int(await agent_gauge(http, url, "kvfleet_agent_requests_in_flight") or 0)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 600))


def test_the_agent_started_under_the_contract_with_the_adapters_command(agent: AgentProcess) -> None:
    log = agent.stderr.read_text(errors="replace")
    assert f"contract {contract.CONTRACT_VERSION}; engine vllm {VLLM_VERSION}" in log
    # EngineArgs rendered by the vLLM adapter: snake_case settings became vLLM's flags.
    assert "--kv-cache-memory-bytes 4194304" in log and "--served-model-name tiny" in log and "--enforce-eager" in log


def test_an_idle_connection_to_the_real_engine_outlives_uvicorns_default(agent: AgentProcess) -> None:
    """vLLM's uvicorn closes an idle connection after 5 s unless VLLM_HTTP_TIMEOUT_KEEP_ALIVE says otherwise; the
    agent sets it and reuses pooled connections for almost that long, so the real server must honour it."""
    with socket.create_connection(("127.0.0.1", agent.engine_port), timeout=10) as sock:
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{agent.engine_port}\r\n\r\n".encode()
        for _ in range(2):
            sock.sendall(request)
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head[:80]
            time.sleep(6.5)  # past the 5 s default
        # Still open: a closed connection reads EOF (or resets) here.
        sock.sendall(request)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_bench_sweep_against_the_real_engine_through_the_agent(agent: AgentProcess) -> None:
    """`kvfleet bench`'s client in front of the real vLLM: token-id prompts arrive at their exact length (the
    engine's usage says so), ignore_eos makes every answer max_tokens long, and every token is timed."""
    from kvfleet.bench.client import Endpoint, run_concurrency, summarize

    model, levels, capacity = run(
        run_concurrency(
            Endpoint(url=agent.url), concurrencies=[1, 4], requests_per_level=4, prompt_tokens=48, output_tokens=64
        )
    )
    assert model == "tiny"
    # The cache the engine allocated, from its cache_config_info through the agent: the 4 MiB the test gave it over
    # the tiny model's 1 KiB per token (K and V x 2 layers x 2 KV heads x 64 dims x 2 bytes).
    assert capacity is not None and capacity.source == contract.PROM_ENGINE_KV_BLOCKS
    assert capacity.tokens == CACHE_BYTES // (2 * 2 * 2 * 64 * 2)
    for lv in levels:
        assert all(r.ok for r in lv.results), [r.error for r in lv.results]
        for r in lv.results:
            assert r.usage_prompt_tokens == 48 and r.output_tokens == 64
            # vLLM streams one chunk per decode step: 64 tokens, 63 gaps. Its RequestOutputCollector merges the deltas
            # a slow reader has not taken yet (v1/engine/output_processor.py): this tiny model makes a token in about a
            # millisecond on a fast host, faster than its API server streams them, and 12 tokens once came in 2 chunks.
            # So fewer gaps, never more, and at 64 tokens still several.
            assert 3 <= len(r.itl_s) <= 63, len(r.itl_s)
        row = summarize(lv)
        assert row["completed"] == 4 and row["ttft_s"] is not None and row["itl_s"] is not None
        # The lag is measured and reported. Not a speed target (those are benchmarks): on 2 cores shared with the
        # engine it reaches tens of milliseconds; a client stalled for half a second would be broken.
        assert 0 <= row["client_loop_lag_p99_s"] < 0.5


def test_bench_plan_check_and_limits_against_the_real_engine(agent: AgentProcess, capsys: Any) -> None:
    """The CLI's gates in front of the real engine: the KV check passes on the cache the engine was given and fails
    on twice it; --limits at max_model_len (900 + 100 tokens) runs every request at the planned concurrency."""
    from kvfleet.cli import main

    tokens = CACHE_BYTES // (2 * 2 * 2 * 64 * 2)
    base = ["bench", agent.url, "--concurrency", "2", "--requests", "2", "--input-tokens", "16", "--output-tokens", "4"]
    assert main([*base, "--expect-kv-tokens", str(tokens)]) == 0
    out = capsys.readouterr().out
    assert f"= {tokens:,} tokens per replica (kvfleet_engine_kv_cache_blocks)" in out
    assert main([*base, "--expect-kv-tokens", str(2 * tokens)]) == 1
    assert "50% fewer than the plan's" in capsys.readouterr().err
    limits = ["bench", agent.url, "--limits", "--max-input-tokens", "900", "--max-output-tokens", "100"]
    assert main([*limits, "--max-concurrency", "2", "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    at, above = report["levels"]
    assert at["completed"] == 4 and at["preemptions"] == 0
    # The agent's gauges sampled through the level (how high they got depends on this CPU's speed, not asserted).
    t = at["over_time"]
    assert t is not None and t["samples"], at
    for x in t["samples"]:
        assert 0 <= x["kv_cache_utilization"] <= 1 and x["requests_waiting"] >= 0 and x["requests_running"] >= 0
    assert set(above["failed"]) <= {"429"}  # past the plan: refused or served, never failed


def test_bench_replays_a_real_trace_against_the_real_engine(agent: AgentProcess, capsys: Any, tmp_path: Path) -> None:
    """`kvfleet bench --trace`: 20 s of the Azure 2023 conversation trace, lengths divided by 8 to fit the tiny
    model's 1,024 tokens, written as a Mooncake trace and replayed open-loop at its own arrival times through the
    agent: every request sent on time, served, and its gauges sampled."""
    from kvfleet.cli import main
    from kvfleet.workload.traces import read_trace

    t = read_trace(REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv", duration_s=20.0)
    trace = tmp_path / "slice.jsonl"
    with trace.open("w", encoding="utf-8") as f:
        for at, inp, out in zip(t.arrival_s, t.input_tokens, t.output_tokens, strict=True):
            row = {
                "timestamp": round(at * 1000),
                "input_length": min(max(inp // 8, 8), 400),
                "output_length": min(max(out // 8, 2), 60),
            }
            f.write(json.dumps(row) + "\n")
    assert main(["bench", agent.url, "--trace", str(trace), "--trace-format", "mooncake", "--json"]) == 0
    [level] = json.loads(capsys.readouterr().out)["levels"]
    assert level["requests"] == len(t) >= 10 and level["completed"] == len(t), level["first_errors"]
    # Open loop: sent at the trace's times, not when the engine was ready for them (a loose bound: 2 shared cores).
    assert level["late_send_max_s"] < 1.0
    assert level["ttft_s"] is not None and level["over_time"] is not None


GENERATION_LIMITS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens", "sampling_params"}


def test_every_engine_route_that_generates_tokens_is_in_the_agents_route_table(agent: AgentProcess) -> None:
    import urllib.request

    from kvfleet.agent import routes

    with urllib.request.urlopen(f"http://127.0.0.1:{agent.engine_port}/openapi.json", timeout=10) as r:
        doc = json.load(r)
    schemas = doc.get("components", {}).get("schemas", {})

    def properties(schema: dict[str, Any]) -> set[str]:
        if "$ref" in schema:
            return properties(schemas[schema["$ref"].rsplit("/", 1)[-1]])
        found = set(schema.get("properties", {}))
        for key in ("anyOf", "oneOf", "allOf"):
            for s in schema.get(key, []):
                found |= properties(s)
        return found

    generating = {}
    for path, ops in doc["paths"].items():
        post = ops.get("post")
        if not post:
            continue
        content = post.get("requestBody", {}).get("content", {})
        fields = set().union(*(properties(c.get("schema", {})) for c in content.values())) if content else set()
        if fields & GENERATION_LIMITS:
            generating[path] = fields
    assert {"/v1/completions", "/v1/chat/completions"} <= set(generating), sorted(generating)
    for path, fields in generating.items():
        found = routes.lookup(path)
        if found is not None and found[1].generates:
            assert "cache_salt" in fields, f"{path}: the agent salts it, the engine takes no cache_salt"
        else:
            assert path in routes.REFUSED, f"{path} generates tokens: add it to kvfleet.agent.routes"
    # Through the agent: not in the table is 404, even where the engine serves it.
    import urllib.error

    req = urllib.request.Request(agent.url + "/reset_prefix_cache", method="POST", data=b"")
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("the agent forwarded an administrative route")
    except urllib.error.HTTPError as err:
        assert err.code == 404


def test_hostile_bodies_are_400_in_front_of_the_real_engine(agent: AgentProcess) -> None:
    import urllib.error
    import urllib.request

    for raw in (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b"[" * 100_000):
        for path in ("/v1/completions", "/v1/chat/completions/", "/v1/responses", "/v1/messages"):
            req = urllib.request.Request(
                agent.url + path, data=raw, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                urllib.request.urlopen(req, timeout=30)
                raise AssertionError(f"{path}: hostile body accepted")
            except urllib.error.HTTPError as err:
                assert err.code == 400, (path, err.code)


def test_saturated_cache_and_queue_show_in_prometheus_and_emf(agent: AgentProcess) -> None:
    # 32 requests on a cache of 31 blocks (the CPU build's blocks are 128 tokens): 31 run and one waits from the first
    # step on, and preemptions keep some waiting as the 31 outgrow their first block.
    tokens = 800
    [engine] = agent.engine_pids()
    # The engine's EngineCore and worker, held while the cache is full: the API server keeps answering /metrics with
    # the last step's gauges. Polled from here while the burst ran, a CI run read no cache use at all: this VM can
    # keep the client (or the agent's scrape) off the CPU for seconds while the engine decodes.
    core = [pid for pid in process_tree(engine) if pid != engine]
    assert core, "the engine runs no EngineCore"

    def hold(sig: signal.Signals) -> None:
        for pid in core:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def full(look: _Look) -> bool:
        return (look[0] or 0) >= 0.9 and (look[1] or 0) >= 1

    async def burst(http: aiohttp.ClientSession) -> tuple[list[dict[str, Any]], list[_Look]]:
        one: dict[str, Any] = {"model": "tiny", "max_tokens": tokens, "ignore_eos": True}
        started = [asyncio.Event() for _ in range(32)]
        tasks = [asyncio.create_task(stream_completion(http, agent.url, first_chunk=e, **one)) for e in started]
        deadline = time.monotonic() + 120
        while sum(e.is_set() for e in started) < 31 and not all(t.done() for t in tasks):
            assert time.monotonic() < deadline, f"{sum(e.is_set() for e in started)} of 32 streams started"
            await asyncio.sleep(0.05)
        # Held, the engine's gauges stay as its last step left them; the agent publishes once a second, so 1.5 s
        # later it has scraped them. Where that step had none waiting (the 32nd not yet scheduled), run it a moment
        # and look again.
        looks: list[_Look] = []
        for _ in range(10):
            hold(signal.SIGSTOP)
            try:
                await asyncio.sleep(1.5)
                looks.append(
                    (
                        await agent_gauge(http, agent.url, "kvfleet_kv_cache_utilization"),
                        await agent_gauge(http, agent.url, "kvfleet_requests_waiting"),
                        await agent_gauge(http, agent.url, "kvfleet_requests_running"),
                    )
                )
            finally:
                hold(signal.SIGCONT)
            if full(looks[-1]) or not looks[-1][2]:
                break
            await asyncio.sleep(0.2)
        return await asyncio.gather(*tasks), looks

    async def go() -> list[tuple[list[dict[str, Any]], list[_Look]]]:
        bursts = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            # Another burst only where the engine had ended this one before the first look (none running then):
            # the process that holds it was kept off the CPU meanwhile. An engine held mid-burst whose gauges the
            # agent does not show full is a failure, not a retry.
            for _ in range(3):
                bursts.append(await burst(http))
                looks = bursts[-1][1]
                if full(looks[-1]) or looks[0][2]:
                    break
        return bursts

    bursts = run(go())
    for results, _ in bursts:
        assert all(r["status"] == 200 and r["done"] and r["finish"] == ["length"] for r in results)
    problems = sorted({r["ScrapeProblem"] for r in agent.emf() if "ScrapeProblem" in r})
    assert full(bursts[-1][1][-1]), ([looks for _, looks in bursts], problems)
    # The last tokens reach the EMF lines at the next publication or two.
    deadline = time.monotonic() + 15
    while True:
        recs = agent.emf()
        if sum(r.get("OutputTokens", 0) for r in recs) >= len(bursts) * 32 * tokens or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert max(r.get("KvCacheUtilization", 0) for r in recs) >= 0.9
    assert max(r.get("RequestsWaiting", 0) for r in recs) >= 1
    # Saturation is never below KV use. Here the cache binds (the CPU build's blocks are 128 tokens, so 31 sequences
    # of any length fill it before max_num_seqs 32 does); tests/agent/test_metrics.py has the case where the slots do.
    assert all(r["ReplicaSaturation"] >= r["KvCacheUtilization"] for r in recs if "KvCacheUtilization" in r)
    assert sum(r.get("OutputTokens", 0) for r in recs) >= len(bursts) * 32 * tokens
    assert all(r["Deployment"] == "it-tiny" for r in recs)


def test_engine_dies_agent_reports_unhealthy_and_restarts_it(agent: AgentProcess) -> None:
    import urllib.error
    import urllib.request

    [engine] = agent.engine_pids()
    old = process_tree(engine)
    assert any("EngineCor" in name for _, name in old.values()), old  # vLLM's engine runs in a child
    # SIGKILL to the API server alone (as the kernel's OOM killer would): its EngineCore and worker are
    # orphaned, and survived the restart and the agent before the agent swept the engine's tree.
    os.kill(engine, signal.SIGKILL)
    deadline = time.monotonic() + 10
    status = 200
    while time.monotonic() < deadline and status == 200:
        try:
            with urllib.request.urlopen(agent.url + "/ping", timeout=2) as r:
                status = r.status
        except urllib.error.HTTPError as err:
            status = err.code
        time.sleep(0.1)
    assert status == 503
    assert agent.proc.poll() is None  # the agent itself keeps running
    wait_ready(agent.url, 240)
    assert running(old) == []
    # Killed and reaped: the agent's only child is the new engine, no orphan or zombie beside it.
    [restarted] = agent.engine_pids()
    assert restarted != engine
    left = agent.stderr.read_text(errors="replace")
    assert f"engine (pid {engine}) left " in left and "EngineCor" in left
    with urllib.request.urlopen(agent.url + "/metrics", timeout=5) as r:
        assert 'kvfleet_engine_restarts_total{deployment="it-tiny"} 1' in r.read().decode()


def test_sigterm_drains_ten_streams_then_exits_zero(agent: AgentProcess) -> None:
    # The engine may have been restarted by an earlier test: its new forward pass yields too, or the agent's drain
    # could wait behind it until every stream had ended.
    yield_forward_pass()
    # The engine's processes, to find none of them left once the agent has exited.
    [engine] = agent.engine_pids()
    tree = process_tree(engine)

    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            # Hold the engine (SIGSTOP to its process group) from before the streams are sent until readiness reads
            # 503: the ten generations then still run when it does, whatever this machine does meanwhile. A hold
            # from the first tokens lost that race in CI (all ten ended, 1.2 s of decoding here, before its first
            # probe): this VM can keep the client off the CPU for seconds while the engine decodes. The agent keeps
            # running; the engine takes the requests on resume.
            os.killpg(engine, signal.SIGSTOP)
            try:
                tasks = [
                    asyncio.create_task(
                        stream_completion(
                            http,
                            agent.url,
                            model="tiny",
                            max_tokens=STREAM_TOKENS,
                            ignore_eos=True,
                            stream_options={"include_usage": True},
                        )
                    )
                    for _ in range(10)
                ]
                deadline = time.monotonic() + 60
                while (held := await in_flight(http, agent.url)) < 10:
                    assert time.monotonic() < deadline, f"{held} of 10 requests reached the agent"
                    await asyncio.sleep(0.05)
                assert not any(t.done() for t in tasks), "generations finished before the drain began"
                t0 = time.monotonic()
                agent.proc.send_signal(signal.SIGTERM)
                # (seconds after the SIGTERM, status, generations still running) per readiness probe, until a 503:
                # the drain must take the pod out of rotation as it starts, not once the streams have ended.
                pings: list[tuple[float, int, int]] = []
                while (not pings or pings[-1][1] != 503) and time.monotonic() - t0 < 60:
                    async with http.get(agent.url + "/ping") as p:
                        pings.append((round(time.monotonic() - t0, 3), p.status, sum(not t.done() for t in tasks)))
                    await asyncio.sleep(0.05)
                new = await stream_completion(http, agent.url, model="tiny", max_tokens=5)
            finally:
                os.killpg(engine, signal.SIGCONT)
            results = await asyncio.gather(*tasks)
            code = await asyncio.to_thread(agent.proc.wait, DRAIN_BUDGET_S + 60)
            return {
                "pings": pings,
                "new": new,
                "results": results,
                "code": code,
                "t": time.monotonic() - t0,
                "left": running(tree),
            }

    out = run(go())
    assert out["pings"] and out["pings"][-1][1:] == (503, 10), out["pings"]
    assert out["new"]["status"] == 503 and out["new"]["headers"].get("Retry-After")
    for r in out["results"]:
        assert r["status"] == 200 and r["done"] and r["finish"] == ["length"] and not r["errors"]
        # The whole generation, not a cut stream. Counted from the engine's usage record: under load vLLM puts
        # several tokens in one event, so events undercount tokens.
        [usage] = [e["usage"] for e in r["events"] if isinstance(e, dict) and e.get("usage")]
        assert usage["completion_tokens"] == STREAM_TOKENS
    assert out["code"] == 0
    assert out["t"] < DRAIN_BUDGET_S
    # The agent has exited, and nothing of its engine runs: not the API server, EngineCore or its worker.
    assert len(tree) >= 3 and out["left"] == [], tree
    # The agent's own count at the drain's start: all ten were in flight, and all ten completed.
    log = agent.stderr.read_text(errors="replace")
    assert "draining: 10 request(s) in flight" in log and "drained: every in-flight request completed" in log


def test_an_agent_killed_with_sigkill_takes_its_engine_with_it(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Nothing of the agent runs after SIGKILL: the kernel sends the engine's API server SIGTERM
    (PR_SET_PDEATHSIG), and vLLM's API server stops its EngineCore and worker on SIGTERM."""
    with started_agent(tiny_model, tmp_path_factory.mktemp("agent-sigkill")) as a:
        [engine] = a.engine_pids()
        tree = process_tree(engine)
        assert any("EngineCor" in name for _, name in tree.values()), tree
        a.proc.kill()
        a.proc.wait()
        try:
            deadline = time.monotonic() + 60
            while running(tree) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert running(tree) == [], tree
        finally:
            for pid, (start, _) in tree.items():  # a failure here must not leave a vLLM on the machine
                st = _stat(pid)
                if st is not None and st[3] == start:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
