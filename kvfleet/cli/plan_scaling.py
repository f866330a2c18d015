"""The scaling thresholds a plan deploys and how a replay chose them; the standby comparison."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet.config.loader import LoadedEnvironment
    from kvfleet.deployments import DeploymentRequest
    from kvfleet.sim.policy import Derivation, Outcome
    from kvfleet.tuning import StandbyComparison, StandbyOption


def _setting_names() -> dict[str, str]:
    """The search's setting names -> the environment file's."""
    from kvfleet.tuning import SETTINGS_BY_FIELD

    return {v: k for k, v in SETTINGS_BY_FIELD.items()}


def _outcome_json(o: Outcome) -> dict[str, Any]:
    return {
        "saturation_target": o.policy.saturation_target,
        "queue_depth_target": o.policy.queue_target,
        "min_replicas": o.policy.min_replicas,
        "scale_in_after_s": None if o.policy.scale_in_wait_s is None else int(o.policy.scale_in_wait_s),
        "admission_queue": None if o.policy.admission_queue is None else int(o.policy.admission_queue),
        "meets_goal": o.meets,
        "ttft_attainment": round(o.attainment, 4),
        "stopped_at_s": o.stopped_s,
        "cost": round(o.cost, 2),
        "cost_unit": "usd" if o.priced else "replica_hours",
    }


def scaling_section(loaded: LoadedEnvironment, dr: DeploymentRequest, *, derive: bool) -> dict[str, Any] | None:
    """The thresholds the deployment scales on, with scaling.derive (or --derive) how the replay chose them, and
    what a scale-in cuts where the target kills a removed replica before the drain budget runs out."""
    section = _thresholds(loaded, dr, derive=derive)
    if (cut := scale_in_cut(dr)) is not None:
        section = section or {"lines": []}
        section["lines"] = [*section["lines"], cut.pop("line")]
        section["scale_in"] = cut
    return section


def scale_in_cut(dr: DeploymentRequest) -> dict[str, Any] | None:
    """Where the target's scale-in kill (its record's ``scale_in_drain``) comes before scaling.drain_budget_s: the
    drain a removed replica gets, how long the plan says a generation of max_output_tokens takes under the planned
    load, and the line plan prints. None where the budget is the drain."""
    from kvfleet.targets import TARGETS

    kill = TARGETS[dr.deployment.target.platform].scale_in_drain
    budget = dr.deployment.scaling.drain_budget_s
    if kill is None or (drain := kill.drain_s(budget)) >= budget:
        return None
    tokens = dr.deployment.workload.max_output_tokens
    takes_s = _generation_s(dr, tokens)
    if takes_s is None:
        takes = "the plan predicts no finite TTFT under the planned load, so no generation time"
    else:
        verdict = "longer, so a scale-in cuts it" if takes_s > drain else "within that"
        takes = (
            f"a generation of max_output_tokens ({tokens:,}) takes about {takes_s:.0f} s under the planned load "
            f"(TTFT p95, then each token at the mean ITL: {verdict})"
        )
    return {
        "drain_s": drain,
        "kill_after_s": kill.kill_after_s,
        "drain_budget_s": budget,
        "max_output_tokens": tokens,
        "generation_s": None if takes_s is None else round(takes_s, 1),
        "source": kill.source,
        "line": (
            f"  scale-in: cuts generations running longer than {drain} s (a removed replica is killed "
            f"{kill.kill_after_s} s after SIGTERM, whatever drain_budget_s {budget} says); {takes}; updates "
            f"(blue/green) still drain for the full {budget} s"
        ),
    }


def _generation_s(dr: DeploymentRequest, tokens: int) -> float | None:
    """A generation of ``tokens`` under the plan's planned load: TTFT p95, then each token at the mean ITL (over
    that many tokens the gaps average out; a p95 of each gap would not add up). None if the TTFT is not finite."""
    import math

    from kvfleet.sizing.planner import plan
    from kvfleet.sizing.step import latency_percentiles

    load = plan(dr.request).best.planned_load
    ttft = latency_percentiles(load).ttft.p95_s
    return None if math.isinf(ttft) else ttft + tokens * load.itl_s


def _thresholds(loaded: LoadedEnvironment, dr: DeploymentRequest, *, derive: bool) -> dict[str, Any] | None:
    """The thresholds the deployment scales on, and with scaling.derive (or --derive) how the replay chose them."""
    from kvfleet.deployments import resolve
    from kvfleet.tuning import decide, derivation

    s = dr.deployment.scaling
    if (as_set := _not_derived(dr, derive=derive)) is not None:
        return as_set
    r = resolve(loaded.environment, dr)
    trace = loaded.traces.get(dr.index)
    if s.derive:
        decision = decide(r, trace)
        assert decision.derivation is not None
        found, replay = decision.derivation, decision.replay or ""
        head = "scaling (derived, deployed by synth)"
    else:
        found, replay = derivation(r, trace, pin_all=True)
        head = "scaling (the file's values; --derive: what each costs against the best value alone)"
    goal = found.goal
    slo = found.ttft_slo_s
    names = _setting_names()
    lines = [f"{head}: replaying {replay}, goal TTFT <= {slo:g} s for {goal:.0%} of requests"]
    lines += _choice_lines(found, names, s.pinned)
    lines += _pin_cost_lines(found, names)
    o = found.outcome
    verdict = "meets the goal" if found.feasible else "no policy within max_replicas meets the goal"
    lines.append(
        f"  replay: TTFT within {slo:g} s for {o.attainment:.1%} of {o.offered:,} requests, {o.cost_text()} "
        f"({verdict}; {found.evaluated} replays)"
    )
    return {
        "derived": bool(s.derive),
        "replay": replay,
        "ttft_target_s": slo,
        "goal": goal,
        "feasible": found.feasible,
        "policy": _outcome_json(o),
        "reasons": {names[c.setting]: {"pinned": c.pinned, "reason": c.reason} for c in found.choices},
        "pins": [
            {"setting": names[pc.setting], "pinned": _outcome_json(pc.pinned)}
            | ({"best": _outcome_json(pc.best)} if pc.best else {})
            for pc in found.pin_costs
        ],
        "lines": lines,
    }


def _not_derived(dr: DeploymentRequest, *, derive: bool) -> dict[str, Any] | None:
    """The file's values, where nothing derives them (not asked, or no target and arrival rate to derive them on)."""
    s, w = dr.deployment.scaling, dr.deployment.workload
    values = (
        f"saturation_target {s.saturation_target:g}, queue_depth_target {s.queue_depth_target:g}, "
        + (f"min_replicas {s.min_replicas}, scale_in_after_s {s.scale_in_wait_s}")
        + ("" if s.admission_queue is None else f", admission_queue {s.admission_queue}")
    )
    if not s.derive and not derive:
        return {
            "derived": False,
            "lines": [
                f"scaling: {values} as the file sets them (or their defaults); scaling.derive: true derives them on "
                "the workload (kvfleet plan --derive shows what that would choose)"
            ],
        }
    if w.ttft_ms is None or w.peak_requests_per_s is None:
        return {
            "derived": False,
            "lines": [f"scaling: {values}; nothing to derive them on without workload.ttft_ms and an arrival rate"],
        }
    return None


