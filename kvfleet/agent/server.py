"""The agent's HTTP side: SageMaker and OpenAI routes streamed through to the engine, readiness, drain.

Draining answers what the engines get wrong (measured on vLLM 0.32): readiness turns 503 at once,
new requests get 503 with Retry-After (never 500), in-flight requests run to completion within the
drain budget, and past it every remaining stream ends with an error event instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

import aiohttp
from aiohttp import http_exceptions, web

from kvfleet import contract
from kvfleet.agent import metrics, routes, upstream
from kvfleet.agent.admission import Admission, prompt_tokens, request_tokens
from kvfleet.agent.engine import EngineSupervisor
from kvfleet.agent.gate import MAX_BODY_BYTES, BadRequest, parse_body
from kvfleet.agent.request_log import RequestLog
from kvfleet.agent.settings import AgentSettings
from kvfleet.agent.signals import SignalLoop
from kvfleet.agent.tenancy import apply_salt

log = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after the budget: time for aborted streams to write their error event and close


@dataclass(eq=False)
class Flight:
    """One request in progress."""

    task: asyncio.Task[Any] | None
    aborted: bool = False


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Marks a 503 the agent chose (draining, engine starting) for the middleware that counts 5xx; read only on a 5xx.
_DELIBERATE = web.ResponseKey("kvfleet.deliberate", bool)
# 501 is the engine declining a feature the model lacks (vLLM maps NotImplementedError to it: vllm/entrypoints/
# serve/exception_handling/error_response.py, e.g. /v1/decisions on a model without that API, 0.33 on); any client
# can draw it at will, so it is not a server error that a rollback alarm should see.
_NOT_A_FAILURE = frozenset({501})
_QUERY_SAFE = "!$&'()*+,/:;=?@[]~%"  # RFC 3986 query characters, and escapes already made
_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(slots=True, kw_only=True)
class _Exchange:
    """What one request's handling learns, for the middleware and the request log. One object stored once: the
    aiohttp request's own mapping raises and catches KeyError for every absent key it is asked for, which was a
    tenth of the agent's CPU per request."""

    request_id: str
    failed: bool = False  # a stream that began 200 and ended with the engine's failure
    first_byte_s: float | None = None
    usage: dict[str, Any] | None = None
    events: int | None = None
    prompt_estimate: int = 0
    tenant_hash: str = ""


_EXCHANGE = web.RequestKey("kvfleet.exchange", _Exchange)
_LAST_KEPT = 4096  # bytes of a stream's end kept for its usage event


