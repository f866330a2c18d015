"""The inference-component shape of the SageMaker endpoint (``target.shape: inference_components``): a variant with
no model whose instance count SageMaker manages, one inference component holding the model, and Application Auto
Scaling on the component's copy count.

Each copy is one engine on the plan's GPUs per engine; an instance holds ``engines_per_instance`` of them.
``scaling.min_replicas`` / ``max_replicas`` count copies (replicas, as everywhere); the instances follow: SageMaker
adds one when a new copy does not fit, and releases one that holds no copy (COMPONENTS.scale_in_strategy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aws_cdk import Fn
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.metrics import PERIOD
from kvfleet.infra.scaling import scale_scalable_target, wake_scalable_target
from kvfleet.scaling import TargetTracking
from kvfleet.targets.sagemaker import COMPONENTS

# The share of the instance's memory its copies reserve together (MinMemoryRequiredInMb, split evenly): the rest is
# left to the host's own processes. A choice, not a documented limit: SageMaker documents no reserve of its own.
HOST_MEMORY_SHARE = 0.9
# MinMemoryRequiredInMb: "Valid Range: Minimum value of 128" (SageMaker API Reference,
# InferenceComponentComputeResourceRequirements).
MIN_MEMORY_MB = 128


@dataclass(frozen=True, kw_only=True)
class Copies:
    """The component's copies and the instances they need, from the plan and the scaling range."""

    initial: int
    low: int
    high: int
    per_instance: int

    def instances(self, copies: int) -> int:
        """Instances that hold ``copies`` packed ``per_instance`` to one."""
        return math.ceil(copies / self.per_instance)

    def batch(self) -> int | None:
        """A rolling update's batch in copies: the fewest within COMPONENTS' share of the most copies, held to its
        share of the fewest (at least two) where both fit; None below two copies, where no whole batch is inside
        the share and the component updates without a rolling policy."""
        low_share, high_share = COMPONENTS.batch_share
        if self.high < 2:
            return None
        return max(1, min(math.ceil(low_share * self.high), math.floor(high_share * max(self.low, 2))))


def copies(r: ResolvedDeployment) -> Copies:
    """The plan's replicas as the initial copy count, inside the scaling range."""
    s = r.scaling
    return Copies(
        initial=min(max(r.candidate.replicas, s.min_replicas, 1), s.max_replicas),
        low=s.min_replicas,
        high=s.max_replicas,
        per_instance=r.candidate.engines_per_instance,
    )


def memory_per_copy_mb(r: ResolvedDeployment) -> int:
    """MinMemoryRequiredInMb: the instance's memory shared evenly by the copies it holds (HOST_MEMORY_SHARE)."""
    ram_gib = r.candidate.instance.ram_gib
    if ram_gib is None:
        return MIN_MEMORY_MB
    share = ram_gib * 1024 * HOST_MEMORY_SHARE / r.candidate.engines_per_instance
    return max(MIN_MEMORY_MB, int(share))


def managed_instance_scaling(r: ResolvedDeployment) -> sagemaker.CfnEndpointConfig.ManagedInstanceScalingProperty:
    """The variant's instance range: enough instances for the fewest and the most copies (COMPONENTS' rules)."""
    c = copies(r)
    return sagemaker.CfnEndpointConfig.ManagedInstanceScalingProperty(
        status=COMPONENTS.managed_scaling_status,
        min_instance_count=c.instances(c.low),
        # An update provisions each batch's new copies before it stops the old ones (COMPONENTS.update_source): room
        # for one batch over the most copies (one copy where there is no rolling policy, an assumption).
        max_instance_count=c.instances(c.high + (c.batch() or 1)),
        scale_in_policy=sagemaker.CfnEndpointConfig.ScaleInPolicyProperty(strategy=COMPONENTS.scale_in_strategy),
    )