def _choice_lines(found: Derivation, names: dict[str, str], pinned_in_file: Collection[str]) -> list[str]:
    """Each setting's value and why: what the search found, or that the file (or its default) pins it."""
    from kvfleet.sim.policy import INTEGER_SETTINGS

    lines = []
    for c in found.choices:
        name = names[c.setting]
        value = f"{int(c.value)}" if c.setting in INTEGER_SETTINGS else f"{c.value:g}"
        reason = c.reason
        if c.pinned:
            reason = "set in the file" if name in pinned_in_file else "the default (the file does not set it)"
        lines.append(f"  {name} {value}: {reason}")
    return lines


def _pin_cost_lines(found: Derivation, names: dict[str, str]) -> list[str]:
    """What each pinned value costs against the best value of that setting alone."""
    slo, goal = found.ttft_slo_s, found.goal
    lines = []
    for pc in found.pin_costs:
        name = names[pc.setting]
        if pc.best is None:
            lines.append(f"  {name}: no value of it alone meets the goal; raise max_replicas or re-plan")
        elif pc.best.policy == pc.pinned.policy:
            lines.append(f"  {name}: no other value of it alone costs less over the replay")
        elif not pc.pinned.meets:
            lines.append(
                f"  {name}: the file's value misses the goal ({pc.pinned.describe(slo, goal)}); "
                f"{pc.best.policy.value(pc.setting):g} meets it at {pc.best.cost_text()}"
            )
        else:
            delta = pc.pinned.cost - pc.best.cost
            unit = f"${delta:,.2f}" if pc.best.priced else f"{delta:,.2f} replica-hours"
            lines.append(
                f"  {name}: the file's value costs {unit} more over the replay than "
                f"{pc.best.policy.value(pc.setting):g} ({pc.best.attainment:.1%} in time there)"
            )
    return lines