def _usage_of(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a JSON response, or of the last server-sent event that carries one."""
    candidates = [body] if not body.lstrip().startswith(b"data:") and b"\ndata: " not in body else []
    for line in reversed(body.split(b"\n")):
        if line.startswith(b"data: ") and b'"usage"' in line:
            candidates.append(line[len(b"data: ") :])
            break
    for text in candidates:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            continue
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


class _ClientGone(Exception):
    """The client closed its connection while the agent was writing to it."""


def _json_error(status: int, message: str, kind: str, *, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status, headers=headers
    )


def _not_allowed(request: web.BaseRequest, methods: Iterable[str]) -> web.Response:
    resp = _json_error(405, f"{request.method} is not allowed on {request.path}", "invalid_request_error")
    resp.headers["Allow"] = ", ".join(sorted(methods))
    return resp


def _sse_error(message: str, kind: str, code: int) -> bytes:
    event = json.dumps({"error": {"message": message, "type": kind, "code": code}})
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        engine: EngineSupervisor | None = None,
        stdout: IO[str] | None = None,
        publisher: metrics.CloudWatchPublisher | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine or EngineSupervisor(settings)
        self.admission = Admission(budget_tokens=settings.admitted_tokens)
        # The agent starts the engine, so the engine's counters begin at zero with it: nothing is lost to
        # a baseline taken while the first requests are already running.
        self.collector = metrics.SignalCollector(
            engine=settings.engine,
            engine_version=settings.engine_version,
            counters_from_zero=True,
            max_num_seqs=settings.engine_args.max_num_seqs,
            data_parallel_size=settings.engine_args.data_parallel_size or 1,
        )
        self.publisher = publisher
        self.stdout = stdout or sys.stdout
        self.draining = False
        self.drained: bool | None = None  # after a drain: True when nothing had to be aborted
        self.flights: set[Flight] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_task: asyncio.Task[bool] | None = None
        self._pool: upstream.EnginePool | None = None  # proxied requests
        self._runner: web.ServerRunner | None = None
        self._background: list[asyncio.Task[Any]] = []
        self.request_log = RequestLog(self.stdout)
        self.signals = SignalLoop(
            settings,
            engine=self.engine,
            admission=self.admission,
            collector=self.collector,
            publisher=publisher,
            stdout=self.stdout,
        )
        self.shutdown_requested = asyncio.Event()
        # The agent's own routes (HEAD with GET, as HTTP has it); every other path is the engine's route table.
        self._own: dict[str, tuple[frozenset[str], _Handler]] = {
            contract.HEALTH_ROUTE: (frozenset({"GET", "HEAD", "POST"}), self.ping),
            contract.LIVENESS_ROUTE: (frozenset({"GET", "HEAD"}), self.alive),
            contract.METRICS_ROUTE: (frozenset({"GET", "HEAD"}), self.prometheus),
            contract.DRAIN_ROUTE: (frozenset({"POST"}), self.drain_route),
        }

    # ---- lifecycle ---------------------------------------------------------------------------------

    def _make_server(self) -> web.Server:
        """aiohttp's low-level server: no application, router or middleware chain on each request (about a
        fifth of the agent's CPU per request); four fixed routes and the route table need none of them."""
        loop = asyncio.get_running_loop()

        def request(
            message: Any, payload: Any, protocol: Any, writer: Any, task: asyncio.Task[None]
        ) -> web.BaseRequest:
            # A large client_max_size: prompts of long-context models are megabytes of JSON.
            return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=MAX_BODY_BYTES)

        # No access log: a formatted line per request was an eighth of the agent's CPU per request, and the request
        # log (settings.request_log) is the record kvfleet reads. ServerRunner's own access_log argument never
        # reaches a server it is handed, so it is said here.
        return web.Server(self._serve, request_factory=request, keepalive_timeout=75, access_log=None)

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.headers.get("Expect"):  # before any handler reads the body, as aiohttp's router does
            refused = await _expect(request)
            if refused is not None:
                return refused
        return await self._guard(request, self._route)

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        if "%" in request.raw_path.partition("?")[0]:
            # No route of the agent's or the engine's needs an escape, and a load balancer's path rules compare the
            # path as sent: "/%6Detrics" must not reach what "/metrics" is kept from (aiohttp decodes it).
            return _json_error(404, "a path with percent-escapes is not served by this endpoint", "not_found_error")
        own = self._own.get(request.path)
        if own is None:
            # Every other path goes through the route table (kvfleet.agent.routes): anything not in it is 404.
            return await self.dispatch(request)
        methods, handler = own
        if request.method not in methods:
            return _not_allowed(request, methods)
        return await handler(request)

    async def _guard(self, request: web.BaseRequest, handler: _Handler) -> web.StreamResponse:
        """Every response: a request id, aiohttp's own errors as JSON, an exception as a logged, counted 500,
        and ServerErrors counted once for each 5xx the agent sent (its own and the engine's; not the engine's 501)."""
        given = request.headers.get(REQUEST_ID_HEADER, "")
        rid = given if given and _REQUEST_ID.fullmatch(given) else os.urandom(16).hex()  # as random as uuid4, cheaper
        ex = request[_EXCHANGE] = _Exchange(request_id=rid)
        try:
            resp = await handler(request)
        except web.HTTPException as exc:  # 413 (body too large), 405, ...
            resp = _json_error(exc.status, exc.reason, "invalid_request_error" if exc.status < 500 else "server_error")
        except Exception:
            log.exception("%s %s failed: answered 500 (request id %s)", request.method, request.path, rid)
            resp = _json_error(500, f"the agent failed on this request (request id {rid})", "server_error")
        if ex.failed or (resp.status >= 500 and resp.status not in _NOT_A_FAILURE and not resp.get(_DELIBERATE)):
            self._server_error()
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = rid
        return resp

    async def start(self, *, serve: bool = True) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        # No cookie jar, no decompression: the engine sets no cookies and the body passes through as is;
        # both cost time on every request otherwise.
        self.signals.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        engine = urllib.parse.urlsplit(self.settings.engine_url)
        assert engine.hostname is not None and engine.port is not None
        self._pool = upstream.EnginePool(engine.hostname, engine.port, keep_alive_s=self.settings.engine_keep_alive_s)
        self.engine.start()
        self._background.append(asyncio.create_task(self.signals.run(), name="metrics"))
        if serve:
            self._runner = web.ServerRunner(self._make_server(), handle_signals=False)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.settings.host, self.settings.port, backlog=1024)
            await site.start()
            log.info("serving on %s:%d", self.settings.host, self.settings.port)

    def add_background(self, coro: Awaitable[Any], name: str) -> None:
        self._background.append(asyncio.ensure_future(coro))
        self._background[-1].set_name(name)

    def request_shutdown(self) -> None:
        if not self.shutdown_requested.is_set():
            log.info("shutdown requested: draining (budget %.0f s)", self.settings.drain_budget_s)
            self.draining = True  # readiness flips now, before anything else runs
            self.shutdown_requested.set()

    async def shutdown(self) -> None:
        await self.drain()
        self.request_log.flush()
        await self.signals.publish_once()  # the last interval's signals
        for t in self._background:
            t.cancel()
        for t in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.engine.stop(timeout=30)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.signals.session is not None:
            await self.signals.session.close()
        if self._pool is not None:
            self._pool.close()

    # ---- drain -------------------------------------------------------------------------------------

    async def drain(self) -> bool:
        """Stop admitting, let in-flight requests finish within the budget, abort what remains."""
        if self._drain_task is None:
            self.draining = True
            self._drain_task = asyncio.create_task(self._drain(), name="drain")
        return await asyncio.shield(self._drain_task)

    async def _drain(self) -> bool:
        budget = self.settings.drain_budget_s
        n = len(self.flights)
        log.info("draining: %d request(s) in flight, budget %.0f s", n, budget)
        try:
            await asyncio.wait_for(self._idle.wait(), budget)
            self.drained = True
            log.info("drained: every in-flight request completed")
            return True
        except TimeoutError:
            pass
        remaining = list(self.flights)
        log.warning("drain budget of %.0f s passed: ending %d request(s) with an error", budget, len(remaining))
        for f in remaining:
            f.aborted = True
            if f.task is not None:
                f.task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)
        self.drained = False
        return False

    async def drain_route(self, request: web.BaseRequest) -> web.StreamResponse:
        # Only hooks inside the instance or pod (preStop, lifecycle) may drain: never a client.
        if not _is_loopback(request.remote):
            return _json_error(403, "drain is accepted from the local host only", "forbidden")
        if request.query.get("wait") in ("1", "true"):
            clean = await self.drain()
            return web.json_response({"drained": True, "clean": clean})
        task = asyncio.create_task(self.drain())
        self._background.append(task)
        return web.json_response({"draining": True}, status=202)

    def _unavailable(self, why: str) -> web.Response:
        resp = _json_error(503, why, "service_unavailable", retry_after=self.settings.retry_after_s)
        resp[_DELIBERATE] = True
        return resp

    # ---- routes ------------------------------------------------------------------------------------

    async def ping(self, request: web.BaseRequest) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.engine.ready:
            return web.json_response({"status": str(self.engine.state)}, status=503)
        return web.json_response({"status": "ok"})

    async def alive(self, request: web.BaseRequest) -> web.Response:
        """The replica as its host sees it (contract.LIVENESS_ROUTE): a restart within the budget is alive, one that
        has not brought the engine back by then has failed. Not a server error: a deliberate answer, polled often."""
        if self.draining:
            return web.json_response({"status": "draining"})
        down = self.engine.down_s()
        budget = self.settings.restart_budget_s + self.engine.restart_overhead_s
        body = {"down_s": round(down, 1), "budget_s": round(budget, 1), "restarts": self.engine.restarts}
        if self.engine.ready:
            return web.json_response({"status": "ready", **body})
        if down <= budget:
            # Starting: the first start (the group's grace period covers a longer one); restarting: a later one.
            status = "restarting" if self.engine.restarts else "starting"
            return web.json_response({"status": status, "engine": str(self.engine.state), **body})
        resp = web.json_response({"status": "failed", "engine": str(self.engine.state), **body}, status=503)
        resp[_DELIBERATE] = True
        return resp

    async def prometheus(self, request: web.BaseRequest) -> web.Response:
        own = (
            "# HELP kvfleet_agent_draining 1 while the replica drains.\n# TYPE kvfleet_agent_draining gauge\n"
            f'kvfleet_agent_draining{{deployment="{self.settings.deployment}"}} {int(self.draining)}\n'
            "# HELP kvfleet_agent_requests_in_flight Requests the agent is serving: forwarded, or streaming back.\n"
            "# TYPE kvfleet_agent_requests_in_flight gauge\n"
            f'kvfleet_agent_requests_in_flight{{deployment="{self.settings.deployment}"}} {len(self.flights)}\n'
            "# HELP kvfleet_engine_ready 1 when the engine answers its health check.\n"
            "# TYPE kvfleet_engine_ready gauge\n"
            f'kvfleet_engine_ready{{deployment="{self.settings.deployment}"}} {int(self.engine.ready)}\n'
            "# HELP kvfleet_engine_restarts_total Engine restarts after it died.\n"
            "# TYPE kvfleet_engine_restarts_total counter\n"
            f'kvfleet_engine_restarts_total{{deployment="{self.settings.deployment}"}} {self.engine.restarts}\n'
            "# HELP kvfleet_admission_reserved_tokens Tokens reserved by admitted requests.\n"
            "# TYPE kvfleet_admission_reserved_tokens gauge\n"
            f'kvfleet_admission_reserved_tokens{{deployment="{self.settings.deployment}"}} '
            f"{self.admission.reserved_tokens}\n"
        )
        if self.admission.budget_tokens is not None:
            own += (
                "# HELP kvfleet_admission_budget_tokens Tokens admitted requests may reserve: the plan's KV cache, "
                "or the engine's where smaller, times the admission factor.\n"
                "# TYPE kvfleet_admission_budget_tokens gauge\n"
                f'kvfleet_admission_budget_tokens{{deployment="{self.settings.deployment}"}} '
                f"{self.admission.budget_tokens}\n"
            )
        text = self.collector.prometheus_text(deployment=self.settings.deployment) + own
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every engine route, by the route table: generation routes are gated, isolated and admitted;
        read-only ones are forwarded; anything else is 404 here and never reaches the engine."""
        found = routes.lookup(request.path)
        if found is None:
            return _json_error(404, f"{request.path} is not served by this endpoint", "not_found_error")
        path, route = found
        if request.method not in route.methods:
            return _not_allowed(request, route.methods)
        if self.draining:
            return self._unavailable("replica is draining; retry on another replica")
        if not self.engine.ready:
            return self._unavailable("engine is starting")
        if route.generates:
            return await self.generate(request, path)
        try:
            data = await self._read_body(request)
            if data:
                parse_body(data)
        except BadRequest as err:
            return _json_error(400, str(err), "invalid_request_error")
        # The query as the client encoded it, re-quoted so that the request line stays printable ASCII.
        query = urllib.parse.quote(request.rel_url.raw_query_string, safe=_QUERY_SAFE, errors="surrogateescape")
        target = path + (f"?{query}" if query else "")
        return await self._forward(request, target, data, method=request.method)

    async def generate(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        arrived, started = time.time(), time.monotonic()
        resp = await self._generate(request, path)
        if self.settings.request_log:
            self._log_request(request, resp, arrived=arrived, started=started)
        return resp

    def _log_request(
        self, request: web.BaseRequest, resp: web.StreamResponse, *, arrived: float, started: float
    ) -> None:
        """One line per generation request for `kvfleet workload` (kvfleet.contract.REQUEST_LOG_FIELDS): no text,
        and the tenant only as a hash of its cache salt."""
        f = contract.REQUEST_LOG_FIELDS
        ex = request[_EXCHANGE]
        usage = ex.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        now = time.monotonic()
        prompt = usage.get("prompt_tokens", ex.prompt_estimate)
        output = usage.get("completion_tokens", ex.events or 0)
        record = {
            contract.REQUEST_LOG_KIND_KEY: contract.REQUEST_LOG_KIND,
            f.time: round(arrived, 3),
            f.tenant: ex.tenant_hash,
            f.prompt_tokens: prompt if isinstance(prompt, int) else 0,
            f.cached_tokens: cached if isinstance(cached, int) else 0,
            f.output_tokens: output if isinstance(output, int) else 0,
            f.ttft_s: round((ex.first_byte_s or now) - started, 4),
            f.e2e_s: round(now - started, 4),
            f.status: resp.status,
        }
        self.request_log.add(json.dumps(record, separators=(",", ":")) + "\n")

    async def _generate(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        try:
            raw = await self._read_body(request)
            body = parse_body(raw)
        except BadRequest as err:
            return _json_error(400, str(err), "invalid_request_error")
        if path == "/invocations":
            # SageMaker's contract has one route; the body's shape says which OpenAI route it is.
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        changed = False
        s = self.settings
        if s.tenant_isolation:
            assert s.tenant_header is not None and s.tenant_secret is not None
            tenant = request.headers.get(s.tenant_header)
            if not tenant:
                return _json_error(400, f"missing tenant header {s.tenant_header}", "invalid_request_error")
            if not _utf8(tenant):  # bytes that are not UTF-8 arrive as surrogates, which have no salt
                return _json_error(400, f"tenant header {s.tenant_header} is not UTF-8", "invalid_request_error")
            apply_salt(body, secret=s.tenant_secret, tenant=tenant)
            changed = True
            if s.request_log:
                salt = str(body.get("cache_salt", ""))
                request[_EXCHANGE].tenant_hash = hashlib.sha256(salt.encode()).hexdigest()[:16]
        prompt = prompt_tokens(body)
        tokens = request_tokens(body, max_model_len=s.max_model_len, prompt=prompt)
        if s.request_log:
            request[_EXCHANGE].prompt_estimate = prompt
        if not self.admission.try_reserve(tokens):
            self.collector.record(contract.REQUESTS_SHED.name, 1)
            return _json_error(
                429,
                f"replica at its token budget ({self.admission.budget_tokens} tokens reserved or queued); retry",
                "rate_limit_exceeded",
                retry_after=self.admission.retry_after_s(tokens, default=s.retry_after_s),
            )
        try:
            data = json.dumps(body).encode() if changed else raw
            return await self._forward(request, path, data, method="POST")
        finally:
            self.admission.release(tokens)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        """The request body (decoded per Content-Encoding, bounded by client_max_size). Failing to read it is
        the client's doing: a 400, and a disconnect is counted as one, never as a server error."""
        try:
            return await request.read()
        except http_exceptions.HttpProcessingError as err:
            raise BadRequest(f"request body could not be read: {ascii(err.message)[1:-1][:200]}") from None
        except web.RequestPayloadError as err:  # aiohttp's wrapper: a Content-Encoding that does not decode, say
            cause = err.__cause__ or err
            reason = cause.message if isinstance(cause, http_exceptions.HttpProcessingError) else str(cause)
            raise BadRequest(f"request body could not be read: {ascii(reason)[1:-1][:200]}") from None
        except (ConnectionError, asyncio.IncompleteReadError):
            self.collector.record(contract.CLIENT_CANCELLED.name, 1)
            raise BadRequest("request body incomplete: the client closed the connection") from None

    # ---- proxying ----------------------------------------------------------------------------------

    def _enter(self) -> Flight:
        f = Flight(task=asyncio.current_task())
        self.flights.add(f)
        self._idle.clear()
        return f

    def _leave(self, f: Flight) -> None:
        self.flights.discard(f)
        if not self.flights:
            self._idle.set()

    def _server_error(self) -> None:
        self.collector.record(contract.SERVER_ERRORS.name, 1)

    async def _forward(self, request: web.BaseRequest, path: str, data: bytes, *, method: str) -> web.StreamResponse:
        assert self._pool is not None
        ex = request[_EXCHANGE]
        flight = self._enter()
        headers = _engine_headers(request)
        conn: upstream.Connection | None = None
        resp: web.StreamResponse | None = None
        pipe: _Pipe | None = None
        try:
            # Redirects are never followed: a redirected request would skip the route table.
            conn = await self._pool.request(method, path, data, headers)
            assert conn.head is not None
            status, ctype = conn.head.status, conn.head.headers.get("content-type", "application/json")
            if "text/event-stream" not in ctype or method == "HEAD" or status in (204, 304):
                return await self._whole(conn, ex, status, ctype)
            resp = web.StreamResponse(status=status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
            resp.headers[REQUEST_ID_HEADER] = ex.request_id
            framed = request.version >= aiohttp.HttpVersion11
            if framed:
                resp.enable_chunked_encoding()
            # aiohttp sends a StreamResponse's head at once (StreamResponse._send_headers_immediately), so from
            # here on the body goes straight to the client's transport from the engine connection's callback,
            # the first token included: no task wake-up per chunk (the proxy's main cost), and none on the way to
            # the first token either, which under a burst waited behind every other ready callback.
            await _to_client(resp.prepare(request))
            pipe = _Pipe(request, conn, framed=framed, exchange=ex)
            conn.pipe(pipe.write)
            await conn.finished()
            await _to_client(resp.write_eof())
            if self.settings.request_log:
                _log_stream(ex, pipe)
            return resp
        except _ClientGone:
            # The client went away mid-response; the engine's connection is closed, which ends its request too.
            self.collector.record(contract.CLIENT_CANCELLED.name, 1)
            assert resp is not None
            return resp
        except asyncio.CancelledError:
            if pipe is not None:
                pipe.detach()
            if not flight.aborted:
                if not self.draining:
                    self.collector.record(contract.CLIENT_CANCELLED.name, 1)
                raise  # not ours: the client or the server is going away
            msg = "the replica shut down before this request completed (drain budget exceeded); retry it"
            if resp is None:
                return self._unavailable(msg)
            await _end_stream(resp, pipe, msg, "server_shutdown", 503)
            return resp
        except upstream.EngineError as err:
            return await self._engine_failed(err, ex, resp, pipe)
        finally:
            if conn is not None:
                self._pool.release(conn)  # closed unless its exchange completed: the engine drops that request
            self._leave(flight)

    async def _engine_failed(
        self, err: upstream.EngineError, ex: _Exchange, resp: web.StreamResponse | None, pipe: _Pipe | None
    ) -> web.StreamResponse:
        """The engine went away mid-request (it died, or it is restarting): 503 and Retry-After, counted as a server
        error by the middleware; a stream already under way ends with an error event."""
        if pipe is not None:
            pipe.detach()
        msg = f"the engine failed during this request ({err}); retry it"
        if resp is None:
            return _json_error(503, msg, "engine_error", retry_after=self.settings.retry_after_s)
        ex.failed = True
        await _end_stream(resp, pipe, msg, "engine_error", 502)
        return resp

    async def _whole(self, conn: upstream.Connection, ex: _Exchange, status: int, ctype: str) -> web.Response:
        """A response that is not a stream (an error, a buffered answer, HEAD), read whole and passed on."""
        body = await conn.read()
        ex.first_byte_s = time.monotonic()
        logged = self.settings.request_log and status == 200 and b'"usage"' in body
        if logged and (usage := _usage_of(body)) is not None:
            ex.usage = usage
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})


