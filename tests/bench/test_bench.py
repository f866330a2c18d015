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

from kvfleet import contract
from kvfleet.bench.client import Endpoint, concurrency_levels, run_concurrency, summarize
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


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--start-s", "30"], "--start-s applies to --trace only"),
        (["--duration-s", "60"], "--duration-s applies to --trace only"),
        (["--rate-scale", "2"], "--rate-scale applies to --trace only"),
        (["--trace-format", "azure"], "--trace-format applies to --trace only"),
        (["--region", "us-east-1"], "--region is for a SageMaker endpoint"),
        (["--endpoint-url", "https://runtime.example"], "--endpoint-url is for a SageMaker endpoint"),
        (["--calibration", "cal.json"], "--calibration is what --predict simulates with"),
    ],
)
def test_a_flag_the_run_would_ignore_is_refused(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    """Nothing is sent: a flag that would change nothing is an exit 2 with one line, before any request."""
    code, out, err = one_line(capsys, f"http://127.0.0.1:{free_port()}", *args)
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert expected in line and "cannot reach" not in line


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


def _streaming(seen: list[tuple[float, int, int]]) -> Any:
    """An endpoint streaming max_tokens one-token chunks 5 ms apart; records (arrival, prompt length, max_tokens)."""
    import time as _time

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        if request.path == "/metrics":
            return web.Response(status=404)
        body = await request.json()
        seen.append((_time.perf_counter(), len(body["prompt"]), body["max_tokens"]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.005)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    return handler


def test_a_rate_sweep_reports_the_highest_rate_meeting_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[float, int, int]] = []
    with serving(_streaming(seen)) as url:
        code, out, err = one_line(
            capsys, url, "--rate", "5,20", "--requests", "10", "--input-tokens", "7", "--output-tokens", "3",
            "--ttft-ms", "2000", "--json",
        )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert [lv["level"] for lv in report["levels"]] == ["5 req/s", "20 req/s"]
    assert all(lv["completed"] == 10 and lv["ttft_attainment"] == 1.0 for lv in report["levels"])
    assert report["best_rate_per_s"] == 20
    assert {(p, m) for _, p, m in seen} == {(7, 3)}
    assert report["kv_cache"] is None  # this endpoint has no /metrics


def test_the_report_says_what_ran_and_where_the_limit_lies(capsys: pytest.CaptureFixture[str]) -> None:
    """The table names the lengths sent; a sweep whose top rate still met the target says the limit lies above it
    instead of calling that rate the limit."""
    seen: list[tuple[float, int, int]] = []
    with serving(_streaming(seen)) as url:
        code, out, err = one_line(
            capsys, url, "--rate", "5,20", "--requests", "10", "--input-tokens", "7", "--output-tokens", "3",
            "--ttft-ms", "2000",
        )  # fmt: skip
    assert code == 0, err
    assert "7 prompt + 3 generated tokens per request" in out and "its own lengths" not in out
    assert "the limit lies above 20 req/s" in out and "highest rate" not in out


def test_a_trace_is_replayed_at_its_own_times_and_lengths(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00.000,11,2\n"
        "2023-11-16 18:00:00.400,12,3\n"
        "2023-11-16 18:00:00.800,13,4\n"
        "2023-11-16 18:00:01.600,14,5\n",
        encoding="utf-8",
    )
    seen: list[tuple[float, int, int]] = []
    with serving(_streaming(seen)) as url:
        code, out, err = one_line(capsys, url, "--trace", str(trace), "--trace-format", "azure", "--json")
    assert code == 0, err
    [level] = json.loads(out)["levels"]
    assert level["completed"] == 4 and level["level"] == "trace x1"
    seen.sort()
    assert [(p, m) for _, p, m in seen] == [(11, 2), (12, 3), (13, 4), (14, 5)]
    offsets = [t - seen[0][0] for t, _, _ in seen]
    assert offsets == pytest.approx([0.0, 0.4, 0.8, 1.6], abs=0.1)  # open loop: sent on the trace's schedule


def test_a_missed_ttft_target_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[float, int, int]] = []
    with serving(_streaming(seen)) as url:
        code, _, err = one_line(capsys, url, "--concurrency", "2", "--requests", "2", "--ttft-ms", "1")
    assert code == 1
    assert "kvfleet: TTFT target: no level got 95% of its requests a first token within 1 ms" in err


@contextlib.contextmanager
def agent_in_thread(**overrides: Any) -> Iterator[str]:
    """The agent (in front of the fake engine) on its own event loop in a thread, so the CLI's own loop can run."""
    loop = asyncio.new_event_loop()
    s = settings(**overrides)
    ctx = running(s)
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def main_() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with ctx:
            started.set()
            await stop.wait()

    t = threading.Thread(target=lambda: loop.run_until_complete(main_()), daemon=True)
    t.start()
    assert started.wait(60), "the agent did not start"
    try:
        yield f"http://127.0.0.1:{s.port}"
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        t.join(60)