def standby_section(loaded: LoadedEnvironment, dr: DeploymentRequest, *, force: bool) -> dict[str, Any] | None:
    """A warm minimum, a warm pool and scale to zero replayed with the deployment's thresholds: where asked
    (--standby), where the file scales to zero or keeps a pool, or where its trace idles longer than the wait."""
    from kvfleet.deployments import resolve
    from kvfleet.tuning import idle_gaps, standby_comparison

    d = dr.deployment
    trace = loaded.traces.get(dr.index)
    r = None
    wanted = force or d.scaling.min_replicas == 0 or d.target.warm_pool_kept() is not None
    if not wanted and trace is not None:
        r = resolve(loaded.environment, dr)
        wanted = idle_gaps(trace, float(r.idle_to_zero_s)).count > 0
    if not wanted:
        return None
    if d.workload.ttft_ms is None or (trace is None and d.workload.peak_requests_per_s is None):
        return {"lines": ["standby: nothing to compare on without workload.ttft_ms and an arrival rate or a trace"]}
    r = r or resolve(loaded.environment, dr)
    cmp = standby_comparison(r, trace)
    lines = [
        f"standby: replaying {cmp.replay} with the thresholds above, goal TTFT <= {cmp.ttft_slo_s:g} s for "
        f"{cmp.goal:.0%} of requests"
    ]
    rows = [_option_row(o) for o in cmp.options]
    lines += [_option_line(o) for o in cmp.options]
    best = cmp.best
    lines.append(
        f"  cheapest that meets the goal: {best.label}" if best else "  no option meets the goal on this replay"
    )
    lines += _break_even_lines(cmp, rows)
    g = cmp.gaps
    wait = f"{g.wait_s / 60:.0f} min"
    lines.append(
        f"  idle: {g.count} spell{'s' if g.count != 1 else ''} without a request longer than the {wait} wait, "
        f"{g.idle_s / 3600:.1f} h past it (what a fleet at zero stops paying for; each spell's end costs the "
        "requests of one cold start)"
        if g.count
        else f"  idle: no spell without a request longer than the {wait} wait, so scale to zero would never act"
    )
    lines += [f"  not available: {u}" for u in cmp.unavailable]
    return {
        "replay": cmp.replay,
        "options": rows,
        "best": rows[cmp.options.index(best)] if best else None,
        "idle_spells": g.count,
        "idle_hours_past_wait": round(g.idle_s / 3600, 2),
        "idle_wait_s": g.wait_s,
        "unavailable": list(cmp.unavailable),
        "lines": lines,
    }


def _option_line(o: StandbyOption) -> str:
    extra = f"cold start {o.cold_start_s / 60:.1f} min"
    if o.standby_usd_per_hour:
        extra += f", pool ${o.standby_usd_per_hour:,.3f}/h"
    tag = " (as configured)" if o.configured else ""
    verdict = "meets the goal" if o.outcome.meets else "misses the goal"
    return (
        f"  {o.label}{tag}: TTFT in time for {o.outcome.attainment:.1%}, {o.outcome.cost_text()} ({verdict}; {extra})"
    )


def _option_row(o: StandbyOption) -> dict[str, Any]:
    return {
        "min_replicas": o.min_replicas,
        "warm_pool": None if o.pool == "none" else {"state": o.pool, "min_size": o.pool_size},
        "configured": o.configured,
        "cold_start_s": round(o.cold_start_s, 1),
        "standby_usd_per_hour": round(o.standby_usd_per_hour, 4),
        "meets_goal": o.outcome.meets,
        "ttft_attainment": round(o.outcome.attainment, 4),
        "cost": round(o.outcome.cost, 2),
        "cost_unit": "usd" if o.outcome.priced else "replica_hours",
    }


def _break_even_lines(cmp: StandbyComparison, rows: list[dict[str, Any]]) -> list[str]:
    """What scale to zero saves against the cheapest warm option, and the attainment it can never pass here, so the
    goal it pays off under (each such option's row gets its ceiling)."""
    lines = []
    warm = [o for o in cmp.options if o.min_replicas > 0]
    for o in cmp.options:
        if o.ceiling is None or o.exposed is None or not warm or not cmp.gaps.count:
            continue
        ref = min(warm, key=lambda w: w.outcome.cost)
        saved = ref.outcome.cost - o.outcome.cost
        unit = f"${abs(saved):,.2f}" if o.outcome.priced else f"{abs(saved):,.2f} replica-hours"
        lines.append(
            f"  {o.label}: {'saves' if saved >= 0 else 'costs'} {unit} {'against' if saved >= 0 else 'more than'} "
            f"{ref.label} over the replay; {o.exposed:,} of "
            f"{o.outcome.offered:,} requests arrive between an idle spell's end and the woken replica serving "
            f"({(o.wake_s + o.cold_start_s) / 60:.1f} min), so it can never serve more than {o.ceiling:.1%} in "
            "time: it pays off for a goal at or below that"
        )
        rows[cmp.options.index(o)]["attainment_ceiling"] = round(o.ceiling, 4)
    return lines
