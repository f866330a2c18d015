"""From a resolved deployment to the fleet simulator: its fleet, the replay, and the scaling thresholds derived on it.

`kvfleet simulate`, `kvfleet plan` and synth all build the simulated fleet here, so the policy the plan prints is
the one synth deploys (``scaling.derive``) and the one `kvfleet simulate` replays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from kvfleet.calibration import Calibration
from kvfleet.config.schema import ScalingConfig
from kvfleet.deployments import ResolvedDeployment
from kvfleet.errors import KvfleetError
from kvfleet.sim.fleet import FleetSpec, Router, Scaling
from kvfleet.sim.policy import Derivation, Setting, derive
from kvfleet.sim.replica import EngineLimits, StepModel
from kvfleet.sim.steps import RooflineSteps
from kvfleet.targets import TARGETS
from kvfleet.workload.traces import Trace
from kvfleet.workload.traces import poisson_trace as poisson

# Without a trace, the derivation replays a step: a quiet spell long enough for the autoscaler to scale in (its
# 15-minute wait), then the peak, which the fleet must grow into within its cold start.
STEP_QUIET_S = 1200.0
STEP_PEAK_S = 1200.0
STEP_QUIET_FRACTION = 0.4

# A Stopped warm-pool instance boots again before its engine starts from the weights already on disk: a planning
# figure like kvfleet.sizing.startup's, not a measurement (a GPU instance's boot and driver load take a minute or
# two). A Running one only starts the engine.
WARM_BOOT_S = {"Stopped": 90.0, "Running": 0.0}

# The file's settings -> the search's names.
SETTINGS_BY_FIELD: dict[str, Setting] = {
    "saturation_target": "saturation_target",
    "queue_depth_target": "queue_target",
    "min_replicas": "min_replicas",
}


class ScaledSteps:
    """A step model's times multiplied by a measured factor (a calibration's step_time_scale)."""

    def __init__(self, inner: StepModel, scale: float) -> None:
        self.inner = inner
        self.scale = scale

    def step_s(self, *, prefill: Sequence[tuple[int, int]], decode_seqs: int, decode_kv_tokens: int) -> float:
        return self.scale * self.inner.step_s(
            prefill=prefill, decode_seqs=decode_seqs, decode_kv_tokens=decode_kv_tokens
        )


def fleet_spec(
    r: ResolvedDeployment, router: str | None = None, *, calibration: Calibration | None = None
) -> FleetSpec:
    """The deployment as the simulator's fleet: the plan's engine limits and step times, the target's autoscaler.
    A calibration measured on this deployment replaces the planned KV cache with the allocated one and scales the
    step times by what was measured."""
    c = r.candidate
    cap = c.capacity
    s = r.deployment.scaling
    blocks = cap.num_blocks
    model: StepModel = RooflineSteps.for_candidate(c, r.model)
    if calibration is not None:
        calibration.check_matches(
            instance_type=c.name,
            engine=r.engine,
            engine_version=r.deployment.engine.version,
            model=r.model_id,
            tp=c.tensor_parallel_size,
        )
        if calibration.kv_cache_tokens is not None:
            blocks = max(1, calibration.kv_cache_tokens // cap.block_size)
        model = ScaledSteps(model, calibration.step_time_scale)
    limits = EngineLimits(
        max_num_seqs=r.engine_args.max_num_seqs or cap.max_num_seqs,
        max_num_batched_tokens=r.engine_args.max_num_batched_tokens or cap.max_num_batched_tokens,
        kv_blocks=blocks,
        block_tokens=cap.block_size,
        prefix_caching=r.engine_args.enable_prefix_caching,
        admission_tokens=r.admission.tokens,
    )
    target = TARGETS[r.deployment.target.platform]
    sim_scaling = Scaling(
        kind=target.autoscaler,
        min_replicas=max(1, s.min_replicas),
        max_replicas=s.max_replicas,
        kv_cache_target=s.saturation_target,
        queue_target=s.queue_depth_target,
        scale_in_cooldown_s=s.scale_in_wait_s,
        stabilization_s=s.scale_in_wait_s,
        drain_budget_s=s.drain_budget_s,
    )
    return FleetSpec(
        limits=limits,
        model=model,
        scaling=sim_scaling,
        initial_replicas=r.initial_instance_count * c.engines_per_instance,
        cold_start_s=cold_start_s(r),
        usd_per_replica_hour=c.usd_per_hour_per_instance / c.engines_per_instance,
        router=cast("Router", router or target.hosting.routing.value),
    )


def cold_start_s(r: ResolvedDeployment) -> float:
    """Launch to serving for a replica the autoscaler adds. With an EC2 warm pool, the pool's instances skip the
    image pull and the download (the simulator gives every launch the warm figure: optimistic past the pool's
    size, which a burst that needs more than min_size new instances at once would exceed)."""
    pool = getattr(r.deployment.target, "warm_pool", None)
    if pool is not None and pool.enabled:
        return WARM_BOOT_S[pool.state] + r.startup.container_start_s
    return r.startup.ready_s


def _poisson(r: ResolvedDeployment, phases: tuple[tuple[float, float], ...], source: str) -> Trace:
    """Phases of (seconds, fraction of the workload's peak rate) at its average lengths."""
    w = r.deployment.workload
    if w.peak_requests_per_s is None:
        raise KvfleetError(
            "nothing to replay; give --trace FILE, workload.trace, or workload.peak_requests_per_s for Poisson "
            "arrivals",
            field=f"deployments.{r.deployment.name}.workload",
        )
    peak = w.peak_requests_per_s
    return poisson(
        tuple((seconds, peak * fraction) for seconds, fraction in phases),
        input_tokens=w.avg_input_tokens or w.max_input_tokens,
        output_tokens=w.avg_output_tokens or w.max_output_tokens,
        source=source,
    )


def poisson_trace(r: ResolvedDeployment) -> Trace:
    """Without a trace: Poisson arrivals at the workload's peak rate for half an hour, at its average lengths."""
    rate = r.deployment.workload.peak_requests_per_s
    return _poisson(r, ((1800.0, 1.0),), f"Poisson arrivals at {rate or 0:g}/s")


def step_trace(r: ResolvedDeployment) -> Trace:
    """The derivation's replay without a trace: a quiet spell at 40% of the peak rate, then the peak."""
    rate = r.deployment.workload.peak_requests_per_s or 0
    return _poisson(
        r,
        ((STEP_QUIET_S, STEP_QUIET_FRACTION), (STEP_PEAK_S, 1.0)),
        f"Poisson arrivals, {STEP_QUIET_S / 60:.0f} min at {STEP_QUIET_FRACTION * rate:g}/s then "
        f"{STEP_PEAK_S / 60:.0f} min at {rate:g}/s",
    )


@dataclass(frozen=True, kw_only=True)
class ScalingDecision:
    """The scaling a deployment deploys, and the derivation behind it (None: the file's values as written)."""

    scaling: ScalingConfig
    derivation: Derivation | None
    replay: str | None  # what was replayed


def _fingerprint(trace: Trace) -> str:
    h = hashlib.sha256()
    for a in (trace.arrival_s, trace.input_tokens, trace.output_tokens):
        h.update(a.tobytes())
    return h.hexdigest()


# Synth and plan in one process (and the tests) derive each deployment once.
_CACHE: dict[tuple[str, ...], Derivation] = {}


def derivation(r: ResolvedDeployment, trace: Trace | None = None, *, pin_all: bool = False) -> tuple[Derivation, str]:
    """The thresholds derived for ``r`` on ``trace`` (or the step replay), holding what the file sets (every
    setting with ``pin_all``: what the file's values cost against the derived ones)."""
    d = r.deployment
    w = d.workload
    if w.ttft_ms is None:
        raise KvfleetError(
            "the thresholds are derived for a TTFT target; set workload.ttft_ms", field="workload.ttft_ms"
        )
    replay = trace if trace is not None else step_trace(r)
    s = d.scaling
    pinned_names = set(SETTINGS_BY_FIELD) if pin_all else set(s.pinned)
    pins = {SETTINGS_BY_FIELD[k]: float(getattr(s, k)) for k in pinned_names}
    # SageMaker keeps at least one instance; the simulator models no scale to zero elsewhere either.
    floor = max(1, s.min_replicas) if "min_replicas" in pinned_names else 1
    pins = {k: (max(v, 1.0) if k == "min_replicas" else v) for k, v in pins.items()}
    key = (
        str(r.environment.region),
        d.model_dump_json(),
        r.candidate.name,
        _fingerprint(replay),
        repr(sorted(pins.items())),
    )
    hit = _CACHE.get(key)
    if hit is None:
        hit = derive(
            replay,
            fleet_spec(r),
            ttft_slo_s=w.ttft_ms / 1000,
            goal=s.slo_attainment,
            pinned=pins,
            floor_min=floor,
        )
        _CACHE[key] = hit
    return hit, replay.source


def decide(r: ResolvedDeployment, trace: Trace | None = None) -> ScalingDecision:
    """What synth deploys: with ``scaling.derive``, the derived thresholds for what the file does not set."""
    s = r.deployment.scaling
    if not s.derive:
        return ScalingDecision(scaling=s, derivation=None, replay=None)
    found, replay = derivation(r, trace)
    p = found.policy
    update = {
        k: (p.min_replicas if k == "min_replicas" else getattr(p, SETTINGS_BY_FIELD[k]))
        for k in SETTINGS_BY_FIELD
        if k not in s.pinned
    }
    return ScalingDecision(scaling=s.model_copy(update=update), derivation=found, replay=replay)


def with_decision(r: ResolvedDeployment, decision: ScalingDecision) -> ResolvedDeployment:
    """``r`` deploying the decided scaling (its stacks read ``r.deployment.scaling``)."""
    if decision.scaling is r.deployment.scaling:
        return r
    return replace(r, deployment=r.deployment.model_copy(update={"scaling": decision.scaling}))
