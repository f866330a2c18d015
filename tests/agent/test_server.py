"""The agent in front of a fake engine (a real subprocess speaking vLLM's routes): fast, every behaviour."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvfleet import contract
from kvfleet.agent.tenancy import cache_salt
from tests.agent.harness import fake_engine_command, run, running, settings, stream_completion


def test_ping_and_streaming_and_plain_completions() -> None:
    async def go() -> None:
        async with running(settings()) as r:
            async with r.http.get(r.url + "/ping") as p:
                assert p.status == 200
            s = await stream_completion(r.http, r.url, max_tokens=5)
            assert s["status"] == 200 and s["done"] and s["finish"] == ["length"]
            assert s["headers"]["Content-Type"].startswith("text/event-stream")
            async with r.http.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as c:
                body = await c.json()
                assert c.status == 200 and body["choices"][0]["text"] == " tok" * 3
            async with r.http.get(r.url + "/v1/models") as m:
                assert (await m.json())["data"][0]["id"] == "fake"

    run(go)


def test_no_access_log_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    # aiohttp logs every request at INFO on "aiohttp.access" unless its server is told not to; that formatting was an
    # eighth of the agent's CPU per request.
    caplog.set_level("INFO")

    async def go() -> None:
        async with running(settings()) as r:
            for _ in range(3):
                s = await stream_completion(r.http, r.url, max_tokens=2)
                assert s["status"] == 200
            async with r.http.get(r.url + "/ping") as p:
                assert p.status == 200

    run(go)
    assert not [rec for rec in caplog.records if rec.name == "aiohttp.access"]


def test_a_method_a_route_does_not_take_is_405_with_allow_and_head_is_a_get() -> None:
    async def go() -> None:
        async with running(settings()) as r:
            for method, path, allow in (
                ("GET", contract.DRAIN_ROUTE, "POST"),
                ("DELETE", contract.HEALTH_ROUTE, "GET, HEAD, POST"),
                ("POST", contract.METRICS_ROUTE, "GET, HEAD"),
                ("GET", "/v1/completions", "POST"),
            ):
                async with r.http.request(method, r.url + path) as c:
                    assert c.status == 405 and c.headers["Allow"] == allow, (method, path)
                    assert path in (await c.json())["error"]["message"]
            async with r.http.head(r.url + contract.HEALTH_ROUTE) as h:
                assert h.status == 200 and await h.read() == b""

    run(go)


def test_sagemaker_invocations_route_by_body_shape() -> None:
    async def go() -> None:
        async with running(settings()) as r:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with r.http.post(r.url + "/invocations", json=chat) as c:
                assert (await c.json())["choices"][0]["message"]["content"] == " tok tok"
            async with r.http.post(r.url + "/invocations", json={"prompt": "hi", "max_tokens": 2}) as c:
                assert (await c.json())["choices"][0]["text"] == " tok tok"
            async with r.http.post(r.url + "/invocations", data=b"not json") as c:
                assert c.status == 400

    run(go)


def test_drain_finishes_in_flight_and_refuses_new_work_with_503() -> None:
    async def go() -> None:
        s = settings(engine_command=fake_engine_command(token_delay=0.05, capacity=16), drain_budget_s=20)
        async with running(s) as r:
            streams = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=30)) for _ in range(10)]
            await asyncio.sleep(0.4)  # all ten are generating
            assert len(r.agent.flights) == 10
            r.agent.request_shutdown()
            shutdown = asyncio.create_task(r.agent.shutdown())
            # Readiness is down on the very next ping, while all ten are still generating.
            async with r.http.get(r.url + "/ping") as p:
                assert p.status == 503
            assert not any(task.done() for task in streams)
            new = await stream_completion(r.http, r.url)
            assert new["status"] == 503 and new["headers"]["Retry-After"] == "2"
            async with r.http.get(r.url + "/v1/models") as m:
                assert m.status == 503
            results = await asyncio.gather(*streams)
            assert all(x["status"] == 200 and x["done"] and x["finish"] == ["length"] for x in results)
            assert all(not x["errors"] for x in results)
            await shutdown
            assert r.agent.drained is True

    run(go)


def test_past_the_budget_streams_end_with_an_error_event_not_a_hang() -> None:
    async def go() -> None:
        s = settings(engine_command=fake_engine_command(token_delay=0.2, capacity=8), drain_budget_s=0.5)
        async with running(s) as r:
            streams = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=200)) for _ in range(3)]
            plain = asyncio.create_task(r.http.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200}))
            await asyncio.sleep(0.5)
            r.agent.request_shutdown()
            t0 = time.monotonic()
            await r.agent.drain()
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            # Cut at the budget: a full generation would take 200 x 0.2 s = 40 s.
            assert time.monotonic() - t0 < 20
            for x in results:
                assert x["status"] == 200 and x["done"]
                assert x["errors"][0]["type"] == "server_shutdown" and x["errors"][0]["code"] == 503
                assert not x["finish"]
            p = await plain
            assert p.status == 503 and p.headers["Retry-After"] == "2"
            assert r.agent.drained is False

    run(go)


def test_drain_route_is_loopback_only_and_can_wait() -> None:
    async def go() -> None:
        async with running(settings()) as r:
            async with r.http.post(r.url + "/drain?wait=1") as d:
                assert d.status == 200 and (await d.json()) == {"drained": True, "clean": True}
            async with r.http.get(r.url + "/ping") as p:
                assert p.status == 503
            # The agent stays up, drained, until it is told to stop.
            assert not r.agent.shutdown_requested.is_set()

    run(go)
    from kvfleet.agent.server import _is_loopback

    assert _is_loopback("127.0.0.1") and _is_loopback("::1")
    assert not _is_loopback("10.0.0.5") and not _is_loopback(None) and not _is_loopback("garbage")


def test_token_admission_sheds_with_429_and_counts_it() -> None:
    async def go() -> None:
        s = settings(
            engine_command=fake_engine_command(token_delay=0.05, capacity=64),
            token_budget=300,
            admission_factor=1.0,
        )
        async with running(s) as r:
            # Each request reserves its prompt (2 tokens) + 100: two fit in 300, the third does not.
            first = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=100)) for _ in range(2)]
            await asyncio.sleep(0.3)
            third = await stream_completion(r.http, r.url, max_tokens=100)
            assert third["status"] == 429 and third["headers"]["Retry-After"] == "2"
            assert json.loads(third["body"])["error"]["type"] == "rate_limit_exceeded"
            small = await stream_completion(r.http, r.url, max_tokens=50)
            assert small["status"] == 200
            done = await asyncio.gather(*first)
            assert all(d["status"] == 200 for d in done)
            assert r.agent.admission.reserved_tokens == 0
            await asyncio.sleep(0.5)
            shed = sum(rec.get("RequestsShed", 0) for rec in r.emf())
            assert shed == 1
            async with r.http.get(r.url + "/metrics") as m:
                assert "kvfleet_requests_shed_total" in await m.text()

    run(go)


def test_tenant_salt_is_derived_server_side_and_client_salt_stripped() -> None:
    async def go() -> None:
        s = settings(tenant_header="X-Tenant", tenant_secret=b"s3cret")
        async with running(s) as r:
            body = {"prompt": "x", "max_tokens": 1, "cache_salt": "i-pick-tenant-b"}
            async with r.http.post(r.url + "/v1/completions", json=body, headers={"X-Tenant": "tenant-a"}) as c:
                echo = (await c.json())["echo"]
            assert echo["cache_salt"] == cache_salt(b"s3cret", "tenant-a") != "i-pick-tenant-b"
            async with r.http.post(r.url + "/v1/completions", json=body, headers={"X-Tenant": "tenant-b"}) as c:
                assert (await c.json())["echo"]["cache_salt"] == cache_salt(b"s3cret", "tenant-b")
            async with r.http.post(r.url + "/v1/completions", json=body) as c:
                assert c.status == 400 and "X-Tenant" in (await c.json())["error"]["message"]

    run(go)
    assert cache_salt(b"k", "a") != cache_salt(b"k", "b") != cache_salt(b"other", "a")


def test_engine_dies_agent_reports_unhealthy_restarts_it_and_keeps_serving() -> None:
    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(startup_delay=0.5))) as r:
            pid = r.agent.engine.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            saw_unhealthy = False
            while time.monotonic() < deadline and not saw_unhealthy:
                async with r.http.get(r.url + "/ping") as p:
                    saw_unhealthy = p.status == 503
                await asyncio.sleep(0.05)
            assert saw_unhealthy
            async with r.http.post(r.url + "/v1/completions", json={"prompt": "x"}) as c:
                assert c.status == 503  # not ready yet, and says so
            assert await r.agent.engine.wait_ready(20)
            assert r.agent.engine.restarts == 1 and r.agent.engine.pid != pid
            s = await stream_completion(r.http, r.url, max_tokens=3)
            assert s["status"] == 200 and s["done"]

    run(go)


def test_engine_dying_mid_stream_ends_the_stream_with_an_error_and_counts_a_5xx() -> None:
    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.1))) as r:
            task = asyncio.create_task(stream_completion(r.http, r.url, max_tokens=100))
            await asyncio.sleep(0.5)
            pid = r.agent.engine.pid
            assert pid is not None
            os.killpg(pid, signal.SIGKILL)
            x = await asyncio.wait_for(task, 10)
            assert x["done"] and x["errors"][0]["type"] == "engine_error"
            await asyncio.sleep(0.5)
            assert sum(rec.get("ServerErrors", 0) for rec in r.emf()) == 1

    run(go)


def test_signals_are_published_as_emf_and_prometheus() -> None:
    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.05, capacity=2))) as r:
            tasks = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=20)) for _ in range(6)]
            await asyncio.sleep(0.8)
            async with r.http.get(r.url + "/metrics") as m:
                text = await m.text()
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.5)
            recs = r.emf()
        assert recs, "no EMF lines on stdout"
        waiting = max(rec.get("RequestsWaiting", 0) for rec in recs)
        running_ = max(rec.get("RequestsRunning", 0) for rec in recs)
        assert waiting >= 1 and running_ == 2
        assert max(rec.get("KvCacheUtilization", 0) for rec in recs) == 1.0
        rec = next(rec for rec in recs if "KvCacheUtilization" in rec)
        assert rec["Deployment"] == "test-chat" and rec["Replica"] == "replica-1"
        [directive] = rec["_aws"]["CloudWatchMetrics"]
        assert directive["Namespace"] == "Kvfleet"
        assert 'kvfleet_kv_cache_utilization{deployment="test-chat"}' in text
        assert "kvfleet_engine_ready" in text

    run(go)


def test_trtllm_1_0_signals_and_cache_come_from_its_iteration_statistics() -> None:
    """In front of an engine that speaks as trtllm-serve 1.0 (histograms only on /prometheus/metrics, the KV cache and
    the queue in the iteration statistics on /metrics), the agent still publishes the scaling signals, and its
    /metrics re-exports the cache the engine allocated, which the bench's plan check reads."""
    from kvfleet.bench.client import parse_capacity
    from tests.agent.fake_engine import FakeEngine

    async def go() -> None:
        s = settings(
            engine="trtllm",
            engine_version="1.0.0",
            engine_command=(*fake_engine_command(token_delay=0.05, capacity=2), "--trtllm"),
        )
        async with running(s) as r:
            tasks = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=20)) for _ in range(6)]
            await asyncio.sleep(0.8)
            async with r.http.get(r.url + "/metrics") as m:
                text = await m.text()
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.5)
            recs = r.emf()
        assert max(rec.get("RequestsRunning", 0) for rec in recs) == 2
        assert max(rec.get("RequestsWaiting", 0) for rec in recs) >= 1
        assert max(rec.get("KvCacheUtilization", 0) for rec in recs) > 0
        assert any("TimeToFirstToken" in rec for rec in recs)  # the unprefixed 1.0 histogram
        capacity = parse_capacity(text)
        assert capacity is not None and capacity.source == contract.PROM_ENGINE_KV_BLOCKS
        assert capacity.tokens == FakeEngine.TRT_BLOCKS * FakeEngine.TRT_BLOCK_TOKENS

    run(go)


