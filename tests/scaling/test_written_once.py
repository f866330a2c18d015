"""Each autoscaler is written once (kvfleet.scaling): the simulator executes it, the stacks render it, and driven by
the same signal series the two decide the same.

The simulator's side is the controller ``kvfleet.sim.fleet.Fleet`` runs, built the way the simulator builds it from
the resolved deployment (``kvfleet.tuning.sim_scaling``): fed each period's sample, asked for a decision, told of
each change. The rendered side is read back from what is deployed and evaluated here as the platform evaluates it:

- EC2's "one fewer" alarm and its scale-to-zero alarms by their metric math (``metric_math``, kept apart from the
  code that writes the expressions), threshold, comparison, evaluation periods and missing-data treatment, and their
  simple policies' adjustments and cooldowns, all from the synthesized template;
- target tracking by its documented alarms (AWS creates those alarms; the template holds each signal's target value,
  the cooldowns and the bounds, which are what this side reads): out after 3 minutes above a target to ceil(n x
  metric / target), in after 15 minutes with every signal under 90% of its target, datapoints counted from the last
  scaling;
- the HPA by Kubernetes' algorithm on the ScaledObject's triggers (threshold, metric type), bounds, polling interval
  and behaviour (windows, pace policies).

Both sides run the same closed loop: each period the fleet's load (saturation summed over the replicas, requests
waiting in all) is spread over the replicas in service, which here are those the last decision asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment
from kvfleet.scaling import WAKE_S, Autoscaler, Observation
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.tuning import sim_scaling
from tests.infra.ec2.envs import EC2_ENV, resolved, without_warm_pool
from tests.infra.helpers import REPO, SAGEMAKER_ENV, environment, only, props

from .metric_math import evaluate

SAT, QUEUE = contract.REPLICA_SATURATION.name, contract.REQUESTS_WAITING.name
Load = tuple[float, float]  # (saturation summed over the replicas in service, requests waiting in all)
# One period of the loop: (t, load, in service, desired) -> desired.
Step = Callable[[float, Load, int, int], int]

# EC2 with scale to zero and a 20-minute scale-in wait (its own number, not the 15-minute floor).
EC2_TEXT = (
    without_warm_pool(EC2_ENV)
    .replace("      min_replicas: 1\n", "      min_replicas: 0\n")
    .replace("      drain_budget_s: 420\n", "      drain_budget_s: 420\n      scale_in_after_s: 1200\n")
)
SAGEMAKER_TEXT = SAGEMAKER_ENV.replace("      min_replicas: 1\n", "      min_replicas: 2\n")


def means(load: Load, n: int) -> dict[str, float]:
    """Each signal averaged over the replicas in service; a replica's saturation is at most 1."""
    return {SAT: min(1.0, load[0] / n), QUEUE: load[1] / n}


def simulated(rule: Autoscaler | None, initial: int) -> Step:
    """The simulator's execution of ``rule``: what Fleet.sample, Fleet.autoscale and Fleet._scale_to do with it."""
    assert rule is not None
    c = rule.controller(initial)
    names = [t.signal.name for t in rule.targets]

    def step(t: float, load: Load, n: int, desired: int) -> int:
        m = means(load, n)
        c.observe(Observation(in_service=n, means=tuple(m[k] for k in names), totals=tuple(m[k] * n for k in names)))
        d = c.evaluate(t, in_service=n, desired=desired)
        if d is None:
            return desired
        c.moved(t, desired, d.desired)
        return d.desired

    return step


def run(
    step: Step, loads: list[Load], *, period_s: float, initial: int, cold_periods: int = 0
) -> list[tuple[float, int]]:
    """The closed loop: (time, desired) at each change. A replica launched serves ``cold_periods`` later; a scale-in
    takes the replicas still starting first (as the simulator drains)."""
    desired = initial
    starting: list[float] = []  # when each replica still starting will serve
    changes = []
    for k, load in enumerate(loads):
        t = (k + 1) * period_s
        starting = sorted(ready for ready in starting if ready > t)
        new = step(t, load, desired - len(starting), desired)
        if new > desired:
            starting += [t + cold_periods * period_s] * (new - desired)
        elif new < desired:
            starting = starting[: max(0, len(starting) - (desired - new))]
        if new != desired:
            changes.append((t, new))
            desired = new
    return changes


