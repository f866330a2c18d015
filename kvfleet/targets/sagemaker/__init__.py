"""SageMaker: a real-time endpoint, one production variant of the plan's instances, or (``target.shape:
inference_components``) an endpoint whose instances hold copies of one inference component, several per instance.

Its parts: ``config`` (the ``target:`` section and its checks), ``infra`` (the endpoint construct and the inference
AMIs it runs on), ``live`` (`kvfleet check`: the endpoint's status and one streamed generation), ``pipeline`` (the
live-check role's grants).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.targets import ScaleInDrain, Target, TypeChangeRule

# Scale-in. Application Auto Scaling changes a variant's instance count through UpdateEndpointWeightsAndCapacities
# (its service-linked role's managed policy, AWSApplicationAutoscalingSageMakerEndpointPolicy, grants that action
# and no other that changes a variant). For that call SageMaker documents the stop of the container on each instance
# it removes: SIGTERM, then SIGKILL thirty seconds later (and the same for the old containers an UpdateEndpoint
# replaces). It documents no wait before the SIGTERM and nothing that first stops routing to the instance: a
# termination wait and rolling intervals are UpdateEndpoint's DeploymentConfig, and UpdateEndpointWeightsAndCapacities
# takes only EndpointName and DesiredWeightsAndCapacities (API Reference). Nor does it document a drain of
# inference-component copies on scale-in (target.shape inference_components): kvfleet holds their copies to the same
# 30 s, an assumption, not a documented rule.
SCALE_IN = ScaleInDrain(
    kill_after_s=30,
    rule=(
        "a scale-in stops the container with SIGTERM and kills it 30 s later, whatever scaling.drain_budget_s says; "
        "the agent drains for what is left of those 30 s and ends the generations still running with an error"
    ),
    source=(
        "SageMaker Developer Guide, 'Custom Inference Code with Hosting Services', How SageMaker Runs Your "
        "Inference Image (UpdateEndpointWeightsAndCapacities: 'The command sends the SIGTERM signal, then it sends "
        "the SIGKILL signal thirty seconds later'); AWS Managed Policy Reference, "
        "AWSApplicationAutoscalingSageMakerEndpointPolicy (v2)"
    ),
)

# An update changing the instance type of a variant registered with Application Auto Scaling fails; deregistering
# it first is the documented way. CloudFormation cannot do that step inside the stack's one update: it updates or
# creates resources first and deletes the removed or replaced ones last ("Update behaviors of stack resources":
# it "creates the replacement resource first ... and then deletes the old resource"), and the scalable target
# names the endpoint, so the endpoint's update runs while the variant is still registered. A new variant name
# does not help: removing a variant configured for autoscaling needs the same deregistration.
TYPE_CHANGE = TypeChangeRule(
    procedure=(
        "deploy first with sizing.instance_type set to the deployed type and scaling.min_replicas equal to "
        "max_replicas, at least the deployed count (the stack deregisters the variant), then the new instance type "
        "with the range back"
    ),
    source=(
        "SageMaker Developer Guide, 'Update endpoints that use auto scaling' (endpoint-scaling-update.html); "
        "CloudFormation User Guide, 'Update behaviors of stack resources', Replacement"
    ),
)

# EC2 instances in a Kubernetes node group or an Auto Scaling group: the shape the nothing-fits message suggests.
_WIDER = Hosting(price_list=PriceList.EC2, routing=Routing.RANDOM)

TARGET = Target(
    name="sagemaker",
    summary="a SageMaker real-time endpoint",
    hosting=Hosting(
        price_list=PriceList.SAGEMAKER,
        endpoint_types_only=True,
        one_engine_per_instance=True,  # a production variant runs one container per instance
        max_volume_gib=512,  # ProductionVariant VolumeSizeInGB: 1-512
        # InvokeEndpoint (API reference): "A customer's model containers must respond to requests within 60
        # seconds." Streamed answers (InvokeEndpointWithResponseStream) are not bound by it.
        buffered_response_limit_s=60,
        # ProductionVariant RoutingConfig LEAST_OUTSTANDING_REQUESTS (kvfleet.targets.sagemaker.infra.endpoint).
        routing=Routing.LEAST_OUTSTANDING,
        wider=_WIDER,
        wider_label="platform ec2 or eks (more instance types)",
    ),
    autoscaler=AutoscalerKind.TARGET_TRACKING,
    address_output="EndpointName",
    # Application Auto Scaling takes an endpoint to zero only where it is built from inference components (SageMaker
    # Developer Guide, "Scale an endpoint to zero instances"): the section's shape lifts this (config.py).
    no_scale_to_zero=(
        "a real-time endpoint's production variant keeps at least one instance; leave target.shape out, or set "
        "inference_components, to scale to zero"
    ),
    scale_in_drain=SCALE_IN,
    type_change=TYPE_CHANGE,
)


@dataclass(frozen=True, kw_only=True)
class ComponentRules:
    """The inference-component shape's platform rules, with where each is written: the endpoint config's variant
    carries no model and lets SageMaker add and remove instances for the copies (managed instance scaling), and
    Application Auto Scaling scales the component's copy count."""

    managed_scaling_status: str
    # Which instances managed scaling removes: IDLE_RELEASE only those that hold no copy, so a copy is never moved
    # (stopped and started elsewhere) to empty an instance, as CONSOLIDATION would.
    scale_in_strategy: str
    managed_scaling_source: str
    scalable_dimension: str
    resource_id_prefix: str
    scaling_source: str
    capacity_unit: str  # InferenceComponentCapacitySize Type of a rolling update's batch
    # A rolling update's batch as a share of the copy count: its documented lowest and highest.
    batch_share: tuple[float, float]
    update_source: str
    # Where the copies' containers write their logs: this prefix and the component's name (not the endpoint's).
    log_group_prefix: str
    log_group_source: str
    # The dimension of the component's invocation metrics (Invocation4XXErrors, Invocation5XXErrors) in AWS/SageMaker.
    metric_dimension: str
    metric_source: str
    # At zero: the metric SageMaker reports for a request it could not serve for want of capacity, and its dimension.
    refused_namespace: str
    refused_metric: str
    refused_dimension: str
    zero_source: str

    def resource_id(self, component_name: str) -> str:
        """Application Auto Scaling's ResourceId of the component."""
        return f"{self.resource_id_prefix}{component_name}"


