"""Streaming requests against an OpenAI-compatible endpoint (the agent, vLLM, trtllm-serve, a load balancer).

Why our own client rather than `vllm bench serve`, GuideLLM or inference-perf: each of those pulls in its engine's
or its own dependency tree (torch and transformers for the tokenizer, or a Kubernetes-oriented runner), none knows
the plan it should be checked against, and none speaks SageMaker's runtime API. What they agree on is kept: the
prompt is sent as token ids (exact input length with no tokenizer), generation runs to ``max_tokens`` with
``ignore_eos`` (exact output length), TTFT is send to first streamed token, ITL is the gap between streamed chunks,
TPOT is (end - first token) / (tokens - 1), and the usage block the server returns counts the tokens.

Timing is taken on the client's monotonic clock as each network chunk is read, before any JSON is parsed; a ticker
measures the event loop's own lag during the run, so a report can say when the client, not the server, was slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import aiohttp

from kvfleet import contract
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.bench.sagemaker import SageMakerTarget

# Token ids to build prompts from: inside every vocabulary (Llama, Qwen, Mistral have 32k-152k; the tests' tiny
# model 1,024) and past what some keep at the start (SentencePiece's control and 256 byte-fallback tokens, 0-258).
PROMPT_TOKEN_IDS = range(300, 1000)
TICK_S = 0.01  # the loop-lag ticker's period
CONNECT_TIMEOUT_S = 10.0


class BenchError(KvfleetError):
    """The endpoint cannot be benchmarked: unreachable, refusing the credentials, or not an OpenAI endpoint."""


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    url: str  # base URL: http(s)://host[:port]
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def request_headers(self) -> dict[str, str]:
        h = dict(self.headers)
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(kw_only=True)
class Result:
    """One request as the client saw it. Times are seconds on the client's monotonic clock."""

    prompt_tokens: int
    max_tokens: int
    sent_s: float
    status: int | None = None  # None: no HTTP response (connection refused, reset, timed out)
    error: str | None = None
    first_token_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    done_s: float | None = None
    output_tokens: int = 0  # from the usage block, else the chunks counted
    usage_prompt_tokens: int | None = None
    ended: bool = False  # the stream's closing "data: [DONE]" arrived

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        c = self.chunk_s
        return [b - a for a, b in itertools.pairwise(c)]

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.done_s is None or self.output_tokens < 2:
            return None
        return (self.done_s - self.first_token_s) / (self.output_tokens - 1)


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.choice(PROMPT_TOKEN_IDS) for _ in range(n)]


async def discover_model(http: aiohttp.ClientSession, ep: Endpoint) -> str:
    """The endpoint's model id (its /v1/models), checking on the way that it answers and accepts the credentials."""
    url = ep.url.rstrip("/") + "/v1/models"
    try:
        async with http.get(url, headers=ep.request_headers()) as r:
            text = await r.text()
            if r.status in (401, 403):
                raise BenchError(f"{url} refused the credentials ({r.status}); pass --api-key or --header", field="url")
            if r.status != 200:
                raise BenchError(f"{url} answered {r.status}: {text[:120]!r}; is this an OpenAI endpoint?", field="url")
            data = json.loads(text)
    except aiohttp.ClientError as err:
        raise BenchError(f"cannot reach {url}: {err}", field="url") from None
    except TimeoutError:
        raise BenchError(f"cannot reach {url}: no answer in {CONNECT_TIMEOUT_S:g} s", field="url") from None
    except (ValueError, UnicodeDecodeError):
        raise BenchError(f"{url} did not answer JSON; is this an OpenAI endpoint?", field="url") from None
    if ep.model is not None:
        return ep.model
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)] if isinstance(data, dict) else []
    if not models or not isinstance(models[0], str):
        raise BenchError(f"{url} lists no model; pass --model", field="model")
    return models[0]