def phases(*spans: tuple[int, Load]) -> list[Load]:
    return [load for periods, load in spans for _ in range(periods)]


# ---- EC2: target tracking out, the "one fewer" alarm in ------------------------------------------------------------


class Ec2AsRendered:
    """The group, its target-tracking policies and the simple policy run by the "one fewer" alarm, as synthesized."""

    def __init__(self, t: Template) -> None:
        [group] = props(t, "AWS::AutoScaling::AutoScalingGroup")
        self.min, self.max = int(group["MinSize"]), int(group["MaxSize"])
        resources = t.find_resources("AWS::AutoScaling::ScalingPolicy")
        tracking = [
            r["Properties"]["TargetTrackingConfiguration"]
            for r in resources.values()
            if r["Properties"]["PolicyType"] == "TargetTrackingScaling"
        ]
        assert all(c["DisableScaleIn"] for c in tracking)
        self.targets = {c["CustomizedMetricSpecification"]["MetricName"]: c["TargetValue"] for c in tracking}
        [(pid, simple)] = [
            (k, r["Properties"])
            for k, r in resources.items()
            if r["Properties"].get("AdjustmentType") == "ChangeInCapacity"
        ]
        [alarm] = [a for a in props(t, "AWS::CloudWatch::Alarm") if a.get("AlarmActions") == [{"Ref": pid}]]
        [self.expression] = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
        self.ids = {m["Id"]: m["MetricStat"]["Metric"]["MetricName"] for m in alarm["Metrics"] if "MetricStat" in m}
        self.threshold = alarm["Threshold"]
        assert alarm["ComparisonOperator"] == "LessThanThreshold"
        self.periods = alarm["EvaluationPeriods"]
        self.missing_breaches = alarm["TreatMissingData"] == "breaching"
        self.adjustment, self.cooldown_s = simple["ScalingAdjustment"], int(simple["Cooldown"])
        self.datapoints: list[float | None] = []
        self.since: dict[str, list[float]] = {name: [] for name in self.targets}  # per policy, since the last scaling
        self.last_in_s = -math.inf

    def step(self, t: float, load: Load, n: int, desired: int) -> int:
        m = means(load, n) | {"GroupInServiceInstances": float(n)}
        self.datapoints.append(evaluate(self.expression, {i: m[name] for i, name in self.ids.items()}))
        for name, values in self.since.items():
            values.append(m[name])
        votes = [
            math.ceil(n * values[-1] / self.targets[name])
            for name, values in self.since.items()
            if len(values) >= 3 and all(v > self.targets[name] for v in values[-3:])
        ]
        if votes:  # the high alarm only ever adds
            self._rescaled()
            return max(desired, min(self.max, max(votes)))
        last = self.datapoints[-self.periods :]
        breaching = [self.missing_breaches if v is None else v < self.threshold for v in last]
        if len(last) == self.periods and all(breaching) and t - self.last_in_s >= self.cooldown_s:
            self.last_in_s = t
            self._rescaled()
            return max(self.min, desired + self.adjustment)
        return desired

    def _rescaled(self) -> None:
        for values in self.since.values():
            values.clear()


@pytest.fixture(scope="module")
def ec2() -> tuple[ResolvedDeployment, Template]:
    return resolved(EC2_TEXT), only(EC2_TEXT)


