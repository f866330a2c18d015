"""The autoscalers kvfleet deploys, each written once: its parameters, the rule the fleet simulator executes
(``controller``: signals in, desired replicas out) and the numbers and expressions the stacks render.

- ``TargetTracking`` (SageMaker through Application Auto Scaling; EC2 Auto Scaling's scale-out): the policy's alarms
  read 1-minute data; the high alarm fires after 3 consecutive minutes above the target and the low alarm after
  15 consecutive minutes below 90% of it. On a breach the capacity goes to ceil(n x metric / target) (scale-out: never
  below what is already asked for, replicas still starting included; scale-in: at most to that, never below the
  minimum). Several policies: scale out when any asks, in only when all do.
  Cooldowns follow the alarm (Application Auto Scaling User Guide, "Target tracking scaling policies" and "How
  target tracking works"; EC2 Auto Scaling User Guide, "Target tracking scaling policies").
- ``OneFewer`` (EC2): target tracking scales out only, and one instance goes when, for every minute of the scale-in
  wait, max(signal / target) x n / (n - 1) < 1 with n the instances in service that minute (a CloudWatch
  metric-math alarm and a simple policy); the next no sooner than one more wait (the simple policy's cooldown). EC2
  target tracking has no scale-in cooldown, and its own scale-in alarm fires after 15 minutes whatever the drain
  budget.
- ``Hpa`` (EKS through a KEDA ScaledObject): the HPA controller syncs every 15 s; each trigger proposes the current
  count while its ratio to the target is within the 10% tolerance, else ceil(ready pods x value / target) for a
  Value and ceil(sum / target) for an AverageValue; the largest proposal wins. Scale-up takes effect at once (no
  window), scale-down goes to the highest recommendation of the stabilization window, and each is limited by its pace
  policies (kubernetes.io, "Horizontal Pod Autoscaling": algorithm details, `--horizontal-pod-autoscaler-sync-period`
  default 15 s, "Configurable scaling behavior").

A controller is fed each published sample of the signals (``observe``), asked at every evaluation (``evaluate``)
and told of every change of the fleet's desired size, its own or another rule's (``moved``). New replicas count only
once they serve (``in_service``: SageMaker InService, EC2 instance warm-up, ready pods).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from kvfleet import contract
from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.scaling.signals import SignalTarget

# Target tracking's alarms (Application Auto Scaling and EC2 Auto Scaling alike): period and datapoints.
PERIOD_S = 60
OUT_DATAPOINTS = 3
IN_DATAPOINTS = 15
IN_FRACTION = 0.9
SCALE_OUT_COOLDOWN_S = 60  # fast: queued requests are TTFT already lost
# Kubernetes HPA defaults: the controller's sync period and its tolerance.
HPA_SYNC_S = 15
HPA_TOLERANCE = 0.1
HPA_MAX_WINDOW_S = 3600  # HPAScalingRules.stabilizationWindowSeconds: 0..3600

Why = Literal["scale-out", "scale-in"]


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One published sample of the signals over the replicas in service, in the autoscaler's ``targets`` order."""

    in_service: int
    means: tuple[float, ...]  # each signal's mean over them (CloudWatch's Average, the HPA's Value)
    totals: tuple[float, ...]  # each signal's sum over them (the HPA's AverageValue)


@dataclass(frozen=True, kw_only=True)
class Decision:
    desired: int  # within the autoscaler's bounds, and not the size the fleet already wants
    why: Why


