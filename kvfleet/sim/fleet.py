"""A fleet of replicas behind a router, scaled by the autoscaler its target really has.

The autoscalers are ``kvfleet.scaling``'s, the objects the stacks render: the fleet feeds each the signals it
publishes, asks it at its evaluation period (a minute for CloudWatch's alarms, the HPA's 15 s sync) and launches or
drains what it decides.

Scale to zero (``min_replicas`` 0, what kvfleet deploys on EC2: ``kvfleet.scaling.ScaleToZero``): the fleet goes to
zero once no request has arrived for ``idle_to_zero_s``; at zero every arrival is refused (the load balancer answers
503 with no target registered) and the first one wakes the fleet ``wake_s`` later (the 503 count's one-minute
period, the alarm's evaluation, the policy), which then starts one replica with the full cold start (or the warm
pool's).

The metrics are those the agent publishes and the stacks scale on (kvfleet.contract.SCALING_SIGNALS): replica
saturation and requests waiting, averaged over the serving replicas, sampled every publish interval. A replica's
saturation is the larger of its KV cache use (the fraction of blocks its running sequences hold) and its running
sequences over max_num_seqs (``saturation``): KV use alone never reaches its target where the cache holds many more
sequences than max_num_seqs lets run, so a policy on it would never ask for replicas however busy every slot is.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet import contract
from kvfleet.engines.scheduling import Scheduler
from kvfleet.scaling import WAKE_S, Autoscaler, AutoscalerKind, Controller, ScaleToZero, autoscaler
from kvfleet.scaling.autoscalers import PERIOD_S, Observation
from kvfleet.sim.replica import EngineLimits, Replica, Request, Stats, StepModel
from kvfleet.sizing.hosting import Routing
from kvfleet.workload.traces import Trace

# A random router is seeded: a replay repeats.
ROUTER_SEED = 0


@dataclass(frozen=True, kw_only=True)
class Scaling:
    """The simulated fleet's autoscaler (``kind``) and its parameters, as ``kvfleet.scaling.autoscaler`` takes them."""

    kind: str  # an AutoscalerKind (or its value, as the CLI and the tests write it)
    min_replicas: int
    max_replicas: int
    # The saturation target (ScalingConfig.saturation_target; contract.REPLICA_SATURATION), not a target on raw
    # KV-cache use: the name is the one the CLI and the tests construct it with.
    kv_cache_target: float
    queue_target: float
    scale_out_cooldown_s: float = 60.0
    scale_in_cooldown_s: float = 300.0  # the scale-in wait of target tracking and EC2's one-fewer rule
    stabilization_s: float = 300.0  # HPA scale-down window
    # How long a removed replica drains before what it still runs is cut: the deployment's drain budget, or less
    # where the target kills a stopped replica sooner (kvfleet.targets.Target.scale_in_drain).
    drain_budget_s: float = 300.0
    # With min_replicas 0: the time without arrivals after which the fleet goes to zero (None: the scale-in wait),
    # and the delay from the first request refused at zero to the launch that wakes it.
    idle_to_zero_s: float | None = None
    wake_s: float = WAKE_S

    def autoscaler(self) -> Autoscaler | None:
        kind = AutoscalerKind(self.kind)
        return autoscaler(
            kind,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            saturation_target=self.kv_cache_target,
            queue_target=self.queue_target,
            scale_in_wait_s=self.stabilization_s if kind == AutoscalerKind.HPA else self.scale_in_cooldown_s,
            scale_out_cooldown_s=self.scale_out_cooldown_s,
        )

    def to_zero(self) -> ScaleToZero | None:
        if self.min_replicas != 0:
            return None
        idle = self.idle_to_zero_s if self.idle_to_zero_s is not None else self.scale_in_cooldown_s
        return ScaleToZero(idle_s=idle, wake_s=self.wake_s)


