"""The agent's HTTP/1.1 client to its engine: pooled keep-alive connections, bodies handed on as they arrive.

Why not aiohttp's client here (it still scrapes the metrics): on the token path every chunk went through its
StreamReader, a task wake-up and back, about 80 us of CPU a chunk on a 2-core host, and each request through
ClientSession's set-up, about 0.4 ms (``benchmarks/agent_overhead.py``). The engine is a local HTTP/1.1 server
the agent started, so a small protocol is enough: one write a request, the response head parsed once, and a
streamed body passed to a callback from ``data_received``, without waking a task per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, auto
from typing import Final, cast

MAX_HEAD_BYTES: Final = 64 * 1024  # a response head larger than this is not an engine's
MAX_CHUNK_LINE: Final = 4096  # a chunk-size line (hex size and extensions)
MAX_IDLE_CONNECTIONS: Final = 256
# A connection the engine closed while idle leaves the pool when its close arrives; one idle for less than the
# engine's keep-alive minus this margin is reused, and a request that loses the race with a close arriving at
# that moment (nothing answered yet) is retried once on a new connection.
REUSE_MARGIN_S: Final = 2.0

# A chunk-size line: the size in hex and any extensions (ignored).
_CHUNK_LINE: Final = re.compile(rb"([0-9A-Fa-f]{1,15})(?:[ \t]*;[^\r\n]*)?\r\n")

Sink = Callable[[bytes], None]


class EngineError(Exception):
    """The engine refused the connection, closed it before the response was complete, or spoke something else."""


@dataclass(frozen=True)
class Head:
    status: int
    headers: Mapping[str, str]  # lower-case names; a repeated header keeps its last value


class _Phase(Enum):
    IDLE = auto()  # in the pool, or between requests
    HEAD = auto()
    LENGTH = auto()  # Content-Length body
    CHUNKED = auto()
    UNTIL_EOF = auto()  # neither: the body ends when the engine closes
    COMPLETE = auto()


class _Chunk(Enum):
    SIZE = auto()
    DATA = auto()
    DATA_END = auto()  # the CRLF after a chunk's data
    TRAILER = auto()


def parse_head(raw: bytes) -> tuple[int, str, dict[str, str]]:
    """Status, HTTP version and headers of a response head (without the blank line). Raises ValueError."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed response header line: {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return int(code), version, headers


