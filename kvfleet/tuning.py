"""From a resolved deployment to the fleet simulator: its fleet, the replay, and the scaling thresholds derived on it.

`kvfleet simulate`, `kvfleet plan` and synth all build the simulated fleet here (``fleet_spec``, from the scaling the
resolved deployment carries), and ``deriver`` is how ``kvfleet.deployments.resolve`` decides a file's
``scaling.derive``: the policy the plan prints is the one synth deploys and the one the simulator replays. Nothing
here rewrites the environment file's objects: a decision is a ``kvfleet.scaling.ScalingPolicy``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

from kvfleet.calibration import Calibration
from kvfleet.config.targets import PoolState
from kvfleet.deployments import Deriver, ResolvedDeployment, file_scaling
from kvfleet.engines import adapter
from kvfleet.errors import KvfleetError
from kvfleet.scaling import ScalingPolicy
from kvfleet.sim.fit import linear_model
from kvfleet.sim.fleet import FleetSpec, Scaling, WarmPool
from kvfleet.sim.policy import AdmissionSpace, Derivation, Outcome, Setting, derive
from kvfleet.sim.policy import replay as replay_policy
from kvfleet.sim.replica import EngineLimits, StepModel
from kvfleet.sim.steps import RooflineSteps
from kvfleet.sizing.hosting import Routing
from kvfleet.sizing.planner import admission
from kvfleet.sizing.step import request_overhead_s
from kvfleet.targets import TARGETS
from kvfleet.volumes import root_volume, volume_usd_per_hour
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
    "scale_in_after_s": "scale_in_wait_s",
    "admission_queue": "admission_queue",
}


def admission_space(r: ResolvedDeployment) -> AdmissionSpace | None:
    """The agent's admission as the search varies it (None where nothing admits: serving.admission false, or no
    agent in the image)."""
    if not r.deployment.admits:
        return None
    planned = admission(r.candidate, r.workload)
    return AdmissionSpace(
        running=planned.running,
        request_tokens=planned.request_tokens,
        floor_tokens=planned.running * r.candidate.capacity.max_model_len,
        planned_queue=planned.queued,
    )


def _file_value(r: ResolvedDeployment, name: str) -> float:
    """A setting as the replay takes it: the wait as it is deployed (its floor where the file leaves it), the
    admission queue as the agent's budget admits it (the plan's where the file leaves it)."""
    s = r.deployment.scaling
    if name == "scale_in_after_s":
        return float(s.scale_in_wait_s)
    if name == "admission_queue":
        space = admission_space(r)
        queued = s.admission_queue if s.admission_queue is not None else admission(r.candidate, r.workload).queued
        return float(space.effective(queued)) if space is not None else float(queued)
    return float(getattr(s, name))


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
    """The deployment as the simulator's fleet: the plan's engine limits and step times, the scaling it deploys on
    its target's autoscaler. A calibration measured on this deployment replaces the planned KV cache with the
    allocated one and scales the step times by what was measured."""
    c = r.candidate
    cap = c.capacity
    model, blocks, overhead = _steps(r, calibration)
    dp = c.data_parallel_size  # engine cores of one replica, run as one engine with all their limits
    limits = EngineLimits(
        max_num_seqs=(r.engine_args.max_num_seqs or cap.max_num_seqs) * dp,
        max_num_batched_tokens=(r.engine_args.max_num_batched_tokens or cap.max_num_batched_tokens) * dp,
        kv_blocks=blocks * dp,
        block_tokens=cap.block_size,
        prefix_caching=r.engine_args.enable_prefix_caching,
        admission_tokens=r.admission.tokens if r.deployment.admits else None,
    )
    target = TARGETS[r.deployment.target.platform]
    return FleetSpec(
        limits=limits,
        model=model,
        scheduler=adapter(r.engine).scheduler(r.engine_args),
        scaling=sim_scaling(r),
        initial_replicas=r.initial_instance_count * c.engines_per_instance,
        cold_start_s=cold_start_s(r),
        warm_pool=warm_pool(r),
        usd_per_replica_hour=c.usd_per_hour_per_instance / c.engines_per_instance,
        router=Routing(router) if router else target.hosting.routing,
        standby_usd_per_hour=standby_usd_per_hour(r),
        request_overhead_s=overhead,
    )


def _steps(r: ResolvedDeployment, calibration: Calibration | None) -> tuple[StepModel, int, float]:
    """The step model, the KV blocks and the per-request overhead: the plan's, or what a calibration measured."""
    c = r.candidate
    cap = c.capacity
    blocks = cap.num_blocks
    model: StepModel = RooflineSteps.for_candidate(c, r.model)
    overhead = request_overhead_s(r.engine)  # the engine's, where no calibration measured this deployment's
    if calibration is None:
        return model, blocks, overhead
    calibration.check_matches(
        instance_type=c.name,
        engine=r.engine,
        engine_version=r.deployment.engine.version,
        model=r.model_id,
        tp=c.tensor_parallel_size,
    )
    if calibration.kv_cache_tokens is not None:
        blocks = max(1, calibration.kv_cache_tokens // cap.block_size)
    fitted = calibration.steps
    if fitted is not None:  # the step model fitted on the measured levels replaces the plan's
        model = linear_model(asdict(fitted))
        overhead = fitted.request_overhead_s
    elif c.measured is None:  # a version 1 file: one scale (a candidate priced with it has it already)
        model = ScaledSteps(model, calibration.step_time_scale)
    return model, blocks, overhead


def sim_scaling(r: ResolvedDeployment) -> Scaling:
    """The scaling ``r`` deploys as the simulator runs it."""
    s = r.scaling
    target = TARGETS[r.deployment.target.platform]
    can_zero = r.deployment.target.no_scale_to_zero() is None
    return Scaling(
        kind=s.kind,
        # The config refuses 0 where the target cannot wake from zero; floored anyway, as its stacks would be.
        min_replicas=s.min_replicas if can_zero else max(1, s.min_replicas),
        max_replicas=s.max_replicas,
        kv_cache_target=s.saturation_target,
        queue_target=s.queue_depth_target,
        scale_in_cooldown_s=s.scale_in_wait_s,
        stabilization_s=s.scale_in_wait_s,
        # A target that kills a removed replica sooner cuts the drain (and what still runs then).
        drain_budget_s=target.scale_in_drain.drain_s(s.drain_budget_s) if target.scale_in_drain else s.drain_budget_s,
        idle_to_zero_s=float(r.idle_to_zero_s),
    )


# An EC2 warm pool: its state and its instances; None: no pool.
Pool = tuple[PoolState, int] | None


def file_pool(r: ResolvedDeployment) -> Pool:
    """The warm pool the file keeps, as its target's section says (None: none, or a target without pools)."""
    return r.deployment.target.warm_pool_kept()


def standby_usd_per_hour(r: ResolvedDeployment, pool: Pool | Literal["file"] = "file") -> float:
    """What an EC2 warm pool costs while its instances wait (``pool``: the file's by default): a Stopped pool its
    root volumes, a Running one its instances (the serving replicas' own volumes are not counted anywhere in the
    simulator's dollars)."""
    pool = file_pool(r) if pool == "file" else pool
    if pool is None:
        return 0.0
    state, size = pool
    if state == "Running":
        return size * r.candidate.usd_per_hour_per_instance
    return size * volume_usd_per_hour(root_volume(r, nvme=False))


def cold_start_s(r: ResolvedDeployment) -> float:
    """Launch to serving for a replica started from nothing: the image pull, the download, the load."""
    return r.startup.ready_s


def warm_pool(r: ResolvedDeployment, pool: Pool | Literal["file"] = "file") -> WarmPool | None:
    """An EC2 warm pool (``pool``: the file's by default) as the simulator's: its instances have the image and the
    weights on disk, so a launch from it boots (a Stopped one) and starts the engine; the pool prepares a replacement
    in a whole cold start."""
    pool = file_pool(r) if pool == "file" else pool
    if pool is None:
        return None
    state, size = pool
    return WarmPool(
        size=size,
        start_s=WARM_BOOT_S[state] + r.startup.container_start_s,
        refill_s=r.startup.ready_s,
    )


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

    scaling: ScalingPolicy
    derivation: Derivation | None
    replay: str | None  # what was replayed


def _fingerprint(trace: Trace) -> str:
    h = hashlib.sha256()
    for a in (trace.arrival_s, trace.input_tokens, trace.output_tokens):
        h.update(a.tobytes())
    return h.hexdigest()


# Synth and plan in one process (and the tests) derive each deployment once.
_CACHE: dict[tuple[str, ...], Derivation] = {}


def _as_filed(r: ResolvedDeployment) -> ResolvedDeployment:
    """``r`` with the scaling its file writes: what a derivation starts from, whatever ``r`` was decided with."""
    filed = file_scaling(r.deployment)
    return r if r.scaling == filed else replace(r, scaling=filed)


def derivation(r: ResolvedDeployment, trace: Trace | None = None, *, pin_all: bool = False) -> tuple[Derivation, str]:
    """The thresholds derived for ``r`` on ``trace`` (or the step replay), holding what the file sets (every
    setting with ``pin_all``: what the file's values cost against the derived ones)."""
    r = _as_filed(r)
    d = r.deployment
    w = d.workload
    if w.ttft_ms is None:
        raise KvfleetError(
            "the thresholds are derived for a TTFT target; set workload.ttft_ms", field="workload.ttft_ms"
        )
    replay = trace if trace is not None else step_trace(r)
    s = d.scaling
    pinned_names = set(SETTINGS_BY_FIELD) if pin_all else set(s.pinned)
    space = admission_space(r)
    if space is None:
        pinned_names.discard("admission_queue")
    pins = {SETTINGS_BY_FIELD[k]: _file_value(r, k) for k in pinned_names}
    # The search keeps at least one replica (whether to scale to zero is the standby comparison's question); a
    # file that pins 0 where its target can wake from zero is replayed at 0.
    low = 0 if d.target.no_scale_to_zero() is None else 1
    floor = max(low, s.min_replicas) if "min_replicas" in pinned_names else 1
    pins = {k: (max(v, float(low)) if k == "min_replicas" else v) for k, v in pins.items()}
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
            wait_floor_s=s.scale_in_floor_s,
            admission=space,
        )
        _CACHE[key] = hit
    return hit, replay.source


