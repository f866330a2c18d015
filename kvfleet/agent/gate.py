"""The one request-parsing gate in front of every route that carries a JSON body.

What a client sends is hostile until proven otherwise: the body is bounded in size (the server's
``client_max_size``) and in nesting depth, every way JSON parsing can fail (malformed text, bad UTF-8,
integers past Python's digit limit, NaN, nesting that exhausts the recursion limit) is a 400 with a
message, and the numeric fields that size the work are integers in range before the engine sees them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

MAX_BODY_BYTES: Final = 64 * 1024**2  # prompts of long-context models are megabytes of JSON
MAX_DEPTH: Final = 64  # the deepest real requests (tool schemas in chat messages) are a dozen levels
MAX_N: Final = 128  # choices per request
INT32_MAX: Final = 2**31 - 1

# field -> (lowest, highest); bool is never an integer here (JSON true is not 1).
INTEGER_FIELDS: Final[Mapping[str, tuple[int, int]]] = {
    "max_tokens": (0, INT32_MAX),
    "max_completion_tokens": (0, INT32_MAX),
    "max_output_tokens": (0, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "n": (1, MAX_N),
    "best_of": (1, MAX_N),
    "top_k": (-1, INT32_MAX),
    "top_logprobs": (0, 1024),
    "prompt_logprobs": (-1, 1024),
    "seed": (-(2**63), 2**64 - 1),
    "truncate_prompt_tokens": (-1, INT32_MAX),
}
# Fields that are an integer on one route and a boolean on another (``logprobs``: completions vs chat).
INTEGER_OR_BOOL_FIELDS: Final[Mapping[str, tuple[int, int]]] = {"logprobs": (-1, 1024)}
NUMBER_FIELDS: Final[Mapping[str, tuple[float, float]]] = {
    "temperature": (0.0, 1e4),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 1e4),
}
_CHECKED: Final = frozenset(INTEGER_FIELDS) | frozenset(INTEGER_OR_BOOL_FIELDS) | frozenset(NUMBER_FIELDS)


class BadRequest(Exception):
    """The request is refused with 400; the message says what to change."""


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"request body is not JSON: {name} is not a JSON number")


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, iteratively (no recursion for a hostile body to exhaust)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            return d
        stack.extend((c, d + 1) for c in children)
    return deepest


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or BadRequest with a message. Never raises anything else."""
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant)
    except BadRequest:
        raise
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8 JSON") from None
    except RecursionError:
        raise BadRequest(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError, and integers past Python's digit limit
        reason = str(err).split(";")[0][:200]
        raise BadRequest(f"request body is not JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    # Fewer brackets than the limit (strings included) cannot nest past it: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        raise BadRequest(f"request body nests deeper than {MAX_DEPTH} levels")
    check_fields(body)
    return body


def check_fields(body: Mapping[str, Any]) -> None:
    """Numeric fields: the right type, in range, before they reach the engine or the token estimate."""
    # Only the fields the body has (a request names a few of the eighteen), in the tables' order.
    if body.keys().isdisjoint(_CHECKED):
        return
    for name, (lo, hi) in INTEGER_FIELDS.items():
        if name in body:
            _check_int(body, name, lo, hi, bool_ok=False)
    for name, (lo, hi) in INTEGER_OR_BOOL_FIELDS.items():
        if name in body:
            _check_int(body, name, lo, hi, bool_ok=True)
    for name, (flo, fhi) in NUMBER_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"{name} must be a number, got {type(value).__name__}")
        if not flo <= value <= fhi:
            raise BadRequest(f"{name} must be between {flo:g} and {fhi:g}")


def _check_int(body: Mapping[str, Any], name: str, lo: int, hi: int, *, bool_ok: bool) -> None:
    value = body.get(name)
    if value is None or (bool_ok and isinstance(value, bool)):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer from {lo} to {hi}")
