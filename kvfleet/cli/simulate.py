"""`kvfleet simulate`: a planned fleet, or one engine start, under a trace or a benchmark shape.

Two subjects: an environment file's deployments as planned (their autoscalers, routers and admission), or one engine
start from flags (``--model --instance-type --tp ...``, no file). Three loads: a trace (``--trace``, or the
deployment's own), a closed loop (``--concurrency N --requests M``) or Poisson arrivals (``--rate R --requests M``),
in the words `kvfleet bench` uses. A benchmark shape runs on a fixed, warm fleet, as a benchmark does.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import _float_list, _fraction, _int_list, _positive_float, _positive_int
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.sim.fleet import FleetResult, FleetSpec
    from kvfleet.sim.report import SimReport
    from kvfleet.workload.shapes import ClosedLoop, PoissonLoad
    from kvfleet.workload.traces import Trace

_TRACE_ONLY = ("trace_format", "start_s", "duration_s", "rate_scale")
_SHAPE_ONLY = ("requests", "input_tokens", "output_tokens", "range_ratio", "seed")
_ENGINE_ONLY = (
    "instance_type",
    "tp",
    "engine",
    "engine_version",
    "precision",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
)


def add_parser(sub: Any) -> None:
    si = sub.add_parser(
        "simulate",
        help="a planned fleet or one engine start under a trace or a benchmark shape: latency percentiles, "
        "throughput, scaling, cost",
    )
    si.add_argument("environment", nargs="?", help="environments/<name>.yaml (or a name in environments/)")
    si.add_argument("--deployment", help="the deployment to simulate (default: each in turn)")
    t = si.add_argument_group("trace")
    t.add_argument("--trace", help="a request trace (kvfleet workload reads the same formats)")
    t.add_argument("--trace-format", choices=["azure", "mooncake", "burstgpt", "kvfleet"])
    t.add_argument("--start-s", type=float, help="skip this many seconds of the trace")
    t.add_argument("--duration-s", type=_positive_float, help="keep this many seconds of the trace")
    t.add_argument("--rate-scale", type=_positive_float, help="replay at this multiple of the rate")
    b = si.add_argument_group("benchmark shape (as kvfleet bench and vllm bench serve run them)")
    b.add_argument(
        "--concurrency",
        type=_int_list,
        help="a closed loop of N clients, all starting at t=0 (comma-separated: a sweep)",
    )
    b.add_argument("--rate", type=_float_list, help="Poisson arrivals at R requests/s (comma-separated: a sweep)")
    b.add_argument("--requests", type=_positive_int, help="requests sent in all (default 1000)")
    b.add_argument("--input-tokens", type=_positive_int, help="prompt length (default: the workload's average)")
    b.add_argument("--output-tokens", type=_positive_int, help="answer length (default: the workload's average)")
    b.add_argument("--range-ratio", type=float, help="lengths drawn uniformly within +/- this fraction (default 0)")
    b.add_argument("--seed", type=int, help="seed of the lengths and arrivals (default 0)")
    b.add_argument("--replicas", type=_positive_int, help="engines serving the shape (default: the plan's, or 1)")
    e = si.add_argument_group("one engine start, without an environment file")
    e.add_argument("--model", help="catalog id/alias, or a path to config.json or its directory")
    e.add_argument("--instance-type", help="EC2 or SageMaker instance type, e.g. p5.48xlarge")
    e.add_argument("--tp", type=_positive_int, help="tensor-parallel size (default 1)")
    e.add_argument("--engine", choices=list(ENGINES), help="default vllm")
    e.add_argument("--engine-version", help="engine release (default: newest modelled)")
    e.add_argument("--precision", help="weight precision: bf16, fp8, awq, ... (default: the checkpoint's)")
    e.add_argument("--kv-cache-dtype", help="auto, fp8, ... (default auto)")
    e.add_argument("--max-model-len", type=_positive_int)
    e.add_argument("--max-num-seqs", type=_positive_int)
    e.add_argument("--max-num-batched-tokens", type=_positive_int)
    e.add_argument("--gpu-memory-utilization", type=_fraction)
    si.add_argument(
        "--router",
        choices=["least_outstanding", "random", "round_robin"],
        help="how requests reach replicas (default: what the deployment's target does)",
    )
    si.add_argument(
        "--png",
        metavar="FILE",
        help="also draw the run over time (requests, queue, KV-cache use, replicas) into this PNG; with several "
        "deployments, one each: FILE-<deployment>.png",
    )
    si.add_argument(
        "--calibration",
        help="a file kvfleet bench --calibrate wrote on this deployment: its measured KV cache and step times",
    )
    si.add_argument("--json", action="store_true")


def _given(a: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(a, n) is not None]


def _refuse_ignored(a: argparse.Namespace) -> None:
    """Flags that would change nothing are refused, each with what it needs."""
    shape = a.concurrency is not None or a.rate is not None

    def refuse(flags: list[str], why: str, field: str) -> None:
        if flags:  # "--x applies", "--x, --y apply"
            verb = "applies" if len(flags) == 1 else "apply"
            raise KvfleetError(f"{', '.join(flags)} {why.format(applies=verb)}", field=field)

    refuse(_given(a, _TRACE_ONLY) if not a.trace else [], "only {applies} to --trace", "trace")
    refuse(_given(a, _SHAPE_ONLY) if not shape else [], "only {applies} to --concurrency or --rate", "concurrency")
    refuse(["--concurrency"] if a.concurrency and a.rate else [], "and --rate are two loads; give one", "rate")
    refuse(["--trace"] if a.trace and shape else [], "and a benchmark shape are two loads; give one", "trace")
    refuse(["--replicas"] if a.replicas and not shape else [], "only applies to --concurrency or --rate", "replicas")
    refuse(["--png"] if a.png and a.concurrency else [], "draws arrivals over time; a closed loop has none", "png")
    refuse(["--png"] if a.png and a.rate and len(a.rate) > 1 else [], "draws one run; give one --rate", "png")
    if a.model is None:
        refuse(_given(a, _ENGINE_ONLY), "describe one engine start: give --model too", "model")
        if not a.environment:
            raise KvfleetError(
                "give an environment file, or --model and --instance-type for one engine start", field="environment"
            )
        return
    refuse([a.environment] if a.environment else [], "is an environment file: give it or --model, not both", "model")
    refuse(["--deployment"] if a.deployment else [], "names a deployment of an environment file", "deployment")
    refuse(["--calibration"] if a.calibration else [], "applies to a planned deployment", "calibration")
    if a.instance_type is None:
        raise KvfleetError("give the instance type the engine runs on, e.g. --instance-type p5.48xlarge", field="model")
    if not shape and not a.trace:
        raise KvfleetError("give a load: --concurrency N or --rate R (with --requests), or --trace FILE", field="model")


def _shapes(a: argparse.Namespace, input_tokens: int, output_tokens: int) -> list[ClosedLoop | PoissonLoad]:
    """Each level asked for: a closed loop per --concurrency, Poisson arrivals per --rate."""
    from kvfleet.workload.shapes import ClosedLoop, Lengths, PoissonLoad

    lengths = Lengths(
        input_tokens=a.input_tokens or input_tokens,
        output_tokens=a.output_tokens or output_tokens,
        range_ratio=a.range_ratio or 0.0,
        seed=a.seed or 0,
    )
    requests = a.requests or 1000
    if a.concurrency is not None:
        return [ClosedLoop(concurrency=c, requests=requests, lengths=lengths) for c in a.concurrency]
    return [PoissonLoad(rate_per_s=r, requests=requests, lengths=lengths) for r in a.rate]


def _trace(a: argparse.Namespace) -> Trace | None:
    from kvfleet.workload.traces import read_trace

    if not a.trace:
        return None
    return read_trace(
        a.trace, fmt=a.trace_format, start_s=a.start_s or 0.0, duration_s=a.duration_s, rate_scale=a.rate_scale or 1.0
    )


def run(a: argparse.Namespace) -> int:
    _refuse_ignored(a)
    rows = _engine_start(a) if a.model is not None else _environment(a)
    if a.json:
        print(json.dumps([row for row, _ in rows], indent=2))
    else:
        print("\n\n".join(text for _, text in rows))
        for row, _ in rows:
            if "png" in row:
                print(f"timeline written to {row['png']}")
    return 0


def _row(subject: str, load: str, report: SimReport, note: str = "", **extra: Any) -> tuple[dict[str, Any], str]:
    from kvfleet.sim.report import render

    return {"subject": subject, "load": load, **extra, **report.as_dict()}, f"{subject}, {load}{note}\n{render(report)}"


def _engine_start(a: argparse.Namespace) -> list[tuple[dict[str, Any], str]]:
    from kvfleet.sim.candidate import EngineStart, start
    from kvfleet.sizing.catalog import resolve_model

    png = _png_paths(a.png, ["engine"])["engine"] if a.png else None
    trace = _trace(a)
    if trace is None and not (a.input_tokens and a.output_tokens):
        raise KvfleetError("give --input-tokens and --output-tokens for one engine start", field="input-tokens")
    loads: list[Trace | ClosedLoop | PoissonLoad] = [trace] if trace is not None else [*_shapes(a, 0, 0)]
    engine = EngineStart(
        model=resolve_model(a.model),
        instance_type=a.instance_type,
        tp=a.tp or 1,
        engine=a.engine or "vllm",
        engine_version=a.engine_version,
        precision=a.precision,
        kv_cache_dtype=a.kv_cache_dtype or "auto",
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )
    started = start(engine, longest_request_tokens=max(_longest(x) for x in loads))
    spec = replace(started.spec, router=a.router) if a.router else started.spec
    extra = {"replicas": a.replicas or 1, "kv_cache_tokens": started.capacity.num_blocks * spec.limits.block_tokens}
    return [_load_row(a, spec, load, started.describe(), png, **extra) for load in loads]


def _longest(load: Trace | ClosedLoop | PoissonLoad) -> int:
    """The longest request of a load, in tokens (prompt and answer)."""
    from kvfleet.workload.traces import Trace

    if isinstance(load, Trace):
        return max(i + o for i, o in zip(load.input_tokens, load.output_tokens, strict=True))
    return load.lengths.max_input_tokens + load.lengths.max_output_tokens


def _load_row(
    a: argparse.Namespace,
    spec: FleetSpec,
    load: Trace | ClosedLoop | PoissonLoad,
    subject: str,
    png: str | None,
    **extra: Any,
) -> tuple[dict[str, Any], str]:
    """One load on a fixed, warm fleet of ``extra["replicas"]`` engines: its report row."""
    from kvfleet.sim.fleet import simulate
    from kvfleet.sim.report import summarize
    from kvfleet.sim.shapes import fixed, run
    from kvfleet.workload.shapes import ClosedLoop
    from kvfleet.workload.traces import Trace

    replicas = extra["replicas"]
    replay: Trace | None
    if isinstance(load, Trace):
        spec = fixed(spec, replicas)
        result, described, replay = simulate(load, spec), load.source, load
    else:
        result, described = run(spec, load, replicas), load.describe()
        replay = None if isinstance(load, ClosedLoop) else load.trace()
    if png is not None and replay is not None:
        extra["png"] = _timeline(png, result, replay, spec, subject)
    return _row(subject, described, summarize(result, spec), **extra)


def _png_paths(png: str, names: list[str]) -> dict[str, str]:
    """Each deployment's timeline file: FILE for one, FILE-<name>.png for several. Checked before the replay, so a
    path that cannot be written costs no simulation."""
    from kvfleet.extras import require_extra

    require_extra("plot", "simulate --png")
    import os
    from pathlib import Path

    path = Path(png)
    if path.suffix.lower() != ".png":
        raise KvfleetError(f"{png} does not end in .png", field="png")
    folder = path.parent
    if not folder.is_dir():
        raise KvfleetError(f"cannot write {png}: there is no directory {folder}", field="png")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise KvfleetError(f"cannot write {png}: the directory {folder} is not writable", field="png")
    paths = {names[0]: path} if len(names) == 1 else {n: path.with_name(f"{path.stem}-{n}{path.suffix}") for n in names}
    for p in paths.values():
        if p.is_dir():
            raise KvfleetError(f"cannot write {p}: it is a directory", field="png")
    return {n: str(p) for n, p in paths.items()}


def _timeline(path: str, result: FleetResult, trace: Trace, spec: FleetSpec, title: str) -> str:
    from kvfleet.sim.timeline import render_png, timeline

    try:
        render_png(timeline(result, trace, spec), path, title=f"{title}\n{trace.source}")
    except OSError as err:
        raise KvfleetError(f"cannot write {path}: {err.strerror or err}", field="png") from None
    return path


def _environment(a: argparse.Namespace) -> list[tuple[dict[str, Any], str]]:
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests, resolve
    from kvfleet.tuning import deriver

    loaded = load_located(environment_path(a.environment))
    env = loaded.environment
    try:
        drs = plan_requests(env)
    except KvfleetError as err:
        raise loaded.problem(err) from None
    names = [dr.deployment.name for dr in drs]
    if a.deployment and a.deployment not in names:
        raise KvfleetError(
            f"no deployment {a.deployment!r} in {loaded.source}; it has {', '.join(names)}", field="deployment"
        )
    pngs = _png_paths(a.png, [n for n in names if not a.deployment or n == a.deployment]) if a.png else {}
    calibration = None
    if a.calibration:
        from kvfleet.calibration import read_calibration

        calibration = read_calibration(a.calibration)
    trace = _trace(a)
    rows = []
    for dr in drs:
        if a.deployment and dr.deployment.name != a.deployment:
            continue
        try:
            # With scaling.derive, the thresholds synth deploys (derived on the deployment's own trace), not the
            # file's starting values.
            r = resolve(env, dr, derive=deriver(loaded.traces))
        except KvfleetError as err:
            raise loaded.problem(config_error(err, dr.index)) from None
        # --trace wins; else the deployment's own workload.trace, read when the file was loaded (its window and
        # rate scale applied); else Poisson arrivals at the workload's peak.
        own = loaded.traces.get(dr.index)
        rows += _deployment(a, r, trace if trace is not None else own, calibration, pngs.get(dr.deployment.name))
    return rows


def _deployment(
    a: argparse.Namespace, r: Any, trace: Trace | None, calibration: Any, png: str | None
) -> list[tuple[dict[str, Any], str]]:
    from kvfleet.sim.fleet import simulate
    from kvfleet.sim.report import summarize
    from kvfleet.tuning import fleet_spec, poisson_trace

    spec = fleet_spec(r, a.router, calibration=calibration)
    w = r.deployment.workload
    name = r.deployment.name
    note = ""
    if calibration is not None:
        kv = f"{calibration.kv_cache_tokens:,} KV tokens" if calibration.kv_cache_tokens else "the planned KV cache"
        fitted = "a fitted step model" if calibration.steps is not None else f"x{calibration.step_time_scale:.2f}"
        note = f"\ncalibrated ({a.calibration}, measured {calibration.measured_at}): step times {fitted}, {kv}"
    if a.concurrency is not None or a.rate is not None:
        replicas = a.replicas or spec.initial_replicas
        fleet = f"{name}: {r.instance_type} x{replicas} (fixed, {spec.router} routing){note}"
        extra = {"deployment": name, "router": spec.router, "autoscaler": "none", "replicas": replicas}
        shapes = _shapes(a, r.workload.input_tokens, r.workload.output_tokens)
        return [_load_row(a, spec, shape, fleet, png, **extra) for shape in shapes]
    replay = trace if trace is not None else poisson_trace(r)
    result = simulate(replay, spec)
    s = spec.scaling
    fleet = (
        f"{name}: {r.instance_type} x{spec.initial_replicas} "
        f"({s.min_replicas}-{s.max_replicas}, {s.kind}, {spec.router} routing)"
    )
    d = r.scaling  # as synth deploys it: derived where the file derives
    thresholds = {
        "saturation_target": d.saturation_target,
        "queue_depth_target": d.queue_depth_target,
        "min_replicas": d.min_replicas,
        "max_replicas": d.max_replicas,
        "scale_in_after_s": d.scale_in_wait_s,
        "derived": r.deployment.scaling.derive,
    }
    extra = {"deployment": name, "router": spec.router, "autoscaler": s.kind, "scaling": thresholds}
    if png is not None:
        extra["png"] = _timeline(png, result, replay, spec, fleet)
    report = summarize(
        result,
        spec,
        ttft_slo_s=w.ttft_ms / 1000 if w.ttft_ms else None,
        itl_slo_s=w.itl_ms / 1000 if w.itl_ms else None,
    )
    return [_row(fleet, replay.source, report, note, **extra)]
