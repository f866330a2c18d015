"""A stand-in for vLLM's OpenAI server, for fast agent tests: same routes, SSE streaming, Prometheus text.

Run as ``python -m tests.agent.fake_engine --port P``. Tokens come out every
``--token-delay`` seconds; the request body is echoed back in the response's ``echo`` field so tests can
see what the agent forwarded (cache_salt included).

``--grandchild`` forks a process that ignores SIGTERM (unless ``--grandchild-obeys-term``), as vLLM's
EngineCore outlives its API server: in
its own session with ``--grandchild-setsid`` (out of the engine's process group), ``--grandchild-delay``
seconds after the server is up. ``--term-takes-group`` makes SIGTERM kill it before the engine exits, as
vLLM's API server stops its EngineCore. ``--shared-memory NAME`` creates a POSIX shared-memory segment
first, as vLLM does for its message queues: Python's resource tracker then runs beside the engine (and the
grandchild inherits its pipe), and unlinks the segment once every process that could use it is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from types import FrameType

from aiohttp import web

# vLLM 0.33.0's DecisionRequest (vllm/entrypoints/openai/decisions/protocol.py): every field it declares.
DECISION_FIELDS = frozenset({"model", "input", "questions", "safety_identifier", "joint", "cache_salt"})
HIST_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FakeEngine:
    def __init__(self, *, token_delay: float, capacity: int, trtllm: bool = False, decisions: bool = True) -> None:
        self.decisions = decisions  # False: a model without the Decisions API (vLLM answers 501)
        self.trtllm = (
            trtllm  # speak as trtllm-serve 1.0: histograms on /prometheus/metrics, iteration stats on /metrics
        )
        self.token_delay = token_delay
        self.capacity = capacity  # sequences that run at once; the rest wait
        self.running = 0
        self.waiting = 0
        self.generated = 0
        self.preemptions = 0
        self.ttft: list[float] = []
        self.sem = asyncio.Semaphore(capacity)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        if self.trtllm:
            app.router.add_get("/prometheus/metrics", self.trtllm_prometheus)
            app.router.add_get("/metrics", self.iteration_stats)
        else:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/decisions", self.decide)
        return app

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def decide(self, request: web.Request) -> web.Response:
        """vLLM 0.33's Decisions API: one one-token read per question, answered with probabilities. Its request
        forbids fields it does not declare (pydantic extra="forbid"), so a field the agent added would be a 400."""
        if not self.decisions:  # vllm/entrypoints/openai/decisions/api_router.py create_decision, 0.33.0
            message = "The model does not support the Decisions API"
            return web.json_response(
                {"error": {"message": message, "type": "NotImplementedError", "param": None, "code": 501}}, status=501
            )
        body = await request.json()
        extra = sorted(set(body) - DECISION_FIELDS)
        if extra:
            message = f"extra fields not permitted: {', '.join(extra)}"
            return web.json_response(
                {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400
            )
        questions = body.get("questions") if isinstance(body.get("questions"), list) else []
        prompt = len(str(body.get("input", "")).split()) or 1
        usage = {
            "input_tokens": prompt * len(questions),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(questions),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": (prompt + 1) * len(questions),
        }
        answers = [{"type": "predicate", "name": None, "probability": 0.5} for _ in questions]
        return web.json_response({"model": body.get("model"), "answers": answers, "usage": usage, "echo": body})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 8)
        arrived = time.monotonic()
        self.waiting += 1
        async with self.sem:
            self.waiting -= 1
            self.running += 1
            try:
                return await self._generate(request, body, n, arrived)
            finally:
                self.running -= 1

    async def _generate(
        self, request: web.Request, body: dict[str, object], n: int, arrived: float
    ) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        prompt = str(body.get("prompt") or body.get("messages") or "")
        # As vLLM reports it: prompt tokens (here one per word), generated tokens, prefix-cache hits.
        usage = {
            "prompt_tokens": len(prompt.split()) or 1,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n)
            self.generated += n
            self.ttft.append(time.monotonic() - arrived)
            text = " tok" * n
            whole: dict[str, object] = {"index": 0, "finish_reason": "length"}
            whole.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({"id": "cmpl-1", "choices": [whole], "echo": body, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(self.token_delay)
            if i == 0:
                self.ttft.append(time.monotonic() - arrived)
            self.generated += 1
            last = i == n - 1
            choice: dict[str, object] = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": " tok"}} if chat else {"text": " tok"})
            chunk: dict[str, object] = {"id": "cmpl-1", "choices": [choice]}
            if i == 0:
                chunk["echo"] = body
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            await resp.write(f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(self, _: web.Request) -> web.Response:
        labels = 'engine="0",model_name="fake"'
        usage = min(1.0, (self.running + self.waiting) / max(1, self.capacity))
        lines = [
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            # As vLLM's info gauge: CacheConfig's fields as labels (here the capacity this fake admits, 16 per block).
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{self.capacity * 64}"}} 1.0',
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(self.waiting)}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.generated)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *self._ttft_histogram("vllm:time_to_first_token_seconds", labels),
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    def _ttft_histogram(self, name: str, labels: str) -> list[str]:
        lines = [
            f'{name}_bucket{{{labels},le="{le}"}} {float(sum(1 for t in self.ttft if t <= le))}' for le in HIST_BUCKETS
        ]
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(len(self.ttft))}')
        lines.append(f"{name}_count{{{labels}}} {float(len(self.ttft))}")
        lines.append(f"{name}_sum{{{labels}}} {sum(self.ttft)}")
        return lines

    TRT_BLOCKS, TRT_BLOCK_TOKENS = 4096, 32

    async def trtllm_prometheus(self, _: web.Request) -> web.Response:
        """trtllm-serve 1.0 with return_perf_metrics: unprefixed request histograms, no KV or queue gauge."""
        labels = 'engine_type="undefined",model_name="undefined"'
        lines = ["# TYPE time_to_first_token_seconds histogram"]
        lines += self._ttft_histogram("time_to_first_token_seconds", labels)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def iteration_stats(self, _: web.Request) -> web.Response:
        """The newest iteration's statistics (the real one returns every iteration since the last read)."""
        if not self.running and not self.waiting:
            return web.json_response([])
        used = 8 * (self.running + self.waiting)
        kv = {"maxNumBlocks": self.TRT_BLOCKS, "usedNumBlocks": used, "freeNumBlocks": self.TRT_BLOCKS - used,
              "tokensPerBlock": self.TRT_BLOCK_TOKENS}  # fmt: skip
        return web.json_response(
            [{"iter": 1, "numActiveRequests": self.running, "numQueuedRequests": self.waiting, "kvCacheStats": kv}]
        )


