"""`kvfleet bench`: load-test a live endpoint."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvfleet import contract
from kvfleet.cli.args import (
    _float_list,
    _fraction,
    _int_list,
    _positive_float,
    _positive_int,
)
from kvfleet.cli.bench_checks import (
    bench_limits,
    limits_fill,
    limits_verdict,
    predicted_speed,
    speed_drift_lines,
)
from kvfleet.cli.bench_levels import bench_levels
from kvfleet.cli.bench_output import print_bench, print_checks, progress_line, what_ran
from kvfleet.cli.calibrate import write_calibration
from kvfleet.cli.endpoint import bench_target, deployed_url, planned_deployment
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.bench.client import KvCapacity, LevelSpec
    from kvfleet.deployments import ResolvedDeployment


def add_parser(sub: Any) -> None:
    be = sub.add_parser(
        "bench",
        help="load-test a live OpenAI-compatible endpoint (the agent, vLLM, trtllm-serve, a load balancer) with "
        "streaming timing: TTFT, ITL, TPOT, throughput per concurrency",
    )
    be.add_argument(
        "url",
        nargs="?",
        help="the endpoint's base URL (http://127.0.0.1:8080), or sagemaker:<endpoint name> for a SageMaker endpoint "
        "(InvokeEndpointWithResponseStream with the usual AWS credentials); default, with --env: where the "
        "deployment's stack says it is",
    )
    be.add_argument("--region", help="the SageMaker endpoint's region (default: the AWS configuration's)")
    be.add_argument("--endpoint-url", help="SageMaker runtime URL (a VPC endpoint)")
    be.add_argument("--model", help="model id to request (default: the first /v1/models lists)")
    be.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $KVFLEET_BENCH_API_KEY)")
    be.add_argument("--header", action="append", default=[], help="extra request header NAME:VALUE (repeatable)")
    be.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="comma-separated levels (default 1,4,16)")
    _load_flags(be)
    _plan_flags(be)


def _load_flags(be: argparse.ArgumentParser) -> None:
    """What each level sends: closed loop, rate sweep, trace or the limits, and the requests' lengths."""
    be.add_argument(
        "--rate",
        type=_float_list,
        help="open loop instead: Poisson arrivals at each of these comma-separated requests/s (a rate sweep)",
    )
    be.add_argument(
        "--trace", help="open loop instead: replay a request trace's arrivals and lengths (the workload formats)"
    )
    be.add_argument(
        "--planned-load",
        action="store_true",
        help="open loop instead, with --env: the plan's own load (Poisson at workload.peak_requests_per_s, the "
        "average lengths) against its TTFT target",
    )
    be.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt", "kvfleet"])
    be.add_argument("--start-s", type=float, default=0.0, help="skip this many seconds of the trace")
    be.add_argument("--duration-s", type=_positive_float, help="trace window length")
    be.add_argument("--rate-scale", type=_positive_float, default=1.0, help="replay the trace this many times faster")
    be.add_argument(
        "--ttft-ms", type=_positive_float, help="TTFT target: report attainment and the best rate meeting it"
    )
    be.add_argument(
        "--slo-attainment", type=_fraction, default=0.95, help="share of requests within --ttft-ms (default 0.95)"
    )
    be.add_argument(
        "--limits",
        action="store_true",
        help="test the limits together: --max-input-tokens + --max-output-tokens at --max-concurrency, then at twice "
        "it (or the plan's, with --env); passes when nothing fails or is preempted at the planned concurrency and "
        "what fails above it is refused with 429",
    )
    be.add_argument("--max-input-tokens", type=_positive_int)
    be.add_argument("--max-output-tokens", type=_positive_int)
    be.add_argument("--max-concurrency", type=_positive_int)
    be.add_argument("--requests", type=_positive_int, default=32, help="requests per level (default 32)")
    be.add_argument("--input-tokens", type=_positive_int, default=512, help="prompt length in tokens (default 512)")
    be.add_argument("--output-tokens", type=_positive_int, default=128, help="tokens to generate (default 128)")
    be.add_argument("--timeout-s", type=_positive_float, default=600.0, help="per request (default 600)")


