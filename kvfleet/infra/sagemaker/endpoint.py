"""SageMaker real-time endpoint for one planned deployment, scaling on KV-cache use and queue depth."""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from kvfleet.config.targets import SageMakerTarget
from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.context import ServingContext
from kvfleet.infra.iam import grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image
from kvfleet.infra.metrics import PERIOD, PlatformMetrics
from kvfleet.infra.nag import acknowledge
from kvfleet.infra.scaling import scale_scalable_target

VARIANT = "AllTraffic"


class SageMakerEndpoint(Construct):
    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        r = context.resolved
        d = r.deployment
        target = d.target
        assert isinstance(target, SageMakerTarget)
        vpc_subnets = context.network.subnet_ids
        security_group = context.network.security_group
        region = context.region
        rollback_alarms = list(context.rollback_alarms)
        local_storage = r.candidate.instance.local_nvme_gb > 0

        self.role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"kvfleet {r.deployment_id}: pull the image, read the model, write logs and metrics",
        )
        policy = iam.Policy(self, "ExecutionPolicy", roles=[self.role])
        image_uri = serving_image(self, r, policy, region)

        log_groups = f"arn:{Aws.PARTITION}:logs:{Aws.REGION}:{Aws.ACCOUNT_ID}:log-group:/aws/sagemaker/Endpoints/*"
        policy.add_statements(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[log_groups, f"{log_groups}:log-stream:*"],
            ),
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

        self.key: kms.Key | None = None
        if not local_storage:
            # Instances with local NVMe encrypt it in hardware, and SageMaker refuses a KMS key for them.
            self.key = kms.Key(
                self, "StorageKey", enable_key_rotation=True, description=f"kvfleet {r.deployment_id} volumes"
            )
            # Named actions (grant_encrypt_decrypt would add GenerateDataKey* / ReEncrypt* wildcards).
            self.key.grant(
                self.role, "kms:Encrypt", "kms:Decrypt", "kms:GenerateDataKey", "kms:CreateGrant", "kms:DescribeKey"
            )

        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=self.role.role_arn,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image_uri,
                environment=r.container_environment(isolated=target.network_isolation),
                model_data_source=model_data,
            ),
            vpc_config=sagemaker.CfnModel.VpcConfigProperty(
                security_group_ids=[security_group.security_group_id], subnets=vpc_subnets
            ),
            enable_network_isolation=target.network_isolation,
        )
        # CreateModel checks that the role can pull the image: the policy must exist first.
        self.model.node.add_dependency(policy)

        variant = sagemaker.CfnEndpointConfig.ProductionVariantProperty(
            variant_name=VARIANT,
            model_name=self.model.attr_model_name,
            instance_type=r.instance_type,
            initial_instance_count=r.initial_instance_count,
            initial_variant_weight=1.0,
            # SageMaker accepts a volume size only for instance types without local storage.
            volume_size_in_gb=None if local_storage else r.disk_gib,
            model_data_download_timeout_in_seconds=r.download_timeout_s,
            container_startup_health_check_timeout_in_seconds=r.startup_timeout_s,
        )
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "EndpointConfig",
            production_variants=[variant],
            kms_key_id=self.key.key_arn if self.key else None,
        )
        drain = d.scaling.drain_budget_s
        rollback = sagemaker.CfnEndpoint.AutoRollbackConfigProperty(
            alarms=[sagemaker.CfnEndpoint.AlarmProperty(alarm_name=a.alarm_name) for a in rollback_alarms]
        )
        if target.update == "rolling":
            deployment = sagemaker.CfnEndpoint.DeploymentConfigProperty(
                rolling_update_policy=sagemaker.CfnEndpoint.RollingUpdatePolicyProperty(
                    maximum_batch_size=sagemaker.CfnEndpoint.CapacitySizeProperty(type="INSTANCE_COUNT", value=1),
                    # Between batches: the replaced instances drain their generations.
                    wait_interval_in_seconds=drain,
                    maximum_execution_timeout_in_seconds=_update_timeout(r, drain, batches=d.scaling.max_replicas),
                    rollback_maximum_batch_size=sagemaker.CfnEndpoint.CapacitySizeProperty(
                        type="CAPACITY_PERCENT", value=100
                    ),
                ),
                auto_rollback_configuration=rollback if rollback_alarms else None,
            )
        else:
            routing = (
                sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
                    type="CANARY",
                    wait_interval_in_seconds=target.canary_wait_s,
                    canary_size=sagemaker.CfnEndpoint.CapacitySizeProperty(
                        type="CAPACITY_PERCENT", value=target.canary_percent
                    ),
                )
                if target.canary_percent
                else sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
                    type="ALL_AT_ONCE", wait_interval_in_seconds=min(600, max(60, drain))
                )
            )
            deployment = sagemaker.CfnEndpoint.DeploymentConfigProperty(
                blue_green_update_policy=sagemaker.CfnEndpoint.BlueGreenUpdatePolicyProperty(
                    traffic_routing_configuration=routing,
                    # The old fleet keeps running this long after traffic moves: its generations finish.
                    termination_wait_in_seconds=drain,
                    maximum_execution_timeout_in_seconds=_update_timeout(r, drain, batches=2),
                ),
                auto_rollback_configuration=rollback if rollback_alarms else None,
            )
        self.endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            deployment_config=deployment,
        )
        self.endpoint_name = self.endpoint.attr_endpoint_name

        self.platform_metrics = PlatformMetrics(
            errors_4xx=self._endpoint_metric("Invocation4XXErrors", "4xx (SageMaker)"),
            errors_5xx=self._endpoint_metric("Invocation5XXErrors", "5xx (SageMaker)"),
        )

        self.scalable_target: appscaling.ScalableTarget | None = None
        s = d.scaling
        if s.max_replicas > s.min_replicas:
            self.scalable_target = appscaling.ScalableTarget(
                self,
                "ScalableTarget",
                service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
                resource_id=f"endpoint/{self.endpoint_name}/variant/{VARIANT}",
                scalable_dimension="sagemaker:variant:DesiredInstanceCount",
                min_capacity=s.min_replicas,
                max_capacity=s.max_replicas,
            )
            scale_scalable_target(self.scalable_target, deployment_id=r.deployment_id, scaling=s)
        self.outputs = {"EndpointName": self.endpoint_name}

    def _endpoint_metric(self, name: str, label: str) -> cw.Metric:
        return cw.Metric(
            namespace="AWS/SageMaker",
            metric_name=name,
            dimensions_map={"EndpointName": self.endpoint_name, "VariantName": VARIANT},
            statistic="Sum",
            period=PERIOD,
            label=label,
        )


def _update_timeout(r: ResolvedDeployment, drain_s: int, *, batches: int) -> int:
    """Long enough for each batch to come up (download + start) and drain; SageMaker's bounds."""
    per_batch = r.download_timeout_s + r.startup_timeout_s + drain_s
    return int(min(14400, max(600, per_batch * batches)))