def decide(r: ResolvedDeployment, trace: Trace | None = None) -> ScalingDecision:
    """The scaling ``r``'s file deploys: its values, and with ``scaling.derive`` the derived thresholds for what it
    does not set."""
    s = r.deployment.scaling
    filed = file_scaling(r.deployment)
    if not s.derive:
        return ScalingDecision(scaling=filed, derivation=None, replay=None)
    found, replay = derivation(r, trace)
    p = found.policy

    def chosen(field: str) -> float | None:
        """The replay's value of a file setting; None where the file sets it (or nothing admits)."""
        setting = SETTINGS_BY_FIELD[field]
        if field in s.pinned or (setting == "admission_queue" and p.admission_queue is None):
            return None
        return p.value(setting)

    sat, queue = chosen("saturation_target"), chosen("queue_depth_target")
    low, wait, queued = chosen("min_replicas"), chosen("scale_in_after_s"), chosen("admission_queue")
    scaling = replace(
        filed,
        saturation_target=filed.saturation_target if sat is None else sat,
        queue_depth_target=filed.queue_depth_target if queue is None else queue,
        min_replicas=filed.min_replicas if low is None else int(low),
        # Never under the floor, as ScalingConfig.scale_in_wait_s.
        scale_in_wait_s=filed.scale_in_wait_s if wait is None else max(s.scale_in_floor_s, int(wait)),
        admission_queue=filed.admission_queue if queued is None else int(queued),
    )
    return ScalingDecision(scaling=scaling, derivation=found, replay=replay)