def _plan_flags(be: argparse.ArgumentParser) -> None:
    """What a run is checked against: the plan of --env, a calibration, the KV cache; and where results go."""
    be.add_argument(
        "--expect-kv-tokens",
        type=_positive_int,
        help="KV-cache tokens per replica the plan expects; fail when the endpoint reports fewer (past --tolerance)",
    )
    be.add_argument("--env", help="take --expect-kv-tokens from this environment file's plan (with --deployment)")
    be.add_argument("--deployment", help="the deployment of --env")
    be.add_argument(
        "--tolerance",
        type=_fraction,
        default=contract.KV_SHORTFALL_TOLERANCE,
        help=f"allowed shortfall of the KV cache (default {contract.KV_SHORTFALL_TOLERANCE})",
    )
    be.add_argument(
        "--speed-tolerance",
        type=_fraction,
        default=0.25,
        help="with --env: how much slower than the plan's step model ITL and output tokens/s may be (default 0.25)",
    )
    be.add_argument("--html", help="also write a self-contained HTML report (distributions, levels, checks) here")
    be.add_argument(
        "--predict",
        action="store_true",
        help="simulate each level beside what it measured, on one replica of the plan (--env) or of a calibration "
        "(--calibration), and print both with the error",
    )
    be.add_argument(
        "--calibration",
        help="with --predict: a file kvfleet bench --calibrate wrote (its fitted steps, KV cache and engine limits)",
    )
    be.add_argument(
        "--calibrate",
        help="with --env: write what was measured (the engine's KV cache, step times against the plan's at each "
        "closed-loop level) as a calibration file for kvfleet plan and simulate --calibration",
    )
    be.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    import asyncio

    from kvfleet.extras import require_extra

    require_extra("bench", "bench")
    from kvfleet.bench.client import run_levels, run_levels_sagemaker, summarize

    planned = planned_deployment(a.env, a.deployment) if a.env is not None else None
    if a.url is None:
        if planned is None:
            raise KvfleetError("give the endpoint's URL, or --env FILE [--deployment NAME] to read it", field="url")
        a.url = deployed_url(planned)
    ep, sagemaker = bench_target(a, planned)
    expected, kv_required = _expected_kv(a, planned)
    limits = bench_limits(a, planned) if a.limits else None
    specs = bench_levels(a, planned, limits)
    _check_writable(a)
    progress = progress_line() if not a.json and sys.stderr.isatty() else None
    if sagemaker is not None:
        measuring = run_levels_sagemaker(sagemaker, specs, model=a.model, timeout_s=a.timeout_s, progress=progress)
    else:
        measuring = run_levels(ep, specs, timeout_s=a.timeout_s, progress=progress)
    model, levels, capacity = asyncio.run(measuring)
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr)  # clear the live line before the report
    ttft_ms = a.ttft_ms or (planned.deployment.workload.ttft_ms if planned is not None else None)
    rows = [summarize(level, ttft_slo_s=ttft_ms / 1000 if ttft_ms else None) for level in levels]
    speed_drift = _against_plan(a, planned, specs, rows)
    prediction_source = _predict_levels(a, planned, specs, rows) if a.predict else None
    if capacity is None and expected is not None and not kv_required:
        print(
            "note: KV check skipped: the endpoint reports no KV-cache size on its /metrics (a load balancer or "
            f"SageMaker hides it); run it against a replica's agent, or pass --expect-kv-tokens {expected} to "
            "require it",
            file=sys.stderr,
        )
        expected = None
    report = _report(
        a,
        model=model,
        rows=rows,
        capacity=capacity,
        expected=expected,
        ttft_ms=ttft_ms,
        limits=limits,
        speed_drift=speed_drift,
    )
    _write_outputs(a, planned=planned, report=report, levels=levels, rows=rows, capacity=capacity)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print_bench(a.url, model, what_ran(a, limits, specs), rows)
        print_checks(a, report, capacity, ttft_ms, prediction_source)
    return _exit_code(a, report)


def _expected_kv(a: argparse.Namespace, planned: ResolvedDeployment | None) -> tuple[int | None, bool]:
    """The KV tokens the endpoint must report, and whether it must report them at all: asked for
    (--expect-kv-tokens), the check fails where the endpoint reports no cache; implied by --env, it is skipped with a
    note there (a load balancer and SageMaker expose no /metrics)."""
    expected: int | None = a.expect_kv_tokens
    kv_required = expected is not None
    if planned is not None:
        expected = expected or planned.candidate.capacity.kv_cache_tokens
    elif a.deployment is not None:
        raise KvfleetError("--deployment names a deployment of --env; give --env FILE too", field="deployment")
    if a.calibration is not None and not a.predict:
        raise KvfleetError("--calibration is what --predict simulates with; add --predict", field="calibration")
    return expected, kv_required


def _check_writable(a: argparse.Namespace) -> None:
    """Before the run, which may take long: a report or calibration that cannot be written should not cost it."""
    import os
    from pathlib import Path

    for out_file, field, tail in ((a.calibrate, "calibrate", ""), (a.html, "html", " to put it in")):
        if out_file:
            folder = Path(out_file).parent
            if Path(out_file).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise KvfleetError(f"cannot write {out_file}: no writable directory {folder}{tail}", field=field)


