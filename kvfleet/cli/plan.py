"""`kvfleet plan`: ranked deployment candidates, from flags or an environment file."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import (
    _positive_float,
    _positive_int,
    progress,
)
from kvfleet.cli.engine_flags import (
    engine_setting_flags,
    engine_settings,
    speculative_flags,
    speculative_from,
    with_rope_flag,
)
from kvfleet.cli.plan_output import choices, plan_json, print_plan
from kvfleet.cli.plan_scaling import scaling_section, standby_section
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError
from kvfleet.targets import TARGETS

if TYPE_CHECKING:
    from kvfleet.sizing.planner import Measured, Plan, PlanRequest


DEFAULT_ENGINE, DEFAULT_PLATFORM = "vllm", "sagemaker"  # a plan from flags alone
# What describes a plan from flags; an environment file says all of it itself.
_FLAGS_ONLY = (
    *("model", "rope_scaling", "engine", "engine_version", "platform", "max_input_tokens", "max_output_tokens"),
    *("concurrency", "peak_rps", "avg_input_tokens", "avg_output_tokens", "ttft_ms", "itl_ms", "buffered"),
    *("precision", "kv_cache_dtype", "family", "instance_type", "region", "max_usd_per_hour", "speculative"),
    *("draft_model", "num_speculative_tokens", "acceptance_length"),
)


def _refuse_ignored(a: argparse.Namespace) -> None:
    """Flags that would change nothing are refused in one line, with where the setting goes instead."""
    if a.environment:
        engine = [k for k, v in engine_settings(a).items() if v not in (None, (), "auto", "weights")]
        if engine:
            raise KvfleetError("set it under the deployment's engine section of the environment file", field=engine[0])
        given = [f for f in _FLAGS_ONLY if getattr(a, f) not in (None, [], False)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise KvfleetError(
                f"{flag} plans from flags; with an environment file, set it in the file's deployment", field=given[0]
            )
        return
    for flag in ("derive", "standby"):
        if getattr(a, flag):
            raise KvfleetError(f"--{flag} replays an environment file's workload; give the file", field=flag)


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="ranked deployment candidates, from flags or an environment file")
    pl.add_argument("environment", nargs="?", help="environments/<name>.yaml: plan every deployment in it")
    pl.add_argument("--model", help="catalog id/alias, or a path to config.json")
    pl.add_argument(
        "--rope-scaling",
        metavar="JSON",
        help="extend the model's context with a RoPE scaling, as kvfleet capacity --rope-scaling (vLLM --hf-overrides)",
    )
    pl.add_argument("--engine", choices=list(ENGINES), help="default vllm")
    pl.add_argument("--engine-version")
    pl.add_argument("--platform", choices=list(TARGETS), help="deployment target (default sagemaker)")
    pl.add_argument("--max-input-tokens", type=_positive_int)
    pl.add_argument("--max-output-tokens", type=_positive_int)
    pl.add_argument("--concurrency", type=_positive_int, help="target concurrent sequences per replica")
    pl.add_argument("--peak-rps", type=_positive_float, help="peak requests per second across the fleet")
    pl.add_argument("--avg-input-tokens", type=_positive_int)
    pl.add_argument("--avg-output-tokens", type=_positive_int)
    pl.add_argument("--ttft-ms", type=_positive_float, help="time-to-first-token target")
    pl.add_argument("--itl-ms", type=_positive_float, help="inter-token latency target")
    pl.add_argument("--buffered", action="store_true", help="clients wait for whole answers (no streaming)")
    pl.add_argument("--precision", action="append", default=[], help="allowed weight precision (repeatable)")
    pl.add_argument("--kv-cache-dtype", action="append", default=[], help="allowed KV dtype (repeatable)")
    pl.add_argument("--family", action="append", default=[], help="allowed instance family (repeatable)")
    pl.add_argument("--instance-type", action="append", default=[], help="only this instance type (repeatable)")
    pl.add_argument("--region")
    pl.add_argument("--max-usd-per-hour", type=_positive_float, help="fleet price ceiling")
    speculative_flags(pl)  # without an environment file (a deployment's speculative section there)
    engine_setting_flags(pl)  # without an environment file (a deployment's engine section there)
    pl.add_argument("--top", type=_positive_int, default=5, help="candidates to show (default 5)")
    pl.add_argument("--rejections", action="store_true", help="list every rejected candidate")
    pl.add_argument(
        "--calibration",
        metavar="FILE",
        help="a file kvfleet bench --calibrate wrote: candidates of its instance type, tensor parallelism, model "
        "and engine release are priced with its measured KV cache and step times",
    )
    pl.add_argument(
        "--derive",
        action="store_true",
        help="derive the scaling thresholds on the workload even where the file has scaling.derive false, and say "
        "what the file's values cost against them",
    )
    pl.add_argument(
        "--standby",
        action="store_true",
        help="compare a warm minimum, an EC2 warm pool and scale to zero on the workload's replay (shown anyway "
        "where the file scales to zero or has a warm pool, or its trace has idle spells longer than the wait)",
    )
    pl.add_argument(
        "--refresh-host-images",
        action="store_true",
        help="resolve the host images the environment pins (EC2's AMI parameter) again and rewrite its lock "
        "(<file>.lock.json) before planning: the deliberate change a release then ships (needs AWS credentials)",
    )
    pl.add_argument("--json", action="store_true")


def _request_from_flags(a: argparse.Namespace) -> PlanRequest:
    from kvfleet.deployments import workload
    from kvfleet.sizing.catalog import resolve_model
    from kvfleet.sizing.engines import EngineName
    from kvfleet.sizing.planner import PlanRequest
    from kvfleet.sizing.precision import KvDtype, kv_dtype

    missing = [
        f
        for f, v in (
            ("--model", a.model),
            ("--max-input-tokens", a.max_input_tokens),
            ("--max-output-tokens", a.max_output_tokens),
        )
        if v is None
    ]
    if missing:
        raise KvfleetError(f"plan needs an environment file or {', '.join(missing)}")
    wl = workload(
        max_input_tokens=a.max_input_tokens,
        max_output_tokens=a.max_output_tokens,
        concurrency_per_replica=a.concurrency,
        peak_requests_per_s=a.peak_rps,
        avg_input_tokens=a.avg_input_tokens,
        avg_output_tokens=a.avg_output_tokens,
        ttft_ms=a.ttft_ms,
        itl_ms=a.itl_ms,
        streaming=not a.buffered,
    )
    kvs = tuple(kv_dtype(k) for k in a.kv_cache_dtype) or (KvDtype.AUTO,)
    return PlanRequest(
        model=with_rope_flag(resolve_model(a.model), a.rope_scaling),
        workload=wl,
        engine=EngineName(a.engine or DEFAULT_ENGINE),
        engine_version=a.engine_version,
        hosting=TARGETS[a.platform or DEFAULT_PLATFORM].hosting,
        weight_precisions=tuple(a.precision),
        kv_cache_dtypes=kvs,
        families=tuple(a.family),
        instance_types=tuple(a.instance_type),
        region=a.region,
        max_fleet_usd_per_hour=a.max_usd_per_hour,
        speculative=speculative_from(a),
        **engine_settings(a),
    )


def plan_environment(
    environment: str, *, measured: tuple[Measured, ...] = (), derive: bool = False, standby: bool = False
) -> tuple[list[tuple[str, str, Plan]], list[dict[str, Any] | None]]:
    """Every deployment of an environment file planned, with its scaling section (and standby comparison)."""
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import config_error, plan_requests
    from kvfleet.sizing.planner import plan

    loaded = load_located(environment_path(environment))
    try:
        drs = plan_requests(loaded.environment)
    except KvfleetError as err:
        raise loaded.problem(err) from None
    if measured:
        drs = tuple(replace(dr, request=replace(dr.request, measured=measured)) for dr in drs)
    results: list[tuple[str, str, Plan]] = []
    scalings: list[dict[str, Any] | None] = []
    say = progress()
    for dr in drs:
        name = dr.deployment.name
        try:
            say(f"planning {name}")
            results.append((name, dr.deployment.target.platform, plan(dr.request)))
            if derive or dr.deployment.scaling.derive:
                say(f"deriving {name}'s scaling thresholds on replays of its workload")
            section = scaling_section(loaded, dr, derive=derive)
            say(f"comparing standby options for {name}" if standby else None)
            waiting = standby_section(loaded, dr, force=standby)
            if waiting is not None:
                section = section or {"lines": []}
                section["standby"] = waiting
                section["lines"] = [*section["lines"], *waiting["lines"]]
            scalings.append(section)
        except KvfleetError as err:
            # The file's line and key path of what to change, not the planner's own field names.
            raise loaded.problem(config_error(err, dr.index)) from None
        finally:
            say(None)
    return results, scalings


def run(a: argparse.Namespace) -> int:
    from kvfleet.sizing.planner import plan

    measured: tuple[Measured, ...] = ()
    if a.calibration:
        from kvfleet.calibration import read_calibration

        measured = (read_calibration(a.calibration).measured(a.calibration),)
    scalings: list[dict[str, Any] | None]
    _refuse_ignored(a)
    if a.refresh_host_images and not a.environment:
        raise KvfleetError(
            "--refresh-host-images rewrites an environment file's lock; give the file", field="environment"
        )
    images: dict[str, dict[str, Any]] = {}
    if a.environment:
        from kvfleet.cli.host_images import host_images, refresh_host_images

        if a.refresh_host_images:
            print("\n".join(refresh_host_images(a.environment)), file=sys.stderr)
        images = host_images(a.environment)
        results, scalings = plan_environment(a.environment, measured=measured, derive=a.derive, standby=a.standby)
    else:
        platform = a.platform or DEFAULT_PLATFORM
        results = [("plan", platform, plan(replace(_request_from_flags(a), measured=measured)))]
        scalings = [None]
    if measured and not any(c.measured for _, _, p in results for c in p.candidates):
        m = measured[0]
        print(
            f"calibration {a.calibration}: it applies to no candidate planned ({m.instance_type} tp="
            f"{m.tensor_parallel_size}, {m.model_id}, {m.engine.value} {m.engine_version}); the plan is the model's",
            file=sys.stderr,
        )
    # What the file must still decide before synth (who hears the alarms, who shares each prefix cache).
    decided, decided_rows = choices(a.environment, results) if a.environment else ([], {})
    if a.json:
        rows = []
        for (name, target, p), scaling in zip(results, scalings, strict=True):
            row = {**plan_json(name, target, p, a.top), **({"scaling": scaling} if scaling else {})}
            rows.append({**row, **({"host_image": images[name]} if name in images else {})})
            rows[-1].update({"choices": decided_rows[name]} if name in decided_rows else {})
        print(json.dumps(rows, indent=2))
    else:
        for (name, target, p), scaling in zip(results, scalings, strict=True):
            print_plan(name, target, p, a.top, a.rejections)
            if scaling:
                for line in scaling["lines"]:
                    print(line)  # whole lines: a reason is one sentence, and tests and pipelines grep them
        for line in decided:
            print(line)
        for line in host_image_lines(a.environment, images):
            print(line)
    return 0


def host_image_lines(environment: str, images: dict[str, dict[str, Any]]) -> list[str]:
    """What each deployment's hosts boot: the image the lock beside the file pins, or the parameter read again at
    every deploy, which moves to each new release and replaces the fleet in a deploy that changed nothing else."""
    out = []
    for name, i in images.items():
        if i["image_id"]:
            out.append(
                f"{name}: host image pinned: {i['image_id']} ({i['image_name']}) in {i['region']}, "
                f"as the parameter held it on {i['resolved_on']}"
            )
        else:
            out.append(
                f"{name}: host image unpinned: {i['parameter']} is read at every deploy, and a new release of it "
                f"replaces the fleet; pin it: kvfleet plan {environment} --refresh-host-images (AWS credentials)"
            )
    return out
