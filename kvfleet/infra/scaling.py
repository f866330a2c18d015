"""Autoscaling on the contract's two signals, shared by every target that CloudWatch scales.

Each target tracks replica saturation (the larger of KV-cache use and running sequences over max_num_seqs:
``contract.REPLICA_SATURATION``; raw KV use may never reach its target where the cache holds more sequences than
max_num_seqs runs) and requests waiting side by side (the policy asking for more replicas wins), scales out within
a minute, and acts on a scale-in only after ``ScalingConfig.scale_in_wait_s`` (15 minutes, or twice the drain
budget): a replica takes minutes to load a model, and every removed replica first drains its generations. EKS
gets the same pair and the same wait as a KEDA ScaledObject (``kvfleet.infra.eks.manifests``).
"""

from __future__ import annotations

import math

import jsii
from aws_cdk import Duration
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from constructs import Construct

from kvfleet.config.schema import ScalingConfig
from kvfleet.infra.metrics import PERIOD, signal_metric

SCALE_OUT_COOLDOWN = Duration.seconds(60)  # fast: queued requests are TTFT already lost


def scale_scalable_target(
    target: appscaling.ScalableTarget, *, deployment_id: str, scaling: ScalingConfig
) -> list[appscaling.TargetTrackingScalingPolicy]:
    """Application Auto Scaling (SageMaker variants): target tracking with the scale-in wait as its cooldown."""
    wait = Duration.seconds(scaling.scale_in_wait_s)
    return [
        target.scale_to_track_metric(
            signal.name,
            target_value=value,
            custom_metric=signal_metric(deployment_id, signal),
            scale_out_cooldown=SCALE_OUT_COOLDOWN,
            scale_in_cooldown=wait,
        )
        for signal, value in scaling.signal_targets
    ]


def scale_group(
    scope: Construct, group: autoscaling.AutoScalingGroup, *, deployment_id: str, scaling: ScalingConfig
) -> tuple[list[autoscaling.TargetTrackingScalingPolicy], autoscaling.CfnScalingPolicy]:
    """EC2 Auto Scaling: target tracking scales out only; one step policy scales in after the wait.

    EC2 target tracking has no scale-in cooldown, and its own scale-in alarm fires after 15 minutes whatever
    the drain budget. So its scale-in is off, and one instance is removed when, for the whole wait, the fleet
    with one instance fewer would still hold both signals under their targets:
    ``max(signal / target) x n / (n - 1) < 1`` with n instances in service; the next one no sooner than one
    more wait later (the policy's cooldown).
    """
    tracking = [
        group.scale_to_track_metric(
            signal.name,
            metric=signal_metric(deployment_id, signal),
            target_value=value,
            disable_scale_in=True,
        )
        for signal, value in scaling.signal_targets
    ]
    using: dict[str, cw.IMetric] = {
        f"s{i}": signal_metric(deployment_id, signal) for i, (signal, _) in enumerate(scaling.signal_targets)
    }
    using["n"] = cw.Metric(
        namespace="AWS/AutoScaling",
        metric_name="GroupInServiceInstances",
        dimensions_map={"AutoScalingGroupName": group.auto_scaling_group_name},
        statistic="Average",
        period=PERIOD,
    )
    ratios = ", ".join(f"s{i} / {value:g}" for i, (_, value) in enumerate(scaling.signal_targets))
    one_fewer = cw.MathExpression(
        expression=f"MAX([{ratios}]) * n / (n - 1)",
        using_metrics=using,
        period=PERIOD,
        label="load per target with one instance fewer",
    )
    # Simple scaling, not step scaling: only a simple policy honours a cooldown, and without one an alarm that
    # stays in ALARM would remove an instance every minute after the first wait.
    action = autoscaling.CfnScalingPolicy(
        scope,
        "ScaleIn",
        auto_scaling_group_name=group.auto_scaling_group_name,
        policy_type="SimpleScaling",
        adjustment_type="ChangeInCapacity",
        scaling_adjustment=-1,
        cooldown=str(scaling.scale_in_wait_s),
    )
    alarm = cw.Alarm(
        scope,
        "ScaleInAlarm",
        metric=one_fewer,
        threshold=1,
        comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
        evaluation_periods=math.ceil(scaling.scale_in_wait_s / PERIOD.to_seconds()),
        # With one instance there is no "one fewer" (n - 1 = 0): no data, and nothing to scale in.
        treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        alarm_description=(
            f"scale in by one: for {scaling.scale_in_wait_s // 60} min the fleet with one instance fewer would "
            "still hold saturation and queue depth under their targets"
        ),
    )
    alarm.add_alarm_action(_PolicyAction(action))
    return tracking, action