def _against_plan(
    a: argparse.Namespace, planned: ResolvedDeployment | None, specs: list[LevelSpec], rows: list[dict[str, Any]]
) -> list[str]:
    """Each closed-loop level of one length beside what the plan's step model predicts for it (row["planned"]);
    the levels slower than the plan by more than --speed-tolerance."""
    speed_drift: list[str] = []
    if planned is None:
        return speed_drift
    for row, spec in zip(rows, specs, strict=True):
        if spec.concurrency is not None and len(set(spec.lengths)) == 1:
            (n_in, n_out) = spec.lengths[0]
            row["planned"] = predicted_speed(planned, n_in, n_out, spec.concurrency)
            row["input_tokens"], row["output_tokens_each"] = n_in, n_out
            speed_drift += speed_drift_lines(row, a.speed_tolerance)
    return speed_drift


def _report(
    a: argparse.Namespace,
    *,
    model: str,
    rows: list[dict[str, Any]],
    capacity: KvCapacity | None,
    expected: int | None,
    ttft_ms: float | None,
    limits: tuple[int, int, int] | None,
    speed_drift: list[str],
) -> dict[str, Any]:
    """The run as the JSON prints it: levels, the KV check, the TTFT target's verdict, the limits test's."""
    from kvfleet.bench.client import kv_drift

    meeting = [r for r in rows if r["ttft_attainment"] is not None and r["ttft_attainment"] >= a.slo_attainment]
    verdict = limits_verdict(rows, a.slo_attainment) if limits is not None else None
    if verdict is not None and limits is not None:
        verdict["lines"].append(limits_fill(limits, capacity))
    slo_miss = None
    if ttft_ms and limits is None and not meeting:  # --limits judges the planned level alone, not every level
        slo_miss = (
            f"no level got {a.slo_attainment:.0%} of its requests a first token within {ttft_ms:g} ms "
            f"(best {max(r['ttft_attainment'] or 0.0 for r in rows):.1%})"
        )
    return {
        "url": a.url,
        "model": model,
        "input_tokens": a.input_tokens,
        "output_tokens": a.output_tokens,
        "levels": rows,
        "kv_cache": None
        if capacity is None
        else {"blocks": capacity.blocks, "block_tokens": capacity.block_tokens, "tokens": capacity.tokens},
        "expected_kv_tokens": expected,
        "drift": kv_drift(capacity, expected, a.tolerance),
        "ttft_target_s": ttft_ms / 1000 if ttft_ms and limits is None else None,
        "best_rate_per_s": max((r["rate_per_s"] or 0.0 for r in meeting if r["rate_per_s"]), default=None),
        "slo_miss": slo_miss,
        "limits": verdict,
        "speed_drift": speed_drift,
    }


def _write_outputs(
    a: argparse.Namespace,
    *,
    planned: ResolvedDeployment | None,
    report: dict[str, Any],
    levels: list[Any],
    rows: list[dict[str, Any]],
    capacity: KvCapacity | None,
) -> None:
    """The HTML report and the calibration file, where asked for."""
    from pathlib import Path

    if a.html:
        from kvfleet.bench.report import render_html

        try:
            Path(a.html).write_text(render_html(report, levels), encoding="utf-8")
        except OSError as err:  # checked before the run; a disk that filled since still gets one line
            print(f"kvfleet: cannot write {a.html}: {err.strerror or err}", file=sys.stderr)
    if a.calibrate and planned is not None:
        write_calibration(a.calibrate, planned, rows, capacity)


def _exit_code(a: argparse.Namespace, report: dict[str, Any]) -> int:
    """Problems on stderr, one line each; 1 when a request failed or a check did not pass."""
    drift = report["drift"]
    if drift is not None:
        print(f"kvfleet: plan check: {drift}", file=sys.stderr)
    for line in report["speed_drift"]:
        print(f"kvfleet: plan check: {line}", file=sys.stderr)
    drift = drift or (report["speed_drift"][0] if report["speed_drift"] else None)
    if report["slo_miss"] is not None:
        print(f"kvfleet: TTFT target: {report['slo_miss']}", file=sys.stderr)
    verdict = report["limits"]
    if verdict is not None:
        for line in verdict["lines"]:
            if line.startswith("kvfleet: "):
                print(line, file=sys.stderr)
            elif not a.json:
                print(line)
        return 0 if verdict["passed"] and drift is None else 1
    failed = sum(r["requests"] - r["completed"] for r in report["levels"])
    return 1 if failed or drift is not None or report["slo_miss"] is not None else 0


def _predict_levels(
    a: argparse.Namespace, planned: ResolvedDeployment | None, specs: list[LevelSpec], rows: list[dict[str, Any]]
) -> str:
    """Each level simulated beside what it measured (row["predicted"]); returns where the prediction came from."""
    from kvfleet.cli.predict import predict_level, prediction_fleet

    fleet, source = prediction_fleet(a, planned)
    for row, spec in zip(rows, specs, strict=True):
        row["predicted"] = predict_level(fleet, spec)
    return source
