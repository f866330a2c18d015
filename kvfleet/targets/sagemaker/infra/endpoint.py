"""SageMaker real-time endpoint for one planned deployment, scaling on replica saturation and queue depth: a
variant's instances, or (target.shape inference_components) an inference component's copies (components.py)."""

from __future__ import annotations

from aws_cdk import Aws, Fn, Token
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.context import ServingContext
from kvfleet.infra.cuda import HostChoice, host_for_image, nvidia_gpu
from kvfleet.infra.iam import grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image, serving_image_cuda
from kvfleet.infra.metrics import PERIOD, PlatformMetrics
from kvfleet.infra.nag import acknowledge
from kvfleet.infra.scaling import scale_scalable_target
from kvfleet.scaling import TargetTracking
from kvfleet.sizing.hosting import Routing
from kvfleet.targets.sagemaker import COMPONENT_SEPARATOR, COMPONENTS, TARGET
from kvfleet.targets.sagemaker.config import SageMakerTarget
from kvfleet.targets.sagemaker.infra import components
from kvfleet.targets.sagemaker.infra.hosts import HOSTS

_ADDRESS = TARGET.address_output or ""  # the stack output `kvfleet bench --env` reads

VARIANT = "AllTraffic"

# The agent builds its AWS clients from contract.REGION_VARIABLE. SageMaker hosting documents no region variable in
# the container's environment (its documented ones are SAGEMAKER_*), so the model sets it itself.
REGION_VARIABLE = contract.REGION_VARIABLE

# What an update keeps from the running endpoint (UpdateEndpoint RetainAllVariantProperties): the instance
# count, which Application Auto Scaling owns once the variant scales; the weight and data capture come from the
# plan (ExcludeRetainedVariantProperties). A fixed-size variant retains nothing: the plan's count wins.
# Source: SageMaker API Reference, UpdateEndpoint and VariantProperty; botocore shape VariantPropertyType.
RETAINED_WHEN_SCALING = ("DesiredInstanceCount",)
VARIANT_PROPERTIES = ("DesiredInstanceCount", "DesiredWeight", "DataCaptureConfig")

# The variant's RoutingConfig RoutingStrategy for each way kvfleet.targets may declare SageMaker routes
# (TARGET.hosting.routing, which the planner sizes for). Without a RoutingConfig SageMaker routes at
# random. Source: SageMaker API Reference, ProductionVariantRoutingConfig
# (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariantRoutingConfig.html):
# RoutingStrategy LEAST_OUTSTANDING_REQUESTS | RANDOM. SageMaker has no round robin.
ROUTING_STRATEGIES: dict[Routing, str] = {
    Routing.LEAST_OUTSTANDING: "LEAST_OUTSTANDING_REQUESTS",
    Routing.RANDOM: "RANDOM",
}

# An update that changes the instance type of a variant registered with Application Auto Scaling fails
# (TARGET.type_change, with its sources): `kvfleet diff` refuses such a release against the deployed plan and
# names the two deploys that make it.


