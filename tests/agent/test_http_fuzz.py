"""The agent's HTTP surface under generated hostile requests, in front of the fake engine.

Requests go out as raw bytes (an HTTP client library would refuse or repair most of them): random methods,
paths (encoded, dot segments, trailing slashes, very long, raw non-ASCII), headers (tenant header variants,
huge values, bytes that are not UTF-8, contradictory framing), bodies (OpenAI completion and chat requests
with wrong types, huge numbers, deep nesting, non-UTF-8, truncated, gzip-encoded, chunked). Whatever comes
in, the agent answers below 500 (the engine is healthy and nothing drains, so no 503 is deliberate here),
within a timeout, counts no ServerErrors, and serves a normal request afterwards.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import urllib.parse
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet import contract
from kvfleet.agent import routes
from kvfleet.agent.gate import INTEGER_FIELDS, INTEGER_OR_BOOL_FIELDS, MAX_DEPTH, NUMBER_FIELDS
from tests.agent import harness

T = TypeVar("T")
TENANT = "X-Tenant"
EXCHANGE_TIMEOUT_S = 10.0
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Live:
    """The agent (tenant isolation on) and its fake engine, on an event loop in a thread for the whole module:
    hypothesis runs plain functions, and one agent for every example keeps the suite fast."""

    loop: asyncio.AbstractEventLoop
    running: harness.Running
    port: int

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def server_errors(self) -> float:
        return self.running.agent.collector.totals.get(contract.SERVER_ERRORS.name, 0.0)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    s = harness.settings(
        tenant_header=TENANT,
        tenant_secret=b"fuzz",
        engine_command=harness.fake_engine_command(token_delay=0.0, capacity=64),
    )
    cm = harness.running(s)
    r = asyncio.run_coroutine_threadsafe(cm.__aenter__(), loop).result(90)
    try:
        yield Live(loop=loop, running=r, port=s.port)
    finally:
        asyncio.run_coroutine_threadsafe(cm.__aexit__(None, None, None), loop).result(90)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def exchange(port: int, raw: bytes, *, half_close: bool = False) -> tuple[int | None, bytes]:
    """Sends raw bytes, reads until the agent closes (every request says Connection: close). The status,
    or None when the agent closed without an answer; a timeout is a hang and fails the test."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        if half_close:
            writer.write_eof()
        try:
            await writer.drain()
            data = await asyncio.wait_for(reader.read(-1), EXCHANGE_TIMEOUT_S)
        except (ConnectionResetError, BrokenPipeError):
            return None, b""
    finally:
        writer.close()
    while data.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")):  # an interim answer (100 Continue): the real one follows
        data = data.partition(b"\r\n\r\n")[2]
    if not data.startswith(b"HTTP/1."):
        assert not data, f"not an HTTP response: {data[:80]!r}"
        return None, data
    return int(data[9:12]), data


def request(method: str, target: str | bytes, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> bytes:
    line = (target if isinstance(target, bytes) else target.encode()) or b"/"
    out = [method.encode() + b" " + line + b" HTTP/1.1", b"Host: agent"]
    out.extend(k + b": " + v for k, v in headers)
    if not any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers):
        out.append(b"Content-Length: " + str(len(body)).encode())
    out.append(b"Connection: close")
    return b"\r\n".join(out) + b"\r\n\r\n" + body


def check(live: Live, raw: bytes, *, half_close: bool = False) -> int | None:
    """The invariants, around one hostile request."""
    before = live.server_errors()
    status, data = live.call(exchange(live.port, raw, half_close=half_close))
    assert status is None or status < 500, (status, raw[:300], data[:600])
    assert live.server_errors() == before, raw[:300]
    ok, _ = live.call(exchange(live.port, NORMAL))
    assert ok == 200, "the agent stopped serving after a hostile request"
    return status


NORMAL = request(
    "POST",
    "/v1/completions",
    [(b"X-Tenant", b"t"), (b"Content-Type", b"application/json")],
    json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode(),
)

# ---- strategies ---------------------------------------------------------------------------------------

KNOWN_PATHS = sorted({*routes.ROUTES, *routes.REFUSED, contract.HEALTH_ROUTE, contract.METRICS_ROUTE, "/health"})
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "PROPFIND"]) | (
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-_!", min_size=1, max_size=12)
)


def _not_drain(target: str | bytes) -> bool:
    # The fuzzer is on the loopback, where the drain route is allowed: draining would end the run.
    text = target.decode("latin-1") if isinstance(target, bytes) else target
    return "drain" not in urllib.parse.unquote(text).lower()


