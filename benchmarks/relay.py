"""A bare TCP relay: what any extra process on the token path costs on this host, with no HTTP work at all.

``agent_overhead.py`` runs it beside the agent, against the same engine, as a reference path: the agent cannot
add less than this hop does (one more process to wake per streamed event, one more read and write), so the
difference between the two is the agent's own work. Bytes are passed on as they arrive, both ways. A client
connection that ends hands its engine connection to the next one, as the agent's pool does: the load generator
closes its connections after every round and reads every response to its end, so no response is ever cut short.

    python benchmarks/relay.py PORT ENGINE_PORT
"""

from __future__ import annotations

import asyncio
import sys

import uvloop


class _Engine(asyncio.Protocol):
    """The engine side of one relayed connection."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.client: _Client | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.client is not None and self.client.transport is not None:
            self.client.transport.close()


class _Client(asyncio.Protocol):
    """The client side: bytes held until its engine connection is there, then written straight through."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.engine: _Engine | None = None
        self.held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.relay.attach(self)

    def data_received(self, data: bytes) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.write(data)
        else:
            self.held.append(data)

    def engine_ready(self, engine: _Engine) -> None:
        self.engine = engine
        engine.client = self
        assert engine.transport is not None
        for data in self.held:
            engine.transport.write(data)
        self.held = []

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None:
            self.relay.release(self.engine)


class Relay:
    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        self.idle: list[_Engine] = []

    def attach(self, client: _Client) -> None:
        while self.idle:
            engine = self.idle.pop()
            if not engine.closed:
                client.engine_ready(engine)
                return
        asyncio.get_running_loop().create_task(self._connect(client))

    async def _connect(self, client: _Client) -> None:
        _, engine = await asyncio.get_running_loop().create_connection(_Engine, "127.0.0.1", self.engine_port)
        client.engine_ready(engine)

    def release(self, engine: _Engine) -> None:
        engine.client = None
        if not engine.closed:
            self.idle.append(engine)


async def serve(port: int, engine_port: int) -> None:
    relay = Relay(engine_port)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(relay), "127.0.0.1", port, backlog=1024)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2])))