class _Pipe:
    """Streams the engine's body bytes to the client's transport from the engine connection's callback.

    Chunked framing is written here (aiohttp wrote the head with ``Transfer-Encoding: chunked`` and writes the
    last chunk). A client that reads slower than the engine writes pauses the engine connection instead of
    buffering without bound."""

    HIGH_WATER = 256 * 1024
    RECHECK_S = 0.02

    def __init__(
        self, request: web.BaseRequest, conn: upstream.Connection, *, framed: bool, exchange: _Exchange
    ) -> None:
        transport = request.transport
        assert transport is not None
        self._transport = transport
        self._conn: upstream.Connection | None = conn
        self._framed = framed
        self._loop = asyncio.get_running_loop()
        self._exchange: _Exchange | None = exchange  # until the first bytes: their time is the request's TTFT
        self.events = 0  # server-sent events passed on (for the request log)
        # The stream's end as sent, trimmed now and then rather than on every write (a copy per event otherwise);
        # before any event it is on an event boundary.
        self._end = bytearray(b"\n\n")

    @property
    def last(self) -> bytes:
        """The stream's last bytes: where a usage event would be."""
        return bytes(self._end[-_LAST_KEPT:])

    @property
    def tail(self) -> bytes:
        """The last two bytes sent: an error event must start on an event boundary."""
        return bytes(self._end[-2:])

    def write(self, data: bytes) -> None:
        transport = self._transport
        if transport.is_closing():
            self._gone()
            return
        if self._exchange is not None:
            self._exchange.first_byte_s = time.monotonic()
            self._exchange = None
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._framed else data)
        self.events += data.count(b"data: ")
        end = self._end
        end += data
        if len(end) > 4 * _LAST_KEPT:
            del end[:-_LAST_KEPT]
        if transport.get_write_buffer_size() > self.HIGH_WATER and self._conn is not None:
            self._conn.pause()
            self._loop.call_later(self.RECHECK_S, self._recheck)

    def _recheck(self) -> None:
        if self._conn is None:
            return
        if self._transport.is_closing():
            self._gone()
        elif self._transport.get_write_buffer_size() > self.HIGH_WATER // 4:
            self._loop.call_later(self.RECHECK_S, self._recheck)
        else:
            self._conn.resume()

    def _gone(self) -> None:
        if self._conn is not None:
            self._conn.abort(_ClientGone())
            self._conn = None

    def detach(self) -> None:
        """No more bytes from the engine reach the client (an error event follows instead)."""
        if self._conn is not None:
            self._conn.detach()
            self._conn = None


