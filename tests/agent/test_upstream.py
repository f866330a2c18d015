"""The agent's engine client: response framing however the bytes are split, and what is never reused."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.agent import upstream

T = TypeVar("T")


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


def _conn(method: str = "POST") -> tuple[upstream.EnginePool, upstream.Connection, _Transport]:
    pool = upstream.EnginePool("127.0.0.1", 1)
    conn = upstream.Connection(pool)
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.start(method, b"request")
    return pool, conn, t


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_a_chunked_body_is_the_same_however_the_reads_split_it(parts: list[bytes], cuts: list[int]) -> None:
    async def go() -> None:
        _, conn, _ = _conn()
        wire = HEAD + _chunked(parts)
        points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
        got: list[bytes] = []
        for a, b in itertools.pairwise(points):
            conn.data_received(wire[a:b])
            if conn.head is not None and not got and conn._sink is None:
                conn.pipe(got.append)
        await conn.finished()
        assert b"".join(got) == b"".join(parts)
        assert conn.complete and conn.reusable

    _run(go)


def test_content_length_until_eof_and_no_body_responses() -> None:
    async def go() -> None:
        _, conn, _ = _conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
        conn.data_received(b"lo")
        assert await conn.read() == b"hello" and conn.reusable
        _, conn, _t = _conn()
        conn.data_received(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        conn.connection_lost(None)
        assert await conn.read() == b"all of it" and not conn.reusable
        _, conn, _ = _conn("HEAD")
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")
        assert await conn.read() == b"" and conn.complete
        _, conn, _ = _conn()
        conn.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        assert conn.head is not None and conn.head.status == 204 and conn.complete

    _run(go)


@pytest.mark.parametrize(
    "wire",
    [
        b"SPDY/3 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        HEAD + b"zz\r\n",
        HEAD + b"3\r\nabcXY",
        b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20_000,
    ],
)
def test_what_is_not_http_fails_the_exchange_and_closes_the_connection(wire: bytes) -> None:
    async def go() -> None:
        _, conn, t = _conn()
        conn.data_received(wire)
        with pytest.raises(upstream.EngineError):
            await conn.wait_head()
            await conn.finished()
        assert t.closed and not conn.reusable

    _run(go)


def test_the_engine_closing_mid_body_is_an_engine_error_and_extra_bytes_end_reuse() -> None:
    async def go() -> None:
        _, conn, _ = _conn()
        conn.data_received(HEAD + b"3\r\nabc\r\n")
        conn.connection_lost(ConnectionResetError("reset"))
        with pytest.raises(upstream.EngineError, match="before the response was complete"):
            await conn.finished()
        _, conn, t = _conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
        assert await conn.read() == b"ok" and not conn.reusable and t.closed
        _, conn, t = _conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        assert await conn.read() == b"ok" and not conn.reusable

    _run(go)


def test_a_connection_refused_is_an_engine_error() -> None:
    async def go() -> None:
        from tests.agent.harness import free_port

        pool = upstream.EnginePool("127.0.0.1", free_port())
        with pytest.raises(upstream.EngineError, match="cannot connect"):
            await pool.request("GET", "/v1/models", b"", {})

    _run(go)


def test_an_idle_connection_is_reused_only_inside_the_engines_keep_alive() -> None:
    """The reuse window follows the engine's keep-alive as the agent set it, less a margin for a close in flight."""

    async def go() -> None:
        for keep_alive, reused_after, closed_after in ((5.0, 2.5, 3.5), (75.0, 60.0, 74.0)):
            pool = upstream.EnginePool("127.0.0.1", 1, keep_alive_s=keep_alive)
            for idle, expect_reuse in ((reused_after, True), (closed_after, False)):
                conn = upstream.Connection(pool)
                conn.connection_made(_Transport())  # type: ignore[arg-type]
                conn.start("GET", b"request")
                conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                pool.release(conn)
                conn.idle_since = pool.loop.time() - idle
                if expect_reuse:
                    got, reused = await pool._acquire()
                    assert got is conn and reused, (keep_alive, idle)
                    pool.release(got)  # mid-exchange: closed, not pooled
                else:  # closed, and a new connection is tried (here, to a port nobody listens on)
                    with pytest.raises(upstream.EngineError, match="cannot connect"):
                        await pool._acquire()
                    assert conn.closed, (keep_alive, idle)

    _run(go)