def inference_component(
    scope: Construct,
    r: ResolvedDeployment,
    *,
    endpoint_name: str,
    variant: str,
    model_name: str,
    rollback_alarms: list[cw.IAlarm],
) -> sagemaker.CfnInferenceComponent:
    """The model as an inference component on the endpoint's variant: each copy takes the plan's GPUs per engine and
    its share of memory, waits the start-up estimate, and an update replaces one copy at a time, each given the
    drain budget before the next."""
    c = copies(r)
    drain = r.scaling.drain_budget_s
    batch = c.batch()
    batches = math.ceil(c.high / batch) if batch else 1
    per_batch = r.download_timeout_s + r.startup_timeout_s + drain
    return sagemaker.CfnInferenceComponent(
        scope,
        "InferenceComponent",
        endpoint_name=endpoint_name,
        variant_name=variant,
        specification=sagemaker.CfnInferenceComponent.InferenceComponentSpecificationProperty(
            model_name=model_name,
            compute_resource_requirements=sagemaker.CfnInferenceComponent.InferenceComponentComputeResourceRequirementsProperty(
                number_of_accelerator_devices_required=r.candidate.gpus_per_replica,
                min_memory_required_in_mb=memory_per_copy_mb(r),
            ),
            startup_parameters=sagemaker.CfnInferenceComponent.InferenceComponentStartupParametersProperty(
                model_data_download_timeout_in_seconds=r.download_timeout_s,
                container_startup_health_check_timeout_in_seconds=r.startup_timeout_s,
            ),
        ),
        runtime_config=sagemaker.CfnInferenceComponent.InferenceComponentRuntimeConfigProperty(copy_count=c.initial),
        deployment_config=sagemaker.CfnInferenceComponent.InferenceComponentDeploymentConfigProperty(
            rolling_update_policy=sagemaker.CfnInferenceComponent.InferenceComponentRollingUpdatePolicyProperty(
                maximum_batch_size=_copies(batch),
                wait_interval_in_seconds=drain,
                # SageMaker's bounds for an update's whole run (as the variant's updates, endpoint._update_timeout).
                maximum_execution_timeout_in_seconds=int(min(14400, max(600, per_batch * batches))),
                rollback_maximum_batch_size=_copies(c.high),
            ),
            auto_rollback_configuration=sagemaker.CfnInferenceComponent.AutoRollbackConfigurationProperty(
                alarms=[sagemaker.CfnInferenceComponent.AlarmProperty(alarm_name=a.alarm_name) for a in rollback_alarms]
            )
            if rollback_alarms
            else None,
        )
        # The deployment config requires a rolling policy (API Reference, InferenceComponentDeploymentConfig).
        if batch
        else None,
    )


def component_name(component: sagemaker.CfnInferenceComponent) -> str:
    """The component's generated name, the last part of its ARN (arn:...:inference-component/<name>; a name has no
    slash, pattern ^[a-zA-Z0-9](-*[a-zA-Z0-9])*): the resource returns only its ARN (its CloudFormation schema's
    primary identifier, InferenceComponentArn)."""
    return Fn.select(1, Fn.split("/", component.attr_inference_component_arn))


def _copies(n: int) -> sagemaker.CfnInferenceComponent.InferenceComponentCapacitySizeProperty:
    return sagemaker.CfnInferenceComponent.InferenceComponentCapacitySizeProperty(
        type=COMPONENTS.capacity_unit, value=n
    )


def copy_scaling(
    scope: Construct, r: ResolvedDeployment, component: sagemaker.CfnInferenceComponent
) -> appscaling.ScalableTarget | None:
    """The component's copy count tracks the saturation and queue signals, the same target-tracking rule a variant's
    instance count follows (the signals carry the deployment's id, and one deployment is one component)."""
    s = r.scaling
    if not s.scales:
        return None
    target = appscaling.ScalableTarget(
        scope,
        "ScalableTarget",
        service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
        resource_id=COMPONENTS.resource_id(component_name(component)),
        scalable_dimension=COMPONENTS.scalable_dimension,
        min_capacity=s.min_replicas,
        max_capacity=s.max_replicas,
    )
    target.node.add_dependency(component)
    rule = s.autoscaler
    assert isinstance(rule, TargetTracking)  # kvfleet.targets: SageMaker's autoscaler
    scale_scalable_target(target, deployment_id=r.deployment_id, rule=rule)
    to_zero = s.to_zero(float(r.idle_to_zero_s))
    if to_zero is not None:
        # Target tracking takes the copies to zero (the minimum 0); a request refused there wakes one.
        refused = cw.Metric(
            namespace=COMPONENTS.refused_namespace,
            metric_name=COMPONENTS.refused_metric,
            dimensions_map={COMPONENTS.refused_dimension: component_name(component)},
            statistic="Sum",
            period=PERIOD,
            label="requests refused with no copy",
        )
        wake_scalable_target(scope, target, refused=refused, rule=to_zero)
    return target
