"""A fake EC2 instance metadata service (IMDSv2) on loopback, for the lifecycle tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

INSTANCE_ID = "i-0123456789abcdef0"
REGION = "us-east-1"
# The group and termination hook the fake instance belongs to, and the Auto Scaling calls the watcher must make.
GROUP = "kvfleet-chat"
HOOK = "kvfleet-chat-drain"
HEARTBEAT = {"LifecycleHookName": HOOK, "AutoScalingGroupName": GROUP, "InstanceId": INSTANCE_ID}
COMPLETE = {**HEARTBEAT, "LifecycleActionResult": "CONTINUE"}


class FakeImds:
    """IMDSv2 on loopback: GETs need a token from PUT /latest/api/token, otherwise 401."""

    def __init__(self) -> None:
        self.state: str | None = "InService"
        self.terminate_after_reads: int | None = None
        self.failing_state_reads = 0
        self.placement_region = True
        self.hang = False
        self.valid_tokens: set[str] = set()
        self.token_puts = 0
        self.unauthorized = 0
        self.state_reads = 0
        self.served: list[tuple[float, str | None]] = []  # each target-lifecycle-state answer, and when
        self.url = ""
        self._release = asyncio.Event()

    def expire_tokens(self) -> None:
        self.valid_tokens.clear()

    async def put_token(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        ttl = request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return web.Response(status=400)
        self.token_puts += 1
        token = f"token-{self.token_puts}"
        self.valid_tokens.add(token)
        return web.Response(text=token)

    async def get(self, request: web.Request) -> web.Response:
        await self._maybe_hang()
        if request.headers.get("X-aws-ec2-metadata-token") not in self.valid_tokens:
            self.unauthorized += 1
            return web.Response(status=401)
        path = request.path
        if path == "/latest/meta-data/instance-id":
            return web.Response(text=INSTANCE_ID)
        if path == "/latest/meta-data/placement/region" and self.placement_region:
            return web.Response(text=REGION)
        if path == "/latest/dynamic/instance-identity/document":
            return web.json_response({"instanceId": INSTANCE_ID, "region": REGION})
        if path == "/latest/meta-data/autoscaling/target-lifecycle-state":
            self.state_reads += 1
            if self.state_reads <= self.failing_state_reads:
                return web.Response(status=500)
            if self.terminate_after_reads is not None and self.state_reads > self.terminate_after_reads:
                self.state = "Terminated"
            self.served.append((time.monotonic(), self.state))
            if self.state is not None:
                return web.Response(text=self.state)
        return web.Response(status=404)

    async def _maybe_hang(self) -> None:
        if self.hang:
            await self._release.wait()

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[FakeImds]:
        app = web.Application()
        app.router.add_put("/latest/api/token", self.put_token)
        app.router.add_get("/{tail:.*}", self.get)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        try:
            yield self
        finally:
            self._release.set()
            await runner.cleanup()
