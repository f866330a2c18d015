"""`kvfleet bench --html FILE`: one self-contained page (inline SVG, no scripts, no network) with the run's
distributions and levels, so a report can be attached to a pipeline run or a ticket and opened anywhere."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from kvfleet.bench.client import Level

WIDTH, HEIGHT, PAD = 560, 300, 48
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _axes(title: str) -> list[str]:
    """An SVG's opening, its title and its two axes."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{html.escape(title)}">',
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - 10}" y2="{HEIGHT - PAD}" stroke="#333"/>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{PAD}" y2="24" stroke="#333"/>',
    ]


def _cdf_svg(title: str, series: Sequence[tuple[str, Sequence[float]]], unit: str) -> str:
    """Empirical CDFs, one line per series, x in ``unit`` (values are seconds; shown in ms)."""
    values = [v for _, vs in series for v in vs]
    if not values:
        return f"<p>{html.escape(title)}: no data</p>"
    hi = max(values) * 1e3 or 1.0
    parts = _axes(title)
    plot_w, plot_h = WIDTH - 10 - PAD, HEIGHT - PAD - 24
    for i in range(5):
        x = PAD + plot_w * i / 4
        parts.append(
            f'<text x="{x:.0f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">{hi * i / 4:,.0f}</text>'
        )
        y = HEIGHT - PAD - plot_h * i / 4
        parts.append(f'<text x="{PAD - 6}" y="{y + 4:.0f}" text-anchor="end" font-size="11">{i * 25}%</text>')
    parts.append(
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle" font-size="11">{html.escape(unit)}</text>'
    )
    for k, (name, vs) in enumerate(series):
        if not vs:
            continue
        v = sorted(vs)
        step = max(1, len(v) // 400)  # at most ~400 points a line
        pts = []
        for j in range(0, len(v), step):
            x = PAD + plot_w * (v[j] * 1e3) / hi
            y = HEIGHT - PAD - plot_h * (j + 1) / len(v)
            pts.append(f"{x:.1f},{y:.1f}")
        color = COLORS[k % len(COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(pts)}"/>')
        parts.append(
            f'<text x="{WIDTH - 14}" y="{40 + 14 * k}" text-anchor="end" font-size="11" fill="{color}">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _bars_svg(title: str, bars: Sequence[tuple[str, float]], unit: str) -> str:
    if not bars:
        return ""
    hi = max(v for _, v in bars) or 1.0
    bw = (WIDTH - PAD - 10) / len(bars)
    plot_h = HEIGHT - PAD - 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{html.escape(title)}">',
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)} ({unit})</text>',
    ]
    for i, (name, v) in enumerate(bars):
        h = plot_h * v / hi
        x = PAD + i * bw
        parts.append(
            f'<rect x="{x + 4:.1f}" y="{HEIGHT - PAD - h:.1f}" width="{bw - 8:.1f}" height="{h:.1f}" fill="#1f77b4"/>'
        )
        parts.append(
            f'<text x="{x + bw / 2:.1f}" y="{HEIGHT - PAD - h - 4:.1f}" text-anchor="middle" font-size="11">'
            f"{v:,.0f}</text>"
        )
        parts.append(
            f'<text x="{x + bw / 2:.1f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _lines_svg(
    title: str,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    unit: str,
    *,
    marks: Sequence[tuple[float, str]] = (),
    y_max: float | None = None,
) -> str:
    """Lines over the run's time (x in seconds), with each level's start marked."""
    points = [p for _, ps in series for p in ps]
    if not points:
        return ""
    x_hi = max(t for t, _ in points) or 1.0
    y_hi = y_max if y_max is not None else max(v for _, v in points) or 1.0
    plot_w, plot_h = WIDTH - 10 - PAD, HEIGHT - PAD - 24
    parts = [
        *_axes(title),
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle" font-size="11">s since the run began</text>',
    ]
    for i in range(5):
        x = PAD + plot_w * i / 4
        parts.append(
            f'<text x="{x:.0f}" y="{HEIGHT - PAD + 16}" text-anchor="middle" font-size="11">{x_hi * i / 4:,.0f}</text>'
        )
        y = HEIGHT - PAD - plot_h * i / 4
        parts.append(
            f'<text x="{PAD - 6}" y="{y + 4:.0f}" text-anchor="end" font-size="11">{y_hi * i / 4:,.3g}{unit}</text>'
        )
    for t, label in marks:
        x = PAD + plot_w * t / x_hi
        parts.append(
            f'<line x1="{x:.1f}" y1="24" x2="{x:.1f}" y2="{HEIGHT - PAD}" stroke="#bbb" stroke-dasharray="3"/>'
        )
        parts.append(f'<text x="{x + 3:.1f}" y="34" font-size="10" fill="#777">{html.escape(label)}</text>')
    for k, (name, ps) in enumerate(series):
        if not ps:
            continue
        pts = " ".join(
            f"{PAD + plot_w * t / x_hi:.1f},{HEIGHT - PAD - plot_h * min(v, y_hi) / y_hi:.1f}" for t, v in ps
        )
        color = COLORS[k % len(COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        parts.append(
            f'<text x="{WIDTH - 14}" y="{48 + 14 * k}" text-anchor="end" font-size="11" fill="{color}">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _over_time(levels: Sequence[Level]) -> list[str]:
    """KV-cache use and the engine's queue through the run, as the endpoint's /metrics reported them."""
    samples = [x for lv in levels for x in lv.samples]
    if not samples:
        return ["<p>KV-cache use and queue over time: this endpoint has no /metrics</p>"]
    marks = [(lv.samples[0].t_s, lv.spec.label) for lv in levels if lv.samples]
    kv = [(x.t_s, 100 * x.kv_cache_utilization) for x in samples if x.kv_cache_utilization is not None]
    waiting = [(x.t_s, x.requests_waiting) for x in samples if x.requests_waiting is not None]
    running = [(x.t_s, x.requests_running) for x in samples if x.requests_running is not None]
    return [
        _lines_svg("KV-cache use over the run", [("KV blocks in use", kv)], "%", marks=marks, y_max=100.0),
        _lines_svg(
            "Requests in the engine over the run", [("waiting", waiting), ("running", running)], "", marks=marks
        ),
    ]


def _ms(p: dict[str, float] | None, key: str) -> str:
    return "-" if p is None or not math.isfinite(p[key]) else f"{p[key] * 1e3:,.1f}"


def _levels_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One row a level: what it completed and failed, its latency percentiles and throughput, and the plan's."""
    table = [
        "<table><tr><th>level</th><th>ok</th><th>failed</th><th>TTFT p50 / p95 / p99 ms</th>"
        "<th>ITL p50 / p95 / p99 ms</th><th>TPOT p50 ms</th><th>req/s</th><th>out tok/s</th>"
        "<th>plan ITL ms</th><th>plan tok/s</th></tr>"
    ]
    for r in rows:
        failed = ", ".join(f"{n} x {k}" for k, n in sorted(r["failed"].items())) or "0"
        p = r.get("planned")
        table.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    r["level"],
                    r["completed"],
                    failed,
                    " / ".join(_ms(r["ttft_s"], q) for q in ("p50", "p95", "p99")),
                    " / ".join(_ms(r["itl_s"], q) for q in ("p50", "p95", "p99")),
                    _ms(r["tpot_s"], "p50"),
                    f"{r['requests_per_s']:.2f}",
                    f"{r['output_tokens_per_s']:,.0f}",
                    f"{p['itl_s'] * 1e3:.1f}" if p else "-",
                    f"{p['output_tokens_per_s']:,.0f}" if p else "-",
                )
            )
            + "</tr>"
        )
    table.append("</table>")
    return table