def completion_body(model: str | None, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streaming completion of exactly ``max_tokens`` tokens for a token-id prompt (vLLM's and TensorRT-LLM's
    OpenAI servers take token ids as the prompt and ignore_eos/min_tokens as sampling extensions)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if model is not None:
        body["model"] = model
    return body


def feed_sse(res: Result, buf: bytes, now: float) -> tuple[bytes, int]:
    """Parse every complete server-sent event in ``buf`` into ``res``; returns what is left and the text chunks."""
    chunks = 0
    while b"\n\n" in buf:
        block, buf = buf.split(b"\n\n", 1)
        chunks += _event(res, block, now)
    return buf, chunks


def finish_stream(res: Result, buf: bytes, chunks: int) -> None:
    """The stream has ended: parse what is left of it, count the tokens (the usage block's, else the chunks), and
    say what was wrong with an answer that had no token or no closing [DONE]."""
    if buf.strip():
        _, n = feed_sse(res, buf + b"\n\n", time.perf_counter())
        chunks += n
    res.done_s = time.perf_counter()
    if not res.output_tokens:
        res.output_tokens = chunks
    if res.first_token_s is None and res.error is None:
        res.error = "the stream ended without a token"
    elif not res.ended and res.error is None:
        res.error = "the stream ended before its [DONE]: the answer is cut short"


async def one_request(
    http: aiohttp.ClientSession, ep: Endpoint, model: str, prompt: list[int], *, max_tokens: int, timeout_s: float
) -> Result:
    body = completion_body(model, prompt, max_tokens)
    res = Result(prompt_tokens=len(prompt), max_tokens=max_tokens, sent_s=time.perf_counter())
    url = ep.url.rstrip("/") + "/v1/completions"
    try:
        async with http.post(
            url, json=body, headers=ep.request_headers(), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            res.status = r.status
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                res.done_s = time.perf_counter()
                return res
            buf = b""
            chunks = 0
            async for data in r.content.iter_any():
                buf, n = feed_sse(res, buf + data, time.perf_counter())
                chunks += n
            finish_stream(res, buf, chunks)
    except TimeoutError:
        res.error = f"no complete answer in {timeout_s:g} s"
        res.done_s = time.perf_counter()
    except aiohttp.ClientError as err:
        res.error = f"{type(err).__name__}: {err}"
        res.done_s = time.perf_counter()
    return res


def _event(res: Result, block: bytes, now: float) -> int:
    """One server-sent event; returns 1 when it carried text."""
    for line in block.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            res.ended = True
            return 0
        try:
            ev = json.loads(data)
        except ValueError:
            res.error = f"a malformed stream event: {data[:80]!r}"
            return 0
        if not isinstance(ev, dict):
            res.error = f"a malformed stream event: {data[:80]!r}"
            return 0
        if "error" in ev:
            res.error = f"the stream ended with an error: {str(ev['error'])[:160]}"
            return 0
        usage = ev.get("usage")
        if isinstance(usage, dict):
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.usage_prompt_tokens = usage.get("prompt_tokens")
        choices = ev.get("choices") or []
        # A chunk per engine step; its text may be "" (the detokenizer holds back an incomplete UTF-8 sequence), and
        # it is still a token's arrival, as vLLM's own benchmark client counts it.
        if choices and isinstance(choices[0], dict) and isinstance(choices[0].get("text"), str):
            if res.first_token_s is None:
                res.first_token_s = now
            res.chunk_s.append(now)
            return 1
    return 0


@dataclass(frozen=True, kw_only=True)
class KvCapacity:
    blocks: int
    block_tokens: int
    source: str  # which metric said so

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens


def kv_drift(capacity: KvCapacity | None, expected: int | None, tolerance: float) -> str | None:
    """Why the endpoint's KV cache fails the plan check, or None when it passes (or nothing was expected)."""
    if expected is None:
        return None
    if capacity is None:
        return (
            f"the endpoint reports no KV-cache size on {contract.METRICS_ROUTE} (a load balancer that hides it, or "
            "an agent older than this check); run the check against a replica's agent"
        )
    if capacity.tokens < expected * (1 - tolerance):
        short = 1 - capacity.tokens / expected
        return (
            f"the engine allocated {capacity.tokens:,} KV tokens per replica, {short:.0%} fewer than the plan's "
            f"{expected:,} (tolerance {tolerance:.0%}); the engine release or the memory left to it changed: "
            "re-plan, or calibrate the plan with this measurement"
        )
    return None


_GAUGE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(?P<k>[A-Za-z_][A-Za-z0-9_]*)="(?P<v>(?:[^"\\]|\\.)*)"')