@dataclass(frozen=True, kw_only=True)
class WarmPool:
    """An EC2 warm pool: ``size`` instances prepared ahead. A launch takes a prepared one while there is one (and
    serves ``start_s`` later); the group prepares its replacement at once, ready ``refill_s`` later (a pool with
    ReuseOnScaleIn off refills by launching, not by taking back what scale-in removed). Past the pool, a launch
    has the whole cold start."""

    size: int
    start_s: float
    refill_s: float


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    limits: EngineLimits
    model: StepModel
    scheduler: Scheduler  # the engine's own (its adapter's ``scheduler``)
    scaling: Scaling
    initial_replicas: int
    cold_start_s: float
    usd_per_replica_hour: float | None
    router: Routing = Routing.LEAST_OUTSTANDING
    exact_steps: bool = False  # simulate every decode step on its own (slow; the check on the leaps)
    # Paid for the whole replay whatever serves: a warm pool's stopped instances (their volumes) or running ones.
    standby_usd_per_hour: float = 0.0
    warm_pool: WarmPool | None = None
    # A request's time outside the engine's steps (the API server, tokenizing, the first event's way back to the
    # client): added to each request's TTFT and end-to-end latency as its client times them (a calibration fits it).
    request_overhead_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Sample:
    t_s: float
    replicas: int  # serving
    starting: int
    draining: int
    outstanding: int
    waiting: int
    kv_utilization: float  # KV-cache use, mean over the serving replicas (charted; the autoscaler reads saturation)
    kv_max: float  # the fullest serving replica's
    saturation: float  # mean over the serving replicas of ``saturation`` (the autoscaler's signal)
    # Running totals: the timeline turns them into refusals per interval without a record per request.
    rejected_429: int
    rejected_503: int


@dataclass(kw_only=True)
class FleetResult:
    stats: Stats
    samples: list[Sample]
    replica_seconds: float
    end_s: float
    requests: int
    scale_events: list[tuple[float, int, str]] = field(default_factory=list)
    stopped_s: float | None = None  # where ``stop`` ended the replay early (the rest of the trace was not offered)


def saturation(replica: Replica) -> float:
    """What the agent publishes as ReplicaSaturation: the larger of KV-cache use and running over max_num_seqs."""
    return max(replica.kv_utilization, len(replica.running) / replica.limits.max_num_seqs)


class _Member:
    __slots__ = ("drain_started_s", "gone_s", "replica", "started_s")

    def __init__(self, replica: Replica, started_s: float) -> None:
        self.replica = replica
        self.started_s = started_s  # billed from here (launch), serving from replica.ready_s
        self.drain_started_s: float | None = None
        self.gone_s: float | None = None


