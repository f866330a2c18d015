"""What `kvfleet plan` prints and its JSON: candidates, the chosen one's speed, memory and engine settings."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kvfleet.cli.args import (
    _console,
)
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError

if TYPE_CHECKING:
    from kvfleet.config.schema import Environment
    from kvfleet.sim.report import SimReport
    from kvfleet.sizing.planner import Candidate, Plan, Workload


def _engine_line(c: Candidate) -> tuple[str, dict[str, Any]]:
    from kvfleet.deployments import engine_args

    a = ENGINES[c.capacity.engine.value]
    args = engine_args(c)
    return a.describe(args), a.settings_json(args)


def _candidate_json(c: Candidate, wl: Workload) -> dict[str, Any]:
    from kvfleet.sizing.planner import admission, binding

    adm = admission(c, wl)
    bound = binding(c, wl)
    return {
        "instance_type": c.name,
        "tensor_parallel_size": c.tensor_parallel_size,
        "pipeline_parallel_size": c.pipeline_parallel_size,
        "expert_parallel": c.expert_parallel,
        "weight_precision": c.weight_scheme.name,
        "kv_cache_dtype": c.kv_cache_dtype.value,
        "concurrency_per_replica": c.concurrency_per_replica,
        "cache_concurrency": c.cache_concurrency,
        "limited_by": c.limited_by,
        "replicas": c.replicas,
        "engines_per_instance": c.engines_per_instance,
        "instance_count": c.instance_count,
        "usd_per_hour_per_instance": c.usd_per_hour_per_instance,
        "fleet_usd_per_hour": round(c.fleet_usd_per_hour, 4),
        "usd_per_million_output_tokens": round(c.usd_per_million_output_tokens, 4),
        "price_as_of": c.price_as_of,
        "price_source": c.price_source,
        # Under load: the batch step model with concurrency_per_replica sequences running (what the targets are
        # checked against); alone: one request on an idle replica.
        "ttft_s": round(c.under_load.ttft_s, 4),
        "itl_s": round(c.under_load.itl_s, 5),
        "under_load": {
            "running": round(c.under_load.running, 2),
            "ttft_s": round(c.under_load.ttft_s, 4),
            "itl_s": round(c.under_load.itl_s, 5),
            "decode_step_s": round(c.under_load.decode_step_s, 5),
            "prefill_step_s": round(c.under_load.prefill_step_s, 5),
            "output_tokens_per_s": round(c.under_load.output_tokens_per_s, 1),
        },
        "alone": {"ttft_s": round(c.alone.ttft_s, 4), "itl_s": round(c.alone.itl_s, 5)},
        # The planned load: Poisson arrivals at peak_requests_per_s spread over the replicas as the target routes
        # them (else the under_load batch), with queueing; percentiles of the step model (`kvfleet simulate` checks).
        "planned_load": _planned_json(c),
        "binding": {
            "limit": bound.limit,
            "kv_at_full_slots": round(bound.kv_at_full_slots, 4),
            "kv_ceiling": round(bound.kv_ceiling, 4),
            "reason": bound.reason,
        },
        "admission": {
            "tokens": adm.tokens,
            "running": adm.running,
            "queued": adm.queued,
            "request_tokens": adm.request_tokens,
            "reason": adm.reason,
        },
        "decode_bound": c.perf.bound,
        "requests_per_s_per_replica": round(c.requests_per_s_per_replica, 3),
        "output_tokens_per_s_per_replica": round(c.output_tokens_per_s_per_replica, 1),
        "memory": c.capacity.as_dict(),
        "engine_settings": _engine_line(c)[1],
        "notes": list(c.notes),
    }


def _planned_json(c: Candidate) -> dict[str, Any]:
    from kvfleet.sizing.step import latency_percentiles

    q = latency_percentiles(c.planned_load)

    def finite(d: dict[str, float]) -> dict[str, float | None]:
        return {k: (v if math.isfinite(v) else None) for k, v in d.items()}  # JSON has no Infinity

    return {
        "requests_per_s_per_replica": None if c.planned_requests_per_s is None else round(c.planned_requests_per_s, 4),
        "routing": c.hosting.routing.value,
        "running": round(c.planned_load.running, 2),
        "ttft_s": finite(q.ttft.as_dict()),
        "itl_s": finite(q.itl.as_dict(5)),
    }


def _simulated_load(p: Plan) -> tuple[SimReport, str]:
    """The chosen candidate's planned load run through the simulator (its replicas and routing, the engine's own
    scheduler): the percentiles the plan prints beside its closed form, and the load's description."""
    from kvfleet.sim.candidate import planned_fleet
    from kvfleet.sim.report import summarize
    from kvfleet.sim.shapes import run

    spec, shape = planned_fleet(p.best, p.request.model, p.request.workload)
    return summarize(run(spec, shape, spec.initial_replicas), spec), shape.describe()