class SageMakerEndpoint(Construct):
    """The steps, in order: the execution role, the model, the endpoint config, the endpoint with its update
    policy, the autoscaling. Construct ids are fixed: the CloudFormation logical ids derive from them."""

    role: iam.Role
    key: kms.Key | None
    model: sagemaker.CfnModel
    endpoint_config: sagemaker.CfnEndpointConfig
    endpoint: sagemaker.CfnEndpoint
    endpoint_name: str
    host: HostChoice | None
    scalable_target: appscaling.ScalableTarget | None
    component: sagemaker.CfnInferenceComponent | None

    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        r = context.resolved
        target = r.deployment.target
        assert isinstance(target, SageMakerTarget)
        # Instances with local NVMe encrypt it in hardware: SageMaker refuses a volume size and a KMS key for them.
        local_storage = r.candidate.instance.local_nvme_gb > 0

        policy, image_uri = self._execution_role(r, context.region)
        if context.rollback_alarms:
            # SageMaker reads the rollback alarms as the execution role: "Ensure that your IAM execution role has
            # permission to perform the cloudwatch:DescribeAlarms action on the auto-rollback alarms you specify"
            # (Developer Guide, "Auto-Rollback Configuration and Monitoring"). Metric alarms can be named one by one.
            policy.add_statements(
                iam.PolicyStatement(
                    actions=["cloudwatch:DescribeAlarms"], resources=[a.alarm_arn for a in context.rollback_alarms]
                )
            )
        model_data = self._model_access(r, target, policy)
        self.key = None if local_storage else self._storage_key(r)
        self._model(r, target, context, image_uri=image_uri, model_data=model_data, policy=policy)
        gpu = nvidia_gpu(r)
        # The NVIDIA driver comes with the host AMI: the one that runs the image's CUDA (None: not a GPU).
        self.host = (
            host_for_image(
                rule=HOSTS,
                image=image_uri
                if not Token.is_unresolved(image_uri)
                else f"({r.deployment.image.source} image of {r.engine} {r.deployment.engine.version})",
                cuda=serving_image_cuda(r),
                pinned=target.inference_ami_version,
                gpu=gpu,
            )
            if gpu
            else None
        )
        self._endpoint_config(r, target, local_storage=local_storage, host=self.host, context=context)
        self._endpoint(r, target, rollback_alarms=list(context.rollback_alarms))
        self.component = (
            components.inference_component(
                self,
                r,
                endpoint_name=self.endpoint_name,
                variant=VARIANT,
                model_name=self.model.attr_model_name,
                rollback_alarms=list(context.rollback_alarms),
            )
            if _packs(r)
            else None
        )
        self.platform_metrics = PlatformMetrics(
            errors_4xx=self._endpoint_metric("Invocation4XXErrors", "4xx (SageMaker)"),
            errors_5xx=self._endpoint_metric("Invocation5XXErrors", "5xx (SageMaker)"),
        )
        self._autoscaling(r)
        self.outputs = {_ADDRESS: self._address()}

    # ---- the execution role ---------------------------------------------------------------------------

    def _execution_role(self, r: ResolvedDeployment, region: str | None) -> tuple[iam.Policy, str]:
        """The role SageMaker runs the model as: pull the image, write logs and metrics, attach to the VPC.
        Returns its policy (the model's grants join it) and the image's URI."""
        self.role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"kvfleet {r.deployment_id}: pull the image, read the model, write logs and metrics",
        )
        policy = iam.Policy(self, "ExecutionPolicy", roles=[self.role])
        image_uri = serving_image(self, r, policy, region)

        _grant_logs(policy, packs=_packs(r))
        policy.add_statements(
            put_metric_data(),
            # SageMaker attaches the instances to the VPC through network interfaces it creates.
            iam.PolicyStatement(
                actions=[
                    "ec2:CreateNetworkInterface",
                    "ec2:CreateNetworkInterfacePermission",
                    "ec2:DeleteNetworkInterface",
                    "ec2:DeleteNetworkInterfacePermission",
                    "ec2:DescribeNetworkInterfaces",
                    "ec2:DescribeVpcs",
                    "ec2:DescribeDhcpOptions",
                    "ec2:DescribeSubnets",
                    "ec2:DescribeSecurityGroups",
                ],
                resources=["*"],
            ),
        )
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::*]",
            "cloudwatch:PutMetricData and ecr:GetAuthorizationToken have no resource-level permissions "
            "(PutMetricData is limited to the kvfleet namespace by condition); EC2 Describe* calls have none, and "
            "SageMaker names its network interfaces at deploy time.",
        )
        return policy, image_uri

    def _model_access(
        self, r: ResolvedDeployment, target: SageMakerTarget, policy: iam.Policy
    ) -> sagemaker.CfnModel.ModelDataSourceProperty | None:
        """Read access to the weights' S3 prefix (returned as the model's data source) or to the token's secret."""
        d = r.deployment
        model_data = None
        if d.model.s3_uri:
            model_prefix = grant_model_read(policy, d.model.s3_uri)
            model_data = sagemaker.CfnModel.ModelDataSourceProperty(
                s3_data_source=sagemaker.CfnModel.S3DataSourceProperty(
                    s3_uri=model_prefix, s3_data_type="S3Prefix", compression_type="None"
                )
            )
        if d.model.hf_token_secret and not target.network_isolation:
            grant_token_read(self, policy, d.model.hf_token_secret)
        if d.serving.tenant_secret is not None:  # the config refuses it with network isolation
            grant_token_read(self, policy, d.serving.tenant_secret, id="TenantSecret")
        return model_data

    def _storage_key(self, r: ResolvedDeployment) -> kms.Key:
        """The key for the instances' EBS volumes, usable by the execution role only."""
        key = kms.Key(self, "StorageKey", enable_key_rotation=True, description=f"kvfleet {r.deployment_id} volumes")
        # Named actions (grant_encrypt_decrypt would add GenerateDataKey* / ReEncrypt* wildcards).
        key.grant(self.role, "kms:Encrypt", "kms:Decrypt", "kms:GenerateDataKey", "kms:CreateGrant", "kms:DescribeKey")
        return key

    # ---- model, endpoint config, endpoint ---------------------------------------------------------------

    def _model(
        self,
        r: ResolvedDeployment,
        target: SageMakerTarget,
        context: ServingContext,
        *,
        image_uri: str,
        model_data: sagemaker.CfnModel.ModelDataSourceProperty | None,
        policy: iam.Policy,
    ) -> None:
        """The serving container with the contract's environment, in the VPC."""
        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=self.role.role_arn,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image_uri,
                environment={**container_environment(r, target), REGION_VARIABLE: Aws.REGION},
                model_data_source=model_data,
            ),
            vpc_config=sagemaker.CfnModel.VpcConfigProperty(
                security_group_ids=[context.network.security_group.security_group_id],
                subnets=context.network.subnet_ids,
            ),
            enable_network_isolation=target.network_isolation,
        )
        # CreateModel checks that the role can pull the image: the policy must exist first.
        self.model.node.add_dependency(policy)

    def _endpoint_config(
        self,
        r: ResolvedDeployment,
        target: SageMakerTarget,
        *,
        local_storage: bool,
        host: HostChoice | None,
        context: ServingContext,
    ) -> None:
        """One variant on the plan's instance type, on the inference AMI whose NVIDIA driver runs the image's
        CUDA (SageMaker's default hosts run driver 470 or 535), with timeouts from the startup estimate, routing
        as the target's hosting declares. For inference components the variant names no model (the component
        does, with the timeouts), SageMaker manages its instance count, and the endpoint config carries the role
        and the VPC the copies run with (CreateEndpointConfig ExecutionRoleArn, VpcConfig)."""
        packs = _packs(r)
        c = components.copies(r)
        variant = sagemaker.CfnEndpointConfig.ProductionVariantProperty(
            variant_name=VARIANT,
            model_name=None if packs else self.model.attr_model_name,
            instance_type=r.instance_type,
            initial_instance_count=c.instances(c.initial) if packs else r.initial_instance_count,
            initial_variant_weight=None if packs else 1.0,
            inference_ami_version=host.host.setting if host else None,
            # SageMaker accepts a volume size only for instance types without local storage.
            volume_size_in_gb=None if local_storage else r.disk_gib,
            model_data_download_timeout_in_seconds=None if packs else r.download_timeout_s,
            container_startup_health_check_timeout_in_seconds=None if packs else r.startup_timeout_s,
            managed_instance_scaling=components.managed_instance_scaling(r) if packs else None,
            routing_config=sagemaker.CfnEndpointConfig.RoutingConfigProperty(
                routing_strategy=routing_strategy(target.hosting.routing)
            ),
        )
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "EndpointConfig",
            production_variants=[variant],
            kms_key_id=self.key.key_arn if self.key else None,
            execution_role_arn=self.role.role_arn if packs else None,
            # The copies' isolation is the endpoint config's (CreateEndpointConfig EnableNetworkIsolation: "whether
            # all model containers deployed to the endpoint are isolated"), as the variant's is the model's.
            enable_network_isolation=target.network_isolation if packs else None,
            vpc_config=sagemaker.CfnEndpointConfig.VpcConfigProperty(
                security_group_ids=[context.network.security_group.security_group_id],
                subnets=context.network.subnet_ids,
            )
            if packs
            else None,
        )

    def _endpoint(self, r: ResolvedDeployment, target: SageMakerTarget, *, rollback_alarms: list[cw.IAlarm]) -> None:
        # With inference components the copies scale, not the variant: nothing to retain, and the component's own
        # rolling update replaces copies (components.inference_component).
        packs = _packs(r)
        retained = RETAINED_WHEN_SCALING if r.scaling.scales and not packs else ()
        self.endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            deployment_config=None if packs else _deployment_config(r, target, rollback_alarms),
            retain_all_variant_properties=bool(retained),
            exclude_retained_variant_properties=[
                sagemaker.CfnEndpoint.VariantPropertyProperty(variant_property_type=p)
                for p in VARIANT_PROPERTIES
                if p not in retained
            ]
            if retained
            else None,
        )
        self.endpoint_name = self.endpoint.attr_endpoint_name

    # ---- autoscaling on the signals ---------------------------------------------------------------------

    def _autoscaling(self, r: ResolvedDeployment) -> None:
        """The variant's instance count, or the component's copy count, tracks the saturation and queue signals (none
        for a fixed size)."""
        self.scalable_target = None
        s = r.scaling
        if self.component is not None:
            self.scalable_target = components.copy_scaling(self, r, self.component)
            return
        if not s.scales:
            return
        self.scalable_target = appscaling.ScalableTarget(
            self,
            "ScalableTarget",
            service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
            resource_id=f"endpoint/{self.endpoint_name}/variant/{VARIANT}",
            scalable_dimension="sagemaker:variant:DesiredInstanceCount",
            min_capacity=s.min_replicas,
            max_capacity=s.max_replicas,
        )
        rule = s.autoscaler
        assert isinstance(rule, TargetTracking)  # kvfleet.targets: SageMaker's autoscaler
        scale_scalable_target(self.scalable_target, deployment_id=r.deployment_id, rule=rule)

    def _address(self) -> str:
        """Where clients send: the endpoint's name, and /<component> where it hosts an inference component (a request
        to such an endpoint names it: InvokeEndpoint InferenceComponentName; COMPONENT_SEPARATOR)."""
        if self.component is None:
            return self.endpoint_name
        return Fn.join(COMPONENT_SEPARATOR, [self.endpoint_name, components.component_name(self.component)])

    def _endpoint_metric(self, name: str, label: str) -> cw.Metric:
        """SageMaker's invocation metric of the variant, or of the component where the endpoint hosts one
        (COMPONENTS.metric_dimension)."""
        dimensions = (
            {"EndpointName": self.endpoint_name, "VariantName": VARIANT}
            if self.component is None
            else {COMPONENTS.metric_dimension: components.component_name(self.component)}
        )
        return cw.Metric(
            namespace="AWS/SageMaker",
            metric_name=name,
            dimensions_map=dimensions,
            statistic="Sum",
            period=PERIOD,
            label=label,
        )