def scale_group_to_zero(
    scope: Construct,
    group: autoscaling.AutoScalingGroup,
    *,
    load_balancer: elbv2.ApplicationLoadBalancer,
    target_group: elbv2.ApplicationTargetGroup,
    idle_s: int,
) -> tuple[autoscaling.CfnScalingPolicy, autoscaling.CfnScalingPolicy]:
    """EC2 with ``min_replicas`` 0: to zero after ``idle_s`` without a request, and back to one on the first request
    refused at zero. Returns the (to zero, wake) policies.

    The agents' own signals cannot wake a group that has no instance, so both rules read the load balancer, which
    answers 503 itself when its target group has no registered target (Application Load Balancer User Guide,
    "Troubleshoot your Application Load Balancers", HTTP 503) and counts those in HTTPCode_ELB_503_Count. Its
    metrics are reported only while requests flow (same guide, "CloudWatch metrics for your Application Load
    Balancer"), so a minute without data is a minute without requests: the idle alarm treats it as breaching, the
    wake alarm as not. The wake counts 503s only while the group's desired capacity is 0, so a 503 in a rolling
    replacement never sets a larger fleet to one; the idle rule counts the load balancer's own 5xx too, so the
    requests refused while a woken instance starts keep it from going straight back to zero.
    """
    period = PERIOD
    desired = cw.Metric(
        namespace="AWS/AutoScaling",
        metric_name="GroupDesiredCapacity",
        dimensions_map={"AutoScalingGroupName": group.auto_scaling_group_name},
        statistic="Maximum",
        period=period,
    )
    refused = load_balancer.metrics.http_code_elb(elbv2.HttpCodeElb.ELB_503_COUNT, period=period, statistic="Sum")
    elb_errors = load_balancer.metrics.http_code_elb(elbv2.HttpCodeElb.ELB_5XX_COUNT, period=period, statistic="Sum")
    served = target_group.metrics.request_count(period=period, statistic="Sum")

    to_zero = autoscaling.CfnScalingPolicy(
        scope,
        "ScaleToZero",
        auto_scaling_group_name=group.auto_scaling_group_name,
        policy_type="SimpleScaling",
        adjustment_type="ExactCapacity",
        scaling_adjustment=0,
        cooldown=str(idle_s),
    )
    idle = cw.Alarm(
        scope,
        "IdleAlarm",
        metric=cw.MathExpression(
            expression="FILL(r, 0) + FILL(e, 0)",
            using_metrics={"r": served, "e": elb_errors},
            period=period,
            label="requests reaching the load balancer",
        ),
        threshold=1,
        comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
        evaluation_periods=math.ceil(idle_s / period.to_seconds()),
        treat_missing_data=cw.TreatMissingData.BREACHING,
        alarm_description=f"scale to zero: no request for {idle_s // 60} min",
    )
    idle.add_alarm_action(_PolicyAction(to_zero))

    wake = autoscaling.CfnScalingPolicy(
        scope,
        "Wake",
        auto_scaling_group_name=group.auto_scaling_group_name,
        policy_type="SimpleScaling",
        adjustment_type="ExactCapacity",
        scaling_adjustment=1,
        cooldown=str(int(period.to_seconds())),
    )
    woken = cw.Alarm(
        scope,
        "WakeAlarm",
        metric=cw.MathExpression(
            expression="IF(d < 1, FILL(e, 0), 0)",
            using_metrics={"d": desired, "e": refused},
            period=period,
            label="requests refused with no instance",
        ),
        threshold=1,
        comparison_operator=cw.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
        evaluation_periods=1,
        treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
        alarm_description="wake from zero: a request was refused while no instance was desired",
    )
    woken.add_alarm_action(_PolicyAction(wake))
    return to_zero, wake


@jsii.implements(cw.IAlarmAction)
class _PolicyAction:
    """An alarm action that runs one Auto Scaling policy (CDK's AutoScalingAction takes only step policies)."""

    def __init__(self, policy: autoscaling.CfnScalingPolicy) -> None:
        self._policy = policy

    def bind(self, scope: Construct, alarm: cw.IAlarm) -> cw.AlarmActionConfig:
        return cw.AlarmActionConfig(alarm_action_arn=self._policy.ref)