def parse_capacity(text: str) -> KvCapacity | None:
    """The KV cache an endpoint reports on its /metrics: the agent's re-export (contract.PROM_ENGINE_KV_*), or the
    engine's own info metric (its adapter's ``capacity_metric``) where the URL is the engine itself."""
    agent: dict[str, float] = {}
    engine: list[tuple[int, int]] = []
    source = ""
    info = {spec[0]: spec for a in ENGINES.values() if (spec := a.capacity_metric) is not None}
    for line in text.splitlines():
        m = _GAUGE.match(line)
        if m is None:
            continue
        name = m["name"]
        if name in (contract.PROM_ENGINE_KV_BLOCKS, contract.PROM_ENGINE_KV_BLOCK_TOKENS):
            try:
                agent[name] = float(m["value"])
            except ValueError:
                continue
        elif name in info:
            _, blocks_label, size_label = info[name]
            labels = {x["k"]: x["v"] for x in _LABEL.finditer(m["labels"] or "")}
            try:
                engine.append((int(labels[blocks_label]), int(labels[size_label])))
            except (KeyError, ValueError):
                continue
            source = name
    if contract.PROM_ENGINE_KV_BLOCKS in agent and contract.PROM_ENGINE_KV_BLOCK_TOKENS in agent:
        return KvCapacity(
            blocks=int(agent[contract.PROM_ENGINE_KV_BLOCKS]),
            block_tokens=int(agent[contract.PROM_ENGINE_KV_BLOCK_TOKENS]),
            source=contract.PROM_ENGINE_KV_BLOCKS,
        )
    if engine:
        blocks, size = min(engine, key=lambda c: c[0] * c[1])
        return KvCapacity(blocks=blocks, block_tokens=size, source=source)
    return None


# The preemption counter: the agent's, else an engine's own under any name its adapter knows (where the URL is the
# engine itself); Prometheus exposes a counter with the _total suffix.
_PREEMPTION_COUNTERS = (
    contract.PREEMPTIONS.prometheus_name,
    *dict.fromkeys(
        n if n.endswith("_total") else f"{n}_total"
        for a in ENGINES.values()
        for _, names in a.metric_rows
        for n in names.get(contract.PREEMPTIONS.name, ())
    ),
)


# The gauges charted over a run: the agent's names first, then each engine's own (where the URL is the engine).
_OVER_TIME = (contract.KV_CACHE_UTILIZATION, contract.REQUESTS_WAITING, contract.REQUESTS_RUNNING)
_GAUGE_NAMES: dict[str, str] = {
    name: sig.name
    for sig in _OVER_TIME
    for name in (
        sig.prometheus_name,
        *(n for a in ENGINES.values() for _, names in a.metric_rows for n in names.get(sig.name, ())),
    )
}
SAMPLE_S = 1.0  # how often a run reads the endpoint's /metrics for the charts over time


@dataclass(frozen=True, kw_only=True)
class Sample:
    """The endpoint's own gauges at one moment of a run (None: not reported)."""

    t_s: float  # since the run started
    level: str
    kv_cache_utilization: float | None
    requests_waiting: float | None
    requests_running: float | None