def test_ec2_decides_as_its_template_says(ec2: tuple[ResolvedDeployment, Template]) -> None:
    r, template = ec2
    # Fleet loads on either side of what one fewer replica would hold under the targets (saturation 0.75 and 2
    # waiting per replica): at 3 replicas a saturation sum of 1.5, at 2 one of 0.75; a queue of 4 at 3.
    loads = phases(
        (10, (1.0, 0.5)),  # 2 replicas at two thirds of their target
        (12, (3.4, 1.0)),  # saturated: out, and out again
        (25, (1.6, 0.4)),  # 4 -> 3 after the 20-minute wait; 3 would hold it, 2 not
        (25, (1.6, 0.4)),
        (25, (0.3, 4.4)),  # the queue: 2 would not hold it
        (1, (3.0, 0.4)),  # a one-minute spike: no scale-out, but the wait starts over
        (25, (1.4, 0.4)),  # 2 would hold it: 3 -> 2
        (8, (0.4, 12.0)),  # a queue: out on the queue's target, to the maximum
        (45, (0.8, 0.2)),  # 4 -> 3 -> 2, one wait apart
        (25, (0.8, 0.2)),  # 1 would not hold it
        (25, (0.7, 0.2)),  # 1 would: 2 -> 1
        (10, (0.1, 0.0)),  # one instance: no "one fewer" (no data point), nothing to scale in
    )
    rendered = Ec2AsRendered(template)
    assert rendered.periods * 60 == r.scaling.scale_in_wait_s == 1200
    mine = run(simulated(sim_scaling(r).autoscaler(), 2), loads, period_s=60, initial=2)
    theirs = run(rendered.step, loads, period_s=60, initial=2)
    assert mine == theirs
    assert [d for _, d in mine] == [3, 4, 3, 2, 4, 3, 2, 1], mine


def test_ec2_counts_each_minute_with_the_instances_in_service_then(ec2: tuple[ResolvedDeployment, Template]) -> None:
    """New instances serve 5 minutes after launch: the minutes before count the instances then in service (the
    alarm's GroupInServiceInstances), and a high alarm that asks for fewer than are already launching adds none."""
    r, template = ec2
    loads = phases(
        (3, (1.0, 0.3)),
        (3, (1.0, 12.0)),  # a queue: out to the maximum, 2 of them still starting for 5 minutes
        (3, (1.0, 5.0)),  # still above the queue target on the 2 in service: asks for 3 of the 4 launched
        (30, (0.9, 0.2)),  # what 3 would hold (not 2 with their own load); the first minutes still had 2 in service
        (30, (0.9, 0.2)),
    )
    mine = run(simulated(sim_scaling(r).autoscaler(), 2), loads, period_s=60, initial=2, cold_periods=5)
    theirs = run(Ec2AsRendered(template).step, loads, period_s=60, initial=2, cold_periods=5)
    assert mine == theirs
    assert [d for _, d in mine] == [4, 3, 2], mine


# ---- SageMaker: target tracking out and in -------------------------------------------------------------------------


class TrackingAsRendered:
    """Application Auto Scaling: the scalable target's bounds and one target-tracking policy per signal."""

    OUT, IN, LOW = 3, 15, 0.9  # the documented alarms: datapoints above the target, under 90% of it

    def __init__(self, t: Template) -> None:
        [target] = props(t, "AWS::ApplicationAutoScaling::ScalableTarget")
        self.min, self.max = target["MinCapacity"], target["MaxCapacity"]
        configs = [
            p["TargetTrackingScalingPolicyConfiguration"]
            for p in props(t, "AWS::ApplicationAutoScaling::ScalingPolicy")
        ]
        self.targets = {c["CustomizedMetricSpecification"]["MetricName"]: c["TargetValue"] for c in configs}
        [self.out_cooldown_s] = {c["ScaleOutCooldown"] for c in configs}
        [self.in_cooldown_s] = {c["ScaleInCooldown"] for c in configs}
        assert not any(c.get("DisableScaleIn") for c in configs)
        self.since: dict[str, list[float]] = {name: [] for name in self.targets}
        self.last_out_s = self.last_in_s = -math.inf

    def step(self, t: float, load: Load, n: int, desired: int) -> int:
        m = means(load, n)
        for name, values in self.since.items():
            values.append(m[name])
        votes = [
            math.ceil(n * values[-1] / self.targets[name])
            for name, values in self.since.items()
            if len(values) >= self.OUT and all(v > self.targets[name] for v in values[-self.OUT :])
        ]
        if votes and t - self.last_out_s >= self.out_cooldown_s:  # the high alarm only ever adds
            self._rescaled()
            new = max(desired, self.min, min(self.max, max(votes)))
            self.last_out_s = t if new > desired else self.last_out_s
            return new
        low = all(
            len(values) >= self.IN and all(v < self.LOW * self.targets[name] for v in values[-self.IN :])
            for name, values in self.since.items()
        )
        if low and t - self.last_in_s >= self.in_cooldown_s:
            wanted = max(math.ceil(n * values[-1] / self.targets[name]) for name, values in self.since.items())
            if wanted < desired:
                self._rescaled()
                new = max(self.min, wanted)
                self.last_in_s = t if new < desired else self.last_in_s
                return new
        return desired

    def _rescaled(self) -> None:
        for values in self.since.values():
            values.clear()