def test_scrape_failure_never_blocks_serving() -> None:
    async def go() -> None:
        async with running(settings()) as r:
            original = r.agent.settings
            object.__setattr__(r.agent, "settings", type(original)(**{**original.__dict__, "engine_port": 1}))
            await asyncio.sleep(0.5)  # scrapes now fail (nothing listens on port 1)
            object.__setattr__(r.agent, "settings", original)
            s = await stream_completion(r.http, r.url, max_tokens=2)
            assert s["status"] == 200
            assert r.emf()  # still publishing (the agent's own counters)

    run(go)


@pytest.mark.parametrize("status", [200])
def test_client_disconnect_releases_the_request(status: int) -> None:
    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.05))) as r:
            async with aiohttp.ClientSession() as other:
                resp = await other.post(
                    r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}
                )
                assert resp.status == status
                await resp.content.readany()
                resp.close()
            await asyncio.sleep(0.5)
            assert not r.agent.flights

    run(go)


def test_hostile_bodies_are_400s_with_a_message_never_500s() -> None:
    async def go() -> None:
        async with running(settings(tenant_header="X-Tenant", tenant_secret=b"k")) as r:
            t = {"X-Tenant": "a", "Content-Type": "application/json"}
            bodies = [
                b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's integer-string limit
                b"[" * 100_000,  # RecursionError in json.loads
                b'{"prompt": "x", "max_tokens": -1}',
                b'{"prompt": "x", "n": 1000000}',
                b'{"prompt": "x", "max_tokens": "5"}',
                b'{"prompt": "x", "temperature": NaN}',
                b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}",
                b"\xff\xfe",
            ]
            for path in ("/v1/completions", "/v1/responses", "/v1/chat/completions/", "/tokenize"):
                for raw in bodies:
                    async with r.http.post(r.url + path, data=raw, headers=t) as c:
                        assert c.status == 400, (path, raw[:40], c.status)
                        assert (await c.json())["error"]["message"]
                        assert c.headers["X-Request-Id"]
            await asyncio.sleep(0.5)
            assert sum(rec.get("ServerErrors", 0) for rec in r.emf()) == 0

    run(go)


