"""The lifecycle-hook watcher against a fake IMDSv2 server on loopback and a stubbed Auto Scaling client."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import boto3
import pytest
from botocore.stub import Stubber  # type: ignore[import-untyped]

from kvfleet import contract
from kvfleet.agent import lifecycle
from kvfleet.agent.aws import Retry
from kvfleet.agent.lifecycle import Imds, ImdsUnavailable, LifecycleWatcher, watcher_from_env
from tests.agent.fake_imds import COMPLETE, GROUP, HEARTBEAT, HOOK, INSTANCE_ID, REGION, FakeImds

T = TypeVar("T")

HB_OP = "RecordLifecycleActionHeartbeat"
COMPLETE_OP = "CompleteLifecycleAction"
HEARTBEAT_S = 0.05
ENV_ASG_NAME = contract.ENV_ASG_NAME
ENV_LIFECYCLE_HOOK = contract.ENV_LIFECYCLE_HOOK
ENV_LIFECYCLE_HEARTBEAT_S = contract.ENV_LIFECYCLE_HEARTBEAT_S
ENV_IMDS_URL = contract.ENV_IMDS_URL


def run(coro: Coroutine[Any, Any, T], timeout: float = 3.0) -> T:
    # The bound turns a hung watcher into a failure instead of a hung test run.
    return asyncio.run(asyncio.wait_for(coro, timeout))


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Aws:
    """A real Auto Scaling client under a Stubber, recording every attempted call and its outcome."""

    def __init__(self) -> None:
        self.client = boto3.client("autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
        self.stubber = Stubber(self.client)
        self.attempts: list[str] = []
        self.outcomes: list[tuple[str, bool]] = []
        self.heartbeat_times: list[float] = []
        self.regions: list[str] = []
        # provide-client-params fires even for calls the Stubber then rejects, so stray calls are seen too.
        self.client.meta.events.register("provide-client-params.auto-scaling", self._attempt)
        self.client.meta.events.register("after-call.auto-scaling", self._outcome)

    def _attempt(self, model: Any, **_: Any) -> None:
        self.attempts.append(model.name)

    def _outcome(self, model: Any, parsed: dict[str, Any], **_: Any) -> None:
        self.outcomes.append((model.name, "Error" not in parsed))
        if model.name == HB_OP:
            self.heartbeat_times.append(time.monotonic())

    def factory(self, region: str) -> Any:
        self.regions.append(region)
        return self.client

    def heartbeat_ok(self) -> None:
        self.stubber.add_response("record_lifecycle_action_heartbeat", {}, HEARTBEAT)

    def heartbeat_throttled(self) -> None:
        self.stubber.add_client_error(
            "record_lifecycle_action_heartbeat", service_error_code="Throttling", expected_params=HEARTBEAT
        )

    def complete_ok(self) -> None:
        self.stubber.add_response("complete_lifecycle_action", {}, COMPLETE)

    def complete_throttled(self) -> None:
        self.stubber.add_client_error(
            "complete_lifecycle_action", service_error_code="Throttling", expected_params=COMPLETE
        )

    def ok_heartbeats(self) -> int:
        return self.outcomes.count((HB_OP, True))


def watcher(fake: FakeImds, aws: Aws, **kwargs: Any) -> LifecycleWatcher:
    options: dict[str, Any] = {"poll_s": 0.01, "heartbeat_s": HEARTBEAT_S, "retry": Retry(base_s=0.01), **kwargs}
    return LifecycleWatcher(
        imds=Imds(fake.url, timeout_s=0.5),
        autoscaling_client_factory=aws.factory,
        group_name=GROUP,
        hook_name=HOOK,
        **options,
    )


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.002)


def drain_until(
    condition: Callable[[], bool], calls: list[float], result: bool = True
) -> Callable[[], Awaitable[bool]]:
    """A drain that lasts until ``condition`` holds (in-flight requests finishing), recording when it started."""

    async def drain() -> bool:
        calls.append(time.monotonic())
        await until(condition)
        return result

    return drain


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# IMDS client


def test_imds_fetches_one_token_and_reads_metadata() -> None:
    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            imds = Imds(fake.url)
            try:
                assert await imds.instance_id() == INSTANCE_ID
                assert await imds.region() == REGION
                assert await imds.target_lifecycle_state() == "InService"
                fake.state = "Terminated"
                assert await imds.target_lifecycle_state() == "Terminated"
            finally:
                await imds.close()
            assert fake.token_puts == 1
            assert fake.unauthorized == 0
            assert imds.closed

    run(scenario())


def test_imds_refreshes_an_expired_token_on_401() -> None:
    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            imds = Imds(fake.url)
            try:
                assert await imds.instance_id() == INSTANCE_ID
                fake.expire_tokens()
                assert await imds.target_lifecycle_state() == "InService"
                assert await imds.instance_id() == INSTANCE_ID
            finally:
                await imds.close()
            assert fake.unauthorized == 1
            assert fake.token_puts == 2

    run(scenario())


def test_imds_state_is_none_outside_an_auto_scaling_group() -> None:
    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = None
            imds = Imds(fake.url)
            try:
                assert await imds.target_lifecycle_state() is None
            finally:
                await imds.close()

    run(scenario())


def test_imds_region_falls_back_to_the_identity_document() -> None:
    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.placement_region = False
            imds = Imds(fake.url)
            try:
                assert await imds.region() == REGION
            finally:
                await imds.close()

    run(scenario())


def test_imds_refused_connection_is_unavailable_fast() -> None:
    async def scenario() -> None:
        imds = Imds(closed_port_url(), timeout_s=60.0)
        try:
            with pytest.raises(ImdsUnavailable):
                await imds.instance_id()
        finally:
            await imds.close()

    # The check is the bound: ending inside 30 s of a 60 s timeout means the refusal ended it, not the timeout.
    run(scenario(), timeout=30.0)


def test_imds_that_never_answers_times_out() -> None:
    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.hang = True
            imds = Imds(fake.url, timeout_s=0.2)
            started = time.monotonic()
            try:
                with pytest.raises(ImdsUnavailable):
                    await imds.instance_id()
            finally:
                await imds.close()
            assert time.monotonic() - started > 0.15  # it waited for the timeout

    run(scenario())  # and did not hang: run() bounds it


# Watcher


def test_heartbeats_through_a_long_drain_then_completes(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    for _ in range(3):
        aws.heartbeat_ok()
    aws.complete_ok()
    drains: list[float] = []

    async def scenario() -> tuple[LifecycleWatcher, int]:
        async with FakeImds().serve() as fake:
            fake.terminate_after_reads = 3
            w = watcher(fake, aws)
            with aws.stubber:
                await w.run(drain_until(lambda: aws.ok_heartbeats() >= 3, drains))
            return w, fake.state_reads

    caplog.set_level(logging.INFO, logger=lifecycle.__name__)
    w, reads = run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert reads == 4  # three InService polls, then Terminated
    assert len(drains) == 1
    # One heartbeat per period while the drain runs: not a burst, and not stalled either.
    beats = [drains[0], *aws.heartbeat_times]
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    assert len(gaps) == 3
    assert all(gap >= HEARTBEAT_S * 0.9 for gap in gaps), gaps
    assert sum(gaps) / len(gaps) < 4 * HEARTBEAT_S, gaps
    assert aws.regions == [REGION]
    assert aws.attempts == [HB_OP, HB_OP, HB_OP, COMPLETE_OP]
    assert w.imds.closed
    assert errors(caplog) == []


def test_polling_survives_imds_errors_and_logs_them_once(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    aws.complete_ok()
    drains: list[float] = []

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.failing_state_reads = 5
            fake.terminate_after_reads = 7
            with aws.stubber:
                await watcher(fake, aws, heartbeat_s=10.0).run(drain_until(lambda: True, drains))

    caplog.set_level(logging.INFO, logger=lifecycle.__name__)
    run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert len(drains) == 1
    assert aws.outcomes == [(COMPLETE_OP, True)]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot read target lifecycle state" in m for m in messages) == 1
    assert sum("readable again" in m for m in messages) == 1


def test_throttled_heartbeat_is_retried_and_the_drain_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    aws.heartbeat_ok()
    aws.heartbeat_throttled()
    aws.heartbeat_ok()
    aws.heartbeat_ok()
    aws.complete_ok()
    drains: list[float] = []

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = "Terminated"
            with aws.stubber:
                await watcher(fake, aws).run(drain_until(lambda: aws.ok_heartbeats() >= 3, drains))

    run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert aws.outcomes == [(HB_OP, True), (HB_OP, False), (HB_OP, True), (HB_OP, True), (COMPLETE_OP, True)]
    assert len(drains) == 1
    assert any("Throttling" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert errors(caplog) == []


def test_heartbeat_that_exhausts_its_retries_does_not_stop_the_drain(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    aws.heartbeat_throttled()
    aws.heartbeat_throttled()
    aws.heartbeat_ok()
    aws.complete_ok()
    drains: list[float] = []

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = "Terminated"
            with aws.stubber:
                await watcher(fake, aws, retry=Retry(attempts=2, base_s=0.01)).run(
                    drain_until(lambda: aws.ok_heartbeats() >= 1, drains)
                )

    run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert aws.outcomes == [(HB_OP, False), (HB_OP, False), (HB_OP, True), (COMPLETE_OP, True)]
    [error] = errors(caplog)
    assert error.startswith("record_lifecycle_action_heartbeat failed after 2 attempt(s)")
    assert "Throttling" in error


def test_complete_is_retried_with_backoff_after_throttling() -> None:
    aws = Aws()
    aws.complete_throttled()
    aws.complete_throttled()
    aws.complete_ok()
    sleeps: list[float] = []

    async def recording_sleep(delay: float) -> None:
        sleeps.append(delay)
        await asyncio.sleep(delay)

    async def drain() -> bool:
        return True

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = "Terminated"
            w = watcher(fake, aws, heartbeat_s=10.0, retry=Retry(base_s=0.02), sleep=recording_sleep)
            with aws.stubber:
                await w.run(drain)

    run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert aws.outcomes == [(COMPLETE_OP, False), (COMPLETE_OP, False), (COMPLETE_OP, True)]
    backoff = [d for d in sleeps if d not in (0.01, 10.0)]
    assert len(backoff) == 2
    # Jittered exponential: half to all of 0.02, then of 0.04.
    assert 0.01 <= backoff[0] <= 0.02
    assert 0.02 <= backoff[1] <= 0.04


@pytest.mark.parametrize("outcome", ["unfinished", "raises"])
def test_drain_that_does_not_finish_still_completes_with_continue(
    outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    aws = Aws()
    aws.complete_ok()

    async def drain() -> bool:
        if outcome == "raises":
            raise RuntimeError("engine went away")
        return False

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = "Terminated"
            with aws.stubber:
                await watcher(fake, aws, heartbeat_s=10.0).run(drain)

    run(scenario())
    aws.stubber.assert_no_pending_responses()
    assert aws.outcomes == [(COMPLETE_OP, True)]
    assert any("did not finish" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_no_imds_returns_quickly_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    drains: list[float] = []

    async def scenario() -> LifecycleWatcher:
        w = LifecycleWatcher(
            imds=Imds(closed_port_url(), timeout_s=60.0),
            autoscaling_client_factory=aws.factory,
            group_name=GROUP,
            hook_name=HOOK,
        )
        await w.run(drain_until(lambda: True, drains))
        return w

    w = run(scenario(), timeout=30.0)  # gave up on the refusal, not after the 60 s IMDS timeout
    assert drains == []
    assert aws.regions == []
    assert w.imds.closed
    warnings = [r for r in caplog.records if r.name == lifecycle.__name__ and r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "instance metadata unavailable" in warnings[0].getMessage()


def test_outside_an_auto_scaling_group_keeps_polling_and_never_calls_aws(caplog: pytest.LogCaptureFixture) -> None:
    aws = Aws()
    drains: list[float] = []

    async def scenario() -> None:
        async with FakeImds().serve() as fake:
            fake.state = None
            w = watcher(fake, aws)
            with aws.stubber:
                task = asyncio.create_task(w.run(drain_until(lambda: True, drains)))
                await until(lambda: fake.state_reads >= 10)
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

    caplog.set_level(logging.INFO, logger=lifecycle.__name__)
    run(scenario())
    assert drains == []
    # The client is built up front, so the drain is not delayed by it later; no AWS call is made.
    assert aws.regions == ["us-east-1"]
    assert aws.attempts == []
    # Said once, not once per poll.
    assert sum("not in an Auto Scaling group" in r.getMessage() for r in caplog.records) == 1


def test_cancel_while_polling_ends_cleanly() -> None:
    aws = Aws()

    async def drain() -> bool:
        raise AssertionError("must not drain while InService")

    async def scenario() -> LifecycleWatcher:
        async with FakeImds().serve() as fake:
            w = watcher(fake, aws)
            task = asyncio.create_task(w.run(drain))
            await until(lambda: fake.state_reads >= 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return w

    w = run(scenario())
    assert w.imds.closed
    assert aws.attempts == []


def test_cancel_during_drain_stops_heartbeats_and_does_not_complete() -> None:
    aws = Aws()
    aws.heartbeat_ok()
    drains: list[float] = []

    async def scenario() -> tuple[LifecycleWatcher, set[asyncio.Task[Any]]]:
        async with FakeImds().serve() as fake:
            fake.state = "Terminated"
            w = watcher(fake, aws)
            before = asyncio.all_tasks()
            with aws.stubber:
                task = asyncio.create_task(w.run(drain_until(lambda: False, drains)))
                await until(lambda: aws.ok_heartbeats() == 1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Several heartbeat periods: a leaked heartbeat task would call again.
                await asyncio.sleep(4 * HEARTBEAT_S)
            return w, asyncio.all_tasks() - before

    w, leftover = run(scenario())
    assert leftover == set()
    assert len(drains) == 1
    assert aws.attempts == [HB_OP]
    assert w.imds.closed


# Configuration


@pytest.mark.parametrize(
    "env",
    [{}, {ENV_ASG_NAME: GROUP}, {ENV_LIFECYCLE_HOOK: HOOK}, {ENV_ASG_NAME: GROUP, ENV_LIFECYCLE_HOOK: "  "}],
)
def test_watcher_from_env_needs_group_and_hook(env: dict[str, str]) -> None:
    assert watcher_from_env(env) is None


def test_watcher_from_env_reads_names_heartbeat_and_imds_url() -> None:
    default = watcher_from_env({ENV_ASG_NAME: GROUP, ENV_LIFECYCLE_HOOK: HOOK})
    assert default is not None
    assert (default.group_name, default.hook_name, default.heartbeat_s) == (GROUP, HOOK, 60.0)

    async def scenario() -> str:
        async with FakeImds().serve() as fake:
            env = {
                ENV_ASG_NAME: GROUP,
                ENV_LIFECYCLE_HOOK: HOOK,
                ENV_LIFECYCLE_HEARTBEAT_S: "15",
                ENV_IMDS_URL: fake.url,
            }
            w = watcher_from_env(env)
            assert w is not None
            assert w.heartbeat_s == 15.0
            try:
                return await w.imds.instance_id()
            finally:
                await w.imds.close()

    assert run(scenario()) == INSTANCE_ID


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_watcher_from_env_rejects_a_bad_heartbeat(value: str) -> None:
    with pytest.raises(ValueError, match=ENV_LIFECYCLE_HEARTBEAT_S):
        watcher_from_env({ENV_ASG_NAME: GROUP, ENV_LIFECYCLE_HOOK: HOOK, ENV_LIFECYCLE_HEARTBEAT_S: value})


def test_default_client_factory_targets_the_instance_region() -> None:
    client = lifecycle.autoscaling_client("eu-west-1")
    assert client.meta.region_name == "eu-west-1"
    assert client.meta.service_model.service_name == "autoscaling"