class Controller(Protocol):
    """One autoscaler running on one fleet: what it has seen and done."""

    def observe(self, o: Observation) -> None: ...

    def evaluate(self, t_s: float, *, in_service: int, desired: int) -> Decision | None: ...

    def moved(self, t_s: float, before: int, after: int) -> None: ...

    def forget(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class _Bounds:
    min_replicas: int
    max_replicas: int
    targets: tuple[SignalTarget, ...]

    def clamp(self, desired: int) -> int:
        """``desired`` within the bounds; the signal rules never ask for fewer than one replica (only scale to zero
        takes a fleet there)."""
        return max(1, self.min_replicas, min(self.max_replicas, desired))

    def _decision(self, wanted: int, desired: int, why: Why) -> Decision | None:
        target = self.clamp(wanted)
        return None if target == desired else Decision(desired=target, why=why)


@dataclass(frozen=True, kw_only=True)
class TargetTracking(_Bounds):
    """One target-tracking policy per signal; rendered as each signal's target value and the two cooldowns."""

    kind: ClassVar[AutoscalerKind] = AutoscalerKind.TARGET_TRACKING
    period_s: ClassVar[int] = PERIOD_S
    scale_in_cooldown_s: float  # the scale-in wait
    scale_out_cooldown_s: float = SCALE_OUT_COOLDOWN_S
    scale_in: bool = True  # False: the policies scale out only (their scale-in is disabled)

    def controller(self, initial: int) -> Controller:
        return _Tracking(self, None)


@dataclass(frozen=True, kw_only=True)
class OneFewer(_Bounds):
    """EC2: ``scale_out`` (target tracking without scale-in), and a CloudWatch alarm on ``expression`` (metric ids
    ``metric_ids`` and ``IN_SERVICE``) below ``THRESHOLD`` for ``evaluation_periods`` minutes, whose simple policy
    removes one instance and then waits ``cooldown_s``."""

    kind: ClassVar[AutoscalerKind] = AutoscalerKind.EC2
    period_s: ClassVar[int] = PERIOD_S
    IN_SERVICE: ClassVar[str] = "n"  # the group's GroupInServiceInstances
    THRESHOLD: ClassVar[float] = 1.0
    COMPARISON: ClassVar[str] = "LessThanThreshold"
    # With one instance there is no "one fewer" (n - 1 = 0): no data, and nothing to scale in.
    TREAT_MISSING_DATA: ClassVar[str] = "notBreaching"
    ADJUSTMENT: ClassVar[int] = -1  # ChangeInCapacity of a SimpleScaling policy
    wait_s: float
    scale_out_cooldown_s: float = SCALE_OUT_COOLDOWN_S

    @property
    def scale_out(self) -> TargetTracking:
        return TargetTracking(
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            targets=self.targets,
            scale_in_cooldown_s=self.wait_s,
            scale_out_cooldown_s=self.scale_out_cooldown_s,
            scale_in=False,
        )

    @property
    def evaluation_periods(self) -> int:
        return math.ceil(self.wait_s / self.period_s)

    @property
    def cooldown_s(self) -> int:
        return math.ceil(self.wait_s)

    def metric_ids(self) -> dict[str, contract.Signal]:
        """The expression's id of each signal (``IN_SERVICE`` is the group's in-service count)."""
        return {f"s{i}": t.signal for i, t in enumerate(self.targets)}

    def expression(self) -> str:
        """The load per target with one instance fewer, as CloudWatch metric math."""
        ratios = ", ".join(f"s{i} / {t.value:g}" for i, t in enumerate(self.targets))
        return f"MAX([{ratios}]) * {self.IN_SERVICE} / ({self.IN_SERVICE} - 1)"

    def description(self) -> str:
        return (
            f"scale in by one: for {self.cooldown_s // 60} min the fleet with one instance fewer would still hold "
            "saturation and queue depth under their targets"
        )

    def holds(self, signals: Sequence[float], in_service: int) -> bool:
        """One minute of the rule: ``expression`` below the threshold. With one instance in service there is no
        data point (n - 1 = 0), which does not breach."""
        n = in_service
        if n < 2:
            return False
        return max(v / t.value for v, t in zip(signals, self.targets, strict=True)) * n / (n - 1) < self.THRESHOLD

    def controller(self, initial: int) -> Controller:
        return _Tracking(self.scale_out, self)


# How each signal is compared by the HPA (KEDA's trigger metricType): the saturation query averages over the pods, so
# it is a Value (desired = ceil(n x value / target)); the queue query sums them, an AverageValue (desired =
# ceil(total / target)). As an AverageValue an average would be divided by the replica count again.
HPA_METRIC_TYPES = {contract.REPLICA_SATURATION.name: "Value", contract.REQUESTS_WAITING.name: "AverageValue"}


@dataclass(frozen=True, kw_only=True)
class HpaTrigger:
    target: SignalTarget
    metric_type: str  # "Value" (the query averages over the pods) or "AverageValue" (it sums them)


@dataclass(frozen=True, kw_only=True)
class Hpa(_Bounds):
    """The HPA a KEDA ScaledObject configures: one trigger per signal, scale-up at once, scale-down stabilized."""

    kind: ClassVar[AutoscalerKind] = AutoscalerKind.HPA
    period_s: ClassVar[int] = HPA_SYNC_S
    tolerance: ClassVar[float] = HPA_TOLERANCE
    stabilization_s: float  # the scale-down window: the scale-in wait (the HPA takes at most an hour)
    # Scaling pace. Up: fast, a queued request is time-to-first-token already spent. Down: slow, a removed replica
    # takes minutes to come back and first drains its generations.
    scale_up_pods: int = 2
    scale_up_percent: int = 100
    scale_up_period_s: int = 60
    scale_down_pods: int = 1
    scale_down_period_s: int = 300
    polling_interval_s: int = HPA_SYNC_S  # KEDA's query of the metrics, once per HPA sync
    cooldown_period_s: int = 300  # KEDA's wait before scaling to zero (never here: min_replicas >= 1)

    @property
    def triggers(self) -> tuple[HpaTrigger, ...]:
        return tuple(HpaTrigger(target=t, metric_type=HPA_METRIC_TYPES[t.signal.name]) for t in self.targets)

    @property
    def scale_down_window_s(self) -> int:
        return min(HPA_MAX_WINDOW_S, math.ceil(self.stabilization_s))

    def controller(self, initial: int) -> Controller:
        return _Hpa(self, initial)


Autoscaler = TargetTracking | OneFewer | Hpa


class _Tracking:
    """Target tracking's alarms on the minutes' averages; with ``one_fewer``, its scale-in instead of the low alarm."""

    def __init__(self, policy: TargetTracking, one_fewer: OneFewer | None) -> None:
        self.policy = policy
        self.one_fewer = one_fewer
        keep = max(IN_DATAPOINTS, math.ceil(policy.scale_in_cooldown_s / policy.period_s))
        self.minutes: deque[tuple[float, ...]] = deque(maxlen=keep)  # each signal's average per minute
        # The replicas in service each minute (the group's GroupInServiceInstances: one reading a minute, the last).
        self.in_service: deque[int] = deque(maxlen=keep)
        self.window: list[Observation] = []  # the samples within the current minute
        self.last_out_s = -math.inf
        self.last_in_s = -math.inf

    def observe(self, o: Observation) -> None:
        self.window.append(o)

    def forget(self) -> None:
        self.minutes.clear()
        self.in_service.clear()
        self.window.clear()

    def moved(self, t_s: float, before: int, after: int) -> None:
        if after > before:
            self.last_out_s = t_s
        elif after < before:
            self.last_in_s = t_s

    def evaluate(self, t_s: float, *, in_service: int, desired: int) -> Decision | None:
        if not self.window:
            return None
        k = len(self.window)
        self.minutes.append(tuple(sum(w.means[i] for w in self.window) / k for i in range(len(self.window[0].means))))
        self.in_service.append(self.window[-1].in_service)
        self.window.clear()
        n = in_service or 1
        p = self.policy
        recent = list(self.minutes)
        votes = []
        for i, target in enumerate(p.targets):
            last = recent[-OUT_DATAPOINTS:]
            if len(last) == OUT_DATAPOINTS and all(m[i] > target.value for m in last):
                votes.append(math.ceil(n * last[-1][i] / target.value))
        if votes and t_s - self.last_out_s >= p.scale_out_cooldown_s:
            self.forget()
            # The high alarm only ever adds: a count under the one already asked for (replicas still starting are
            # not in service yet) leaves it.
            return p._decision(max(votes), desired, "scale-out") if max(votes) > desired else None
        if self.one_fewer is not None:
            return self._one_fewer(self.one_fewer, t_s, desired, recent)
        return self._scale_in(t_s, n, desired, recent) if p.scale_in else None

    def _scale_in(self, t_s: float, n: int, desired: int, recent: list[tuple[float, ...]]) -> Decision | None:
        """The low alarm: every signal under 90% of its target for 15 minutes."""
        p = self.policy
        recent = recent[-IN_DATAPOINTS:]
        if (
            len(recent) < IN_DATAPOINTS
            or t_s - self.last_in_s < p.scale_in_cooldown_s
            or not all(all(m[i] < IN_FRACTION * t.value for i, t in enumerate(p.targets)) for m in recent)
        ):
            return None
        # The capacity that would put the last minute at the target, as the out side computes it.
        wanted = max(math.ceil(n * recent[-1][i] / t.value) for i, t in enumerate(p.targets))
        if wanted >= desired:
            return None
        self.forget()
        return p._decision(wanted, desired, "scale-in")

    def _one_fewer(self, rule: OneFewer, t_s: float, desired: int, recent: list[tuple[float, ...]]) -> Decision | None:
        """The alarm on every minute of the wait, each with the replicas in service that minute."""
        need = rule.evaluation_periods
        if len(recent) < need or t_s - self.last_in_s < rule.wait_s:
            return None
        if not all(rule.holds(m, n) for m, n in zip(recent[-need:], list(self.in_service)[-need:], strict=True)):
            return None
        self.forget()
        return rule._decision(desired - 1, desired, "scale-in")


class _Hpa:
    """The HPA controller's sync on the latest sample: one proposal per trigger, the largest of them, stabilized by
    the recommendations of the windows and limited by the pace policies (kubernetes/kubernetes
    pkg/controller/podautoscaler: replica_calculator.go GetExternalMetricReplicas and
    GetExternalPerPodMetricReplicas, horizontal.go stabilizeRecommendationWithBehaviors and
    convertDesiredReplicasWithBehaviorRate)."""

    def __init__(self, policy: Hpa, initial: int) -> None:
        self.policy = policy
        self.latest: Observation | None = None
        # The fleet was at its planned size before the replay began: that is the recommendation history.
        self.recommendations: deque[tuple[float, int]] = deque([(0.0, initial)])
        self.events: deque[tuple[float, int]] = deque()  # (when, replicas added; negative: removed)

    def observe(self, o: Observation) -> None:
        self.latest = o

    def forget(self) -> None:
        self.latest = None

    def moved(self, t_s: float, before: int, after: int) -> None:
        longest = max(self.policy.scale_up_period_s, self.policy.scale_down_period_s)
        while self.events and self.events[0][0] <= t_s - longest:
            self.events.popleft()
        self.events.append((t_s, after - before))

    def evaluate(self, t_s: float, *, in_service: int, desired: int) -> Decision | None:
        o = self.latest
        if o is None:
            return None
        self.latest = None
        p = self.policy
        rec = max(self._proposal(o, i, t, in_service, desired) for i, t in enumerate(p.triggers))
        stable = self._stabilized(t_s, rec, desired)
        if stable > desired:
            limit = max(desired, *(self._up_limit(t_s, desired, kind) for kind in ("Pods", "Percent")))
            target = min(stable, p.max_replicas, limit)
        elif stable < desired:
            start = desired - self._changed(t_s, p.scale_down_period_s)
            limit = min(desired, start - p.scale_down_pods)
            target = max(stable, 1, p.min_replicas, limit)
        else:
            return None
        if target == desired:
            return None
        return Decision(desired=target, why="scale-out" if target > desired else "scale-in")

    def _proposal(self, o: Observation, i: int, t: HpaTrigger, in_service: int, desired: int) -> int:
        """One trigger's replicas: the current count within the tolerance, else what holds the target."""
        p = self.policy
        if t.metric_type == "Value":  # the query's figure against the target, times the ready pods
            ratio = o.means[i] / t.target.value
            return desired if abs(1 - ratio) <= p.tolerance else math.ceil(ratio * in_service)
        # AverageValue: the query's sum per pod against the target
        ratio = o.totals[i] / (t.target.value * desired)
        return desired if abs(1 - ratio) <= p.tolerance else math.ceil(o.totals[i] / t.target.value)

    def _stabilized(self, t_s: float, rec: int, desired: int) -> int:
        """Scale-up at once (no window); scale-down to the highest recommendation within the window."""
        cutoff = t_s - self.policy.scale_down_window_s
        down = max([rec, *(r for when, r in self.recommendations if when > cutoff)])
        while self.recommendations and self.recommendations[0][0] <= cutoff:
            self.recommendations.popleft()
        self.recommendations.append((t_s, rec))
        return rec if rec > desired else min(desired, down)

    def _changed(self, t_s: float, period_s: int) -> int:
        """Replicas the HPA added (less those it removed) within the last ``period_s``."""
        return sum(change for when, change in self.events if when > t_s - period_s)

    def _up_limit(self, t_s: float, desired: int, kind: str) -> int:
        p = self.policy
        start = desired - self._changed(t_s, p.scale_up_period_s)
        if kind == "Pods":
            return start + p.scale_up_pods
        return math.ceil(start * (1 + p.scale_up_percent / 100))
