"""The one retry policy for the agent's AWS calls: which failures are retried, how long it backs off, what it logs."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import boto3
import pytest
from botocore.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    ReadTimeoutError,
)
from botocore.stub import Stubber  # type: ignore[import-untyped]

from kvfleet.agent import aws

log = logging.getLogger("test.aws")


def client_error(code: str, status: int = 400) -> ClientError:
    response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "Op")


@pytest.mark.parametrize(
    "exc",
    [
        client_error("Throttling"),
        client_error("ThrottlingException"),
        client_error("RequestLimitExceeded"),
        client_error("TooManyRequestsException"),
        client_error("ServiceUnavailable", 503),
        client_error("InternalFailure", 500),
        client_error("SomethingNew", 502),  # any 5xx, whatever its code
        client_error("RequestTimeout", 408),
        EndpointConnectionError(endpoint_url="https://monitoring.us-east-1.amazonaws.com"),
        ConnectTimeoutError(endpoint_url="https://autoscaling.us-east-1.amazonaws.com"),
        ReadTimeoutError(endpoint_url="https://autoscaling.us-east-1.amazonaws.com"),
        ConnectionResetError(104, "reset"),
        TimeoutError(),
    ],
    ids=lambda e: type(e).__name__ + (f"-{aws.error_code(e)}" if aws.error_code(e) else ""),
)
def test_transient_failures_are_retryable(exc: Exception) -> None:
    assert aws.retryable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        client_error("ValidationError"),
        client_error("AccessDenied", 403),
        client_error("InvalidParameterValue"),
        NoCredentialsError(),
        ParamValidationError(report="bad"),
        RuntimeError("a bug"),
        ValueError("a bug"),
    ],
    ids=lambda e: type(e).__name__ + (f"-{aws.error_code(e)}" if aws.error_code(e) else ""),
)
def test_final_failures_are_not_retried(exc: Exception) -> None:
    assert not aws.retryable(exc)


def test_error_code_and_status_read_by_shape() -> None:
    exc = client_error("Throttling", 400)
    assert (aws.error_code(exc), aws.http_status(exc)) == ("Throttling", 400)
    assert (aws.error_code(RuntimeError()), aws.http_status(RuntimeError())) == (None, None)


def test_backoff_doubles_to_the_cap_with_half_of_each_step_fixed() -> None:
    retry = aws.Retry(attempts=6, base_s=0.2, cap_s=1.0)
    steps = [0.2, 0.4, 0.8, 1.0, 1.0]
    rng = random.Random(7)
    for i, step in enumerate(steps):
        for _ in range(50):
            assert step / 2 <= retry.delay(i, rng) <= step


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_s": -1.0}, {"base_s": 2.0, "cap_s": 1.0}])
def test_a_retry_policy_must_make_sense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        aws.Retry(**kwargs)


class Calls:
    def __init__(self, *outcomes: Exception | str) -> None:
        self.outcomes = list(outcomes)
        self.made = 0

    def __call__(self) -> str:
        self.made += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _call(fn: Calls, retry: aws.Retry, sleeps: list[float]) -> Any:
    async def sleep(delay: float) -> None:
        sleeps.append(delay)

    return asyncio.run(aws.call(fn, what="Op", retry=retry, log=log, sleep=sleep, rng=random.Random(1)))


def test_call_retries_transient_failures_then_returns(caplog: pytest.LogCaptureFixture) -> None:
    sleeps: list[float] = []
    fn = Calls(client_error("Throttling"), EndpointConnectionError(endpoint_url="https://x"), "ok")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert _call(fn, aws.Retry(attempts=3, base_s=0.1), sleeps) == "ok"
    assert fn.made == 3 and len(sleeps) == 2
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "Op failed (Throttling)",
        "Op failed (EndpointConnectionError)",
    ]


def test_call_gives_up_after_its_attempts() -> None:
    sleeps: list[float] = []
    fn = Calls(*[client_error("Throttling")] * 3)
    with pytest.raises(aws.CallFailed, match=r"^Op failed after 3 attempt\(s\): ") as info:
        _call(fn, aws.Retry(attempts=3, base_s=0.1), sleeps)
    assert fn.made == 3 and len(sleeps) == 2 and info.value.attempts == 3
    assert aws.error_code(info.value.cause) == "Throttling"


def test_call_stops_at_once_on_a_final_failure() -> None:
    sleeps: list[float] = []
    fn = Calls(client_error("AccessDenied", 403), "never reached")
    with pytest.raises(aws.CallFailed, match=r"^Op failed \(not retryable\): .*AccessDenied"):
        _call(fn, aws.Retry(attempts=5), sleeps)
    assert fn.made == 1 and sleeps == []


def test_the_clients_leave_retrying_to_call() -> None:
    client = aws.client("cloudwatch", "eu-west-1")
    assert client.meta.region_name == "eu-west-1"
    assert client.meta.config.retries["total_max_attempts"] == 1
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (5, 10)


def test_a_throttled_real_client_call_is_retried() -> None:
    # A real botocore ClientError, as the service would answer: the shape the helper reads.
    client = boto3.client("autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)

    with Stubber(client) as stub:
        stub.add_client_error("describe_auto_scaling_groups", service_error_code="Throttling")
        stub.add_client_error(
            "describe_auto_scaling_groups", service_error_code="ServiceUnavailable", http_status_code=503
        )
        stub.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": []})
        result = asyncio.run(
            aws.call(client.describe_auto_scaling_groups, what="Describe", retry=aws.Retry(), log=log, sleep=sleep)
        )
        stub.assert_no_pending_responses()
    assert result["AutoScalingGroups"] == [] and len(sleeps) == 2
