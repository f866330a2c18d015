"""EC2 scale to zero (scaling.min_replicas 0): the load balancer's own counts take the group to zero and back.

Platform rules the alarms rest on (Application Load Balancer User Guide): with no registered target the load
balancer itself answers 503 ("Troubleshoot your Application Load Balancers", HTTP 503) and counts it in
HTTPCode_ELB_503_Count, a LoadBalancer-dimension metric; its metrics are reported only while requests flow
("CloudWatch metrics for your Application Load Balancer"), so a missing minute is a minute without requests.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from kvfleet.infra.app import build_app
from tests.infra.ec2.envs import EC2_ENV, resolved, without_warm_pool
from tests.infra.helpers import environment, make_app, only, props
from tests.infra.test_cfn_lint import cfn_lint

ZERO_ENV = without_warm_pool(EC2_ENV).replace("      min_replicas: 1\n", "      min_replicas: 0\n")
ZERO_POOL_ENV = EC2_ENV.replace("      min_replicas: 1\n", "      min_replicas: 0\n")


@pytest.fixture(scope="module")
def template() -> Template:
    return only(ZERO_ENV)


def _policy(t: Template, adjustment: int) -> tuple[str, dict[str, Any]]:
    found = t.find_resources(
        "AWS::AutoScaling::ScalingPolicy",
        {"Properties": {"PolicyType": "SimpleScaling", "AdjustmentType": "ExactCapacity"}},
    )
    [(pid, p)] = [(k, v["Properties"]) for k, v in found.items() if v["Properties"]["ScalingAdjustment"] == adjustment]
    return pid, p


def _alarm_for(t: Template, policy_id: str) -> dict[str, Any]:
    [alarm] = [a for a in props(t, "AWS::CloudWatch::Alarm") if a.get("AlarmActions") == [{"Ref": policy_id}]]
    return alarm


def _stats(alarm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["Id"]: m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m}


def test_the_group_may_go_to_zero(template: Template) -> None:
    [g] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    assert g["MinSize"] == "0"
    assert int(g["DesiredCapacity"]) >= 1  # deployed serving; the idle rule takes it down


def test_to_zero_after_the_idle_wait_without_a_request(template: Template) -> None:
    r = resolved(ZERO_ENV)
    idle_s = r.idle_to_zero_s
    assert idle_s == max(r.deployment.scaling.scale_in_wait_s, r.ready_window_s)
    pid, policy = _policy(template, 0)
    # One period: a simple policy's cooldown holds back the group's every simple policy, the wake's too (EC2 Auto
    # Scaling User Guide, "Scaling cooldowns for Amazon EC2 Auto Scaling"); the idle wait is the alarm's.
    assert policy["Cooldown"] == "60"
    alarm = _alarm_for(template, pid)
    assert alarm["EvaluationPeriods"] == math.ceil(idle_s / 60)
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("LessThanThreshold", 1)
    # No data is no request: the load balancer reports nothing for a minute without requests.
    assert alarm["TreatMissingData"] == "breaching"
    stats = _stats(alarm)
    names = {s["Metric"]["MetricName"] for s in stats.values()}
    assert names == {"RequestCount", "HTTPCode_ELB_5XX_Count"}
    assert all(s["Stat"] == "Sum" and s["Period"] == 60 for s in stats.values())
    [expr] = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
    assert all(re.search(rf"\b{i}\b", expr) for i in stats)
    # Requests the target group served, so probes of the refused internal routes never keep it awake.
    [served] = [s["Metric"] for s in stats.values() if s["Metric"]["MetricName"] == "RequestCount"]
    assert {d["Name"] for d in served["Dimensions"]} == {"LoadBalancer", "TargetGroup"}


def test_the_first_request_refused_at_zero_wakes_one_instance(template: Template) -> None:
    pid, _ = _policy(template, 1)
    alarm = _alarm_for(template, pid)
    assert alarm["EvaluationPeriods"] == 1
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("GreaterThanOrEqualToThreshold", 1)
    assert alarm["TreatMissingData"] == "notBreaching"
    stats = _stats(alarm)
    by_name = {s["Metric"]["MetricName"]: (i, s) for i, s in stats.items()}
    assert set(by_name) == {"HTTPCode_ELB_503_Count", "GroupDesiredCapacity"}
    desired_id, desired = by_name["GroupDesiredCapacity"]
    refused_id, _ = by_name["HTTPCode_ELB_503_Count"]
    assert desired["Metric"]["Dimensions"][0]["Value"]["Ref"].startswith("FleetGroupASG")
    [expr] = [m["Expression"] for m in alarm["Metrics"] if "Expression" in m]
    # Gated on a desired capacity of 0: a 503 while a larger fleet replaces its instances never sets it to one.
    assert re.search(rf"IF\(\s*{desired_id}\s*<\s*1\s*,", expr) and refused_id in expr


def test_a_fleet_that_keeps_one_has_no_zero_rules() -> None:
    t = only(without_warm_pool(EC2_ENV))
    assert not t.find_resources("AWS::AutoScaling::ScalingPolicy", {"Properties": {"AdjustmentType": "ExactCapacity"}})


@pytest.mark.parametrize("text", [ZERO_ENV, ZERO_POOL_ENV], ids=["cold", "warm-pool"])
def test_lints_and_nags_clean(text: str, tmp_path: Path) -> None:
    env = environment(text)
    app = build_app(env, app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []
    result = cfn_lint(sorted(tmp_path.glob("*.template.json")), "us-east-1")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_signals_missing_is_no_alarm_at_zero(template: Template) -> None:
    [alarm] = [a for a in props(template, "AWS::CloudWatch::Alarm") if "no saturation signal" in a["AlarmDescription"]]
    assert alarm["TreatMissingData"] == "notBreaching"
    [kept] = [
        a
        for a in props(only(without_warm_pool(EC2_ENV)), "AWS::CloudWatch::Alarm")
        if "no saturation signal" in a["AlarmDescription"]
    ]
    assert kept["TreatMissingData"] == "breaching"  # a fleet that keeps one replica must always publish


def test_a_stopped_pool_pays_its_volumes() -> None:
    from kvfleet.tuning import standby_usd_per_hour
    from kvfleet.volumes import GP3, GP3_PRICE, HOURS_PER_MONTH, root_volume

    r = resolved(ZERO_POOL_ENV)
    v = root_volume(r, nvme=False)
    month = v.size_gib * 0.08 + (v.iops - GP3.baseline_iops) * 0.005 + (v.throughput_mib_s - GP3.baseline_mib_s) * 0.04
    assert standby_usd_per_hour(r) == pytest.approx(month / HOURS_PER_MONTH)
    assert (GP3_PRICE.region, GP3_PRICE.as_of) == ("us-east-1", "2020-12-01")
    assert GP3_PRICE.source.startswith("https://aws.amazon.com/ebs/pricing")
    running = resolved(ZERO_POOL_ENV.replace("        min_size: 1\n", "        min_size: 1\n        state: Running\n"))
    assert standby_usd_per_hour(running) == r.candidate.usd_per_hour_per_instance
    assert standby_usd_per_hour(resolved(ZERO_ENV)) == 0.0