GRANDCHILD_LIFETIME_S = 120.0  # a grandchild a failed test leaves behind goes away on its own


def fork_grandchild(*, setsid: bool, obeys_term: bool) -> int:
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if obeys_term else signal.SIG_IGN)
        if setsid:
            os.setsid()
        deadline = time.monotonic() + GRANDCHILD_LIFETIME_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
        os._exit(0)
    return pid


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-delay", type=float, default=0.01)
    p.add_argument("--capacity", type=int, default=4)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--grandchild", action="store_true")
    p.add_argument("--grandchild-setsid", action="store_true")
    p.add_argument("--grandchild-delay", type=float, default=0.0)
    p.add_argument("--grandchild-obeys-term", action="store_true")
    p.add_argument("--term-takes-group", action="store_true")
    p.add_argument("--shared-memory", default=None)
    p.add_argument("--trtllm", action="store_true", help="speak as trtllm-serve 1.0 on its metrics paths")
    p.add_argument("--no-decisions", action="store_true", help="a model without vLLM's Decisions API (501)")
    a = p.parse_args()
    if a.shared_memory:
        from multiprocessing import shared_memory

        segment = shared_memory.SharedMemory(name=a.shared_memory, create=True, size=4096)
        segment.close()  # left for the resource tracker to unlink
    grandchildren: list[int] = []

    def on_term(signum: int, frame: FrameType | None) -> None:
        for pid in grandchildren:
            os.kill(pid, signal.SIGKILL)
        os._exit(0)

    if a.term_takes_group:
        signal.signal(signal.SIGTERM, on_term)

    def grandchild() -> None:
        grandchildren.append(fork_grandchild(setsid=a.grandchild_setsid, obeys_term=a.grandchild_obeys_term))

    if a.grandchild and a.grandchild_delay == 0:
        grandchild()  # before the event loop: a fork-safe point

    async def run() -> None:
        await asyncio.sleep(a.startup_delay)
        engine = FakeEngine(
            token_delay=a.token_delay, capacity=a.capacity, trtllm=a.trtllm, decisions=not a.no_decisions
        )
        # uvicorn's keep-alive as vLLM sets it (5 s unless VLLM_HTTP_TIMEOUT_KEEP_ALIVE says otherwise).
        keep_alive = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))
        runner = web.AppRunner(engine.app(), access_log=None, keepalive_timeout=keep_alive)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", a.port).start()
        if a.grandchild and a.grandchild_delay > 0:
            await asyncio.sleep(a.grandchild_delay)
            grandchild()
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