@st.composite
def paths(draw: st.DrawFn) -> str | bytes:
    base = draw(st.sampled_from(KNOWN_PATHS))
    kind = draw(st.sampled_from(["as-is", "slash", "dots", "encoded", "double", "long", "segment", "raw", "query"]))
    if kind == "slash":
        return base + "/" * draw(st.integers(1, 3))
    if kind == "dots":
        return draw(st.sampled_from(["/..", "/../..", "/%2e%2e", "/./", "/v1/../"])) + base.lstrip("/")
    if kind == "encoded":
        return "".join(f"%{ord(c):02X}" if c.isalnum() and draw(st.booleans()) else c for c in base)
    if kind == "double":
        return "/" + base
    if kind == "long":
        return base + "/" + "a" * draw(st.sampled_from([200, 5000, 9000, 70_000]))
    if kind == "segment":
        seg = draw(st.text(alphabet=st.characters(codec="ascii", categories=["L", "N", "P"]), max_size=30))
        return base + "/" + urllib.parse.quote(seg)
    if kind == "raw":  # bytes that are not percent-encoded: non-ASCII, controls, NUL
        return base.encode() + draw(st.binary(min_size=1, max_size=12).filter(lambda b: b" " not in b))
    if kind == "query":
        q = draw(st.text(max_size=40))
        return base + "?" + urllib.parse.quote(q, safe="=&%")
    return base


def _json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=30)
    )
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=max_leaves,
    )


# The fake engine generates max_tokens tokens; an in-range limit stays small so a valid request ends quickly.
_LIMITS = st.integers(0, 8) | st.integers(2**31, 2**80) | st.integers(-(2**40), -1)
_NUMERIC_FIELDS = sorted({*INTEGER_FIELDS, *INTEGER_OR_BOOL_FIELDS, *NUMBER_FIELDS})
_SMALL_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n", "best_of"}