def container_environment(r: ResolvedDeployment, target: SageMakerTarget) -> dict[str, str]:
    """The deployment's container environment, the agent's drain budget (where it runs the agent) cut to fit:
    SageMaker kills a stopped container 30 s after its SIGTERM (TARGET.scale_in_drain), so the agent drains for what
    fits and ends what still runs with an error event, not a cut connection."""
    env = dict(r.container_environment(isolated=target.network_isolation))
    if contract.ENV_DRAIN_BUDGET_S in env:
        env[contract.ENV_DRAIN_BUDGET_S] = str(agent_drain_s(r))
    return env


def agent_drain_s(r: ResolvedDeployment) -> int:
    """The agent's drain budget on SageMaker: scaling.drain_budget_s, cut to what the kill after SIGTERM leaves."""
    stop = TARGET.scale_in_drain
    return stop.drain_s(r.scaling.drain_budget_s) if stop is not None else r.scaling.drain_budget_s


def _grant_logs(policy: iam.Policy, *, packs: bool) -> None:
    """The execution role writes the containers' logs: the endpoint's log group, and where the endpoint hosts an
    inference component the component's (COMPONENTS.log_group_source)."""
    log_groups = [_log_group("/aws/sagemaker/Endpoints/*")]
    if packs:
        # Not narrowed to the component's name: the component names the model, which waits for this policy, so the
        # policy cannot name the component.
        log_groups.append(_log_group(f"{COMPONENTS.log_group_prefix}*"))
    policy.add_statements(
        iam.PolicyStatement(
            actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
            resources=[arn for group in log_groups for arn in (group, f"{group}:log-stream:*")],
        )
    )
    acknowledge(
        policy,
        "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:"
        "/aws/sagemaker/Endpoints/*]",
        "SageMaker names the endpoint's log group after the generated endpoint name, unknown until deploy.",
    )
    acknowledge(
        policy,
        "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:"
        "/aws/sagemaker/Endpoints/*:log-stream:*]",
        "One log stream per instance and container, named by SageMaker at launch.",
    )
    if packs:
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:"
            f"{COMPONENTS.log_group_prefix}*]",
            "SageMaker names the log group after the generated component name; the component waits for the model, "
            "which waits for this policy, so the policy cannot name it.",
        )
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:"
            f"{COMPONENTS.log_group_prefix}*:log-stream:*]",
            "One log stream per instance and container, named by SageMaker at launch.",
        )