class Fleet:
    def __init__(self, spec: FleetSpec, *, hash_block_tokens: int | None = None) -> None:
        self.spec = spec
        self.hash_block_tokens = hash_block_tokens  # the trace's prefix-hash block, in tokens
        self.stats = Stats()
        self.members: list[_Member] = []
        self.samples: list[Sample] = []
        self.events: list[tuple[float, int, str]] = []
        self._rr = 0
        self._random = random.Random(ROUTER_SEED)
        self._next_id = 0
        self._autoscaler = spec.scaling.autoscaler()
        # The fleet was at its planned size before the replay began (the HPA's recommendation history).
        self._controller: Controller | None = (
            self._autoscaler.controller(spec.initial_replicas) if self._autoscaler is not None else None
        )
        self._to_zero = spec.scaling.to_zero() if self._autoscaler is not None else None
        self._last_arrival_s = 0.0
        self._wake_at: float | None = None  # the first request refused while the fleet was at zero
        pool = spec.warm_pool
        self._pool: list[float] = [0.0] * pool.size if pool is not None else []  # when each pool instance is ready
        self.pool_launches = 0
        for _ in range(spec.initial_replicas):
            self._launch(0.0, ready_now=True)

    @property
    def scale_every_s(self) -> int:
        """How often the autoscaler evaluates: its alarms' period or the HPA's sync."""
        return self._autoscaler.period_s if self._autoscaler is not None else PERIOD_S

    # ---- membership ---------------------------------------------------------------------------------------

    def _launch(self, t: float, *, ready_now: bool = False) -> None:
        ready = t if ready_now else t + self._start_s(t)
        r = Replica(
            self._next_id,
            self.spec.limits,
            self.spec.model,
            self.stats,
            scheduler=self.spec.scheduler,
            ready_s=ready,
            leap=not self.spec.exact_steps,
            hash_block_tokens=self.hash_block_tokens,
        )
        self._next_id += 1
        self.members.append(_Member(r, t))

    def _start_s(self, t: float) -> float:
        """Launch to serving: from a prepared pool instance while one is ready, else the whole cold start."""
        pool = self.spec.warm_pool
        if pool is not None and self._pool and self._pool[0] <= t:
            heapq.heappop(self._pool)
            heapq.heappush(self._pool, t + pool.refill_s)
            self.pool_launches += 1
            return pool.start_s
        return self.spec.cold_start_s

    def _serving(self, t: float) -> list[Replica]:
        return [
            m.replica for m in self.members if m.gone_s is None and m.drain_started_s is None and m.replica.ready_s <= t
        ]

    def _alive(self) -> list[_Member]:
        return [m for m in self.members if m.gone_s is None]

    def _desired_count(self) -> int:
        return sum(1 for m in self.members if m.gone_s is None and m.drain_started_s is None)

    # ---- traffic ------------------------------------------------------------------------------------------

    def route(self, req: Request, t: float) -> None:
        self._last_arrival_s = t
        serving = self._serving(t)
        if not serving:
            self.stats.rejected_503 += 1
            if self._wake_at is None and self._desired_count() == 0:
                self._wake_at = t
            return
        if self.spec.router == Routing.ROUND_ROBIN:
            self._rr = (self._rr + 1) % len(serving)
            target = serving[self._rr]
        elif self.spec.router == Routing.RANDOM:
            target = self._random.choice(serving)
        else:
            target = min(serving, key=lambda r: (r.outstanding, r.rid))
        if not target.admit(req, t):
            self.stats.rejected_429 += 1

    def advance(self, t: float) -> None:
        for m in self.members:
            if m.gone_s is None:
                m.replica.advance(t)
                if m.drain_started_s is not None:
                    self._maybe_leave(m, t)

    def _maybe_leave(self, m: _Member, t: float) -> None:
        r = m.replica
        assert m.drain_started_s is not None
        if not r.outstanding:
            m.gone_s = max(r.clock, m.drain_started_s)
        elif t - m.drain_started_s >= self.spec.scaling.drain_budget_s:
            self.stats.cut_by_scale_in += r.abort_all(t)
            m.gone_s = m.drain_started_s + self.spec.scaling.drain_budget_s

    # ---- autoscaling --------------------------------------------------------------------------------------

    def sample(self, t: float) -> None:
        serving = self._serving(t)
        alive = self._alive()
        n = len(serving)
        kvs = [r.kv_utilization for r in serving]
        kv = sum(kvs) / n if n else 0.0
        sat_sum = sum(saturation(r) for r in serving)
        sat = sat_sum / n if n else 0.0
        waiting = sum(len(r.waiting) for r in serving)
        self.samples.append(
            Sample(
                t_s=t,
                replicas=n,
                starting=sum(1 for m in alive if m.replica.ready_s > t),
                draining=sum(1 for m in alive if m.drain_started_s is not None),
                outstanding=sum(r.outstanding for r in serving),
                waiting=waiting,
                kv_utilization=kv,
                kv_max=max(kvs, default=0.0),
                saturation=sat,
                rejected_429=self.stats.rejected_429,
                rejected_503=self.stats.rejected_503,
            )
        )
        if n and self._autoscaler is not None and self._controller is not None:
            totals = {contract.REPLICA_SATURATION.name: sat_sum, contract.REQUESTS_WAITING.name: float(waiting)}
            means = {contract.REPLICA_SATURATION.name: sat, contract.REQUESTS_WAITING.name: waiting / n}
            names = [x.signal.name for x in self._autoscaler.targets]
            self._controller.observe(
                Observation(in_service=n, means=tuple(means[k] for k in names), totals=tuple(totals[k] for k in names))
            )

    def _scale_to(self, t: float, desired: int, why: str) -> None:
        """Launch or drain to ``desired`` (what a rule decided, within its bounds)."""
        current = self._desired_count()
        if desired > current:
            for _ in range(desired - current):
                self._launch(t)
        elif desired < current:
            # Drain the newest serving replicas first (the ones that started last hold the least work).
            candidates = [m for m in self.members if m.gone_s is None and m.drain_started_s is None]
            candidates.sort(key=lambda m: (m.replica.ready_s > t, m.started_s), reverse=True)
            for m in candidates[: current - desired]:
                m.drain_started_s = t
                self._maybe_leave(m, t)
        else:
            return
        self.events.append((t, desired, why))
        if self._controller is not None:
            self._controller.moved(t, current, desired)

    def autoscale(self, t: float) -> None:
        c = self._controller
        if c is None:
            return
        if self._to_zero is not None and self._zero(t, self._to_zero, c):
            return
        decision = c.evaluate(t, in_service=len(self._serving(t)), desired=self._desired_count())
        if decision is not None:
            self._scale_to(t, decision.desired, decision.why)

    def _zero(self, t: float, rule: ScaleToZero, c: Controller) -> bool:
        """Scale to zero and back: True when the fleet is at zero or has just gone there (nothing else to do)."""
        if self._desired_count() == 0:
            if rule.wakes(t, refused_s=self._wake_at):
                self._wake_at = None
                self._scale_to(t, 1, "wake")
                c.forget()
            return True
        busy = any(m.replica.outstanding for m in self._alive())
        if rule.idle(t, last_arrival_s=self._last_arrival_s, busy=busy):
            self._scale_to(t, 0, "to zero")
            c.forget()
            return True
        return False


