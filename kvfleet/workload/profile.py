"""What a trace says about a workload: lengths, arrival rate and its bursts, prefix reuse.

The profile is what the planner needs in place of hand-typed averages: typical and tail lengths, the peak
rate to size for (the busiest minute, not the mean), and how bursty arrivals are (the coefficient of
variation of the gaps between requests: 1 for a Poisson process, above 1 when requests bunch).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from kvfleet.workload.traces import Trace


@dataclass(frozen=True, kw_only=True)
class Lengths:
    mean: float
    p50: int
    p90: int
    p99: int
    max: int


@dataclass(frozen=True, kw_only=True)
class Arrivals:
    mean_per_s: float
    mean_per_minute: float
    peak_per_minute: int
    peak_to_mean: float  # busiest whole minute over the mean minute
    peak_per_s: int  # busiest single second
    interarrival_cv: float | None  # None with fewer than three requests


@dataclass(frozen=True, kw_only=True)
class PrefixReuse:
    """Prompt tokens an unbounded prefix cache would have served: from block hashes (Mooncake) or from what
    the engine reported (the agent's log)."""

    reused_token_fraction: float
    requests_with_reuse_fraction: float
    measured: bool  # True: the engine's own count; False: derived from block hashes


@dataclass(frozen=True, kw_only=True)
class WorkloadProfile:
    source: str
    fmt: str
    requests: int
    failed: int
    duration_s: float
    started_at: str | None
    input_tokens: Lengths
    output_tokens: Lengths
    arrivals: Arrivals
    prefix_reuse: PrefixReuse | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rank(sorted_values: list[int], q: float) -> int:
    # Nearest rank: an observed value, never an interpolation between two requests.
    i = max(0, math.ceil(q * len(sorted_values)) - 1)
    return sorted_values[i]


def lengths(values: array[int]) -> Lengths:
    v = sorted(values)
    return Lengths(mean=sum(v) / len(v), p50=_rank(v, 0.50), p90=_rank(v, 0.90), p99=_rank(v, 0.99), max=v[-1])


def arrivals(t: array[float]) -> Arrivals:
    n = len(t)
    span = t[-1] - t[0]
    minutes = Counter(int(x // 60) for x in t)
    seconds = Counter(int(x) for x in t)
    n_minutes = max(1, math.ceil(span / 60)) if span > 0 else 1
    mean_minute = n / n_minutes
    cv = None
    if n >= 3:
        gaps = [t[i + 1] - t[i] for i in range(n - 1)]
        mean_gap = sum(gaps) / len(gaps)
        if mean_gap > 0:
            var = sum((g - mean_gap) ** 2 for g in gaps) / (len(gaps) - 1)
            cv = math.sqrt(var) / mean_gap
    return Arrivals(
        mean_per_s=n / span if span > 0 else float(n),
        mean_per_minute=mean_minute,
        peak_per_minute=max(minutes.values()),
        peak_to_mean=max(minutes.values()) / mean_minute,
        peak_per_s=max(seconds.values()),
        interarrival_cv=cv,
    )


def prefix_reuse(trace: Trace) -> PrefixReuse | None:
    if trace.cached_tokens is not None:
        total = sum(trace.input_tokens)
        cached = sum(trace.cached_tokens)
        with_reuse = sum(1 for c in trace.cached_tokens if c > 0)
        return PrefixReuse(
            reused_token_fraction=cached / total if total else 0.0,
            requests_with_reuse_fraction=with_reuse / len(trace),
            measured=True,
        )
    if trace.prefix_blocks is None or trace.block_tokens is None:
        return None
    seen: set[int] = set()
    reused_tokens = 0
    requests_with_reuse = 0
    for blocks, n_in in zip(trace.prefix_blocks, trace.input_tokens, strict=True):
        # A prefix cache hits a block only if every block before it hit too: count the leading run of known ids.
        hit = 0
        for b in blocks:
            if b not in seen:
                break
            hit += 1
        seen.update(blocks)
        tokens = min(hit * trace.block_tokens, n_in)
        reused_tokens += tokens
        requests_with_reuse += tokens > 0
    total = sum(trace.input_tokens)
    return PrefixReuse(
        reused_token_fraction=reused_tokens / total if total else 0.0,
        requests_with_reuse_fraction=requests_with_reuse / len(trace),
        measured=False,
    )


def profile(trace: Trace) -> WorkloadProfile:
    return WorkloadProfile(
        source=trace.source,
        fmt=trace.fmt,
        requests=len(trace),
        failed=trace.failed,
        duration_s=trace.duration_s,
        started_at=trace.started_at,
        input_tokens=lengths(trace.input_tokens),
        output_tokens=lengths(trace.output_tokens),
        arrivals=arrivals(trace.arrival_s),
        prefix_reuse=prefix_reuse(trace),
    )


def render(p: WorkloadProfile) -> str:
    """The profile as a few lines of text for a terminal."""
    a = p.arrivals
    lines = [
        f"{p.source} ({p.fmt}): {p.requests:,} requests over {p.duration_s / 60:.1f} min"
        + (f" from {p.started_at}" if p.started_at else "")
        + (f"; {p.failed:,} failed requests left out" if p.failed else ""),
        "                mean     p50     p90     p99     max",
    ]
    for name, ln in (("input tokens", p.input_tokens), ("output tokens", p.output_tokens)):
        lines.append(f"{name:<14}{ln.mean:>6.0f}{ln.p50:>8}{ln.p90:>8}{ln.p99:>8}{ln.max:>8}")
    cv = "n/a" if a.interarrival_cv is None else f"{a.interarrival_cv:.2f}"
    lines += [
        f"arrivals      {a.mean_per_s:.2f}/s mean, {a.mean_per_minute:.0f}/min mean, "
        f"busiest minute {a.peak_per_minute} ({a.peak_to_mean:.2f}x the mean), busiest second {a.peak_per_s}",
        f"burstiness    gap coefficient of variation {cv} (1 is Poisson; above 1, requests bunch)",
    ]
    r = p.prefix_reuse
    if r is not None:
        how = "reported by the engine" if r.measured else "from block hashes, unbounded cache"
        lines.append(
            f"prefix reuse  {r.reused_token_fraction:.0%} of prompt tokens, in {r.requests_with_reuse_fraction:.0%} of "
            f"requests ({how})"
        )
    return "\n".join(lines)
