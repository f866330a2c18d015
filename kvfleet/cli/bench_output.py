"""What `kvfleet bench` prints: the table, what ran, a live progress line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import (
    _console,
)

if TYPE_CHECKING:
    from kvfleet.bench.client import KvCapacity, LevelSpec


def what_ran(a: argparse.Namespace, limits: tuple[int, int, int] | None, specs: list[LevelSpec]) -> str:
    """The table's title: what the levels sent."""
    if a.trace is not None:
        return f"the trace {a.trace} (its own lengths and arrivals, x{a.rate_scale:g} the rate)"
    if limits is not None:
        n_in, n_out, c = limits
        return f"the limits: {n_in} prompt + {n_out} generated tokens per request at {c} and {2 * c} clients"
    lengths = sorted({n for s in specs for n in s.lengths})
    each = ", ".join(f"{i} prompt + {o} generated" for i, o in lengths)
    if a.planned_load:
        return f"the plan's load: Poisson arrivals, {each} tokens per request"
    return f"{each} tokens per request"


def print_bench(url: str, model: str, what: str, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    def ms(p: dict[str, float] | None, key: str, digits: int = 0) -> str:
        return "-" if p is None else f"{p[key] * 1e3:,.{digits}f}"

    slo = any(r["ttft_attainment"] is not None for r in rows)
    t = Table(title=f"{url}: {model}, {what}")
    cols = ["level", "ok", "failed", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50 ms", "req/s", "out tok/s"]
    cols += ["TTFT in time"] if slo else []
    gauges = any(r.get("over_time") for r in rows)
    cols += ["KV peak", "queue peak"] if gauges else []
    cols += ["client lag p99 ms"]
    for col in cols:
        t.add_column(col, justify="left" if col == "level" else "right")
    for r in rows:
        failed = ", ".join(f"{n} x {k}" for k, n in sorted(r["failed"].items())) or "0"
        cells = [
            r["level"],
            str(r["completed"]),
            failed,
            f"{ms(r['ttft_s'], 'p50')}/{ms(r['ttft_s'], 'p90')}/{ms(r['ttft_s'], 'p99')}",
            f"{ms(r['itl_s'], 'p50', 1)}/{ms(r['itl_s'], 'p90', 1)}/{ms(r['itl_s'], 'p99', 1)}",
            ms(r["tpot_s"], "p50", 1),
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:,.0f}",
        ]
        if slo:
            cells.append("-" if r["ttft_attainment"] is None else f"{r['ttft_attainment']:.1%}")
        if gauges:
            ot = r.get("over_time") or {}
            kv, q = ot.get("kv_cache_utilization_max"), ot.get("requests_waiting_max")
            cells += ["-" if kv is None else f"{kv:.0%}", "-" if q is None else f"{q:g}"]
        cells.append(f"{r['client_loop_lag_p99_s'] * 1e3:.1f}")
        t.add_row(*cells)
    console = _console()
    console.print(t)
    worst = max(r["client_loop_lag_p99_s"] for r in rows)
    late = max(r["late_send_max_s"] for r in rows)
    if worst > 0.005 or late > 0.05:
        console.print(
            f"note: the client's event loop lagged {worst * 1e3:.1f} ms (p99) and sent a request up to "
            f"{late * 1e3:.0f} ms after its time: timings include the client's own delay; run it from a machine "
            "with more CPU or fewer concurrent streams",
            markup=False,
        )
    for r in rows:
        for e in r["first_errors"]:
            console.print(f"error at {r['level']}: {e}", markup=False)


def progress_line() -> Callable[[LevelSpec, list[Any]], None]:
    """A live line on the terminal (stderr) for long runs: the level, requests done, failed, tokens so far."""
    import time

    last = [0.0]

    def show(spec: LevelSpec, results: list[Any]) -> None:
        now = time.monotonic()
        if now - last[0] < 0.25 and len(results) < len(spec.lengths):  # a few redraws a second at most
            return
        last[0] = now
        failed = sum(1 for r in results if not r.ok)
        tokens = sum(r.output_tokens for r in results)
        print(
            f"\r\033[K{spec.label}: {len(results)}/{len(spec.lengths)} requests, {failed} failed, {tokens:,} tokens",
            end="",
            file=sys.stderr,
            flush=True,
        )

    return show


def print_checks(
    a: argparse.Namespace,
    report: dict[str, Any],
    capacity: KvCapacity | None,
    ttft_ms: float | None,
    prediction_source: str | None,
) -> None:
    """Below the table, for people: the engine's cache, the plan's and the simulator's figures, the best rate."""
    rows = report["levels"]
    if capacity is not None:
        print(
            f"engine KV cache: {capacity.blocks:,} blocks of {capacity.block_tokens} tokens = "
            f"{capacity.tokens:,} tokens per replica ({capacity.source})"
        )
    for row in rows:
        if p := row.get("planned"):
            itl = row["itl_s"]
            measured = f"{itl['mean'] * 1e3:.1f} ms" if itl else "-"
            print(
                f"plan ({p['instance_type']}, one replica) at {row['level']}: ITL {p['itl_s'] * 1e3:.1f} ms "
                f"(measured {measured}), {p['output_tokens_per_s']:,.0f} output tokens/s (measured "
                f"{row['output_tokens_per_s']:,.0f}), TTFT {p['ttft_s'] * 1e3:,.0f} ms"
            )
    if prediction_source is not None:
        from kvfleet.cli.predict import prediction_lines

        print("\n".join(prediction_lines(rows, prediction_source)))
    _print_best_rate(a, report["best_rate_per_s"], ttft_ms)
    expected = report["expected_kv_tokens"]
    if expected is not None and report["drift"] is None:
        print(f"plan check: {expected:,} KV tokens expected; the engine has them (tolerance {a.tolerance:.0%})")


def _print_best_rate(a: argparse.Namespace, best_rate: float | None, ttft_ms: float | None) -> None:
    if best_rate is None or ttft_ms is None:
        return
    top = max(a.rate or [0.0])
    if a.rate and best_rate >= top:  # the sweep never found where it stops
        print(
            f"every rate up to {top:g} req/s got {a.slo_attainment:.0%} of first tokens within {ttft_ms:g} "
            f"ms: the limit lies above {top:g} req/s (add higher rates to find it)"
        )
    else:
        print(f"highest rate with {a.slo_attainment:.0%} of first tokens within {ttft_ms:g} ms: {best_rate:g} req/s")