def parse_gauges(text: str) -> dict[str, float]:
    """KV-cache use, waiting and running requests from a /metrics page, by contract signal name: the agent's
    re-export where it is there, else the engine's own gauge (vLLM reports KV use as a fraction, 0-1). Several
    series of one gauge (labels) are averaged for KV use and summed for the counts."""
    agent_names = {sig.prometheus_name for sig in _OVER_TIME}
    seen: dict[str, dict[str, list[float]]] = {}  # signal -> metric name -> values
    for line in text.splitlines():
        m = _GAUGE.match(line)
        if m is None or m["name"] not in _GAUGE_NAMES:
            continue
        try:
            v = float(m["value"])
        except ValueError:
            continue
        if math.isfinite(v):
            seen.setdefault(_GAUGE_NAMES[m["name"]], {}).setdefault(m["name"], []).append(v)
    out: dict[str, float] = {}
    for signal, by_name in seen.items():
        name = next((n for n in by_name if n in agent_names), next(iter(by_name)))
        values = by_name[name]
        out[signal] = sum(values) / len(values) if signal == contract.KV_CACHE_UTILIZATION.name else sum(values)
    return out


def parse_preemptions(text: str) -> float | None:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _GAUGE.match(line)
        if m is not None and m["name"] in _PREEMPTION_COUNTERS:
            try:
                totals[m["name"]] = totals.get(m["name"], 0.0) + float(m["value"])
            except ValueError:
                continue
    return next((totals[n] for n in _PREEMPTION_COUNTERS if n in totals), None)


async def _metrics_text(http: aiohttp.ClientSession, ep: Endpoint) -> str | None:
    url = ep.url.rstrip("/") + contract.METRICS_ROUTE
    try:
        async with http.get(url, headers=ep.request_headers()) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def read_preemptions(http: aiohttp.ClientSession, ep: Endpoint) -> float | None:
    text = await _metrics_text(http, ep)
    return None if text is None else parse_preemptions(text)


async def read_capacity(http: aiohttp.ClientSession, ep: Endpoint) -> KvCapacity | None:
    """The endpoint's KV cache from its /metrics; None where it has none (a load balancer that hides /metrics, an
    engine or agent that does not report it)."""
    text = await _metrics_text(http, ep)
    return None if text is None else parse_capacity(text)


@dataclass(frozen=True, kw_only=True)
class LevelSpec:
    """One level of a run: a closed loop (``concurrency`` requests always in flight) or an open one (each request
    sent at its ``arrivals_s`` offset, whatever is still in flight: the way traffic really arrives)."""

    label: str
    lengths: tuple[tuple[int, int], ...]  # (prompt tokens, output tokens) per request
    concurrency: int | None = None
    arrivals_s: tuple[float, ...] | None = None
    rate_per_s: float | None = None  # the open loop's mean rate, for the report

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.arrivals_s is None):
            raise ValueError("a level is either a concurrency or a schedule of arrivals")
        if self.arrivals_s is not None and len(self.arrivals_s) != len(self.lengths):
            raise ValueError("one arrival per request")


@dataclass(frozen=True, kw_only=True)
class Level:
    """One level's results and what the client's own loop lagged meanwhile."""

    spec: LevelSpec
    results: tuple[Result, ...]
    wall_s: float
    loop_lag_p99_s: float
    loop_lag_max_s: float
    late_sends_s: float = 0.0  # open loop: the latest a request left after its scheduled time
    preemptions: float | None = None  # the engine's preemption counter over the level (None: not reported)
    samples: tuple[Sample, ...] = ()  # the endpoint's gauges every SAMPLE_S (none where it has no /metrics)

    @property
    def concurrency(self) -> int | None:
        return self.spec.concurrency


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(max(0.0, time.perf_counter() - t - TICK_S))


Send = Callable[[list[int], int], Awaitable[Result]]  # (prompt ids, output tokens) -> the request's result


Progress = Callable[[LevelSpec, list["Result"]], None]  # called as results come in (a live display)