def test_an_exception_in_a_handler_is_a_counted_500_with_a_request_id(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with running(settings()) as r:

            async def broken(request: object, path: str) -> object:
                raise RuntimeError("boom")

            r.agent.generate = broken  # type: ignore[assignment,method-assign]
            headers = {"X-Request-Id": "req-42"}
            async with r.http.post(r.url + "/v1/completions", json={"prompt": "x"}, headers=headers) as c:
                assert c.status == 500 and "req-42" in (await c.json())["error"]["message"]
            await asyncio.sleep(0.5)
            assert sum(rec.get("ServerErrors", 0) for rec in r.emf()) == 1

    run(go)
    assert any("req-42" in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_routes_outside_the_table_are_404_and_trailing_slashes_are_isolated_and_admitted() -> None:
    async def go() -> None:
        s = settings(tenant_header="X-Tenant", tenant_secret=b"s3cret")
        async with running(s) as r:
            for path in ("/v1/load_lora_adapter", "/reset_prefix_cache", "/v1/audio/transcriptions", "/sleep"):
                async with r.http.post(r.url + path, json={}) as c:
                    assert c.status == 404, path
            body = {"prompt": "x", "max_tokens": 1, "cache_salt": "tenant-b"}
            for path in ("/v1/completions/", "/v1/responses", "/v1/messages", "/v1/chat/completions/"):
                async with r.http.post(r.url + path, json=body) as c:
                    assert c.status == 400 and "X-Tenant" in (await c.json())["error"]["message"], path
            async with r.http.post(r.url + "/v1/completions/", json=body, headers={"X-Tenant": "a"}) as c:
                assert c.status == 200
                assert (await c.json())["echo"]["cache_salt"] == cache_salt(b"s3cret", "a")
        s = settings(engine_command=fake_engine_command(token_delay=0.05), token_budget=150, admission_factor=1.0)
        async with running(s) as r:
            first = asyncio.create_task(stream_completion(r.http, r.url, max_tokens=100))
            await asyncio.sleep(0.3)
            for path in ("/v1/completions/", "/v1/responses", "/v1/messages", "/v1/chat/completions/"):
                async with r.http.post(r.url + path, json={"prompt": "x", "max_tokens": 100}) as c:
                    assert c.status == 429, path
            assert (await first)["status"] == 200

    run(go)


def test_a_percent_escaped_path_is_404_so_no_escape_reaches_an_internal_route() -> None:
    """The load balancer's rule keeps /metrics and /drain from clients by the path as sent and cannot name "%"; the
    agent's router would decode "/%6Detrics" to /metrics, so the agent refuses every escaped path itself."""
    from yarl import URL

    async def go() -> None:
        async with running(settings()) as r:
            for method, path in (("GET", "/%6Detrics"), ("POST", "/dr%61in"), ("POST", "/v1/chat/%63ompletions")):
                url = URL(r.url + path, encoded=True)
                async with r.http.request(method, url, json={}) as c:
                    assert c.status == 404, path
                    assert "percent-escapes" in (await c.json())["error"]["message"]
            async with r.http.get(r.url + contract.METRICS_ROUTE) as c:  # the plain form, from the instance itself
                assert c.status == 200

    run(go)


def test_client_disconnect_counts_client_cancelled_not_a_server_error() -> None:
    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.05))) as r:
            async with aiohttp.ClientSession() as other:
                resp = await other.post(
                    r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100, "stream": True}
                )
                await resp.content.readany()
                resp.close()
            await asyncio.sleep(1.0)
            recs = r.emf()
            assert sum(rec.get("ServerErrors", 0) for rec in recs) == 0
            assert sum(rec.get("ClientCancelled", 0) for rec in recs) == 1
            async with r.http.get(r.url + "/metrics") as m:
                assert 'kvfleet_client_cancelled_total{deployment="test-chat"} 1.0' in await m.text()

    run(go)