def deriver(traces: Mapping[int, Trace] | None = None) -> Deriver:
    """How ``kvfleet.deployments.resolve`` decides a file's ``scaling.derive``: each deployment's trace (by its
    index in the file) replayed, the step replay where it has none."""

    def derived(r: ResolvedDeployment, index: int) -> ScalingPolicy:
        return decide(r, (traces or {}).get(index)).scaling

    return derived


def with_decision(r: ResolvedDeployment, decision: ScalingDecision) -> ResolvedDeployment:
    """``r`` deploying the decided scaling."""
    return r if decision.scaling == r.scaling else replace(r, scaling=decision.scaling)


# ---- standby: a warm minimum, a warm pool or scale to zero, compared on the replay --------------------------------

StandbyPool = Literal["none", "Stopped", "Running"]


@dataclass(frozen=True, kw_only=True)
class StandbyOption:
    """One way to wait for traffic, replayed with the deployment's thresholds."""

    min_replicas: int
    pool: StandbyPool  # an EC2 warm pool of one instance per replica the minimum does not keep (at least one)
    pool_size: int
    cold_start_s: float  # launch to serving for the first replica the autoscaler adds (from the pool if any)
    standby_usd_per_hour: float
    outcome: Outcome
    configured: bool  # what the file deploys
    # At zero: the requests that arrive between an idle spell's end and the replica it woke serving (the wake and
    # the cold start): refused whatever the thresholds, so 1 - exposed / offered bounds the attainment.
    exposed: int | None = None
    wake_s: float = 0.0  # at zero: from the first refused request to the launch

    @property
    def ceiling(self) -> float | None:
        if self.exposed is None:
            return None
        return 1 - self.exposed / self.outcome.offered if self.outcome.offered else 1.0

    @property
    def label(self) -> str:
        head = "scale to zero" if self.min_replicas == 0 else f"{self.min_replicas} warm"
        if self.pool != "none":
            head += f" + {self.pool.lower()} warm pool of {self.pool_size}"
        return head