def _simulated_json(p: Plan) -> dict[str, Any]:
    from kvfleet.cli.predict import SIMULATED_KEYS

    r, load = _simulated_load(p)
    report = r.as_dict()
    return {"candidate": p.best.label(), "load": load, **{k: report[k] for k in SIMULATED_KEYS}}


def _ms(v: float, digits: int = 0) -> str:
    return f"{v * 1e3:,.{digits}f}" if math.isfinite(v) else "inf"


def plan_json(name: str, target: str, p: Plan, top: int) -> dict[str, Any]:
    return {
        "deployment": name,
        "model": p.request.model.model_id,
        "platform": target,
        # The replicas the planner sized between (min floored at 1): `kvfleet diff` reads whether it scales.
        "replica_range": [p.request.min_replicas, p.request.max_replicas],
        "candidates": [_candidate_json(c, p.request.workload) for c in p.candidates[:top]],
        **({"simulated": _simulated_json(p)} if p.candidates else {}),
        "rejections": [
            {
                "instance_type": r.instance_type,
                "tensor_parallel_size": r.tensor_parallel_size,
                "pipeline_parallel_size": r.pipeline_parallel_size,
                "expert_parallel": r.expert_parallel,
                "weight_precision": r.weight_precision,
                "kv_cache_dtype": r.kv_cache_dtype,
                "reason": r.reason,
            }
            for r in p.rejections
        ],
    }


def print_plan(name: str, target: str, p: Plan, top: int, all_rejections: bool) -> None:
    console = _console()
    console.print(_candidates_table(name, target, p, top))
    _print_chosen(console, p)
    _print_limits(console, p)
    _print_rejections(console, p, all_rejections)


def _candidates_table(name: str, target: str, p: Plan, top: int) -> Any:
    """The ranked candidates, one row each."""
    from rich.table import Table

    from kvfleet.sizing.step import latency_percentiles
    from kvfleet.sizing.units import GiB

    wl = p.request.workload
    t = Table(
        title=f"{name}: {p.request.model.model_id} on {target} ({wl.max_input_tokens}+{wl.max_output_tokens} tokens)"
    )
    for col in (
        "#",
        "instance",
        "tp",
        "weights",
        "kv",
        "seqs",
        "limited by",
        "replicas",
        "instances",
        "$/h fleet",
        "$/M tok",
        "TTFT p50/90/99 ms",
        "ITL p50/90/99 ms",
        "wts GiB",
        "KV GiB",
    ):
        t.add_column(col, justify="right" if col not in ("instance", "limited by") else "left")
    for n, c in enumerate(p.candidates[:top], 1):
        cap = c.capacity
        q = latency_percentiles(c.planned_load)
        t.add_row(
            str(n),
            c.name,
            c.layout.label().removeprefix("tp="),
            c.weight_scheme.name,
            c.kv_cache_dtype.value,
            str(c.concurrency_per_replica),
            c.limited_by,
            str(c.replicas),
            str(c.instance_count),
            f"{c.fleet_usd_per_hour:.2f}",
            f"{c.usd_per_million_output_tokens:.3f}",
            f"{_ms(q.ttft.p50_s)}/{_ms(q.ttft.p90_s)}/{_ms(q.ttft.p99_s)}",
            f"{_ms(q.itl.p50_s, 1)}/{_ms(q.itl.p90_s, 1)}/{_ms(q.itl.p99_s, 1)}",
            f"{cap.weights_bytes_per_gpu / GiB:.2f}",
            f"{cap.kv_cache_bytes_per_gpu / GiB:.2f}",
        )
    return t