def test_streams_and_plain_answers_under_uvloop_the_loop_the_image_runs() -> None:
    # uvloop's transports are not asyncio.Transport subclasses: the engine client must not assume they are.
    import uvloop

    async def go() -> None:
        async with running(settings(engine_command=fake_engine_command(capacity=16))) as r:
            streams = await asyncio.gather(*(stream_completion(r.http, r.url, max_tokens=20) for _ in range(8)))
            assert all(x["status"] == 200 and x["done"] and len(x["events"]) == 21 for x in streams)
            async with r.http.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as c:
                assert c.status == 200 and (await c.json())["choices"][0]["text"] == " tok" * 3
            async with r.http.get(r.url + "/v1/models?x=%C3%A9&y=a%20b") as m:
                assert m.status == 200

    uvloop.run(asyncio.wait_for(go(), 60))


def test_request_log_lines_leave_together_and_within_the_flush_interval() -> None:
    from kvfleet.agent.request_log import REQUEST_LOG_FLUSH_S

    async def go() -> tuple[int, int, int]:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.0, capacity=32))) as r:
            writes: list[str] = []
            real = r.stdout.write

            def counted(text: str) -> int:
                writes.append(text)
                return real(text)

            r.stdout.write = counted  # type: ignore[method-assign]
            body = {"prompt": "a b", "max_tokens": 2}
            answers = await asyncio.gather(*(r.http.post(r.url + "/v1/completions", json=body) for _ in range(20)))
            assert all(a.status == 200 for a in answers)
            await asyncio.sleep(REQUEST_LOG_FLUSH_S + 0.25)  # no flush asked for: the timer writes them
            logged = sum(t.count('"status"') for t in writes)
            return logged, len([t for t in writes if '"status"' in t]), len(r.request_log())

    logged, writes, lines = run(go)
    assert logged == lines == 20
    assert writes < 20  # one write for many requests, not a write each