def _kv_line(report: dict[str, Any]) -> str:
    kv = report.get("kv_cache")
    if not kv:
        return "engine KV cache: not reported by this endpoint"
    return f"engine KV cache: {kv['blocks']:,} blocks of {kv['block_tokens']} = {kv['tokens']:,} tokens per replica"


def render_html(report: dict[str, Any], levels: Sequence[Level]) -> str:
    rows = report["levels"]
    head = (
        f"{report['url']}: {report['model']}, {report['input_tokens']} prompt + {report['output_tokens']} "
        "generated tokens per request"
    )
    ttft = [(lv.spec.label, [t for r in lv.results if r.ok and (t := r.ttft_s) is not None]) for lv in levels]
    itl = [(lv.spec.label, [g for r in lv.results if r.ok for g in r.itl_s]) for lv in levels]
    checks = [x for x in (report.get("drift"), report.get("slo_miss")) if x]
    checks += (report.get("limits") or {}).get("lines", [])
    return "\n".join(
        [
            "<!doctype html><html><head><meta charset='utf-8'><title>kvfleet bench</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}svg{margin:8px}</style></head><body>",
            f"<h1>kvfleet bench</h1><p>{html.escape(head)}</p>",
            *_levels_table(rows),
            f"<p>{html.escape(_kv_line(report))}</p>",
            *(f"<p><b>{html.escape(c)}</b></p>" for c in checks),
            "<div>",
            _cdf_svg("TTFT, cumulative share of requests", ttft, "ms"),
            _cdf_svg("Inter-token gaps, cumulative share", itl, "ms"),
            _bars_svg(
                "Output tokens per second by level", [(r["level"], r["output_tokens_per_s"]) for r in rows], "tok/s"
            ),
            *_over_time(levels),
            "</div></body></html>",
        ]
    )
