"""`kvfleet bench` against the agent in front of the fake engine, and against endpoints that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvfleet.bench.client import Endpoint, run_concurrency, summarize
from kvfleet.cli import main
from tests.agent.harness import fake_engine_command, free_port, run, running, settings


def test_a_sweep_through_the_agent_times_every_token() -> None:
    async def go() -> tuple[str, list[Any], Any]:
        s = settings(engine_command=fake_engine_command(token_delay=0.01, capacity=8))
        async with running(s) as r:
            return await run_concurrency(
                Endpoint(url=r.url), concurrencies=[1, 3], requests_per_level=6, prompt_tokens=20, output_tokens=5
            )

    model, levels, capacity = run(go)
    assert model == "fake"
    # The fake engine's cache_config_info (8 x 64 blocks of 16), as the agent re-exports it.
    assert (capacity.blocks, capacity.block_tokens, capacity.tokens) == (512, 16, 8192)
    assert capacity.source == "kvfleet_engine_kv_cache_blocks"
    assert [lv.concurrency for lv in levels] == [1, 3]
    for lv in levels:
        assert len(lv.results) == 6 and all(r.ok for r in lv.results), [r.error for r in lv.results]
        for r in lv.results:
            assert r.output_tokens == 5 and r.prompt_tokens == 20
            assert len(r.itl_s) == 4  # one chunk per token: four gaps
            assert r.ttft_s is not None and 0 < r.ttft_s < r.done_s - r.sent_s  # type: ignore[operator]
            assert all(g >= 0.005 for g in r.itl_s)  # the fake engine's 10 ms per token, seen by the client
        row = summarize(lv)
        assert row["completed"] == 6 and row["failed"] == {}
        assert row["ttft_s"]["p50"] <= row["ttft_s"]["p95"] <= row["ttft_s"]["p99"]
        assert row["output_tokens_per_s"] > 0


@contextlib.contextmanager
def serving(handler: Any) -> Iterator[str]:
    """A local HTTP server answering every path with ``handler``, in its own thread."""
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def one_line(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_nothing_listening_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = one_line(capsys, f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--requests", "1")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "cannot reach" in line and "/v1/models" in line and "Traceback" not in err


def test_not_a_url_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = one_line(capsys, "localhost:8080")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "is not an http(s) URL" in line


def test_refused_credentials_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    async def handler(_: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=401)

    with serving(handler) as url:
        code, _, err = one_line(capsys, url, "--requests", "1", "--concurrency", "1")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "refused the credentials (401)" in line and "--api-key" in line


def test_a_malformed_stream_fails_the_request_not_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Half the requests get a stream that breaks off into garbage: those fail with the reason, the others are
    timed, the report is printed and the exit status says that requests failed."""
    calls = [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        calls[0] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if calls[0] % 2:
            await resp.write(b"data: {not json\n\n")
        else:
            await resp.write(b'data: {"choices": [{"text": "b"}]}\n\n')
            await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        return resp

    with serving(handler) as url:
        code, out, err = one_line(
            capsys, url, "--requests", "4", "--concurrency", "2", "--json", "--output-tokens", "2"
        )
    assert code == 1, err
    report = json.loads(out)
    [level] = report["levels"]
    assert level["completed"] == 2 and level["failed"] == {"stream": 2}
    assert any("malformed stream event" in e for e in level["first_errors"])


def test_the_plan_check_reads_the_engines_cache_and_fails_short_of_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Against vLLM's own /metrics (no agent): its cache_config_info labels give the cache; an expectation the
    cache meets passes, one it falls short of by more than the tolerance fails with the numbers and what to do."""
    metrics = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",cache_dtype="auto"} 1.0\n'
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        if request.path == "/metrics":
            return web.Response(text=metrics)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        return resp

    with serving(handler) as url:
        base = [url, "--requests", "1", "--concurrency", "1", "--output-tokens", "1"]
        code, out, err = one_line(capsys, *base, "--expect-kv-tokens", "16400")  # 2.4% over 16,000: within 5%
        assert code == 0, err
        assert "1,000 blocks of 16 tokens = 16,000 tokens per replica (vllm:cache_config_info)" in out
        code, out, err = one_line(capsys, *base, "--expect-kv-tokens", "20000", "--json")
    assert code == 1
    assert json.loads(out)["kv_cache"] == {"blocks": 1000, "block_tokens": 16, "tokens": 16000}
    [line] = err.strip().splitlines()
    assert line.startswith("kvfleet: plan check: the engine allocated 16,000 KV tokens per replica, 20% fewer than")
    assert "re-plan" in line


def test_plan_check_options_are_checked_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: an option error must come first
    code, _, err = one_line(capsys, url, "--deployment", "chat")
    assert code == 2 and "give --env FILE too" in err
    code, _, err = one_line(capsys, url, "--env", "dev", "--deployment", "nope")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "no deployment 'nope'" in line and "it has chat" in line