def test_limits_pass_at_the_plan_and_are_refused_with_429_above(capsys: pytest.CaptureFixture[str]) -> None:
    """Admission holds 6 requests of 20 + 5 tokens (150 tokens at factor 1): at the planned 4 every request runs,
    at 8 the ones past the budget are refused with 429, which is the designed break, so --limits passes."""
    with agent_in_thread(
        engine_command=fake_engine_command(token_delay=0.02, capacity=8), token_budget=150, admission_factor=1.0
    ) as url:
        code, out, err = one_line(
            capsys, url, "--limits", "--max-input-tokens", "20", "--max-output-tokens", "5",
            "--max-concurrency", "4", "--json",
        )  # fmt: skip
    report = json.loads(out)
    at, above = report["levels"]
    assert at["completed"] == 8 and at["failed"] == {} and at["preemptions"] == 0
    assert above["failed"].get("429", 0) > 0 and set(above["failed"]) == {"429"}, above
    assert report["limits"]["passed"] and code == 0, err
    assert "refused with 429 (admission), none failed" in report["limits"]["lines"][1]
    # The most the levels hold at once (8 x 25 tokens) against the cache the engine reports.
    fill = report["limits"]["lines"][2]
    assert fill.startswith("limits:") and "200 tokens at once" in fill, fill


def test_limits_fail_when_the_planned_level_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """The same endpoint with a budget too small for the planned concurrency: requests at the plan are refused."""
    with agent_in_thread(
        engine_command=fake_engine_command(token_delay=0.02, capacity=8), token_budget=60, admission_factor=1.0
    ) as url:
        code, _, err = one_line(
            capsys, url, "--limits", "--max-input-tokens", "20", "--max-output-tokens", "5", "--max-concurrency", "4"
        )
    assert code == 1
    assert "kvfleet: limits: at the planned concurrency limits at 4:" in err and "x 429" in err


def test_limits_need_their_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = one_line(capsys, f"http://127.0.0.1:{free_port()}", "--limits", "--max-input-tokens", "10")
    assert code == 2
    assert "--limits needs --max-output-tokens, --max-concurrency (or --env with the plan)" in err


def _paced(token_delay_s: float) -> Any:
    """An endpoint streaming each token ``token_delay_s`` after the last (one model, no /metrics)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        if request.path == "/metrics":
            return web.Response(status=404)
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(token_delay_s)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


def test_speed_against_the_plan_of_an_environment(capsys: pytest.CaptureFixture[str]) -> None:
    """The dev example's plan (Llama-3.1-8B, one replica of its instance) predicts its ITL from the step model. An
    endpoint faster than that passes; one 10x slower fails with both figures. Its KV cache is not reported here, so
    the KV part of the check says so too."""
    args = ["--env", "dev", "--concurrency", "2", "--requests", "4", "--input-tokens", "64", "--output-tokens", "8"]
    with serving(_paced(0.002)) as url:
        code, out, err = one_line(capsys, url, *args, "--json")
    report = json.loads(out)
    [level] = report["levels"]
    planned = level["planned"]
    assert 0.002 < planned["itl_s"] < 0.2 and planned["output_tokens_per_s"] > 0
    assert report["speed_drift"] == []
    # No /metrics here: the KV check the plan implies is skipped with a note (asked for, it would fail; below).
    assert code == 0 and "note: KV check skipped" in err
    slow = 12 * planned["itl_s"]
    with serving(_paced(slow)) as url:
        code, out, err = one_line(capsys, url, *args, "--expect-kv-tokens", "1", "--tolerance", "0.99")
    assert code == 1
    assert "concurrency 2: mean ITL" in err and "against the plan's" in err and "tolerance 25%" in err


def test_the_html_report_is_self_contained(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from html.parser import HTMLParser

    page = tmp_path / "bench.html"
    with serving(_paced(0.002)) as url:
        code, _, err = one_line(capsys, url, "--concurrency", "1,2", "--requests", "4", "--output-tokens", "5",
                                  "--html", str(page))  # fmt: skip
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    HTMLParser().feed(text)  # parses
    assert text.count("<svg") == 3 and "<polyline" in text  # two CDFs and the throughput bars
    assert "concurrency 1" in text and "concurrency 2" in text
    assert "http" not in text.replace(url, "").replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched
    code, _, err = one_line(capsys, url, "--html", str(tmp_path / "missing" / "r.html"))
    assert code == 2 and "no writable directory" in err


def test_an_endpoint_that_dies_mid_stream_gives_a_partial_report(capsys: pytest.CaptureFixture[str]) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # the connection drops before the answer ends
        return resp

    with serving(handler) as url:
        code, out, err = one_line(capsys, url, "--concurrency", "2", "--requests", "3", "--json")
    assert code == 1 and "Traceback" not in err
    [level] = json.loads(out)["levels"]
    assert level["completed"] == 0 and sum(level["failed"].values()) == 3
    assert level["first_errors"]  # each says what broke


def test_progress_is_reported_as_results_arrive() -> None:
    from kvfleet.bench.client import run_levels

    seen: list[tuple[str, int]] = []
    with serving(_paced(0.001)) as url:
        specs = concurrency_levels([2], requests=5, prompt_tokens=4, output_tokens=2)
        asyncio.run(run_levels(Endpoint(url=url), specs, progress=lambda spec, rs: seen.append((spec.label, len(rs)))))
    assert seen == [("concurrency 2", n) for n in range(1, 6)]


def test_the_planned_load_of_an_environment(capsys: pytest.CaptureFixture[str]) -> None:
    """dev's workload: Poisson at its 2 requests/s peak, its average lengths (1500 + 200 when this was written)."""
    seen: list[tuple[float, int, int]] = []
    with serving(_streaming(seen)) as url:
        code, out, err = one_line(capsys, url, "--env", "dev", "--planned-load", "--requests", "6", "--json")
    report = json.loads(out)
    [level] = report["levels"]
    assert level["level"] == "2 req/s" and level["completed"] == 6
    from kvfleet.config.loader import environment_path, load_located

    w = load_located(environment_path("dev")).environment.deployments[0].workload
    assert {(p, m) for _, p, m in seen} == {(w.avg_input_tokens, w.avg_output_tokens)}
    assert code == 0 and "note: KV check skipped" in err  # the KV check, with --env, has nothing to read here
    code, _, err = one_line(capsys, url, "--planned-load")
    assert code == 2 and "give --env FILE" in err