@dataclass(frozen=True, kw_only=True)
class IdleGaps:
    """Spells of the replay without a request long enough for scale to zero to act."""

    count: int
    idle_s: float  # their length past the wait, summed: the time a fleet at zero would not pay for
    wait_s: float


@dataclass(frozen=True, kw_only=True)
class StandbyComparison:
    options: tuple[StandbyOption, ...]  # the file's first, then the others
    gaps: IdleGaps
    ttft_slo_s: float
    goal: float
    replay: str
    unavailable: tuple[str, ...]  # options this target cannot deploy, each with why

    @property
    def best(self) -> StandbyOption | None:
        """The cheapest option that meets the goal."""
        meets = [o for o in self.options if o.outcome.meets]
        return min(meets, key=lambda o: o.outcome.cost) if meets else None


def idle_gaps(trace: Trace, wait_s: float) -> IdleGaps:
    """Gaps between arrivals (and after the last, to the replay's end) longer than ``wait_s``."""
    a = trace.arrival_s
    count = 0
    idle = 0.0
    for prev, nxt in itertools.pairwise(a):
        if nxt - prev > wait_s:
            count += 1
            idle += nxt - prev - wait_s
    return IdleGaps(count=count, idle_s=idle, wait_s=wait_s)


def exposed_requests(trace: Trace, wait_s: float, delay_s: float) -> int:
    """Requests arriving within ``delay_s`` of the end of a spell without requests longer than ``wait_s``."""
    a = trace.arrival_s
    exposed = 0
    j = 0
    for i in range(1, len(a)):
        if a[i] - a[i - 1] > wait_s:
            j = max(j, i)
            while j < len(a) and a[j] < a[i] + delay_s:
                exposed += 1
                j += 1
    return exposed


