"""The alarms updates roll back on: the 5xx rate with a minimum-traffic guard, evaluated as CloudWatch would; the
saturation alarm and the dashboard's saturation graph."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.infra.metrics import PlatformMetrics
from kvfleet.infra.monitoring import (
    CACHE_SATURATED,
    ERROR_RATE_CEILING,
    ERROR_RATE_MIN_ERRORS,
    ServingMonitoring,
    error_rate_threshold,
    min_requests,
)
from tests.envs import SAGEMAKER_ENV
from tests.infra.helpers import environment, make_app, only


@pytest.fixture(scope="module")
def template() -> Template:
    return only(SAGEMAKER_ENV)


def rate_alarm(t: Template) -> dict[str, Any]:
    [alarm] = [r["Properties"] for k, r in t.find_resources("AWS::CloudWatch::Alarm").items() if "ServerErrorRate" in k]
    return dict(alarm)


class _Value(float):
    """A data point: division by zero gives NaN, as a metric-math data point with no value, never an exception."""

    def __truediv__(self, other: float) -> _Value:
        return _Value(math.nan if other == 0 else float(self) / other)

    def __add__(self, other: float) -> _Value:
        return _Value(float(self) + other)


def evaluate(alarm: dict[str, Any], values: dict[str, float | None]) -> float:
    """One minute of the alarm's expression, given each metric's value (None: no data point that minute).

    CloudWatch metric math (User Guide, "Metric math syntax and functions"): FILL(m, 0) gives 0 where m has no
    data point; IF(condition, a, b) gives a where the condition is true, else b, point by point.
    """
    [expr] = [m for m in alarm["Metrics"] if "Expression" in m]
    ids = {m["Id"]: m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m}
    by_name = {stat["Metric"]["MetricName"] + "/" + stat["Stat"]: i for i, stat in ids.items()}
    env = {by_name[k]: v for k, v in values.items()}
    code = re.sub(r"FILL\((\w+), 0\)", lambda m: f"_fill({m[1]})", expr["Expression"])
    code = code.replace("IF(", "_if(")

    def _fill(v: float | None) -> _Value:
        return _Value(0.0 if v is None else v)

    def _if(condition: bool, a: float, b: float) -> float:
        return a if condition else b

    return float(eval(code, {"_fill": _fill, "_if": _if}, env))


ERRORS = f"{contract.SERVER_ERRORS.name}/Sum"
STARTED = f"{contract.TIME_TO_FIRST_TOKEN.name}/SampleCount"


def test_the_rate_reads_the_agents_errors_over_the_requests_it_answered(template: Template) -> None:
    alarm = rate_alarm(template)
    stats = {
        m["MetricStat"]["Metric"]["MetricName"]: m["MetricStat"]["Stat"] for m in alarm["Metrics"] if "MetricStat" in m
    }
    assert stats == {contract.SERVER_ERRORS.name: "Sum", contract.TIME_TO_FIRST_TOKEN.name: "SampleCount"}
    assert (alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]) == (5, 3)
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
    assert alarm["TreatMissingData"] == "notBreaching"


def test_a_failing_release_trips_it_and_a_busy_healthy_one_does_not(template: Template) -> None:
    alarm = rate_alarm(template)
    threshold = alarm["Threshold"]
    assert threshold == ERROR_RATE_CEILING  # max_replicas 4: one new instance of 4 is 25% of the requests
    # A new instance of 4 failing every request: a quarter of the fleet's requests are 5xx.
    assert evaluate(alarm, {ERRORS: 100, STARTED: 300}) > threshold
    # Peak load on a healthy fleet: the same few 5xx (an engine restart) among many requests stay under it.
    assert evaluate(alarm, {ERRORS: 5, STARTED: 5000}) < threshold
    # So does a count alarm's trigger (5 a minute) when traffic is ten times higher: the rate does not grow.
    assert evaluate(alarm, {ERRORS: 50, STARTED: 50000}) < threshold


def test_a_quiet_minute_never_trips_it(template: Template) -> None:
    alarm = rate_alarm(template)
    floor = min_requests(alarm["Threshold"])
    assert floor == math.ceil(ERROR_RATE_MIN_ERRORS / alarm["Threshold"])
    # One error among few requests is a 100% or 50% rate: under the floor it reads 0.
    assert evaluate(alarm, {ERRORS: 1, STARTED: None}) == 0
    assert evaluate(alarm, {ERRORS: 1, STARTED: 1}) == 0
    assert evaluate(alarm, {ERRORS: floor - 1, STARTED: None}) == 0
    # No data at all (no traffic, or no ServerErrors published in a clean minute).
    assert evaluate(alarm, {ERRORS: None, STARTED: None}) == 0
    assert evaluate(alarm, {ERRORS: None, STARTED: 1000}) == 0
    # At the floor, errors alone do count.
    assert evaluate(alarm, {ERRORS: floor, STARTED: None}) == 1


@pytest.mark.parametrize(("max_replicas", "expected"), [(1, 0.05), (10, 0.05), (20, 0.025), (64, 1 / 128)])
def test_the_threshold_catches_one_failing_instance_among_max_replicas(max_replicas: int, expected: float) -> None:
    text = SAGEMAKER_ENV.replace("max_replicas: 4", f"max_replicas: {max_replicas}")
    [d] = environment(text).deployments
    threshold = error_rate_threshold(d.scaling)
    assert threshold == pytest.approx(expected)
    # A new instance failing half its requests, as one of max_replicas equally loaded ones, exceeds it.
    assert 0.5 / max_replicas >= threshold


# ---- saturation: what scales, what alarms, what the dashboard holds against the target ----------------------


def monitoring_template(saturation_target: float) -> Template:
    """The monitoring construct alone in a stack, with its dashboard (the replicas counted from the agent's data)."""
    text = SAGEMAKER_ENV.replace(
        "      drain_budget_s: 420\n", f"      drain_budget_s: 420\n      saturation_target: {saturation_target}\n"
    )
    [d] = environment(text).deployments
    stack = cdk.Stack(make_app(), "Monitored")
    ServingMonitoring(stack, "Monitoring", deployment_id="test-chat", scaling=d.scaling).add_dashboard(
        PlatformMetrics()
    )
    return Template.from_stack(stack)


def dashboard(t: Template) -> dict[str, Any]:
    [dash] = [r["Properties"]["DashboardBody"] for r in t.find_resources("AWS::CloudWatch::Dashboard").values()]
    if isinstance(dash, dict):  # the region is a reference
        [sep, parts] = dash["Fn::Join"]
        dash = sep.join(p if isinstance(p, str) else "<token>" for p in parts)
    out: dict[str, Any] = json.loads(dash)
    return out


def metric_names(widget: dict[str, Any]) -> list[tuple[str, str]]:
    """(metric name, statistic) of each plain metric a graph draws."""
    rows = [m for m in widget["properties"]["metrics"] if isinstance(m[0], str)]
    return [(m[1], m[-1].get("stat", "Average") if isinstance(m[-1], dict) else "Average") for m in rows]


def alarm_stat(alarm: dict[str, Any]) -> tuple[str, str] | None:
    """(metric name, statistic) of a single-metric alarm, whichever shape CDK rendered; None for metric math."""
    if "Metrics" in alarm:
        if len(alarm["Metrics"]) != 1:
            return None
        stat = alarm["Metrics"][0]["MetricStat"]
        return stat["Metric"]["MetricName"], stat["Stat"]
    return alarm["MetricName"], alarm["Statistic"]


def test_the_saturation_alarm_reads_saturation_not_kv_use() -> None:
    alarms = {k: r["Properties"] for k, r in monitoring_template(0.6).find_resources("AWS::CloudWatch::Alarm").items()}
    [saturated] = [a for k, a in alarms.items() if k.startswith("MonitoringSaturated")]
    assert alarm_stat(saturated) == (contract.REPLICA_SATURATION.name, "Average")
    assert saturated["Threshold"] == CACHE_SATURATED
    assert "KV cache" in saturated["AlarmDescription"] and "sequence slots" in saturated["AlarmDescription"]
    assert not [k for k in alarms if "CacheSaturated" in k]
    # Blind autoscaling is no saturation data: it is published at the same interval as every gauge.
    [missing] = [a for k, a in alarms.items() if k.startswith("MonitoringSignalsMissing")]
    assert alarm_stat(missing) == (contract.REPLICA_SATURATION.name, "SampleCount")
    # No alarm on raw KV use: its ceiling may sit far under any threshold.
    assert contract.KV_CACHE_UTILIZATION.name not in json.dumps(alarms)


def test_the_dashboard_charts_saturation_at_its_target_beside_kv_use() -> None:
    widgets = dashboard(monitoring_template(0.6))["widgets"]
    [text] = [w for w in widgets if w["type"] == "text"]
    assert "saturation" in text["properties"]["markdown"] and "target 60%" in text["properties"]["markdown"]
    [graph] = [w for w in widgets if w["properties"].get("title", "").startswith("Replica saturation")]
    assert graph["properties"]["annotations"]["horizontal"][0]["value"] == 0.6
    assert metric_names(graph) == [
        (contract.REPLICA_SATURATION.name, "Average"),
        (contract.REPLICA_SATURATION.name, "Maximum"),
        (contract.KV_CACHE_UTILIZATION.name, "Average"),  # still published: charted, not scaled on
    ]
    # No other graph holds KV use against a target.
    for w in widgets:
        if w["type"] == "metric" and w is not graph and "annotations" in w["properties"]:
            assert contract.KV_CACHE_UTILIZATION.name not in {n for n, _ in metric_names(w)}
    # Replicas counted from the agent's data points, on the saturation signal.
    [instances] = [w for w in widgets if w["properties"].get("title") == "Instances"]
    counted = [m for m in instances["properties"]["metrics"] if isinstance(m[0], str)]
    assert [(m[1], m[-1]["stat"]) for m in counted] == [(contract.REPLICA_SATURATION.name, "SampleCount")]


def test_an_alarm_when_the_cache_fills_where_the_plan_has_the_slots_binding(template: Template) -> None:
    """The SageMaker example's plan runs max_num_seqs sequences well inside its cache; a full cache with slots free
    means requests longer than planned. The alarm reads KV use only in that conjunction."""
    from kvfleet.deployments import resolve_environment
    from kvfleet.infra.monitoring import SLOTS_IDLE_FRACTION

    [r] = resolve_environment(environment(SAGEMAKER_ENV))
    assert r.candidate.limited_by != "kv-cache" and r.engine_args.max_num_seqs is not None
    n = r.engine_args.max_num_seqs
    alarms = {k: a["Properties"] for k, a in template.find_resources("AWS::CloudWatch::Alarm").items()}
    [alarm] = [a for k, a in alarms.items() if "CacheBindsFirst" in k]
    kv, running = f"{contract.KV_CACHE_UTILIZATION.name}/Average", f"{contract.REQUESTS_RUNNING.name}/Average"
    assert evaluate(alarm, {kv: 0.97, running: n * SLOTS_IDLE_FRACTION / 2}) == 1  # cache full, slots free
    assert evaluate(alarm, {kv: 0.97, running: float(n)}) == 0  # both full: saturation's alarm, not this one
    assert evaluate(alarm, {kv: 0.3, running: 2.0}) == 0  # quiet
    assert alarm["EvaluationPeriods"] == alarm["DatapointsToAlarm"] >= 10
    assert "re-plan" in alarm["AlarmDescription"]
    # Where the plan has the cache binding first, a full cache is the plan working: no such alarm.
    bound = ServingMonitoring(
        cdk.Stack(make_app(), "CacheBound"),
        "Monitoring",
        deployment_id="d",
        scaling=r.deployment.scaling,
        max_num_seqs=n,
        slots_bind=False,
    )
    assert bound.cache_binds_first is None