def test_kv_use_and_the_queue_are_charted_over_the_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An endpoint whose /metrics reports the agent's gauges as they stand (KV use rising with the requests in
    flight, the queue past two running): the run samples them every second, the JSON holds the samples and their
    peaks per level, and the HTML draws KV use and the queue over the run with each level's start marked."""
    in_flight = [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        if request.path == "/metrics":
            n = in_flight[0]
            d = '{deployment="t"}'
            return web.Response(
                text=(
                    f"# TYPE {contract.KV_CACHE_UTILIZATION.prometheus_name} gauge\n"
                    f"{contract.KV_CACHE_UTILIZATION.prometheus_name}{d} {0.1 * n}\n"
                    f"{contract.REQUESTS_WAITING.prometheus_name}{d} {max(0, n - 2)}\n"
                    f"{contract.REQUESTS_RUNNING.prometheus_name}{d} {min(n, 2)}\n"
                    # the engine's own gauge beside it: the agent's wins
                    "vllm:kv_cache_usage_perc 0.99\n"
                )
            )
        body = await request.json()
        in_flight[0] += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.1)
                await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            in_flight[0] -= 1

    page = tmp_path / "bench.html"
    with serving(handler) as url:
        code, out, err = one_line(capsys, url, "--concurrency", "1,4", "--requests", "8", "--output-tokens", "15",
                                  "--json", "--html", str(page))  # fmt: skip
    assert code == 0, err
    one, four = json.loads(out)["levels"]
    for row, n in ((one, 1), (four, 4)):
        t = row["over_time"]
        assert t is not None and t["interval_s"] == 1.0 and len(t["samples"]) >= 2
        assert t["kv_cache_utilization_max"] == pytest.approx(0.1 * n)  # the agent's figure, not vLLM's 0.99
        assert t["requests_waiting_max"] == max(0, n - 2) and t["requests_running_max"] == min(n, 2)
    assert four["over_time"]["samples"][0]["t_s"] > one["over_time"]["samples"][-1]["t_s"]  # one clock for the run
    text = page.read_text(encoding="utf-8")
    assert text.count("<svg") == 5 and "KV-cache use over the run" in text and "Requests in the engine" in text
    assert ">concurrency 4</text>" in text  # the level's start, marked


def test_gauges_are_read_from_the_engine_where_the_url_is_the_engine() -> None:
    from kvfleet.bench.client import parse_gauges

    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 7\n'
        "vllm:num_requests_waiting_by_reason 9\n"  # not a gauge of the contract's
        "vllm:num_requests_running NaN\n"
    )
    assert parse_gauges(text) == {"KvCacheUtilization": 0.25, "RequestsWaiting": 3.0, "RequestsRunning": 7.0}