def _standby_wanted(r: ResolvedDeployment, min_replicas: int) -> tuple[list[tuple[int, StandbyPool, int]], list[str]]:
    """(min_replicas, pool, pool size) of each option to replay, the file's first; and those the target cannot
    deploy, each with why."""
    target = TARGETS[r.deployment.target.platform]
    configured = file_pool(r)
    configured_pool: StandbyPool = "none"
    configured_size = 0
    if configured is not None:
        state, size = configured
        if state != "Hibernated":  # the config refuses it
            configured_pool, configured_size = state, size
    warm = max(1, min_replicas)
    wanted: list[tuple[int, StandbyPool, int]] = [(min_replicas, configured_pool, configured_size), (warm, "none", 0)]
    unavailable: list[str] = []
    if target.warm_pools:
        wanted.append((warm, "Stopped", max(1, configured_size)))
    else:
        able = " or ".join(name for name, t in TARGETS.items() if t.warm_pools)
        unavailable.append(f"warm pools: {able} only, not {target.name}")
    no_zero = r.deployment.target.no_scale_to_zero()
    if no_zero is None:
        wanted.append((0, "none", 0))
        if target.warm_pools:
            wanted.append((0, "Stopped", max(1, configured_size)))
    else:
        unavailable.append(f"scale to zero: not on {target.name}: {no_zero}")
    return wanted, unavailable


def standby_comparison(r: ResolvedDeployment, trace: Trace | None = None) -> StandbyComparison:
    """The deployment's scaling (derived where the file derives it) replayed with each way of waiting for traffic
    its target can deploy: the minimum it keeps warm, an EC2 warm pool, and scale to zero from a cold launch or
    from the pool. The same thresholds throughout, so what differs is what the fleet keeps and how fast it grows."""
    w = r.deployment.workload
    if w.ttft_ms is None:
        raise KvfleetError(
            "the standby options are compared on a TTFT target; set workload.ttft_ms", field="workload.ttft_ms"
        )
    decided = with_decision(r, decide(r, trace))
    goal = r.deployment.scaling.slo_attainment
    replay_trace = trace if trace is not None else step_trace(r)
    wanted, unavailable = _standby_wanted(r, decided.scaling.min_replicas)
    base = fleet_spec(decided)
    options: list[StandbyOption] = []
    seen: set[tuple[int, StandbyPool, int]] = set()
    for i, (m, pool, wanted_size) in enumerate(wanted):
        size = 0 if pool == "none" else wanted_size
        if (m, pool, size) in seen:
            continue
        seen.add((m, pool, size))
        kept: Pool = None if pool == "none" else (pool, size)
        spec = replace(
            base,
            scaling=replace(base.scaling, min_replicas=m),
            warm_pool=warm_pool(decided, kept),
            standby_usd_per_hour=standby_usd_per_hour(decided, kept),
        )
        first_start = spec.warm_pool.start_s if spec.warm_pool is not None else spec.cold_start_s
        # At zero: the requests refused while a woken replica starts, whatever the thresholds.
        exposed = (
            exposed_requests(replay_trace, float(r.idle_to_zero_s), spec.scaling.wake_s + first_start)
            if m == 0
            else None
        )
        options.append(
            StandbyOption(
                min_replicas=m,
                pool=pool,
                pool_size=size,
                cold_start_s=first_start,
                standby_usd_per_hour=spec.standby_usd_per_hour,
                outcome=replay_policy(replay_trace, spec, ttft_slo_s=w.ttft_ms / 1000, goal=goal),
                configured=i == 0,
                exposed=exposed,
                wake_s=spec.scaling.wake_s if m == 0 else 0.0,
            )
        )
    return StandbyComparison(
        options=tuple(options),
        gaps=idle_gaps(replay_trace, float(r.idle_to_zero_s)),
        ttft_slo_s=w.ttft_ms / 1000,
        goal=goal,
        replay=replay_trace.source,
        unavailable=tuple(unavailable),
    )