def _print_chosen(console: Any, p: Plan) -> None:
    """The chosen candidate's cache and speed: the batch step model, the planned load, the simulator's run."""
    from kvfleet.sizing.step import latency_percentiles

    wl = p.request.workload
    best = p.best
    console.print(
        f"chosen: {best.label()} - {best.capacity.kv_cache_tokens:,} KV tokens per replica, "
        f"{best.cache_concurrency} sequences of {best.capacity.max_model_len} fit, running "
        f"{best.concurrency_per_replica}; price ${best.usd_per_hour_per_instance}/h as of {best.price_as_of}"
    )
    u = best.under_load
    console.print(
        f"speed with {best.concurrency_per_replica} running (batch step model): TTFT {u.ttft_s * 1e3:,.0f} ms, "
        f"ITL {u.itl_s * 1e3:.1f} ms, {u.output_tokens_per_s:,.0f} output tokens/s per replica; one request alone: "
        f"TTFT {best.alone.ttft_s * 1e3:,.0f} ms, ITL {best.alone.itl_s * 1e3:.1f} ms",
        markup=False,
    )
    q = latency_percentiles(best.planned_load)
    if best.planned_requests_per_s is not None:
        load = (
            f"{wl.peak_requests_per_s:g} requests/s (Poisson) over {best.replicas} replica(s), "
            f"{best.hosting.routing.value.replace('_', ' ')} routing"
        )
    else:
        load = f"{best.concurrency_per_replica} sequences running per replica"
    console.print(
        f"under the planned load ({load}; average lengths): TTFT p50 {_ms(q.ttft.p50_s)} / p90 {_ms(q.ttft.p90_s)} / "
        f"p95 {_ms(q.ttft.p95_s)} / p99 {_ms(q.ttft.p99_s)} ms, ITL p50 {_ms(q.itl.p50_s, 1)} / p90 "
        f"{_ms(q.itl.p90_s, 1)} / p99 {_ms(q.itl.p99_s, 1)} ms "
        "(`kvfleet simulate` replays it)",
        markup=False,
    )
    sim, shape = _simulated_load(p)
    if sim.ttft_s is not None and sim.itl_s is not None:
        console.print(
            f"simulated ({shape}, the engine's own scheduler): TTFT p50 {_ms(sim.ttft_s.p50)} / p90 "
            f"{_ms(sim.ttft_s.p90)} / p99 {_ms(sim.ttft_s.p99)} ms, ITL p50 {_ms(sim.itl_s.p50, 1)} / p90 "
            f"{_ms(sim.itl_s.p90, 1)} / p99 {_ms(sim.itl_s.p99, 1)} ms, {sim.output_tokens_per_s:,.0f} output tokens/s",
            markup=False,
        )


def _print_limits(console: Any, p: Plan) -> None:
    """What binds the chosen candidate, what the agent admits, its engine settings and notes."""
    from kvfleet.sizing.planner import admission, binding

    best, wl = p.best, p.request.workload
    bound = binding(best, wl)
    console.print(f"binding limit at the planned load: {bound.limit} ({bound.reason})", markup=False)
    adm = admission(best, wl)
    console.print(
        f"admission: {adm.tokens:,} tokens per replica, prompt + generation limit reserved per request ({adm.reason}); "
        "past it the agent answers 429 with Retry-After",
        markup=False,
    )
    console.print(_engine_line(best)[0], markup=False)
    for note in best.notes:
        console.print(f"  note: {note}", markup=False)


