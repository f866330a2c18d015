"""Request traces from real serving: read once, checked line by line, held as columns.

Formats (detected from the header or first record; ``fmt`` overrides):

- ``azure``: the Azure LLM inference traces, 2023 (Splitwise, ISCA 2024) and 2024 (DynamoLLM, HPCA 2025):
  CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with ISO timestamps (github.com/Azure/AzurePublicDataset,
  AzureLLMInferenceDataset2023.md / 2024.md).
- ``mooncake``: JSON lines ``{"timestamp": ms since the first request, "input_length", "output_length",
  "hash_ids": [one id per block of the prompt]}``; equal ids are equal prefixes (github.com/kvcache-ai/Mooncake,
  FAST25-release/traces; their block is 512 tokens).
- ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` with seconds
  since the trace began; a response of 0 tokens is a failed request (github.com/HPMLL/BurstGPT, README).
- ``kvfleet``: the request log the serving agent writes (JSON lines, see kvfleet.contract.REQUEST_LOG_FIELDS);
  other log lines in the same file (the agent's metrics, the engine's output) are skipped.

Every problem is one line, ``file:line: column: what is wrong; what to do``, and reading stops at the first.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kvfleet import contract
from kvfleet.errors import KvfleetError

TraceFormat = Literal["azure", "mooncake", "burstgpt", "kvfleet"]
FORMATS: tuple[TraceFormat, ...] = ("azure", "mooncake", "burstgpt", "kvfleet")
# A trace kvfleet generated rather than read (the simulator's Poisson replay): never a file format.
TraceOrigin = TraceFormat | Literal["poisson"]

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
# Mooncake's FAST'25 traces hash prompts in blocks of 512 tokens (kvcache-ai/Mooncake, FAST25-release/README).
MOONCAKE_BLOCK_TOKENS = 512
# Longer than any context a catalog model serves: a length past it is a corrupt row, not a long prompt.
MAX_TOKENS = 10_000_000


class TraceError(KvfleetError):
    """A trace that cannot be read: the file, the line, the column and what to change."""


@dataclass(frozen=True, kw_only=True)
class Trace:
    """Requests in arrival order, as columns (a week of a busy service is millions of rows).

    ``arrival_s`` counts from the first request kept. ``cached_tokens`` is what the engine served from its
    prefix cache (the agent's log only); ``prefix_blocks`` holds each request's block hash ids (Mooncake only)
    and ``block_tokens`` their size. The arrays are not to be changed once the trace is built.
    """

    source: str
    fmt: TraceOrigin
    arrival_s: array[float]
    input_tokens: array[int]
    output_tokens: array[int]
    cached_tokens: array[int] | None = None
    prefix_blocks: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int | None = None
    tenants: tuple[str, ...] | None = None
    failed: int = 0  # requests the trace marks failed (BurstGPT's 0-token responses; the log's 5xx), left out
    skipped: int = 0  # rows outside the window
    started_at: str | None = field(default=None)  # wall-clock time of arrival_s == 0, where the trace has one

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.arrival_s[-1] - self.arrival_s[0] if len(self.arrival_s) > 1 else 0.0


# ---- reading ------------------------------------------------------------------------------------------------


class _Rows:
    """Collects one trace's columns while checking each row."""

    def __init__(self, source: str, fmt: TraceFormat, *, start_s: float, duration_s: float | None) -> None:
        self.source = source
        self.fmt = fmt
        self.start_s = start_s
        self.end_s = math.inf if duration_s is None else start_s + duration_s
        self.t = array("d")
        self.inp = array("q")
        self.out = array("q")
        self.cached = array("q")
        self.blocks: list[tuple[int, ...]] = []
        self.tenants: list[str] = []
        self.failed = 0
        self.skipped = 0
        self.origin: float | None = None
        self.last: float = -math.inf
        self.started_at: str | None = None

    def error(self, line: int, column: str, what: str) -> TraceError:
        return TraceError(f"{self.source}:{line}: {column}: {what}")

    def length(self, line: int, column: str, raw: Any, *, zero_ok: bool = True) -> int:
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise self.error(line, column, f"{raw!r} is not a token count; give a whole number of tokens")
        if isinstance(raw, str):
            text = raw.strip()
            digits = text[1:] if text.startswith("-") else text
            if text.startswith("-") and digits.isascii() and digits.isdigit():
                raise self.error(line, column, f"{text} is negative; a token count is 0 or more")
            if not (text.isascii() and text.isdigit()):
                what = "is empty" if not text else f"{text[:40]!r} is not a whole number"
                raise self.error(line, column, f"{what}; give a token count of 0 or more")
            value = int(text) if len(text) <= 9 else MAX_TOKENS + 1
        else:
            value = raw
        if value < 0:
            raise self.error(line, column, f"{value} is negative; a token count is 0 or more")
        if value == 0 and not zero_ok:
            raise self.error(line, column, "0 tokens; a prompt has at least one token")
        if value > MAX_TOKENS:
            raise self.error(line, column, f"more than {MAX_TOKENS:,} tokens; this row is corrupt, remove it")
        return value

    def arrival(self, line: int, column: str, t: float) -> bool:
        """Record an arrival time (seconds on the trace's own clock); False when the row is outside the window."""
        if not math.isfinite(t):
            raise self.error(line, column, f"{t} is not a time; give a finite number")
        if t < self.last:
            raise self.error(
                line,
                column,
                f"earlier than the row before it ({t - self.last:+.3f} s); sort the trace by arrival time",
            )
        self.last = t
        if self.origin is None:
            self.origin = t
        rel = t - self.origin
        if rel < self.start_s or rel >= self.end_s:
            self.skipped += 1
            return False
        self.t.append(rel - self.start_s)
        return True

    def build(self, *, rate_scale: float, block_tokens: int | None = None) -> Trace:
        if not self.t:
            if self.origin is None:
                raise TraceError(f"{self.source}:1: (file): no requests; give a trace with at least one row")
            raise TraceError(
                f"{self.source}: (window): no requests between {self.start_s:g} s and {self.end_s:g} s of the trace; "
                f"it spans {self.last - self.origin:.0f} s"
            )
        t = self.t
        first = t[0]
        scaled = array("d", ((x - first) / rate_scale for x in t)) if (first or rate_scale != 1.0) else t
        return Trace(
            source=self.source,
            fmt=self.fmt,
            arrival_s=scaled,
            input_tokens=self.inp,
            output_tokens=self.out,
            cached_tokens=self.cached if self.fmt == "kvfleet" else None,
            prefix_blocks=tuple(self.blocks) if self.fmt == "mooncake" else None,
            block_tokens=block_tokens,
            tenants=tuple(self.tenants) if self.fmt == "kvfleet" else None,
            failed=self.failed,
            skipped=self.skipped,
            started_at=self.started_at,
        )


def _timestamp(rows: _Rows, line: int, raw: str) -> tuple[float, datetime]:
    text = raw.strip()
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise rows.error(
            line, AZURE_COLUMNS[0], f"{text[:40]!r} is not a date and time; give one like 2023-11-16 18:15:46.68"
        ) from None
    # Naive times are read as UTC: only differences matter, and local time would move them at DST changes.
    return (dt.timestamp() if dt.tzinfo is not None else dt.replace(tzinfo=UTC).timestamp()), dt


def _header(rows: _Rows, reader: Iterator[list[str]], needed: tuple[str, ...]) -> dict[str, int]:
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(f"{rows.source}:1: (file): no requests; give a trace with at least one row") from None
    names = [h.strip().lstrip("\ufeff") for h in header]
    missing = [c for c in needed if c not in names]
    if missing:
        raise rows.error(
            1, "header", f"missing column {', '.join(missing)}; a {rows.fmt} trace has {', '.join(needed)}"
        )
    return {c: names.index(c) for c in needed}


def _cell(rows: _Rows, line: int, record: list[str], at: dict[str, int], column: str) -> str:
    i = at[column]
    if i >= len(record):
        raise rows.error(line, column, f"the row has {len(record)} fields; give every column of the header")
    return record[i]


def _read_azure(rows: _Rows, text: io.TextIOBase) -> None:
    reader = csv.reader(text)
    at = _header(rows, reader, AZURE_COLUMNS)
    for record in reader:
        line = reader.line_num
        if not record:
            continue
        t, when = _timestamp(rows, line, _cell(rows, line, record, at, "TIMESTAMP"))
        inp = rows.length(line, "ContextTokens", _cell(rows, line, record, at, "ContextTokens"), zero_ok=False)
        out = rows.length(line, "GeneratedTokens", _cell(rows, line, record, at, "GeneratedTokens"))
        if rows.arrival(line, "TIMESTAMP", t):
            if rows.started_at is None:
                rows.started_at = when.isoformat()
            rows.inp.append(inp)
            rows.out.append(out)


def _number(rows: _Rows, line: int, column: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise rows.error(line, column, f"{raw!r} is not a time; give a number")
    try:
        return float(raw)
    except ValueError:
        raise rows.error(line, column, f"{str(raw)[:40]!r} is not a time; give a number") from None


def _read_burstgpt(rows: _Rows, text: io.TextIOBase) -> None:
    reader = csv.reader(text)
    at = _header(rows, reader, BURSTGPT_COLUMNS)
    for record in reader:
        line = reader.line_num
        if not record:
            continue
        t = _number(rows, line, "Timestamp", _cell(rows, line, record, at, "Timestamp"))
        inp = rows.length(line, "Request tokens", _cell(rows, line, record, at, "Request tokens"))
        out = rows.length(line, "Response tokens", _cell(rows, line, record, at, "Response tokens"))
        if not rows.arrival(line, "Timestamp", t):
            continue
        if out == 0 or inp == 0:  # BurstGPT marks a failed request with a 0-token response
            rows.t.pop()
            rows.failed += 1
            continue
        rows.inp.append(inp)
        rows.out.append(out)


def _json_lines(rows: _Rows, text: io.TextIOBase) -> Iterator[tuple[int, Any]]:
    for line, raw in enumerate(text, start=1):
        if not raw.strip():
            continue
        try:
            yield line, json.loads(raw)
        except (ValueError, RecursionError):
            if rows.fmt == "kvfleet":
                continue  # the engine's own output shares the log
            raise rows.error(line, "(line)", "not a JSON object; give one request per line") from None


def _read_mooncake(rows: _Rows, text: io.TextIOBase) -> None:
    for line, obj in _json_lines(rows, text):
        if not isinstance(obj, dict):
            raise rows.error(line, "(line)", "not a JSON object; give one request per line")
        missing = [k for k in MOONCAKE_KEYS if k not in obj]
        if missing:
            raise rows.error(line, missing[0], f"missing; a mooncake record has {', '.join(MOONCAKE_KEYS)}")
        t = _number(rows, line, "timestamp", obj["timestamp"]) / 1000.0  # milliseconds
        inp = rows.length(line, "input_length", obj["input_length"], zero_ok=False)
        out = rows.length(line, "output_length", obj["output_length"])
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise rows.error(line, "hash_ids", "not a list of block ids; give whole numbers, one per prompt block")
        if rows.arrival(line, "timestamp", t):
            rows.inp.append(inp)
            rows.out.append(out)
            rows.blocks.append(tuple(hashes))


def _read_kvfleet(rows: _Rows, text: io.TextIOBase) -> None:
    f = contract.REQUEST_LOG_FIELDS
    for line, obj in _json_lines(rows, text):
        if not isinstance(obj, dict) or obj.get(contract.REQUEST_LOG_KIND_KEY) != contract.REQUEST_LOG_KIND:
            continue
        missing = [k for k in (f.time, f.prompt_tokens, f.output_tokens, f.status) if k not in obj]
        if missing:
            raise rows.error(line, missing[0], f"missing from a {contract.REQUEST_LOG_KIND} record")
        t = _number(rows, line, f.time, obj[f.time])
        status = obj[f.status]
        if isinstance(status, bool) or not isinstance(status, int):
            raise rows.error(line, f.status, f"{status!r} is not an HTTP status")
        inp = rows.length(line, f.prompt_tokens, obj[f.prompt_tokens])
        out = rows.length(line, f.output_tokens, obj[f.output_tokens])
        cached = rows.length(line, f.cached_tokens, obj.get(f.cached_tokens, 0))
        if not rows.arrival(line, f.time, t):
            continue
        if status >= 500 or inp == 0:
            rows.t.pop()
            rows.failed += 1
            continue
        rows.inp.append(inp)
        rows.out.append(out)
        rows.cached.append(min(cached, inp))
        tenant = obj.get(f.tenant)
        rows.tenants.append(tenant if isinstance(tenant, str) else "")
    if rows.origin is None:
        raise TraceError(
            f"{rows.source}:1: (file): no {contract.REQUEST_LOG_KIND} records; give the serving agent's request log"
        )


def detect_format(path: Path, head: str) -> TraceFormat:
    first = head.lstrip("\ufeff").splitlines()[0] if head.strip() else ""
    names = {c.strip() for c in first.split(",")}
    # One known column is enough to name the format: a missing one is then reported as missing.
    if names & set(AZURE_COLUMNS):
        return "azure"
    if names & set(BURSTGPT_COLUMNS):
        return "burstgpt"
    for raw in head.splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get(contract.REQUEST_LOG_KIND_KEY) == contract.REQUEST_LOG_KIND:
            return "kvfleet"
        if isinstance(obj, dict) and "input_length" in obj:
            return "mooncake"
    raise TraceError(
        f"{path}:1: (file): not a trace kvfleet reads; give an Azure or BurstGPT CSV, Mooncake JSON lines or the "
        f"agent's request log (or name the format: {', '.join(FORMATS)})"
    )


def poisson_trace(
    phases: tuple[tuple[float, float], ...],
    *,
    input_tokens: int,
    output_tokens: int,
    source: str,
    seed: int = 0,
) -> Trace:
    """Poisson arrivals, ``phases`` of (seconds, requests/s) one after the other (0 requests/s: a quiet phase), every
    request of the same lengths.
    Seeded: the same arrivals every run, so that replays compare policies or plans, not draws."""
    rng = random.Random(seed)
    times = array("d")
    t = start = 0.0
    for duration, rate in phases:
        t = max(t, start)
        if rate <= 0:  # a quiet phase: no arrivals
            start += duration
            continue
        while t < start + duration:
            times.append(t)
            t += rng.expovariate(rate)
        start += duration
    n = len(times)
    return Trace(
        source=source,
        fmt="poisson",
        arrival_s=times,
        input_tokens=array("q", [input_tokens] * n),
        output_tokens=array("q", [output_tokens] * n),
    )


def read_trace(
    path: str | Path,
    *,
    fmt: TraceFormat | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
) -> Trace:
    """Read a trace; keep the requests that arrive in [start_s, start_s + duration_s) of it, with arrival gaps
    divided by ``rate_scale`` (2.0 replays the same requests at twice the rate)."""
    p = Path(path)
    if not (math.isfinite(start_s) and start_s >= 0):
        raise TraceError(f"start: {start_s} is not a time in the trace; give 0 or more seconds", field="trace")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise TraceError(f"duration: {duration_s}; give more than 0 seconds", field="trace")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise TraceError(f"rate_scale: {rate_scale}; give a number above 0 (1 replays the trace as recorded)")
    try:
        raw = p.open("r", encoding="utf-8", newline="")
    except OSError as err:
        raise TraceError(f"{p}: cannot read the trace: {err.strerror or err}") from None
    with raw:
        try:
            head = raw.read(64 * 1024)
            kind = fmt or detect_format(p, head)
            rows = _Rows(str(p), kind, start_s=start_s, duration_s=duration_s)
            raw.seek(0)
            {"azure": _read_azure, "burstgpt": _read_burstgpt, "mooncake": _read_mooncake, "kvfleet": _read_kvfleet}[
                kind
            ](rows, raw)
        except UnicodeDecodeError as err:
            raise TraceError(
                f"{p}: (file): byte 0x{err.object[err.start]:02x} is not UTF-8; save it as UTF-8"
            ) from None
        except csv.Error as err:
            raise TraceError(f"{p}: (file): not a CSV file kvfleet can read: {err}") from None
    return rows.build(rate_scale=rate_scale, block_tokens=MOONCAKE_BLOCK_TOKENS if kind == "mooncake" else None)