async def _run_level(send: Send, spec: LevelSpec, rng: random.Random, progress: Progress | None = None) -> Level:
    prompts = [prompt_ids(n, rng) for n, _ in spec.lengths]
    results: list[Result] = []
    late = [0.0]
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(_ticker(lags, stop))
    start = time.perf_counter()
    if spec.concurrency is not None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(prompts)):
            queue.put_nowait(i)

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await send(prompts[i], spec.lengths[i][1]))
                if progress is not None:
                    progress(spec, results)

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    else:
        assert spec.arrivals_s is not None

        async def fire(i: int, at: float) -> None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late[0] = max(late[0], time.perf_counter() - start - at)
            results.append(await send(prompts[i], spec.lengths[i][1]))
            if progress is not None:
                progress(spec, results)

        await asyncio.gather(*(fire(i, at) for i, at in enumerate(spec.arrivals_s)))
    wall = time.perf_counter() - start
    stop.set()
    await tick
    lags.sort()
    return Level(
        spec=spec,
        results=tuple(results),
        wall_s=wall,
        loop_lag_p99_s=lags[max(0, math.ceil(0.99 * len(lags)) - 1)] if lags else 0.0,
        loop_lag_max_s=lags[-1] if lags else 0.0,
        late_sends_s=late[0],
    )


async def run_levels(
    ep: Endpoint,
    levels: Sequence[LevelSpec],
    *,
    timeout_s: float = 600.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[str, list[Level], KvCapacity | None]:
    """Each level in turn, then the KV cache the endpoint reports."""
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        model = await discover_model(http, ep)

        async def send(prompt: list[int], out: int) -> Result:
            return await one_request(http, ep, model, prompt, max_tokens=out, timeout_s=timeout_s)

        done = []
        t0 = time.perf_counter()
        sampling = True  # until /metrics is found missing: an endpoint without it is not asked every second
        for spec in levels:
            before = await read_preemptions(http, ep)
            samples: list[Sample] = []
            stop = asyncio.Event()
            sampler = (
                asyncio.create_task(_sample(http, ep, spec.label, t0=t0, out=samples, stop=stop)) if sampling else None
            )
            try:
                level = await _run_level(send, spec, rng, progress)
            finally:
                stop.set()
                if sampler is not None:
                    sampling = await sampler
            after = await read_preemptions(http, ep)
            level = replace(level, samples=tuple(samples))
            if after is not None:
                # No counter before the level: the agent had not scraped its engine yet, and counts from 0.
                level = replace(level, preemptions=max(0.0, after - (before or 0.0)))
            done.append(level)
        return model, done, await read_capacity(http, ep)


async def _sample(
    http: aiohttp.ClientSession, ep: Endpoint, label: str, *, t0: float, out: list[Sample], stop: asyncio.Event
) -> bool:
    """Read the endpoint's gauges every SAMPLE_S until ``stop``; False where it has no /metrics (or none of them)."""
    while not stop.is_set():
        at = time.perf_counter()
        text = await _metrics_text(http, ep)
        g = parse_gauges(text) if text is not None else {}
        if not g:
            return False
        out.append(
            Sample(
                t_s=at - t0,
                level=label,
                kv_cache_utilization=g.get(contract.KV_CACHE_UTILIZATION.name),
                requests_waiting=g.get(contract.REQUESTS_WAITING.name),
                requests_running=g.get(contract.REQUESTS_RUNNING.name),
            )
        )
        with contextlib.suppress(TimeoutError):  # the next sample is due
            await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_S - (time.perf_counter() - at)))
    return True