@st.composite
def openai_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A completions or chat request, its fields of the right type or not."""
    body: dict[str, Any] = {"model": draw(st.sampled_from(["fake", ""]) | _json_values(2))}
    if draw(st.booleans()):
        body["prompt"] = draw(st.text(max_size=50) | st.lists(st.integers(-5, 2**40), max_size=5) | _json_values())
    else:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", ""]) | _json_values(2)},
            optional={"content": st.text(max_size=40) | st.lists(_json_values(4), max_size=3) | _json_values(3)},
        )
        body["messages"] = draw(st.lists(message, max_size=3) | _json_values())
    for name in draw(st.lists(st.sampled_from(_NUMERIC_FIELDS), max_size=4, unique=True)):
        if name in _SMALL_FIELDS:
            body[name] = draw(_LIMITS | _json_values(2))
        else:
            body[name] = draw(_json_values(2) | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False))
    if "max_tokens" not in body and draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(0, 8))
    for name in draw(st.lists(st.sampled_from(["stream", "cache_salt", "stop", "logit_bias", "tools", "echo"]))):
        body[name] = draw(_json_values(4))
    return body


def _deep(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["json", "json", "json", "truncated", "deep", "bytes", "huge-int", "not-object"]))
    if kind == "truncated":
        raw = json.dumps(draw(openai_bodies())).encode()
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "deep":
        depth = draw(st.sampled_from([MAX_DEPTH, MAX_DEPTH + 1, 1000, 200_000]))
        inner = _deep(depth, draw(st.sampled_from(["list", "dict"])))
        return b'{"prompt": "x", "max_tokens": 1, "logit_bias": ' + inner + b"}"
    if kind == "bytes":
        return draw(st.binary(max_size=200)) + draw(st.sampled_from([b"", b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"]))
    if kind == "huge-int":
        digits = draw(st.sampled_from([19, 400, 4300, 5000]))
        return (
            b'{"prompt": "x", "' + draw(st.sampled_from([b"max_tokens", b"n", b"seed"])) + b'": ' + b"9" * digits + b"}"
        )
    if kind == "not-object":
        return json.dumps(draw(_json_values())).encode()
    return json.dumps(draw(openai_bodies())).encode()


_TENANT_NAMES = [b"X-Tenant", b"x-tenant", b"X-TENANT", b"X-Tenant ", b"X_Tenant", b" X-Tenant"]
_HEADER_VALUES = (
    st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
    | st.sampled_from([b"", b" ", b"\xff", b"\x00", b"\x7f", b"t\x01", "ténant".encode(), b"\xc3\x28"])
    | st.integers(1, 3).map(lambda k: b"t" * (4000 * k))
)


# ---- tests ------------------------------------------------------------------------------------------------


@FUZZ
@given(
    method=METHODS, path=paths().filter(_not_drain), body=st.sampled_from([b"", b"{}", NORMAL.split(b"\r\n\r\n")[1]])
)
def test_any_method_on_any_path_is_answered_below_500(live: Live, method: str, path: str | bytes, body: bytes) -> None:
    check(live, request(method, path, [(b"X-Tenant", b"t"), (b"Content-Type", b"application/json")], body))


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/invocations", "/v1/completions/"]),
    tenant=st.lists(st.tuples(st.sampled_from(_TENANT_NAMES), _HEADER_VALUES), max_size=3),
    extra=st.lists(
        st.tuples(
            st.sampled_from([b"Content-Type", b"Accept", b"X-Request-Id", b"User-Agent", b"Expect", b"X-Junk"]),
            _HEADER_VALUES,
        ),
        max_size=4,
    ),
    body=hostile_bodies(),
)
def test_hostile_headers_and_bodies_on_generation_routes(
    live: Live, path: str, tenant: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]], body: bytes
) -> None:
    status = check(live, request("POST", path, tenant + extra, body))
    if not any(name in {b"X-Tenant", b"x-tenant", b"X-TENANT"} for name, _ in tenant):
        assert status in (None, 400, 413, 417, 431), status  # no tenant, no generation


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
    body=hostile_bodies(),
    framing=st.sampled_from(["chunked", "bad-chunked", "gzip", "bad-gzip", "deflate", "truncated", "te+cl", "cl-x"]),
    cut=st.integers(0, 40),
)
def test_hostile_framing_and_content_encoding(live: Live, path: str, body: bytes, framing: str, cut: int) -> None:
    headers = [(b"X-Tenant", b"t"), (b"Content-Type", b"application/json")]
    half_close = False
    if framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        payload = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:cut], body[cut:]) if p) + b"0\r\n\r\n"
    elif framing == "bad-chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        payload = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        half_close = True
    elif framing in ("gzip", "bad-gzip", "deflate"):
        encoding = b"deflate" if framing == "deflate" else b"gzip"
        headers.append((b"Content-Encoding", encoding))
        payload = gzip.compress(body) if framing == "gzip" else body[:cut] + b"\x1f\x8b\x08garbage"
        headers.append((b"Content-Length", str(len(payload)).encode()))
    elif framing == "truncated":  # the client sends less than it announced, then stops sending
        headers.append((b"Content-Length", str(len(body) + 1 + cut).encode()))
        payload = body
        half_close = True
    elif framing == "te+cl":  # both framings: a smuggling attempt
        headers += [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"3")]
        payload = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        half_close = True
    else:
        headers.append((b"Content-Length", b"1" + b"0" * cut if cut % 2 else b"-1"))
        payload = body
        half_close = True
    check(live, request("POST", path, headers, payload), half_close=half_close)


# ---- what the fuzzing found, one test each -------------------------------------------------------------


def _answer(live: Live, raw: bytes, *, half_close: bool = False) -> tuple[int | None, dict[str, Any]]:
    before = live.server_errors()
    status, data = live.call(exchange(live.port, raw, half_close=half_close))
    assert live.server_errors() == before
    body = data.partition(b"\r\n\r\n")[2]
    return status, json.loads(body) if body.startswith(b"{") else {}


def test_an_expect_header_that_is_not_utf8_is_a_417_not_aiohttps_500(live: Live) -> None:
    # aiohttp's default Expect handler put the value into its 417 text and failed encoding it.
    status, body = _answer(live, request("POST", "/v1/completions", [(b"Expect", b"\xff")], b"{}"))
    assert status == 417 and "100-continue" in body["error"]["message"]
    status, _ = _answer(live, NORMAL.replace(b"Connection: close", b"Expect: 100-continue\r\nConnection: close"))
    assert status == 200


def test_a_tenant_id_that_is_not_utf8_is_a_400(live: Live) -> None:
    # The id arrived as surrogates, and deriving its salt raised UnicodeEncodeError: a 500.
    headers = [(b"X-Tenant", b"t\xff"), (b"Content-Type", b"application/json")]
    status, body = _answer(live, request("POST", "/v1/completions", headers, b'{"prompt": "x", "max_tokens": 1}'))
    assert status == 400 and "not UTF-8" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_body_whose_content_encoding_does_not_decode_is_a_400(live: Live, path: str) -> None:
    # aiohttp raised RequestPayloadError from request.read(): a counted 500.
    headers = [(b"X-Tenant", b"t"), (b"Content-Encoding", b"gzip"), (b"Content-Type", b"application/json")]
    status, body = _answer(live, request("POST", path, headers, b"\x1f\x8b\x08garbage"))
    assert status == 400 and "could not be read" in body["error"]["message"]
    good = gzip.compress(b'{"prompt": "x", "max_tokens": 1}')
    status, _ = _answer(live, request("POST", "/v1/completions", headers, good))
    assert status == 200


def test_a_client_that_stops_mid_body_is_counted_as_cancelled_not_as_a_server_error(live: Live) -> None:
    # ConnectionResetError from request.read() was a logged, counted 500.
    cancelled = contract.CLIENT_CANCELLED.name
    before = live.running.agent.collector.totals.get(cancelled, 0.0)
    headers = [(b"X-Tenant", b"t"), (b"Content-Length", b"100")]
    status, _ = _answer(live, request("POST", "/v1/completions", headers, b'{"prompt": '), half_close=True)
    assert status in (None, 400)
    assert live.running.agent.collector.totals.get(cancelled, 0.0) == before + 1