def simulate(
    trace: Trace,
    spec: FleetSpec,
    *,
    horizon_s: float | None = None,
    stop: Callable[[Stats, float], bool] | None = None,
) -> FleetResult:
    """Replay ``trace`` through the fleet; after the last arrival, run until every request has ended.

    ``stop(stats, t)``, asked at every sample, ends the replay at once when it says so (a policy search drops a
    candidate as soon as it has missed more requests than its goal allows); the result then says where."""
    fleet = Fleet(spec, hash_block_tokens=trace.block_tokens)
    publish = float(contract.PUBLISH_INTERVAL_S)
    scale_every = fleet.scale_every_s
    arrivals = trace.arrival_s
    inputs = trace.input_tokens
    outputs = trace.output_tokens
    blocks = trace.prefix_blocks
    end = arrivals[-1] if horizon_s is None else min(horizon_s, arrivals[-1])
    # Timers as a heap of (time, order, kind): samples every publish interval, autoscaler evaluations.
    timers: list[tuple[float, int, str]] = [(publish, 0, "sample"), (float(scale_every), 1, "scale")]
    i = 0
    n = len(arrivals)
    while i < n and arrivals[i] <= end:
        t = arrivals[i]
        while timers and timers[0][0] <= t:
            tt, order, kind = heapq.heappop(timers)
            fleet.advance(tt)
            if kind == "sample":
                fleet.sample(tt)
                if stop is not None and stop(fleet.stats, tt):
                    return finish(fleet, tt, i, stopped_s=tt)
                heapq.heappush(timers, (tt + publish, order, kind))
            else:
                fleet.autoscale(tt)
                heapq.heappush(timers, (tt + scale_every, order, kind))
        fleet.advance(t)
        fleet.route(Request(i, t, inputs[i], outputs[i], blocks[i] if blocks is not None else None), t)
        i += 1
    # Drain what is left, still sampling (the timeline shows the tail), without further scaling.
    t = end
    while any(m.replica.outstanding for m in fleet._alive()):
        t += publish
        fleet.advance(t)
        fleet.sample(t)
        if t - end > 24 * 3600:  # a fleet that cannot finish its queue in a day: stop and say so
            break
    return finish(fleet, max([t, *(m.replica.clock for m in fleet.members)]), i)


def fleet_usd(result: FleetResult, spec: FleetSpec) -> float | None:
    """What the replay cost: the replicas from launch to leaving, and the standby for the whole replay."""
    if spec.usd_per_replica_hour is None:
        return None
    return (result.replica_seconds * spec.usd_per_replica_hour + result.end_s * spec.standby_usd_per_hour) / 3600


def finish(fleet: Fleet, last: float, offered: int, *, stopped_s: float | None = None) -> FleetResult:
    replica_s = 0.0
    for m in fleet.members:
        end = m.gone_s if m.gone_s is not None else last
        replica_s += max(0.0, end - m.started_s)
    return FleetResult(
        stats=fleet.stats,
        samples=fleet.samples,
        replica_seconds=replica_s,
        end_s=last,
        requests=offered,
        scale_events=fleet.events,
        stopped_s=stopped_s,
    )
