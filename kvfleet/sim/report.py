"""What a simulated run says: latency percentiles, SLO attainment, rejections, replicas over time and cost."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvfleet.sim.fleet import FleetResult, FleetSpec, fleet_usd


@dataclass(frozen=True, kw_only=True)
class Percentiles:
    p50: float
    p90: float
    p95: float  # kept: latency objectives default to p95
    p99: float
    mean: float


@dataclass(frozen=True, kw_only=True)
class SimReport:
    requests: int
    completed: int
    rejected_429: int
    rejected_503: int
    aborted: int
    preemptions: int
    ttft_s: Percentiles | None
    itl_s: Percentiles | None  # every gap between two tokens, pooled (what `vllm bench serve` reports as ITL)
    tpot_s: Percentiles | None  # per request: (end - first token) / (tokens - 1)
    e2e_s: Percentiles | None
    ttft_slo_attainment: float | None
    itl_slo_attainment: float | None
    replicas_min: int
    replicas_max: int
    replica_hours: float
    usd: float | None
    usd_per_million_input_tokens: float | None
    usd_per_million_output_tokens: float | None
    simulated_s: float
    # Served over the run, from the first arrival to the last answer (how benchmark clients count throughput).
    output_tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    # Of ``aborted``, those a scale-in cut: on a removed replica when its drain ended (the drain budget, or the
    # platform's kill where it comes first).
    cut_by_scale_in: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def percentiles(values: list[float]) -> Percentiles | None:
    if not values:
        return None
    v = sorted(values)
    return Percentiles(p50=_pct(v, 0.50), p90=_pct(v, 0.90), p95=_pct(v, 0.95), p99=_pct(v, 0.99), mean=sum(v) / len(v))


def weighted_percentiles(pairs: list[tuple[float, int]]) -> Percentiles | None:
    pairs = sorted(p for p in pairs if p[1] > 0)
    total = sum(w for _, w in pairs)
    if not total:
        return None
    out = []
    for q in (0.50, 0.90, 0.95, 0.99):
        rank = max(1, math.ceil(q * total))
        seen = 0
        for value, w in pairs:
            seen += w
            if seen >= rank:
                out.append(value)
                break
    mean = sum(v * w for v, w in pairs) / total
    return Percentiles(p50=out[0], p90=out[1], p95=out[2], p99=out[3], mean=mean)


def summarize(
    result: FleetResult, spec: FleetSpec, *, ttft_slo_s: float | None = None, itl_slo_s: float | None = None
) -> SimReport:
    s = result.stats
    done = s.finished
    o = spec.request_overhead_s
    ttft = [r.first_token_s - r.arrival_s + o for r in done]
    e2e = [r.done_s - r.arrival_s + o for r in done]
    tpot = [(r.done_s - r.first_token_s) / (r.generated - 1) for r in done if r.generated > 1]
    offered = result.requests
    ttft_ok = None
    if ttft_slo_s is not None and offered:
        # Refused and aborted requests miss the target too.
        ttft_ok = sum(1 for x in ttft if x <= ttft_slo_s) / offered
    itl_ok = None
    if itl_slo_s is not None:
        total = sum(w for _, w in s.itl)
        itl_ok = sum(w for v, w in s.itl if v <= itl_slo_s) / total if total else None
    hours = result.replica_seconds / 3600
    span = max((r.done_s + o for r in done), default=0.0) - min((r.arrival_s for r in done), default=0.0)
    usd = fleet_usd(result, spec)
    counts = [x.replicas + x.starting for x in result.samples] or [spec.initial_replicas]
    return SimReport(
        requests=offered,
        completed=len(done),
        rejected_429=s.rejected_429,
        rejected_503=s.rejected_503,
        aborted=s.aborted,
        preemptions=s.preemptions,
        ttft_s=percentiles(ttft),
        itl_s=weighted_percentiles(s.itl),
        tpot_s=percentiles(tpot),
        e2e_s=percentiles(e2e),
        ttft_slo_attainment=ttft_ok,
        itl_slo_attainment=itl_ok,
        replicas_min=min(counts),
        replicas_max=max(counts),
        replica_hours=hours,
        usd=usd,
        usd_per_million_input_tokens=usd / s.prompt_tokens * 1e6 if usd is not None and s.prompt_tokens else None,
        usd_per_million_output_tokens=usd / s.output_tokens * 1e6 if usd is not None and s.output_tokens else None,
        simulated_s=result.end_s,
        output_tokens_per_s=sum(r.generated for r in done) / span if span > 0 else 0.0,
        requests_per_s=len(done) / span if span > 0 else 0.0,
        cut_by_scale_in=s.cut_by_scale_in,
    )


def _ms(p: Percentiles | None) -> str:
    if p is None:
        return "n/a"
    return (
        f"p50 {p.p50 * 1e3:,.0f} ms, p90 {p.p90 * 1e3:,.0f} ms, p95 {p.p95 * 1e3:,.0f} ms, p99 {p.p99 * 1e3:,.0f} ms "
        f"(mean {p.mean * 1e3:,.0f} ms)"
    )


def _aborted(r: SimReport) -> str:
    if not r.cut_by_scale_in:
        return f"{r.aborted:,} aborted"
    return f"{r.aborted:,} aborted ({r.cut_by_scale_in:,} cut by a scale-in: on a removed replica when its drain ended)"


def render(r: SimReport) -> str:
    lines = [
        f"requests      {r.requests:,} offered, {r.completed:,} completed, {r.rejected_429:,} refused (429), "
        f"{r.rejected_503:,} with no replica (503), {_aborted(r)}; {r.preemptions:,} preemptions",
        f"TTFT          {_ms(r.ttft_s)}",
        f"ITL           {_ms(r.itl_s)}",
        f"TPOT          {_ms(r.tpot_s)}",
        f"end to end    {_ms(r.e2e_s)}",
        f"throughput    {r.output_tokens_per_s:,.0f} output tokens/s, {r.requests_per_s:,.2f} requests/s",
    ]
    if r.ttft_slo_attainment is not None:
        lines.append(f"TTFT target   met by {r.ttft_slo_attainment:.1%} of requests offered")
    if r.itl_slo_attainment is not None:
        lines.append(f"ITL target    met by {r.itl_slo_attainment:.1%} of token gaps")
    cost = ""
    if r.usd is not None:
        cost = f", ${r.usd:,.2f}"
        if r.usd_per_million_input_tokens is not None and r.usd_per_million_output_tokens is not None:
            cost += (
                f" (${r.usd_per_million_input_tokens:,.2f} per million input tokens or "
                f"${r.usd_per_million_output_tokens:,.2f} per million output tokens)"
            )
    lines.append(
        f"replicas      {r.replicas_min} to {r.replicas_max}, {r.replica_hours:,.2f} replica-hours over "
        f"{r.simulated_s / 60:,.1f} min{cost}"
    )
    return "\n".join(lines)
