"""AWS calls from the agent: bounded clients and the one retry policy (which errors, how long to back off).

Every AWS call the agent makes (PutMetricData, the lifecycle-hook heartbeats and completion, the Hugging Face
token read at start-up) goes through ``call``: retried with jittered exponential backoff when the failure can
pass with time (throttling, a 5xx, a dropped connection), given up at once when it cannot (validation, access
denied, missing credentials). botocore's own retries are switched off in ``client`` so this is the only retry
layer and its bounds are the real ones.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[object]]

# Throttling and transient service faults (botocore's standard retry mode lists the same codes). Anything else
# (ValidationError, AccessDenied, InvalidParameterValue) will not get better by asking again.
RETRYABLE_ERROR_CODES: Final = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "ProvisionedThroughputExceededException",
        "SlowDown",
        "EC2ThrottledException",
        "PriorRequestNotComplete",
        "TransactionInProgressException",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalFailure",
        "InternalError",
    }
)
# botocore's exceptions for a request that got no answer (read by name: the agent imports botocore lazily).
_CONNECTION_ERRORS: Final = frozenset({"ConnectionError", "HTTPClientError"})


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How often and how patiently to retry. ``attempts`` counts every call, the first included."""

    attempts: int = 5
    base_s: float = 0.5
    cap_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"need attempts >= 1 and 0 <= base_s <= cap_s, got {self}")

    def delay(self, retry: int, rng: random.Random) -> float:
        """Seconds before retry number ``retry`` (0-based): half the doubled step, plus up to as much again.

        The jitter spreads the retries of a fleet throttled together; the fixed half keeps each retry from
        coming back at once.
        """
        step = min(self.cap_s, self.base_s * 2.0**retry)
        return step / 2 + rng.uniform(0.0, step / 2)


class CallFailed(Exception):
    """An AWS call that failed for good: not retryable, or still failing after its last attempt."""

    def __init__(self, what: str, attempts: int, cause: BaseException, *, retryable: bool) -> None:
        how = f"after {attempts} attempt(s)" if retryable else "(not retryable)"
        super().__init__(f"{what} failed {how}: {cause}")
        self.attempts = attempts
        self.cause = cause


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ClientError (read by shape), None for anything else."""
    error = _response(exc).get("Error")
    code = error.get("Code") if isinstance(error, Mapping) else None
    return str(code) if code else None


def http_status(exc: BaseException) -> int | None:
    metadata = _response(exc).get("ResponseMetadata")
    status = metadata.get("HTTPStatusCode") if isinstance(metadata, Mapping) else None
    return status if isinstance(status, int) else None


def _response(exc: BaseException) -> Mapping[str, Any]:
    response = getattr(exc, "response", None)
    return response if isinstance(response, Mapping) else {}


def is_connection_error(exc: BaseException) -> bool:
    """No answer at all: connection refused or reset, endpoint unreachable, connect or read timeout."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return any(c.__module__ == "botocore.exceptions" and c.__name__ in _CONNECTION_ERRORS for c in type(exc).__mro__)


def retryable(exc: BaseException) -> bool:
    """Throttling, a 5xx, or no answer: worth another try. Everything else is final."""
    status = http_status(exc)
    server_fault = status is not None and status >= 500
    return error_code(exc) in RETRYABLE_ERROR_CODES or server_fault or is_connection_error(exc)


def _why(exc: BaseException) -> str:
    return error_code(exc) or type(exc).__name__


async def call(
    fn: Callable[[], T],
    *,
    what: str,
    retry: Retry,
    log: logging.Logger,
    sleep: Sleep = asyncio.sleep,
    rng: random.Random | None = None,
) -> T:
    """``fn()`` in a worker thread (boto3 blocks), retried per ``retry``; raises ``CallFailed`` when it gives up.

    Each retry is logged as a warning on ``log``; logging the final failure is the caller's (it knows how bad
    it is).
    """
    rng = rng or random.Random()
    for attempt in range(1, retry.attempts + 1):
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:
            again = retryable(exc)
            if not again or attempt == retry.attempts:
                raise CallFailed(what, attempt, exc, retryable=again) from exc
            pause = retry.delay(attempt - 1, rng)
            log.warning("%s failed (%s); retry %d in %.2f s", what, _why(exc), attempt, pause)
            await sleep(pause)
    raise AssertionError("unreachable: the last attempt returns or raises")


def client(service: str, region: str | None) -> Any:
    """A boto3 client with bounded timeouts (one hung call cannot outlast a heartbeat period) and botocore's
    own retries off (``call`` retries)."""
    # Imported here: boto3 ships no type information, and an agent that makes no AWS call never pays for it.
    boto3 = importlib.import_module("boto3")
    config = importlib.import_module("botocore.config").Config(
        connect_timeout=5, read_timeout=10, retries={"mode": "standard", "total_max_attempts": 1}
    )
    return boto3.client(service, region_name=region, config=config)