def test_request_log_has_one_line_per_generation_that_kvfleet_workload_reads(tmp_path: Path) -> None:
    from kvfleet.workload.profile import profile
    from kvfleet.workload.traces import read_trace

    async def go() -> list[dict[str, Any]]:
        async with running(settings(engine_command=fake_engine_command(token_delay=0.01))) as r:
            plain = await r.http.post(r.url + "/v1/completions", json={"prompt": "a b c d", "max_tokens": 5})
            assert plain.status == 200
            streamed = await stream_completion(r.http, r.url, max_tokens=7)
            assert streamed["status"] == 200
            usage = await stream_completion(r.http, r.url, max_tokens=9, stream_options={"include_usage": True})
            assert usage["status"] == 200
            bad = await r.http.post(r.url + "/v1/completions", data=b"{not json")
            assert bad.status == 400
            return r.request_log()

    lines = run(go)
    f = contract.REQUEST_LOG_FIELDS
    assert [x[f.status] for x in lines] == [200, 200, 200, 400]
    plain, streamed, with_usage, _ = lines
    assert plain[f.output_tokens] == 5 and plain[f.prompt_tokens] == 4  # the engine's usage
    assert streamed[f.output_tokens] == 7  # counted events: the client asked for no usage
    assert with_usage[f.output_tokens] == 9
    assert all(0 <= x[f.ttft_s] <= x[f.e2e_s] for x in lines)
    assert streamed[f.ttft_s] < streamed[f.e2e_s]
    assert not any("a b c d" in json.dumps(x) for x in lines)  # no prompt text
    log = tmp_path / "agent.log"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = read_trace(log)
    assert trace.fmt == "kvfleet" and len(trace) == 3  # the 400 has no prompt: not a request the engine saw
    assert profile(trace).output_tokens.max == 9