def _print_rejections(console: Any, p: Plan, all_rejections: bool) -> None:
    if all_rejections:
        shown = list(p.rejections)
    else:  # one per family, for a spread of reasons
        seen: set[str] = set()
        shown = []
        for r in p.rejections:
            family = r.instance_type.split(".")[0]
            if family not in seen:
                seen.add(family)
                shown.append(r)
    more = "" if all_rejections else " (one per family; --rejections for all)"
    console.print(f"rejected {len(p.rejections)} candidates{more}:")
    for r in shown:
        console.print(f"  - {r.describe()}", markup=False)


def choices(environment: str, results: list[tuple[str, str, Plan]]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """What the file says (or leaves open) of who hears the alarms, who shares each prefix cache and what each
    deployment's target asks it to decide: the lines plan prints after the plans, and each deployment's part for its
    JSON row. Synth refuses what is left open."""
    from kvfleet.config.choices import undecided
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.deployments import engine_args

    loaded = load_located(environment_path(environment))
    env = loaded.environment
    caching = {name: engine_args(p.best).enable_prefix_caching for name, _, p in results if p.candidates}
    chosen = {name: p.best for name, _, p in results if p.candidates}
    flags = [caching.get(d.name, False) for d in env.deployments]
    open_lines = {
        u.field: loaded.problem(KvfleetError(u.message, field=u.field)).lines[0] for u in undecided(env, flags)
    }
    lines = [_notifications_line(env, open_lines.get("notifications"))]
    rows: dict[str, dict[str, Any]] = {}
    for i, d in enumerate(env.deployments):
        tenancy = d.serving.declared_tenancy
        still_open = open_lines.get(f"deployments[{i}].serving.tenancy")
        if still_open is not None:
            lines.append(f"{d.name}: prefix cache: undecided, synth refuses: {still_open}")
        elif not flags[i]:
            lines.append(f"{d.name}: prefix cache: off (nothing shared between requests)")
        elif tenancy == "isolated":
            lines.append(f"{d.name}: prefix cache: per tenant (header {d.serving.tenant_header}, salted by the agent)")
        else:
            lines.append(f"{d.name}: prefix cache: shared by every caller (serving.tenancy: single)")
        # What the deployment's target asks the file to decide (TargetSection.undecided), at its line.
        mine = f"deployments[{i}]."
        lines += [
            f"{d.name}: undecided, synth refuses: {line}"
            for key, line in open_lines.items()
            if key.startswith(mine) and key != f"{mine}serving.tenancy"
        ]
        # How the target hosts it, where it has a choice (TargetSection.hosting_note).
        hosting = d.target.hosting_note(d, chosen.get(d.name))
        lines += [f"{d.name}: {hosting}"] if hosting else []
        rows[d.name] = {
            **({"hosting": hosting} if hosting else {}),
            "prefix_caching": flags[i],
            "tenancy": tenancy,
            "notifications": _notifications_kind(env),
            "undecided": [line for key, line in open_lines.items() if key == "notifications" or key.startswith(mine)],
        }
    return lines, rows


def _notifications_kind(env: Environment) -> str | None:
    n = env.notifications
    if not env.notifications_chosen:
        return None
    return "topic" if n.topic_arn is not None else "emails" if n.emails else "none"


def _notifications_line(env: Environment, still_open: str | None) -> str:
    """Who the alarms reach, with what the file's choice still needs outside kvfleet."""
    n = env.notifications
    if still_open is not None:
        return f"alarms: undecided, synth refuses: {still_open}"
    if n.topic_arn is not None:
        topic_account = n.topic_arn.split(":")[4]
        line = (
            f"alarms notify {n.topic_arn}; kvfleet does not read its policies: they must let cloudwatch.amazonaws.com "
            "publish (and use its KMS key, if encrypted)"
        )
        if env.account is not None and topic_account != env.account:
            line += f", for alarms of account {env.account} (the topic is in account {topic_account})"
        return line
    if n.emails:
        return (
            f"alarms notify {', '.join(n.emails)} by email; SNS mails each address a confirmation link on deploy, "
            "and nothing arrives until it is followed"
        )
    return f"alarms notify nobody (notifications: none); they still reach the topic kvfleet-{env.name}-alerts"
