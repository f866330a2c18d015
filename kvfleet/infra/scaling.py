"""The autoscalers of ``kvfleet.scaling`` rendered as CloudWatch-driven policies, for every target that CloudWatch
scales. The rules, their numbers and their expressions are the scaling objects'; this module only makes the CDK calls.

Each target tracks replica saturation (the larger of KV-cache use and running sequences over max_num_seqs:
``contract.REPLICA_SATURATION``) and requests waiting side by side (the policy asking for more replicas wins), scales
out within a minute, and acts on a scale-in only after the scale-in wait (15 minutes, or twice the drain budget): a
replica takes minutes to load a model, and every removed replica first drains its generations. EKS gets the same
pair and the same wait as a KEDA ScaledObject (``kvfleet.targets.eks.infra.manifests``).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import TypeVar

import jsii
from aws_cdk import Duration
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from constructs import Construct

from kvfleet.infra.metrics import PERIOD, signal_metric
from kvfleet.scaling import OneFewer, ScaleToZero, TargetTracking

E = TypeVar("E", bound=Enum)


def scale_scalable_target(
    target: appscaling.ScalableTarget, *, deployment_id: str, rule: TargetTracking
) -> list[appscaling.TargetTrackingScalingPolicy]:
    """Application Auto Scaling (SageMaker variants): target tracking with the scale-in wait as its cooldown."""
    return [
        target.scale_to_track_metric(
            t.signal.name,
            target_value=t.value,
            custom_metric=signal_metric(deployment_id, t.signal),
            scale_out_cooldown=Duration.seconds(rule.scale_out_cooldown_s),
            scale_in_cooldown=Duration.seconds(rule.scale_in_cooldown_s),
        )
        for t in rule.targets
    ]


def scale_group(
    scope: Construct, group: autoscaling.AutoScalingGroup, *, deployment_id: str, rule: OneFewer
) -> tuple[list[autoscaling.TargetTrackingScalingPolicy], autoscaling.CfnScalingPolicy]:
    """EC2 Auto Scaling: target tracking scales out only; one simple policy scales in, run by the "one fewer" alarm."""
    tracking = [
        group.scale_to_track_metric(
            t.signal.name,
            metric=signal_metric(deployment_id, t.signal),
            target_value=t.value,
            disable_scale_in=not rule.scale_out.scale_in,
        )
        for t in rule.targets
    ]
    using: dict[str, cw.IMetric] = {k: signal_metric(deployment_id, s) for k, s in rule.metric_ids().items()}
    using[rule.IN_SERVICE] = _group_metric(group, "GroupInServiceInstances", "Average")
    one_fewer = cw.MathExpression(
        expression=rule.expression(),
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
        scaling_adjustment=rule.ADJUSTMENT,
        cooldown=str(rule.cooldown_s),
    )
    alarm = cw.Alarm(
        scope,
        "ScaleInAlarm",
        metric=one_fewer,
        threshold=rule.THRESHOLD,
        comparison_operator=_cdk(cw.ComparisonOperator, rule.COMPARISON),
        evaluation_periods=rule.evaluation_periods,
        treat_missing_data=_cdk(cw.TreatMissingData, rule.TREAT_MISSING_DATA),
        alarm_description=rule.description(),
    )
    alarm.add_alarm_action(_PolicyAction(action))
    return tracking, action


def scale_group_to_zero(
    scope: Construct,
    group: autoscaling.AutoScalingGroup,
    *,
    load_balancer: elbv2.ApplicationLoadBalancer,
    target_group: elbv2.ApplicationTargetGroup,
    rule: ScaleToZero,
) -> tuple[autoscaling.CfnScalingPolicy, autoscaling.CfnScalingPolicy]:
    """EC2 with ``min_replicas`` 0 (``kvfleet.scaling.ScaleToZero``): to zero after its idle time without a request,
    and back to one on the first request refused at zero. Returns the (to zero, wake) policies."""
    period = PERIOD
    refused = load_balancer.metrics.http_code_elb(elbv2.HttpCodeElb.ELB_503_COUNT, period=period, statistic="Sum")
    elb_errors = load_balancer.metrics.http_code_elb(elbv2.HttpCodeElb.ELB_5XX_COUNT, period=period, statistic="Sum")
    served = target_group.metrics.request_count(period=period, statistic="Sum")

    to_zero = _exact_capacity(scope, "ScaleToZero", group, 0, rule.TO_ZERO_COOLDOWN_S)
    idle = cw.Alarm(
        scope,
        "IdleAlarm",
        metric=cw.MathExpression(
            expression=rule.IDLE_EXPRESSION,
            using_metrics={"r": served, "e": elb_errors},
            period=period,
            label="requests reaching the load balancer",
        ),
        threshold=rule.IDLE_THRESHOLD,
        comparison_operator=_cdk(cw.ComparisonOperator, rule.IDLE_COMPARISON),
        evaluation_periods=rule.idle_periods,
        treat_missing_data=_cdk(cw.TreatMissingData, rule.IDLE_MISSING_DATA),
        alarm_description=rule.description(),
    )
    idle.add_alarm_action(_PolicyAction(to_zero))

    wake = _exact_capacity(scope, "Wake", group, 1, rule.WAKE_COOLDOWN_S)
    refused_at_zero = cw.MathExpression(
        expression=rule.WAKE_EXPRESSION,
        using_metrics={"d": _group_metric(group, "GroupDesiredCapacity", "Maximum"), "e": refused},
        period=period,
        label="requests refused with no instance",
    )
    woken = _wake_alarm(scope, refused_at_zero, rule, "a request was refused while no instance was desired")
    woken.add_alarm_action(_PolicyAction(wake))
    return to_zero, wake


def wake_scalable_target(
    scope: Construct, target: appscaling.ScalableTarget, *, refused: cw.IMetric, rule: ScaleToZero
) -> appscaling.StepScalingAction:
    """Application Auto Scaling at zero (SageMaker inference components): back to one on the first request refused
    with no capacity (``refused``, a per-period Sum the platform reports only then), the ScaleToZero rule's wake
    alarm; a step policy, as target tracking cannot leave zero with no replica to report its signals. The way down is
    the target tracking itself (its scalable target's minimum 0)."""
    wake = appscaling.StepScalingAction(
        scope,
        "Wake",
        scaling_target=target,
        adjustment_type=appscaling.AdjustmentType.EXACT_CAPACITY,
        metric_aggregation_type=appscaling.MetricAggregationType.MAXIMUM,
        cooldown=Duration.seconds(rule.WAKE_COOLDOWN_S),
    )
    wake.add_adjustment(adjustment=1, lower_bound=0)
    woken = _wake_alarm(scope, refused, rule, "a request was refused with no capacity")
    woken.add_alarm_action(cw_actions.ApplicationScalingAction(wake))
    return wake


def _wake_alarm(scope: Construct, refused: cw.IMetric, rule: ScaleToZero, why: str) -> cw.Alarm:
    """The ScaleToZero rule's wake alarm on what the platform counts as refused at zero (every target's)."""
    return cw.Alarm(
        scope,
        "WakeAlarm",
        metric=refused,
        threshold=rule.WAKE_THRESHOLD,
        comparison_operator=_cdk(cw.ComparisonOperator, rule.WAKE_COMPARISON),
        evaluation_periods=rule.WAKE_PERIODS,
        treat_missing_data=_cdk(cw.TreatMissingData, rule.WAKE_MISSING_DATA),
        alarm_description=f"wake from zero: {why}",
    )


def _group_metric(group: autoscaling.AutoScalingGroup, name: str, statistic: str) -> cw.Metric:
    return cw.Metric(
        namespace="AWS/AutoScaling",
        metric_name=name,
        dimensions_map={"AutoScalingGroupName": group.auto_scaling_group_name},
        statistic=statistic,
        period=PERIOD,
    )


def _exact_capacity(
    scope: Construct, id: str, group: autoscaling.AutoScalingGroup, capacity: int, cooldown_s: int
) -> autoscaling.CfnScalingPolicy:
    return autoscaling.CfnScalingPolicy(
        scope,
        id,
        auto_scaling_group_name=group.auto_scaling_group_name,
        policy_type="SimpleScaling",
        adjustment_type="ExactCapacity",
        scaling_adjustment=capacity,
        cooldown=str(cooldown_s),
    )


def _cdk(enum: type[E], cloudformation: str) -> E:
    """The CDK member of a CloudFormation value ("LessThanThreshold" -> LESS_THAN_THRESHOLD)."""
    return enum[re.sub(r"(?<!^)(?=[A-Z])", "_", cloudformation).upper()]


@jsii.implements(cw.IAlarmAction)
class _PolicyAction:
    """An alarm action that runs one Auto Scaling policy (CDK's AutoScalingAction takes only step policies)."""

    def __init__(self, policy: autoscaling.CfnScalingPolicy) -> None:
        self._policy = policy

    def bind(self, scope: Construct, alarm: cw.IAlarm) -> cw.AlarmActionConfig:
        return cw.AlarmActionConfig(alarm_action_arn=self._policy.ref)