def test_admission_follows_the_engines_cache_where_it_is_smaller_than_the_plans(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine sizes its cache at start-up from the memory it finds; where that is less than the plan's (a cold
    first boot, another driver), admitting by the plan would queue and preempt in the engine instead of shedding.
    The fake engine reports 2 x 64 blocks of 16 tokens, 2,048 tokens, against a plan of 100,000."""
    caplog.set_level("INFO", logger="kvfleet.agent.server")

    async def budget(r: Any) -> str:
        async with r.http.get(r.url + "/metrics") as m:
            lines = [x for x in (await m.text()).splitlines() if x.startswith("kvfleet_admission_budget_tokens{")]
        return lines[0].rsplit(" ", 1)[1] if lines else ""

    async def go() -> None:
        s = settings(
            engine_command=fake_engine_command(token_delay=0.05, capacity=2), token_budget=100_000, admission_factor=1.0
        )
        async with running(s) as r:
            assert r.agent.admission.budget_tokens == 100_000  # the plan's, until the first scrape
            for _ in range(50):
                await asyncio.sleep(0.1)
                if r.agent.admission.budget_tokens != 100_000:
                    break
            assert r.agent.admission.budget_tokens == 2048
            assert await budget(r) == "2048"
            # Two requests of up to 1,024 tokens (max_model_len) hold the engine's 2,048; a third is shed here.
            body = {"prompt": "x", "max_tokens": 1000, "stream": True}
            held = [asyncio.create_task(stream_completion(r.http, r.url, max_tokens=1000)) for _ in range(2)]
            await asyncio.sleep(0.3)
            async with r.http.post(r.url + "/v1/completions", json=body) as c:
                assert c.status == 429
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        warned = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
        assert any("2048 KV tokens" in m and "98% fewer than the plan's 100000" in m for m in warned), warned
        assert any("admission now holds the replica to 2048 tokens" in m for m in warned), warned
        # A plan smaller than the engine's cache keeps its own budget, and nothing is reported as a shortfall.
        caplog.clear()
        async with running(settings(engine_command=fake_engine_command(capacity=2), token_budget=1000)) as r:
            await asyncio.sleep(1.0)
            assert r.agent.admission.budget_tokens == int(1000 * contract.ADMISSION_FACTOR)
        assert not [rec for rec in caplog.records if rec.levelname == "WARNING" and "KV tokens" in rec.getMessage()]

    run(go)