async def _end_stream(resp: web.StreamResponse, pipe: _Pipe | None, msg: str, kind: str, code: int) -> None:
    """Ends a stream under way with an error event, on an event boundary."""
    tail = pipe.tail if pipe is not None else b"\n\n"
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write(b"" if tail == b"\n\n" else b"\n\n")
        await resp.write(_sse_error(msg, kind, code))
        await resp.write_eof()


async def _expect(request: web.BaseRequest) -> web.StreamResponse | None:
    """The Expect header: aiohttp's own handler puts the value in its 417 and fails with a 500 on a value that
    is not UTF-8; this one answers 100-continue as aiohttp does and anything else with a 417 in JSON."""
    if request.version != aiohttp.HttpVersion11:
        return None
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None
    return _json_error(
        417, f"Expect {ascii(expect)[:80]} is not supported (only 100-continue)", "invalid_request_error"
    )


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _engine_headers(request: web.BaseRequest) -> dict[str, str]:
    """Only what the engine needs, and only as printable ASCII: the request goes out as one ASCII write."""
    headers = {"Content-Type": _header_value(request.headers.get("Content-Type")) or "application/json"}
    accept = _header_value(request.headers.get("Accept"))
    if accept:
        headers["Accept"] = accept
    return headers


def _log_stream(ex: _Exchange, pipe: _Pipe) -> None:
    """Events with a token (the [DONE] line and a usage event are not); the engine's usage wins when the client asked
    for it (stream_options.include_usage): under load one event can hold several."""
    ex.events = max(0, pipe.events - 1)
    if b'"usage"' in pipe.last and (usage := _usage_of(pipe.last)) is not None:
        ex.usage = usage


def _header_value(value: str | None) -> str | None:
    """A header value to forward: printable ASCII only (anything else is dropped, never sent on)."""
    if value is None or not value.isascii() or not value.isprintable():
        return None
    return value


async def _to_client(write: Awaitable[Any]) -> None:
    """A write to the client; its failure is the client's disconnect, never the engine's."""
    try:
        await write
    except (ConnectionError, RuntimeError) as err:  # aiohttp's ClientConnectionResetError is a ConnectionError
        raise _ClientGone from err


def _is_loopback(remote: str | None) -> bool:
    if remote is None:
        return False
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