class Connection(asyncio.Protocol):
    """One keep-alive connection to the engine, carrying one exchange at a time."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.head: Head | None = None
        self.reusable = False
        self.got_bytes = False
        self._phase = _Phase.IDLE
        self._method = "GET"
        self._buf = b""
        self._remaining = 0
        self._chunk = _Chunk.SIZE
        self._parts: list[bytes] = []
        self._sink: Sink | None = None
        self._head_ready: asyncio.Future[Head] = self._loop.create_future()
        self._done: asyncio.Future[None] = self._loop.create_future()

    # ---- asyncio.Protocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self._pool.discard(self)
        if self._phase is _Phase.UNTIL_EOF:
            self._complete()
        elif self._phase not in (_Phase.IDLE, _Phase.COMPLETE):
            why = f": {exc}" if exc is not None else ""
            self._fail(EngineError(f"the engine closed the connection before the response was complete{why}"))

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.HEAD:
            self.got_bytes = True
            self._head_bytes(data)
        elif self._phase is _Phase.IDLE or self._phase is _Phase.COMPLETE:
            self.close()  # bytes nobody asked for: the connection's framing can no longer be trusted
        else:
            self._body_bytes(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost settles the exchange

    # ---- the exchange --------------------------------------------------------------------------------

    def start(self, method: str, request: bytes) -> None:
        assert self.transport is not None and self._phase is _Phase.IDLE
        self._method = method
        self._phase = _Phase.HEAD
        self.got_bytes = False
        self.head = None
        self._buf = b""
        self._parts = []
        self._sink = None
        self._head_ready = self._loop.create_future()
        self._done = self._loop.create_future()
        self.transport.write(request)

    async def wait_head(self) -> Head:
        return await self._head_ready

    async def read(self) -> bytes:
        """The whole body."""
        await self._done
        return b"".join(self._parts)

    def take(self) -> bytes:
        """The body bytes received and not yet handed on."""
        data = b"".join(self._parts)
        self._parts = []
        return data

    def pipe(self, sink: Sink) -> None:
        """From now on, body bytes go to ``sink`` as they arrive (after any still held, which go first)."""
        held = self.take()
        self._sink = sink
        if held:
            sink(held)

    async def finished(self) -> None:
        """Until the body is complete; raises EngineError, or what ``abort`` was given."""
        await self._done

    def abort(self, exc: BaseException) -> None:
        """Ends the exchange with ``exc`` (the client went away, say) and closes the connection."""
        self._sink = None
        self._fail(exc)
        self.close()

    def detach(self) -> None:
        """Ends the exchange here: the caller stops waiting for it, and the connection is closed."""
        self._sink = None
        self._phase = _Phase.COMPLETE
        if not self._done.done():
            self._done.cancel()
        self.close()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.reusable = False
        self._sink = None
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    @property
    def complete(self) -> bool:
        return self._phase is _Phase.COMPLETE

    def recycle(self) -> None:
        self._phase = _Phase.IDLE
        self._parts = []
        self._sink = None
        self.head = None

    # ---- parsing ---------------------------------------------------------------------------------------

    def _head_bytes(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                self._fail(EngineError(f"the engine's response head is over {MAX_HEAD_BYTES} bytes"))
                self.close()
            else:
                self._buf = buf
            return
        self._buf = b""
        try:
            status, version, headers = parse_head(buf[:end])
        except ValueError as err:
            self._fail(EngineError(str(err)))
            self.close()
            return
        rest = buf[end + 4 :]
        if 100 <= status < 200:  # an interim response (never asked for): the real one follows
            if rest:
                self._head_bytes(rest)
            return
        connection = headers.get("connection", "").lower()
        self.reusable = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
        length = headers.get("content-length")
        if self._method == "HEAD" or status in (204, 304):
            self._phase = _Phase.COMPLETE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._phase = _Phase.CHUNKED
            self._chunk = _Chunk.SIZE
        elif length is not None:
            if not length.isdigit():
                self._fail(EngineError(f"the engine's Content-Length is not a number: {length[:40]!r}"))
                self.close()
                return
            self._remaining = int(length)
            self._phase = _Phase.LENGTH if self._remaining else _Phase.COMPLETE
        else:
            self._phase = _Phase.UNTIL_EOF
            self.reusable = False
        self.head = Head(status=status, headers=headers)
        if not self._head_ready.done():
            self._head_ready.set_result(self.head)
        if self._phase is _Phase.COMPLETE:
            self._complete()
        elif rest:
            self._body_bytes(rest)

    def _body_bytes(self, data: bytes) -> None:
        phase = self._phase
        if phase is _Phase.CHUNKED:
            self._chunked(data)
        elif phase is _Phase.LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self.reusable = False  # more than the length said: the next response would start mid-stream
                self._deliver(data[: self._remaining])
                self._remaining = 0
                self._complete()
            else:
                self._remaining -= len(data)
                self._deliver(data)
        elif phase is _Phase.UNTIL_EOF:
            self._deliver(data)

    # Length and complexity rules waived (pyproject.toml lists it): one state machine over RFC 9112's chunked framing,
    # run for every segment the engine sends on the streaming hot path; its states read best in one place.
    def _chunked(self, data: bytes) -> None:  # noqa: C901, PLR0912, PLR0915
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        out: list[bytes] = []
        while pos < end:
            state = self._chunk
            if state is _Chunk.SIZE:
                line = _CHUNK_LINE.match(buf, pos)
                if line is None:
                    if buf.find(b"\r\n", pos) >= 0 or end - pos > MAX_CHUNK_LINE:
                        return self._bad_chunk(f"not a chunk-size line: {buf[pos : pos + 20]!r}")
                    break  # the rest of the line is still to come
                pos = line.end()
                size = int(line.group(1), 16)
                if size:
                    # The common case, a whole chunk in one read: no state to keep.
                    if end - pos >= size + 2 and buf[pos + size : pos + size + 2] == b"\r\n":
                        out.append(buf[pos : pos + size])
                        pos += size + 2
                        continue
                    self._remaining = size
                    self._chunk = _Chunk.DATA
                else:
                    self._chunk = _Chunk.TRAILER
            elif state is _Chunk.DATA:
                take = min(self._remaining, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._chunk = _Chunk.DATA_END
            elif state is _Chunk.DATA_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    return self._bad_chunk("no CRLF after a chunk")
                pos += 2
                self._chunk = _Chunk.SIZE
            else:  # trailer lines, then the blank line that completes the body
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        return self._bad_chunk("a trailer line is too long")
                    break
                blank = eol == pos
                pos = eol + 2
                if blank:
                    if pos < end:
                        self.reusable = False
                    self._buf = b""
                    if out:
                        self._deliver(b"".join(out))
                    self._complete()
                    return None
        self._buf = buf[pos:]
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out))
        return None

    def _bad_chunk(self, why: str) -> None:
        self._fail(EngineError(f"the engine's chunked body is malformed: {why}"))
        self.close()

    def _deliver(self, data: bytes) -> None:
        if not data:
            return
        sink = self._sink
        if sink is not None:
            sink(data)
            return
        self._parts.append(data)

    def _complete(self) -> None:
        self._phase = _Phase.COMPLETE
        if not self._done.done():
            self._done.set_result(None)
        if not self.reusable:
            self.close()

    def _fail(self, exc: BaseException) -> None:
        self._phase = _Phase.COMPLETE
        self.reusable = False
        if not self._head_ready.done():
            self._head_ready.set_exception(exc)
            self._done.cancel()  # nobody waits for a body whose head never came
        elif not self._done.done():
            self._done.set_exception(exc)


class EnginePool:
    """Keep-alive connections to the engine at ``host:port``, as many as there are requests in flight."""

    def __init__(self, host: str, port: int, *, keep_alive_s: float = 5.0, connect_timeout_s: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        # uvicorn (both engines' server) closes a connection idle for its keep-alive, 5 s unless set.
        self.reuse_s = max(keep_alive_s - REUSE_MARGIN_S, keep_alive_s / 2)
        self.loop = asyncio.get_running_loop()
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()

    def request_bytes(self, method: str, target: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The request as one write. ``target`` and header values are checked ASCII by the caller."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines.extend(f"{k}: {v}" for k, v in headers.items())
        if body or method not in ("GET", "HEAD"):
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body

    async def request(self, method: str, target: str, body: bytes, headers: Mapping[str, str]) -> Connection:
        """Sends the request; returns its connection once the response head is in (``conn.head``).

        The caller hands the connection back with ``release`` when done with it, whatever happened."""
        raw = self.request_bytes(method, target, body, headers)
        for attempt in (1, 2):
            conn, reused = await self._acquire()
            try:
                conn.start(method, raw)
                await conn.wait_head()
                return conn
            except EngineError:
                self.release(conn)
                # A kept-alive connection the engine closed just as it was reused: nothing reached the engine.
                if reused and not conn.got_bytes and attempt == 1:
                    continue
                raise
            except BaseException:
                self.release(conn)
                raise
        raise AssertionError("unreachable")

    async def _acquire(self) -> tuple[Connection, bool]:
        now = self.loop.time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.reuse_s:
                self._busy.add(conn)
                return conn, True
            conn.close()
        try:
            _, proto = await asyncio.wait_for(
                self.loop.create_connection(lambda: Connection(self), self.host, self.port), self.connect_timeout_s
            )
        except (OSError, TimeoutError) as err:
            why = str(err) or "timed out"
            raise EngineError(f"cannot connect to the engine at {self.host}:{self.port}: {why}") from None
        self._busy.add(proto)
        return proto, False

    def release(self, conn: Connection) -> None:
        """Back to the pool when its exchange completed cleanly, else closed."""
        self._busy.discard(conn)
        if conn.complete and conn.reusable and not conn.closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            conn.recycle()
            conn.idle_since = self.loop.time()
            self._idle.append(conn)
        else:
            conn.close()

    def discard(self, conn: Connection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def close(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
