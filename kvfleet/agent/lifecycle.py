"""Auto Scaling termination lifecycle hook: notice Terminating:Wait, drain while heartbeating, then let the instance go.

The instance learns it is being scaled in from IMDS (``autoscaling/target-lifecycle-state``), not from EventBridge or
SQS, so the agent needs no extra infrastructure and no network path other than IMDS and the Auto Scaling API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp

from kvfleet import contract
from kvfleet.agent import aws

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 60.0
DEFAULT_IMDS_URL = "http://169.254.169.254"

# The target state IMDS reports once the group has chosen this instance for termination.
TERMINATED = "Terminated"

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL_S = 21600

# Auto Scaling calls: five tries with 4-8 s of backoff in all, well inside one heartbeat period.
RETRY = aws.Retry(attempts=5, base_s=0.5, cap_s=8.0)

Drain = Callable[[], Awaitable[bool]]


class ImdsError(Exception):
    """IMDS answered something other than what was asked for."""


class ImdsUnavailable(ImdsError):
    """IMDS did not answer at all: not on EC2, or the token response was dropped by the hop limit."""


class Imds:
    """Minimal async IMDSv2 client: session token cached and refreshed, every request bounded by ``timeout_s``."""

    def __init__(
        self, base_url: str = DEFAULT_IMDS_URL, *, timeout_s: float = 1.0, token_ttl_s: int = MAX_TOKEN_TTL_S
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 1 <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ValueError(f"token_ttl_s must be within 1..{MAX_TOKEN_TTL_S}, got {token_ttl_s}")
        self._base_url = base_url.rstrip("/")
        # Short total timeout: off EC2 the link-local address may black-hole packets rather than refuse them.
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expires = 0.0
        self._token_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None

    @property
    def closed(self) -> bool:
        return self._session is None

    async def close(self) -> None:
        """Release the HTTP session; a later call opens a new one."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def instance_id(self) -> str:
        return await self._require("/latest/meta-data/instance-id")

    async def region(self) -> str:
        region = await self._get("/latest/meta-data/placement/region")
        if region:
            return region
        # Older IMDS versions lack placement/region; the identity document always carries it.
        document = await self._require("/latest/dynamic/instance-identity/document")
        try:
            value = json.loads(document)["region"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ImdsError(f"instance identity document has no region: {exc}") from exc
        if not isinstance(value, str) or not value:
            raise ImdsError("instance identity document has no region")
        return value

    async def target_lifecycle_state(self) -> str | None:
        """The Auto Scaling target lifecycle state, or None when the instance is not in an Auto Scaling group."""
        state = await self._get("/latest/meta-data/autoscaling/target-lifecycle-state")
        return state.strip() if state is not None else None

    def _http(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession belongs to the event loop that is running when it is made.
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _require(self, path: str) -> str:
        value = await self._get(path)
        if value is None:
            raise ImdsError(f"IMDS has no {path}")
        return value

    async def _get(self, path: str) -> str | None:
        """GET a metadata path; None on 404. A 401 means the token expired: fetch a new one and retry once."""
        for attempt in range(2):
            token = await self._token_value(force=attempt > 0)
            try:
                async with self._http().get(self._base_url + path, headers={TOKEN_HEADER: token}) as resp:
                    if resp.status == 200:
                        return await resp.text()
                    if resp.status == 404:
                        return None
                    if resp.status != 401:
                        raise ImdsError(f"IMDS GET {path}: HTTP {resp.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ImdsUnavailable(f"IMDS GET {path}: {exc!r}") from exc
        raise ImdsError(f"IMDS GET {path}: HTTP 401 with a fresh token")

    async def _token_value(self, *, force: bool) -> str:
        async with self._token_lock:
            # Renew a minute early so a request never leaves with a token that expires in flight.
            if force or self._token is None or time.monotonic() >= self._token_expires - 60:
                self._token = None
                self._token = await self._fetch_token()
                self._token_expires = time.monotonic() + self._token_ttl_s
            return self._token

    async def _fetch_token(self) -> str:
        url = self._base_url + "/latest/api/token"
        try:
            async with self._http().put(url, headers={TOKEN_TTL_HEADER: str(self._token_ttl_s)}) as resp:
                if resp.status != 200:
                    raise ImdsError(f"IMDS token PUT: HTTP {resp.status}")
                token = (await resp.text()).strip()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ImdsUnavailable(f"IMDS token PUT: {exc!r}") from exc
        if not token:
            raise ImdsError("IMDS token PUT returned an empty token")
        return token


def autoscaling_client(region: str) -> Any:
    """The production Auto Scaling client (bounded timeouts; ``aws.call`` retries)."""
    return aws.client("autoscaling", region)


class LifecycleWatcher:
    """Polls IMDS until the group terminates this instance, then drains with heartbeats and completes the action."""

    def __init__(
        self,
        *,
        imds: Imds,
        autoscaling_client_factory: Callable[[str], Any],
        group_name: str,
        hook_name: str,
        poll_s: float = 5.0,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        sleep: aws.Sleep = asyncio.sleep,
        retry: aws.Retry = RETRY,
    ) -> None:
        if poll_s <= 0 or heartbeat_s <= 0:
            raise ValueError(f"poll_s and heartbeat_s must be positive, got {poll_s} and {heartbeat_s}")
        if not group_name or not hook_name:
            raise ValueError("group_name and hook_name are required")
        self.imds = imds
        self.group_name = group_name
        self.hook_name = hook_name
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self._factory = autoscaling_client_factory
        self._sleep = sleep
        self._retry = retry

    async def run(self, drain: Drain) -> None:
        """Watch, and on termination drain and complete the lifecycle action; returns after completing.

        AWS and IMDS failures are logged, never raised; cancellation propagates. The IMDS session is closed on exit.
        """
        try:
            await self._run(drain)
        finally:
            await self.imds.close()

    async def _run(self, drain: Drain) -> None:
        try:
            instance_id = await self.imds.instance_id()
            region = await self.imds.region()
        except ImdsError as exc:
            log.warning(
                "instance metadata unavailable (%s): not on EC2, or the IMDS hop limit is too low for a container; "
                "lifecycle hook %s not watched",
                exc,
                self.hook_name,
            )
            return

        # The client is built now (config files, endpoint data: slow), so the drain starts the moment the
        # instance is marked for termination.
        client = await self._client(region)
        await self._wait_for_termination()
        log.info(
            "instance %s is terminating (group %s, hook %s): draining", instance_id, self.group_name, self.hook_name
        )
        params = {
            "LifecycleHookName": self.hook_name,
            "AutoScalingGroupName": self.group_name,
            "InstanceId": instance_id,
        }
        finished = await self._drain_with_heartbeats(drain, client, params)
        if finished:
            log.info("drain finished; completing lifecycle action")
        else:
            # The instance terminates either way; CONTINUE lets it go now instead of waiting out the hook.
            log.warning("drain did not finish within its budget; completing lifecycle action anyway")
        if client is None:
            return
        if await self._call(client, "complete_lifecycle_action", {**params, "LifecycleActionResult": "CONTINUE"}):
            log.info("lifecycle action completed with CONTINUE")

    async def _wait_for_termination(self) -> None:
        last_state: str | None = ""
        failing = False
        while True:
            try:
                state = await self.imds.target_lifecycle_state()
            except ImdsError as exc:
                # Log the first failure of a streak only: a flapping IMDS must not flood the log every poll.
                if not failing:
                    log.warning("cannot read target lifecycle state, will keep polling: %s", exc)
                failing = True
            else:
                if failing:
                    log.info("target lifecycle state readable again")
                    failing = False
                if state != last_state:
                    if state is None:
                        log.info("instance is not in an Auto Scaling group; polling in case it joins one")
                    else:
                        log.info("target lifecycle state: %s", state)
                    last_state = state
                if state == TERMINATED:
                    return
            await self._sleep(self.poll_s)

    async def _client(self, region: str) -> Any:
        try:
            # Client construction reads config files and endpoint data: keep it off the event loop.
            return await asyncio.to_thread(self._factory, region)
        except Exception:
            # Still drain: the instance is going away regardless; only the hook bookkeeping is lost.
            log.exception("cannot create the Auto Scaling client; draining without heartbeats")
            return None

    async def _drain_with_heartbeats(self, drain: Drain, client: Any, params: dict[str, str]) -> bool:
        heartbeats = None
        if client is not None:
            heartbeats = asyncio.create_task(self._heartbeat_loop(client, params), name="lifecycle-heartbeat")
        try:
            try:
                return bool(await drain())
            except Exception:
                log.exception("drain failed")
                return False
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
                # asyncio.wait, not await: it neither re-raises the task's CancelledError nor swallows our own.
                await asyncio.wait({heartbeats})

    async def _heartbeat_loop(self, client: Any, params: dict[str, str]) -> None:
        while True:
            await self._sleep(self.heartbeat_s)
            # A failed heartbeat is logged inside _call; the next period tries again and the drain goes on.
            await self._call(client, "record_lifecycle_action_heartbeat", params)

    async def _call(self, client: Any, operation: str, params: Mapping[str, str]) -> bool:
        """One Auto Scaling call, retried on transient errors (``aws.call``); False, logged, when it fails."""
        try:
            await aws.call(
                lambda: getattr(client, operation)(**params),
                what=operation,
                retry=self._retry,
                log=log,
                sleep=self._sleep,
            )
        except aws.CallFailed as err:
            log.error("%s", err)
            return False
        return True


def watcher_from_env(env: Mapping[str, str]) -> LifecycleWatcher | None:
    """A watcher configured from the stack's environment, or None when no lifecycle hook is configured."""
    group = env.get(contract.ENV_ASG_NAME, "").strip()
    hook = env.get(contract.ENV_LIFECYCLE_HOOK, "").strip()
    if not group or not hook:
        return None
    name = contract.ENV_LIFECYCLE_HEARTBEAT_S
    raw = env.get(name, "").strip()
    try:
        heartbeat_s = float(raw) if raw else DEFAULT_HEARTBEAT_S
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < heartbeat_s < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    imds = Imds(env.get(contract.ENV_IMDS_URL, "").strip() or DEFAULT_IMDS_URL)
    return LifecycleWatcher(
        imds=imds,
        autoscaling_client_factory=autoscaling_client,
        group_name=group,
        hook_name=hook,
        heartbeat_s=heartbeat_s,
    )