def test_sagemaker_decides_as_its_template_says() -> None:
    r = resolved(SAGEMAKER_TEXT)
    loads = phases(
        (5, (1.0, 1.0)),
        (10, (3.6, 2.0)),  # out to the saturation target
        (40, (1.0, 0.5)),  # 15 low minutes, then in to what holds the target (not below the minimum of 2)
        (6, (1.2, 14.0)),  # out on the queue
        (50, (0.4, 0.1)),
    )
    rendered = TrackingAsRendered(only(SAGEMAKER_TEXT))
    assert rendered.in_cooldown_s == r.scaling.scale_in_wait_s
    mine = run(simulated(sim_scaling(r).autoscaler(), 2), loads, period_s=60, initial=2)
    theirs = run(rendered.step, loads, period_s=60, initial=2)
    assert mine == theirs
    assert {d for _, d in mine} >= {2, 4}, mine


# ---- EKS: the HPA a KEDA ScaledObject configures -------------------------------------------------------------------


class HpaAsRendered:
    """Kubernetes' HPA on the ScaledObject: proposals per trigger, the stabilization windows, the pace policies."""

    TOLERANCE = 0.1  # the controller's --horizontal-pod-autoscaler-tolerance default

    def __init__(self, so: dict[str, Any], initial: int) -> None:
        spec = so["spec"]
        self.min, self.max = spec["minReplicaCount"], spec["maxReplicaCount"]
        self.sync_s = spec["pollingInterval"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        self.up, self.down = behavior["scaleUp"], behavior["scaleDown"]
        by_query = {s.prometheus_name: s.name for s in contract.SCALING_SIGNALS}
        # (signal, threshold, metric type) per trigger, the signal read from its query
        self.triggers = [
            (
                next(name for q, name in by_query.items() if q in t["metadata"]["query"]),
                float(t["metadata"]["threshold"]),
                t["metricType"],
            )
            for t in spec["triggers"]
        ]
        self.recommendations: list[tuple[float, int]] = [(0.0, initial)]
        self.events: list[tuple[float, int]] = []

    def _proposal(self, trigger: tuple[str, float, str], m: dict[str, float], n: int, d: int) -> int:
        name, threshold, metric_type = trigger
        if metric_type == "Value":  # the query's average
            ratio = m[name] / threshold
            return d if abs(1 - ratio) <= self.TOLERANCE else math.ceil(ratio * n)
        total = m[name] * n  # AverageValue: the query's sum, per pod
        ratio = total / (threshold * d)
        return d if abs(1 - ratio) <= self.TOLERANCE else math.ceil(total / threshold)

    def _period_start(self, t: float, d: int, period_s: int) -> int:
        return d - sum(change for when, change in self.events if when > t - period_s)

    def _limit(self, rules: dict[str, Any], t: float, d: int, sign: int) -> int:
        proposals = []
        for p in rules["policies"]:
            start = self._period_start(t, d, p["periodSeconds"])
            if p["type"] == "Pods":
                proposals.append(start + sign * p["value"])
            else:
                factor = 1 + sign * p["value"] / 100
                proposals.append(math.ceil(start * factor) if sign > 0 else int(start * factor))
        most_change = max if sign > 0 else min
        return (most_change if rules["selectPolicy"] == "Max" else (min if sign > 0 else max))(proposals)

    def step(self, t: float, load: Load, n: int, desired: int) -> int:
        m = means(load, n)
        rec = max(self._proposal(trigger, m, n, desired) for trigger in self.triggers)
        up_cut, down_cut = t - self.up["stabilizationWindowSeconds"], t - self.down["stabilizationWindowSeconds"]
        up = min([rec, *(r for when, r in self.recommendations if when > up_cut)])
        down = max([rec, *(r for when, r in self.recommendations if when > down_cut)])
        self.recommendations.append((t, rec))
        stable = max(desired, up) if desired < up else min(desired, down)
        if stable > desired:
            new = min(stable, self.max, max(desired, self._limit(self.up, t, desired, +1)))
        elif stable < desired:
            new = max(stable, self.min, min(desired, self._limit(self.down, t, desired, -1)))
        else:
            return desired
        if new != desired:
            self.events.append((t, new - desired))
        return new


def test_eks_decides_as_its_scaled_object_says() -> None:
    [r] = [x for x in _resolve(REPO / "environments" / "platform.yaml")]
    opts = k8s.WorkloadOptions(image="i", prometheus_server_address="http://prometheus:9090")
    so = k8s.scaled_object(r, opts)
    rule = sim_scaling(r).autoscaler()
    assert rule is not None and so["spec"]["pollingInterval"] == rule.period_s
    loads = phases(
        (20, (0.8, 0.5)),
        (40, (5.5, 3.0)),  # out, two pods or doubling a minute at most
        (200, (1.1, 0.2)),  # in after the window, one pod each five minutes
        (20, (1.0, 30.0)),  # the queue alone
        (120, (0.2, 0.0)),
    )
    sync = rule.period_s
    mine = run(simulated(rule, 1), loads, period_s=sync, initial=1)
    theirs = run(HpaAsRendered(so, 1).step, loads, period_s=sync, initial=1)
    assert mine == theirs
    assert len(mine) >= 4 and max(d for _, d in mine) > 3, mine


def _resolve(path: Any) -> Iterator[ResolvedDeployment]:
    from kvfleet.deployments import resolve_environment

    yield from resolve_environment(environment(path.read_text(encoding="utf-8")))


# ---- EC2 scale to zero ---------------------------------------------------------------------------------------------


def test_ec2_goes_to_zero_and_wakes_as_its_alarms_say(ec2: tuple[ResolvedDeployment, Template]) -> None:
    """Arrivals, not signals: the idle alarm counts the requests reaching the load balancer each minute, the wake
    alarm the 503s it answers while no instance is desired. The simulator wakes ``WAKE_S`` after the first refused
    request, a planning figure for the minute's close and the alarm's evaluation: never before the rendered alarm
    can act, and within that figure of it. A burst comes 11 minutes after the group went to zero, well within the
    20-minute idle wait: the wake must not wait for the idle rule's own pace."""
    r, template = ec2
    rule = sim_scaling(r).to_zero()
    assert rule is not None
    idle, to_zero = _alarm_and_policy(template, 0)
    wake, woken = _alarm_and_policy(template, 1)
    assert idle["EvaluationPeriods"] * 60 == rule.idle_s == r.idle_to_zero_s
    # Bursts of requests with idle spells between them, longer and shorter than the idle wait.
    arrivals = [
        a
        for start, count in ((30.5, 20), (2000.2, 5), (2600.7, 30), (5400.3, 10), (5700.9, 3), (9000.1, 4))
        for a in (start + 7.3 * i for i in range(count))
    ]
    mine = _simulated_to_zero(arrivals, 12_000, rule)
    theirs = _rendered_to_zero(arrivals, 12_000, (idle, int(to_zero["Cooldown"])), (wake, int(woken["Cooldown"])))
    assert [d for _, d in mine] == [d for _, d in theirs] == [0, 1, 0, 1, 0, 1, 0]
    for (t_mine, d), (t_theirs, _) in zip(mine, theirs, strict=True):
        if d == 0:
            assert t_mine == t_theirs
        else:
            assert t_theirs <= t_mine <= t_theirs + WAKE_S


def _alarm_and_policy(t: Template, capacity: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The simple policy setting the group's exact capacity to ``capacity``, and the alarm that runs it."""
    found = t.find_resources("AWS::AutoScaling::ScalingPolicy", {"Properties": {"AdjustmentType": "ExactCapacity"}})
    [(pid, policy)] = [
        (k, v["Properties"]) for k, v in found.items() if v["Properties"]["ScalingAdjustment"] == capacity
    ]
    [alarm] = [a for a in props(t, "AWS::CloudWatch::Alarm") if a.get("AlarmActions") == [{"Ref": pid}]]
    return alarm, policy


def _rendered_to_zero(
    arrivals: list[float], horizon: int, idle_rule: tuple[dict[str, Any], int], wake_rule: tuple[dict[str, Any], int]
) -> list[tuple[float, int]]:
    """Each minute: the idle alarm over its periods (missing data breaching), else at zero the wake alarm; each
    (alarm, its simple policy's cooldown). After a simple policy acts, no simple policy starts another activity
    until that cooldown has passed (EC2 Auto Scaling User Guide, "Scaling cooldowns for Amazon EC2 Auto Scaling")."""
    (idle, idle_cooldown), (wake, wake_cooldown) = idle_rule, wake_rule
    [idle_expression] = [m["Expression"] for m in idle["Metrics"] if "Expression" in m]
    [wake_expression] = [m["Expression"] for m in wake["Metrics"] if "Expression" in m]
    assert (idle["ComparisonOperator"], idle["TreatMissingData"]) == ("LessThanThreshold", "breaching")
    assert (wake["ComparisonOperator"], wake["EvaluationPeriods"]) == ("GreaterThanOrEqualToThreshold", 1)
    desired, changes, cooling_until = 1, [], -math.inf
    counted: list[float | None] = []  # the idle alarm's datapoints
    for minute in range(1, horizon // 60 + 1):
        t = minute * 60.0
        inside = sum(1 for a in arrivals if t - 60 <= a < t)
        served = float(inside) if inside and desired else None  # RequestCount: none while nothing serves
        refused = float(inside) if inside and not desired else None  # the load balancer's own 503s (and 5xx)
        counted.append(evaluate(idle_expression, {"r": served, "e": refused}))
        if t < cooling_until:
            continue
        if desired == 0:
            woken = evaluate(wake_expression, {"d": float(desired), "e": refused})
            if woken is not None and woken >= wake["Threshold"]:
                desired, cooling_until = 1, t + wake_cooldown
                changes.append((t, 1))
            continue
        last = counted[-idle["EvaluationPeriods"] :]
        if len(last) == idle["EvaluationPeriods"] and all(v is None or v < idle["Threshold"] for v in last):
            desired, cooling_until = 0, t + idle_cooldown
            changes.append((t, 0))
    return changes


def _simulated_to_zero(arrivals: list[float], horizon: int, rule: Any) -> list[tuple[float, int]]:
    """What Fleet.route and Fleet._zero do: arrivals keep the fleet awake, the first refused one wakes it."""
    desired, changes = 1, []
    last_arrival, refused_s = 0.0, None
    pending = iter(arrivals)
    nxt = next(pending, None)
    for minute in range(1, horizon // 60 + 1):
        t = minute * 60.0
        while nxt is not None and nxt <= t:
            last_arrival = nxt
            if desired == 0 and refused_s is None:
                refused_s = nxt
            nxt = next(pending, None)
        if desired == 0:
            if rule.wakes(t, refused_s=refused_s):
                desired, refused_s = 1, None
                changes.append((t, 1))
        elif rule.idle(t, last_arrival_s=last_arrival, busy=False):
            desired = 0
            changes.append((t, 0))
    return changes
