"""The accuracy ledger: published serving benchmarks, each predicted as it ran, and the errors.

``sizing/data/serving_benchmarks.json`` holds public measurements (vLLM and TensorRT-LLM, several GPUs, models and
load levels), each with its source, copied as published. Every row is run here in the shape it was measured: a
closed loop of its clients (``vllm bench serve --max-concurrency``, GenAI-Perf), or an offline run with every
request submitted at once (``trtllm-bench throughput``, ``vllm bench serve`` at an infinite rate), on one engine
started with the row's published settings and otherwise the engine's defaults for that GPU and release, priced by
the step model and scheduled by the engine's own scheduler. Rows are split: ``fit`` rows are the published runs the
step model's constants were fitted on; ``check`` rows were used to fit nothing. `tools/accuracy_ledger.py` writes
``docs/accuracy.md`` from here; ``tests/sim/test_ledger.py`` holds the check-set medians to what it records.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any

from kvfleet.errors import KvfleetError
from kvfleet.sim.candidate import EngineStart, start
from kvfleet.sim.report import SimReport, summarize
from kvfleet.sim.shapes import closed_loop
from kvfleet.sizing import trtllm_bench
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.hardware import accelerator
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.step import StepConstants, default_constants, request_overhead_s
from kvfleet.versions import parse_version
from kvfleet.workload.shapes import ClosedLoop, Lengths

# An offline run's requests all arrive at t = 0 and the engine works through them at its batch limit: past a few
# thousand the throughput is that of the saturated batch, so longer runs are simulated at this many.
OFFLINE_REQUESTS = 2000
# A closed loop whose source does not say how many requests it sent: ten per client (vllm bench serve's default of
# 1,000 prompts is more, but a closed loop's figures settle well before).
REQUESTS_PER_CLIENT = 10
METRICS = ("ttft", "tpot", "itl", "e2e", "output_tokens_per_s")
MOE_FIT_METRICS = ("ttft", "tpot", "output_tokens_per_s")


@dataclass(frozen=True, kw_only=True)
class Row:
    """One published measurement and what kvfleet predicts for it."""

    cid: str
    split: str
    engine: str
    gpu: str
    model: str
    load: str  # the load level it falls in (``load_level``)
    measured: dict[str, float]  # metric -> value, in seconds or tokens/s, at the statistic the source published
    predicted: dict[str, float] = field(default_factory=dict)
    statistic: dict[str, str] = field(default_factory=dict)  # metric -> "p50" or "mean"
    skipped: str | None = None  # why the row is not predicted
    notes: tuple[str, ...] = ()

    def errors(self) -> dict[str, float]:
        """Predicted over measured, minus one, for each metric both have."""
        return {
            k: self.predicted[k] / v - 1
            for k, v in self.measured.items()
            if k in self.predicted and v > 0 and math.isfinite(self.predicted[k])
        }


@cache
def data() -> Mapping[str, Any]:
    text = resources.files("kvfleet.sizing").joinpath("data", "serving_benchmarks.json").read_text(encoding="utf-8")
    loaded: Mapping[str, Any] = json.loads(text)
    return loaded


def load_level(case: Mapping[str, Any]) -> str:
    shape = case["shape"]
    if shape["kind"] == "offline":
        return "offline (all at once)"
    c = shape["concurrency"] or 0
    for bound, name in ((1, "1 client"), (16, "2-16 clients"), (64, "17-64 clients"), (256, "65-256 clients")):
        if c <= bound:
            return name
    return "over 256 clients"


def _measured(case: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    m = case["measured"]
    values: dict[str, float] = {}
    stats: dict[str, str] = {}
    for metric in ("ttft", "tpot", "itl", "e2e"):
        figures = m.get(f"{metric}_ms") or {}
        for stat in ("p50", "mean"):  # the median where the source gives it, else the mean
            if figures.get(stat) is not None:
                values[metric] = figures[stat] / 1000
                stats[metric] = stat
                break
    if m.get("output_tokens_per_s") is not None:
        values["output_tokens_per_s"] = float(m["output_tokens_per_s"])
        stats["output_tokens_per_s"] = "mean"
    return values, stats


def _alias(case: Mapping[str, Any]) -> Mapping[str, Any]:
    alias: Mapping[str, Any] = data().get("model_aliases", {}).get(case["model"], {})
    return alias


def _model(case: Mapping[str, Any]) -> ModelSpec | None:
    try:
        return catalog_model(_alias(case).get("as", case["model"]))
    except KvfleetError:
        return None


def _bench_limits(case: Mapping[str, Any], model: ModelSpec) -> tuple[int, int]:
    """The batch and token limits trtllm-bench derives for a uniform dataset when a run sets none."""
    acc = accelerator(case["gpu"])
    shape = case["shape"]
    bench = trtllm_bench.engine_settings(
        param_count=model.total_params,
        weight_bytes=trtllm_bench.bytes_per_elem(case["weights"]),
        kv_bytes_per_elem=trtllm_bench.bytes_per_elem(case["kv_cache_dtype"] or case["weights"]),
        attention_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        device_memory_bytes=acc.usable_memory_bytes or acc.memory_bytes or 0,
        avg_isl=shape["input_tokens"],
        avg_osl=shape["output_tokens"],
        max_isl=shape["input_tokens"],
        tp=case["tp"] or case["gpus"],
        kv_cache_fraction=0.95,
    )
    return bench.max_batch_size, bench.max_num_tokens


def _engine(case: Mapping[str, Any], model: ModelSpec) -> tuple[EngineStart, tuple[str, ...]]:
    s = {**case["settings"], **{k: v for k, v in case.get("assumed", {}).items() if v is not None}}
    notes: list[str] = [f"assumed: {case['assumed']['why']}"] if case.get("assumed") else []
    seqs, tokens = s.get("max_num_seqs"), s.get("max_num_batched_tokens")
    bench = case.get("client") == "trtllm-bench"  # not trtllm-serve, which starts with the LLM API's defaults
    if bench and seqs is None and tokens is None:
        seqs, tokens = _bench_limits(case, model)
        notes.append(f"trtllm-bench's derived limits: max_batch_size {seqs}, max_num_tokens {tokens}")
    version = case.get("engine_version")
    if version is not None and not _release(version):
        notes.append(f"release {version!r} not a version kvfleet reads: the engine's default release")
        version = None
    memory = s.get("gpu_memory_utilization")
    if memory is None and bench:
        memory = 0.95  # the perf-overview's own words: "we also use a higher KV cache percentage ... 0.95"
    start_args = {
        "model": model,
        "gpu": case["gpu"],
        "tp": case["tp"] or case["gpus"],
        "engine": case["engine"],
        "precision": case["weights"] if case["weights"] != model.native_scheme.name else None,
        "kv_cache_dtype": case["kv_cache_dtype"]
        or s.get("kv_cache_dtype")
        or _alias(case).get("kv_cache_dtype", "auto"),
        "max_model_len": s.get("max_model_len"),
        "max_num_seqs": seqs,
        "max_num_batched_tokens": tokens,
        "gpu_memory_utilization": memory,
        "enable_chunked_prefill": s.get("enable_chunked_prefill"),  # a published serve flag (trtllm-serve's)
    }
    return EngineStart(**start_args, engine_version=version), tuple(notes)


def _release(text: str) -> bool:
    try:
        parse_version(text)
    except ValueError:
        return False
    return True


def _shape(case: Mapping[str, Any]) -> ClosedLoop:
    """The run as the source made it; where it printed the tokens it really sent and got (a run without
    ignore_eos ends answers early), their means."""
    shape = case["shape"]
    n = shape["requests"]
    i, o = shape["input_tokens"], shape["output_tokens"]
    if n and shape.get("input_tokens_total"):
        i = max(1, round(shape["input_tokens_total"] / n))
    if n and shape.get("output_tokens_total"):
        o = max(1, round(shape["output_tokens_total"] / n))  # a dataset of varying lengths: predicted at the mean
    lengths = Lengths(input_tokens=i, output_tokens=o)
    if shape["kind"] == "offline":
        n = min(shape["requests"] or OFFLINE_REQUESTS, OFFLINE_REQUESTS)
        return ClosedLoop(concurrency=n, requests=n, lengths=lengths)
    c = shape["concurrency"]
    return ClosedLoop(concurrency=c, requests=shape["requests"] or REQUESTS_PER_CLIENT * c, lengths=lengths)


def _figures(report: SimReport, stats: Mapping[str, str]) -> dict[str, float]:
    out: dict[str, float] = {"output_tokens_per_s": report.output_tokens_per_s}
    for metric, p in (("ttft", report.ttft_s), ("tpot", report.tpot_s), ("itl", report.itl_s), ("e2e", report.e2e_s)):
        if p is not None:
            out[metric] = p.p50 if stats.get(metric) == "p50" else p.mean
    return out


def predict(case: Mapping[str, Any], constants: StepConstants | None = None) -> Row:
    measured, stats = _measured(case)
    row = Row(
        cid=case["id"],
        split=case["split"],
        engine=case["engine"],
        gpu=case["gpu"],
        model=case["model"],
        load=load_level(case),
        measured=measured,
        statistic=stats,
    )
    model = _model(case)
    if model is None:
        return _skip(row, f"{case['model']} is not in the model catalog")
    engine, notes = _engine(case, model)
    shape = _shape(case)
    try:
        longest = shape.lengths.max_input_tokens + shape.lengths.max_output_tokens
        started = start(engine, longest_request_tokens=longest, constants=constants)
    except KvfleetError as err:
        return _skip(row, f"not started: {err}")
    report = summarize(closed_loop(started.spec, shape), started.spec)
    return Row(**{**row.__dict__, "predicted": _figures(report, stats), "notes": notes})


def _skip(row: Row, why: str) -> Row:
    return Row(**{**row.__dict__, "skipped": why})


def rows() -> list[Row]:
    return [predict(c) for c in data()["cases"]]


def median_abs(errors: Iterable[float]) -> float | None:
    e = [abs(x) for x in errors]
    return statistics.median(e) if e else None


def medians(rs: Iterable[Row], split: str) -> dict[str, float | None]:
    """Median |error| per metric over one split's predicted rows."""
    chosen = [r for r in rs if r.split == split and r.skipped is None]
    return {m: median_abs(r.errors()[m] for r in chosen if m in r.errors()) for m in METRICS}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _figure(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if metric == "output_tokens_per_s" else f"{value * 1e3:,.1f} ms"


def _group_table(rs: list[Row], key: str, title: str) -> list[str]:
    """Median |error| (and median signed error, the bias) per metric for each value of ``key``, check rows only."""
    groups: dict[str, list[Row]] = {}
    for r in rs:
        if r.split == "check" and r.skipped is None:
            groups.setdefault(getattr(r, key), []).append(r)
    out = [f"### {title}", "", "| " + title.rsplit(" by ", maxsplit=1)[-1] + " | rows | " + " | ".join(METRICS) + " |"]
    out.append("|---|---:|" + "---:|" * len(METRICS))
    for name in sorted(groups):
        cells = []
        for m in METRICS:
            errs = [r.errors()[m] for r in groups[name] if m in r.errors()]
            cells.append(f"{_pct(median_abs(errs))} ({statistics.median(errs):+.0%})" if errs else "-")
        out.append(f"| {name} | {len(groups[name])} | " + " | ".join(cells) + " |")
    return [*out, ""]


def render(rs: list[Row]) -> str:
    """docs/accuracy.md: the splits' medians, the check rows by engine, GPU and load level, every row."""
    lines = [
        "# Accuracy ledger",
        "",
        "Generated by `python tools/accuracy_ledger.py` from `kvfleet/sizing/data/serving_benchmarks.json` (published",
        "serving benchmarks, each with its source) and `kvfleet/sim/ledger.py` (each row simulated as it ran: its",
        "clients or its offline batch, the engine's scheduler, its published settings and otherwise the engine's",
        "defaults). `tests/sim/test_ledger.py` fails when this file is stale or the check rows' medians get worse.",
        "",
        "Errors are predicted / measured - 1, at the statistic the source published (the median where it gives one,",
        "else the mean). *fit* rows are the published runs the step model's constants were fitted on; *check* rows",
        "were used to fit nothing. TTFT includes the request's time outside the engine's steps only where a",
        "calibration supplies it.",
        "",
        "## Medians of |error|",
        "",
        "| split | rows predicted | " + " | ".join(METRICS) + " |",
        "|---|---:|" + "---:|" * len(METRICS),
    ]
    for split in ("fit", "check"):
        med = medians(rs, split)
        n = sum(1 for r in rs if r.split == split and r.skipped is None)
        total = sum(1 for r in rs if r.split == split)
        lines.append(f"| {split} | {n} of {total} | " + " | ".join(_pct(med[m]) for m in METRICS) + " |")
    lines += ["", "Cells below: median |error| (median signed error, the bias), check rows.", ""]
    lines += _group_table(rs, "load", "Check rows by load level")
    lines += _group_table(rs, "engine", "Check rows by engine")
    lines += _group_table(rs, "gpu", "Check rows by GPU")
    lines += ["## Rows not predicted", "", "| row | why |", "|---|---|"]
    lines += [f"| {r.cid} | {r.skipped} |" for r in rs if r.skipped is not None]
    lines += [
        "",
        "## Every row",
        "",
        "| row | split | metric | measured | predicted | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rs:
        if r.skipped is not None:
            continue
        for m in METRICS:
            if m in r.measured:
                e = r.errors().get(m)
                stat = r.statistic.get(m, "")
                lines.append(
                    f"| {r.cid} | {r.split} | {m} {stat} | {_figure(m, r.measured[m])} | "
                    f"{_figure(m, r.predicted.get(m))} | {_pct(e) if e is None else f'{e:+.0%}'} |"
                )
    return "\n".join(lines) + "\n"


def overhead_fit() -> dict[str, float]:
    """Each engine's request overhead: the mean, over its FIT rows with one client, of the measured TTFT less the
    TTFT the simulator predicts without any overhead (at one client nothing queues, so the rest is the time outside
    the steps); never below 0. tools/accuracy_ledger.py --fit-overhead writes it into step_calibration.json."""
    gaps: dict[str, list[float]] = {}
    for case in data()["cases"]:
        if case["split"] != "fit" or case["shape"]["kind"] != "closed_loop" or case["shape"]["concurrency"] != 1:
            continue
        row = predict(case)
        if row.skipped is None and "ttft" in row.measured:
            bare = row.predicted["ttft"] - request_overhead_s(case["engine"])
            gaps.setdefault(case["engine"], []).append(row.measured["ttft"] - bare)
    return {engine: round(max(0.0, statistics.fmean(g)), 4) for engine, g in sorted(gaps.items())}


def moe_w4_fit(candidates: Iterable[float] = ()) -> float:
    """The grouped-GEMM factor of 4-bit weight-only experts that brings the FIT rows of such models (gpt-oss's
    MXFP4 experts) closest, by the mean squared log error of their TTFT, TPOT and output tokens/s, over a grid of
    factors (a 1-D fit: the grid is fine enough for two digits). tools/accuracy_ledger.py --fit-moe-w4 writes it."""
    rows = [c for c in data()["cases"] if c["split"] == "fit" and c.get("fits") == "moe_w4_compute_factor"]
    grid = list(candidates) or [round(0.2 * 1.1**i, 3) for i in range(30)]  # 0.2 to about 3.2
    base = default_constants()

    def loss(factor: float) -> float:
        constants = replace(base, moe_w4_compute_factor=factor)
        errs = [e for c in rows for k, e in predict(c, constants).errors().items() if k in MOE_FIT_METRICS]
        return statistics.fmean(math.log1p(e) ** 2 for e in errs)

    return min(grid, key=loss)