COMPONENTS = ComponentRules(
    managed_scaling_status="ENABLED",
    scale_in_strategy="IDLE_RELEASE",
    managed_scaling_source=(
        "SageMaker API Reference, ProductionVariantManagedInstanceScaling (Status: ENABLED | DISABLED; "
        "MinInstanceCount minimum 0, MaxInstanceCount minimum 1) and "
        "ProductionVariantManagedInstanceScalingScaleInPolicy "
        "(Strategy IDLE_RELEASE: 'Releases instances that have no hosted inference component copies'; CONSOLIDATION "
        "moves copies onto fewer instances), botocore 1.44.18 sagemaker/2017-07-24 service-2.json"
    ),
    scalable_dimension="sagemaker:inference-component:DesiredCopyCount",
    resource_id_prefix="inference-component/",
    scaling_source=(
        "Application Auto Scaling API Reference, RegisterScalableTarget: ResourceId 'SageMaker inference component - "
        "The resource type is inference-component and the unique identifier is the resource ID', ScalableDimension "
        "sagemaker:inference-component:DesiredCopyCount (botocore 1.44.18 application-autoscaling/2016-02-06)"
    ),
    capacity_unit="COPY_COUNT",
    batch_share=(0.05, 0.5),
    update_source=(
        "CloudFormation, AWS::SageMaker::InferenceComponent InferenceComponentRollingUpdatePolicy and "
        "InferenceComponentCapacitySize (Type COPY_COUNT | CAPACITY_PERCENT); SageMaker API Reference, "
        "InferenceComponentRollingUpdatePolicy MaximumBatchSize: 'For each step, SageMaker AI provisions capacity on "
        "the new endpoint fleet, routes traffic to that fleet, and terminates capacity on the old endpoint fleet. The "
        "value must be between 5% to 50% of the copy count of the inference component' (Required: Yes, as "
        "InferenceComponentDeploymentConfig RollingUpdatePolicy)"
    ),
    log_group_prefix="/aws/sagemaker/InferenceComponents/",
    log_group_source=(
        "uncertain: no SageMaker Developer Guide page found that names the log group of an inference component's "
        "containers; AWS samples (aws-samples SageMaker LLM hosting notebooks) and the enhanced-metrics docs read "
        "/aws/sagemaker/InferenceComponents/<inference component name>"
    ),
    metric_dimension="InferenceComponentName",
    metric_source=(
        "SageMaker Developer Guide, 'Amazon SageMaker AI metrics in Amazon CloudWatch', endpoint invocation metrics: "
        "dimensions EndpointName, VariantName for a variant's models, InferenceComponentName for an inference "
        "component's (as NoCapacityInvocationFailures, zero_source)"
    ),
    refused_namespace="AWS/SageMaker",
    refused_metric="NoCapacityInvocationFailures",
    refused_dimension="InferenceComponentName",
    zero_source=(
        "SageMaker Developer Guide, 'Scale an endpoint to zero instances': an endpoint scales to and from zero only if "
        "it hosts inference components, with ManagedInstanceScaling MinInstanceCount 0 and the component's scalable "
        "target at minimum capacity 0; out of zero by a step scaling policy run by a CloudWatch alarm on "
        "AWS/SageMaker NoCapacityInvocationFailures (dimension InferenceComponentName, Sum, period 60), which "
        "'SageMaker AI emits ... when an endpoint receives an inference request, but the endpoint has no active "
        "instances'; requests fail while it provisions ('several minutes')"
    ),
)

# The address output of an endpoint built from inference components: <endpoint name>/<component name>. Neither
# name holds a slash (EndpointName and InferenceComponentName pattern ^[a-zA-Z0-9](-*[a-zA-Z0-9])*, SageMaker API
# Reference), and a request to such an endpoint names its component (InvokeEndpoint InferenceComponentName: "If the
# endpoint hosts one or more inference components, this parameter specifies the name of inference component to
# invoke").
COMPONENT_SEPARATOR = "/"

# The inference-component shape lets the planner pack copies: an instance holds accelerators // GPUs per copy of
# them (InferenceComponentComputeResourceRequirements NumberOfAcceleratorDevicesRequired, SageMaker API Reference).
COMPONENT_HOSTING = replace(TARGET.hosting, one_engine_per_instance=False)