async def run_levels_sagemaker(
    target: SageMakerTarget,
    levels: Sequence[LevelSpec],
    *,
    model: str | None,
    timeout_s: float = 600.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> tuple[str, list[Level], KvCapacity | None]:
    """Each level against a SageMaker endpoint (no /metrics there: no capacity, no preemption counter)."""
    from kvfleet.bench.sagemaker import SageMakerTransport

    rng = random.Random(seed)
    most = max((spec.concurrency or len(spec.lengths)) for spec in levels)
    transport = SageMakerTransport(target, workers=min(most, 256), timeout_s=timeout_s)
    try:
        await transport.probe(model)

        async def send(prompt: list[int], out: int) -> Result:
            return await transport.send(model, prompt, max_tokens=out)

        done = [await _run_level(send, spec, rng, progress) for spec in levels]
    finally:
        transport.close()
    return model or target.endpoint_name, done, None


def concurrency_levels(
    concurrencies: Sequence[int], *, requests: int, prompt_tokens: int, output_tokens: int
) -> list[LevelSpec]:
    return [
        LevelSpec(label=f"concurrency {c}", concurrency=c, lengths=((prompt_tokens, output_tokens),) * requests)
        for c in concurrencies
    ]


def poisson_level(
    rate_per_s: float, *, requests: int, prompt_tokens: int, output_tokens: int, seed: int = 0
) -> LevelSpec:
    """Poisson arrivals at ``rate_per_s`` (seeded: reruns send the same schedule)."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(requests):
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return LevelSpec(
        label=f"{rate_per_s:g} req/s",
        arrivals_s=tuple(times),
        lengths=((prompt_tokens, output_tokens),) * requests,
        rate_per_s=rate_per_s,
    )


async def run_concurrency(
    ep: Endpoint,
    *,
    concurrencies: Sequence[int],
    requests_per_level: int,
    prompt_tokens: int,
    output_tokens: int,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> tuple[str, list[Level], KvCapacity | None]:
    """``requests_per_level`` requests at each concurrency in turn (``c`` always in flight until the last)."""
    specs = concurrency_levels(
        concurrencies, requests=requests_per_level, prompt_tokens=prompt_tokens, output_tokens=output_tokens
    )
    return await run_levels(ep, specs, timeout_s=timeout_s, seed=seed)


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)

    def q(p: float) -> float:  # nearest rank, as the simulator's report takes them
        return v[max(0, math.ceil(p * len(v)) - 1)]

    return {"p50": q(0.50), "p90": q(0.90), "p95": q(0.95), "p99": q(0.99), "mean": sum(v) / len(v)}


def summarize(level: Level, *, ttft_slo_s: float | None = None) -> dict[str, Any]:
    rs = level.results
    ok = [r for r in rs if r.ok]
    failed: dict[str, int] = {}
    for r in rs:
        if not r.ok:
            key = str(r.status) if r.status is not None and r.status != 200 else "stream" if r.status else "connection"
            failed[key] = failed.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    attainment = None
    if ttft_slo_s is not None and rs:  # a failed request misses the target
        attainment = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s) / len(rs)
    return {
        "level": level.spec.label,
        "concurrency": level.concurrency,
        "rate_per_s": level.spec.rate_per_s,
        "ttft_attainment": attainment,
        "late_send_max_s": level.late_sends_s,
        "preemptions": level.preemptions,
        "requests": len(rs),
        "completed": len(ok),
        "failed": failed,
        "first_errors": sorted({r.error for r in rs if r.error})[:3],
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([g for r in ok for g in r.itl_s]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        "requests_per_s": len(ok) / level.wall_s if level.wall_s else 0.0,
        "output_tokens_per_s": out_tokens / level.wall_s if level.wall_s else 0.0,
        "wall_s": level.wall_s,
        "client_loop_lag_p99_s": level.loop_lag_p99_s,
        "client_loop_lag_max_s": level.loop_lag_max_s,
        "over_time": _over_time(level.samples),
    }


def _over_time(samples: Sequence[Sample]) -> dict[str, Any] | None:
    """The endpoint's gauges through the level: their peaks and the samples themselves (None: no /metrics)."""
    if not samples:
        return None

    def peak(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return max(vals) if vals else None

    return {
        "interval_s": SAMPLE_S,
        "kv_cache_utilization_max": peak([x.kv_cache_utilization for x in samples]),
        "requests_waiting_max": peak([x.requests_waiting for x in samples]),
        "requests_running_max": peak([x.requests_running for x in samples]),
        "samples": [
            {
                "t_s": round(x.t_s, 3),
                "kv_cache_utilization": x.kv_cache_utilization,
                "requests_waiting": x.requests_waiting,
                "requests_running": x.requests_running,
            }
            for x in samples
        ],
    }