def _log_group(name: str) -> str:
    return f"arn:{Aws.PARTITION}:logs:{Aws.REGION}:{Aws.ACCOUNT_ID}:log-group:{name}"


def _packs(r: ResolvedDeployment) -> bool:
    """Whether the endpoint is built from inference components (copies packed on instances): the section's choice
    for the deployment (SageMakerTarget.chosen_shape)."""
    target = r.deployment.target
    assert isinstance(target, SageMakerTarget)
    return target.chosen_shape(r.deployment)[0] == "inference_components"


def routing_strategy(routing: Routing) -> str:
    """The variant's RoutingStrategy for the declared routing (ROUTING_STRATEGIES)."""
    try:
        return ROUTING_STRATEGIES[routing]
    except KeyError:
        raise ValueError(f"SageMaker cannot route {routing.value}; it routes {', '.join(ROUTING_STRATEGIES)}") from None


def _deployment_config(
    r: ResolvedDeployment, target: SageMakerTarget, rollback_alarms: list[cw.IAlarm]
) -> sagemaker.CfnEndpoint.DeploymentConfigProperty:
    """How an update replaces the fleet: one instance at a time (rolling) or a new fleet (blue/green, optionally
    through a canary); either way the replaced instances get the drain budget, and the alarms roll it back."""
    rollback = (
        sagemaker.CfnEndpoint.AutoRollbackConfigProperty(
            alarms=[sagemaker.CfnEndpoint.AlarmProperty(alarm_name=a.alarm_name) for a in rollback_alarms]
        )
        if rollback_alarms
        else None
    )
    drain = r.scaling.drain_budget_s
    if target.update == "rolling":
        return sagemaker.CfnEndpoint.DeploymentConfigProperty(
            rolling_update_policy=sagemaker.CfnEndpoint.RollingUpdatePolicyProperty(
                maximum_batch_size=sagemaker.CfnEndpoint.CapacitySizeProperty(type="INSTANCE_COUNT", value=1),
                # Between batches: the replaced instances drain their generations.
                wait_interval_in_seconds=drain,
                maximum_execution_timeout_in_seconds=_update_timeout(r, drain, batches=r.scaling.max_replicas),
                rollback_maximum_batch_size=sagemaker.CfnEndpoint.CapacitySizeProperty(
                    type="CAPACITY_PERCENT", value=100
                ),
            ),
            auto_rollback_configuration=rollback,
        )
    return sagemaker.CfnEndpoint.DeploymentConfigProperty(
        blue_green_update_policy=sagemaker.CfnEndpoint.BlueGreenUpdatePolicyProperty(
            traffic_routing_configuration=_traffic_routing(target, drain),
            # The old fleet keeps running this long after traffic moves: its generations finish.
            termination_wait_in_seconds=drain,
            maximum_execution_timeout_in_seconds=_update_timeout(r, drain, batches=2),
        ),
        auto_rollback_configuration=rollback,
    )


def _traffic_routing(target: SageMakerTarget, drain_s: int) -> sagemaker.CfnEndpoint.TrafficRoutingConfigProperty:
    """A blue/green update's traffic shift: a canary share first, or all at once."""
    if target.canary_percent:
        return sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
            type="CANARY",
            wait_interval_in_seconds=target.canary_wait_s,
            canary_size=sagemaker.CfnEndpoint.CapacitySizeProperty(
                type="CAPACITY_PERCENT", value=target.canary_percent
            ),
        )
    return sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
        type="ALL_AT_ONCE", wait_interval_in_seconds=min(600, max(60, drain_s))
    )


def _update_timeout(r: ResolvedDeployment, drain_s: int, *, batches: int) -> int:
    """Long enough for each batch to come up (download + start) and drain; SageMaker's bounds."""
    per_batch = r.download_timeout_s + r.startup_timeout_s + drain_s
    return int(min(14400, max(600, per_batch * batches)))
