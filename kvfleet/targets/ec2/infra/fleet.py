"""EC2 GPU fleet for one planned deployment: an Auto Scaling group behind a load balancer.

Scale-in never cuts a generation: a terminating instance leaves the target group (deregistration
delay = drain budget) while its lifecycle hook holds it in Terminating:Wait; the agent in the container
sees that through IMDS, drains, heartbeats the hook and completes it, and only then does the instance
terminate.

With a warm pool, a launch hook holds each instance in every transition into and out of the pool; the user data
installs a step that runs at every boot and completes it (``lifecycle.TRANSITIONS`` lists who completes which).

``Ec2Fleet`` builds it in steps, one method each, in the order CloudFormation needs them: the instances'
identity, their launch template, the group and its hooks, the load balancer in front, then scaling.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from typing import Any

from aws_cdk import Aws, Duration, IResolvable, RemovalPolicy
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from kvfleet import contract
from kvfleet.config.host_lock import PinnedImage
from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.context import ServingContext
from kvfleet.infra.cuda import host_for_image, hosts, nvidia_gpu
from kvfleet.infra.iam import grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image, serving_image_cuda
from kvfleet.infra.metrics import PERIOD, PlatformMetrics
from kvfleet.infra.nag import acknowledge, logical_id
from kvfleet.infra.network import ServingNetwork
from kvfleet.infra.scaling import scale_group, scale_group_to_zero
from kvfleet.scaling import OneFewer, ScalingPolicy
from kvfleet.sizing.hosting import Routing
from kvfleet.targets.ec2 import MAX_TARGET_GROUPS_PER_ACTION, TARGET
from kvfleet.targets.ec2.config import Ec2Target
from kvfleet.targets.ec2.infra.hosts import HOSTS
from kvfleet.targets.ec2.infra.lifecycle import LAUNCHING, TERMINATING
from kvfleet.targets.ec2.infra.probe import PROBE_OUTPUT, probe_document
from kvfleet.targets.ec2.infra.user_data import Boot, user_data_script
from kvfleet.volumes import root_volume

_ADDRESS = TARGET.address_output or ""  # the stack output `kvfleet bench --env` reads

# Paths the load balancer answers 404 itself, before the forward to the replicas: the agent's own routes that are
# for the instance and the platform, never a client (contract.METRICS_ROUTE, the Prometheus re-export;
# contract.DRAIN_ROUTE, which the agent also refuses from anything but loopback), with anything after them. A path
# pattern compares the path as sent and cannot hold "%" (PATH_PATTERN_CHARACTERS), so an escaped form of these
# routes ("/%6Detrics") is refused by the agent itself: it answers 404 to any path carrying an escape, which no
# client route needs. The health route (contract.HEALTH_ROUTE, the SageMaker contract's health check) stays
# reachable: it says only ok or draining.
# ALB rules (User Guide, "Listener rules" and "Condition types for listener rules"; AWS::ElasticLoadBalancingV2::
# ListenerRule PathPatternConfig): lowest priority number first, then the default action; a path-pattern compares
# the path only, not the query string, case-sensitively, with * and ? wildcards, at most 128 characters each.
# Quotas ("Quotas for your Application Load Balancers", Rules): 5 condition values, 5 wildcards and 5 match
# evaluations per rule, 100 rules per load balancer.
# Sources: https://docs.aws.amazon.com/elasticloadbalancing/latest/application/listener-rules.html,
# https://docs.aws.amazon.com/elasticloadbalancing/latest/application/rule-condition-types.html,
# https://docs.aws.amazon.com/elasticloadbalancing/latest/application/load-balancer-limits.html
# contract.LIVENESS_ROUTE is the host watchdog's, polled on loopback: no client reaches it either.
INTERNAL_PATHS = (f"{contract.METRICS_ROUTE}*", f"{contract.DRAIN_ROUTE}*", f"{contract.LIVENESS_ROUTE}*")
# The characters a path pattern may hold; ELB rejects any other ("contains a character that is not valid"). Elastic
# Load Balancing API Reference, RuleCondition, Values: "A-Z, a-z, 0-9; _ - . $ / ~ " ' @ : +; & (using &amp;);
# * (matches 0 or more characters); ? (matches exactly 1 character)".
# https://docs.aws.amazon.com/elasticloadbalancing/latest/APIReference/API_RuleCondition.html
PATH_PATTERN_CHARACTERS = frozenset(string.ascii_letters + string.digits + "_-.$/~\"'@:+&*?")
INTERNAL_RULE_PRIORITY = 1
RULE_MAX_VALUES = 5
RULE_MAX_WILDCARDS = 5
PATH_PATTERN_MAX_CHARS = 128

# The target group's load_balancing.algorithm.type for each way kvfleet.targets may declare EC2 routes
# (TARGET.hosting.routing, which the planner sizes for). Weighted random with anomaly mitigation off (the
# default) spreads requests evenly in a random order. Slow start ramps a new target's share up, which only round
# robin has: "You can't enable slow start mode when using the least outstanding requests or weighted random routing
# algorithms." Source: ELB User Guide, "Edit target group attributes for your Application Load Balancer", sections
# Routing algorithm and Slow start mode
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/edit-target-group-attributes.html):
# load_balancing.algorithm.type round_robin (the default) | least_outstanding_requests | weighted_random.
ALGORITHMS: dict[Routing, elbv2.TargetGroupLoadBalancingAlgorithmType] = {
    Routing.LEAST_OUTSTANDING: elbv2.TargetGroupLoadBalancingAlgorithmType.LEAST_OUTSTANDING_REQUESTS,
    Routing.RANDOM: elbv2.TargetGroupLoadBalancingAlgorithmType.WEIGHTED_RANDOM,
    Routing.ROUND_ROBIN: elbv2.TargetGroupLoadBalancingAlgorithmType.ROUND_ROBIN,
}
SLOW_START_MAX_S = 900  # slow_start.duration_seconds: 30-900, 0 for off (same page)
SLOW_START_MIN_S = 30

# The hooks are the group's own (its LifecycleHookSpecificationList), so they exist before its first instance launches:
# "One or more lifecycle hooks to add to the Auto Scaling group before instances are launched" (CloudFormation
# Template Reference, AWS::AutoScaling::AutoScalingGroup, LifecycleHookSpecificationList; CreateAutoScalingGroup,
# LifecycleHookSpecificationList). A separate AWS::AutoScaling::LifecycleHook resource needs the group's name, so it is
# created after the group, whose first instances then launch without it (aws-cdk#16356).
# https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-autoscaling-autoscalinggroup.html
# The names differ from those the separate resources had ("kvfleet-drain", "kvfleet-warm"): an update of an older
# stack deletes those resources after the group is updated, and a DeleteLifecycleHook of the same name would remove
# the group's own hook.
LIFECYCLE_HOOK = "kvfleet-group-drain"  # named: the instances read it at boot, before the hook's id is known
WARM_HOOK = "kvfleet-group-launch"  # with a warm pool: held until the image and weights are on the instance
HEARTBEAT_S = 60  # how often the agent heartbeats the hook while draining
# What the instances do to their own group, each allowed on that group alone: every one takes the autoScalingGroup
# resource type (required) and the autoscaling:ResourceTag/${TagKey} and aws:ResourceTag/${TagKey} condition keys
# (Service Authorization Reference, "Actions, resources, and condition keys for Amazon EC2 Auto Scaling", Actions
# table). The ARN names the group; no tag condition is needed for that. The agent completes and heartbeats the
# drain hook (with several engines per instance, the user data's drain step does, once), the user data the launch
# hook, and the watchdog marks its own instance unhealthy (SetInstanceHealth).
GROUP_ACTIONS = (
    "autoscaling:CompleteLifecycleAction",
    "autoscaling:RecordLifecycleActionHeartbeat",
    "autoscaling:SetInstanceHealth",
)
GROUP_ACTIONS_SOURCE = (
    "https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazonec2autoscaling.html"
)
ROOT_DEVICE = "/dev/xvda"  # Amazon Linux 2023 AMIs
MAX_HOOK_TIMEOUT_S = 7200  # the longest heartbeat timeout a lifecycle hook accepts
MAX_OVERRIDES = 10  # instance types a mixed-instances policy accepts


# Which instances a CloudFormation update policy replaces in a group with a warm pool. AWS::AutoScaling::WarmPool:
# "if UpdatePolicy is set to AutoScalingRollingUpdate, CloudFormation replaces InService instances only"; an instance
# refresh (the AutoScalingInstanceRefresh policy) replaces the warm pool's too (InstanceRefreshProgressDetails:
# live pool and warm pool progress).
UPDATE_POLICY_REPLACES: Mapping[str, frozenset[str]] = {
    "AutoScalingRollingUpdate": frozenset({"InService"}),
    "AutoScalingInstanceRefresh": frozenset({"InService", "Warmed"}),
}
UPDATE_POLICY_SOURCES = (
    "https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-resource-autoscaling-warmpool.html",
    "https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_InstanceRefreshProgressDetails.html",
)
UPDATE_POLICY = "AutoScalingInstanceRefresh"


def refresh_healthy_percentages(min_healthy: int) -> tuple[int, int]:
    """Instance refresh's (MinHealthyPercentage, MaxHealthyPercentage): the minimum 0-100, the maximum 100-200 and at
    most 100 above the minimum (InstanceMaintenancePolicy). Replacements launch before the instances they replace,
    up to as many as the minimum lets go at once (at least 10%, so a 100% minimum still makes progress)."""
    high = min(min_healthy + 100, 100 + max(10, 100 - min_healthy))
    return min_healthy, min(200, high)


# A warm pool and a mixed instances policy exclude each other: "You cannot add a warm pool to Auto Scaling groups
# that have a mixed instances policy or that launch Spot Instances" (Amazon EC2 Auto Scaling User Guide, Warm pools,
# Limitations; PutWarmPool API Reference: "cannot be called on an Auto Scaling group that has a mixed instances
# policy"). A group with a warm pool therefore launches the launch template's one type, without capacity overrides.
WARM_POOL_EXCLUDES_MIXED_INSTANCES = True
WARM_POOL_LIMITATION_SOURCES = (
    "https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-warm-pools.html#warm-pools-limitations",
    "https://docs.aws.amazon.com/autoscaling/ec2/APIReference/API_PutWarmPool.html",
)


def fleet_instance_types(r: ResolvedDeployment, *, warm_pool: bool = False) -> list[str]:
    """The plan's type first, then alternatives the same engine settings run unchanged on (capacity overrides):
    the same accelerator, as many of them, so tensor parallelism and the KV-cache budget still hold. With a warm
    pool, the plan's type alone (WARM_POOL_EXCLUDES_MIXED_INSTANCES)."""
    best = r.candidate
    out = [best.instance.name]
    if warm_pool and WARM_POOL_EXCLUDES_MIXED_INSTANCES:
        return out
    for c in r.alternatives:
        i = c.instance
        same = (
            i.accelerator.name == best.instance.accelerator.name
            and i.accelerator_count == best.instance.accelerator_count
            and c.tensor_parallel_size == best.tensor_parallel_size
            and c.pipeline_parallel_size == best.pipeline_parallel_size
            and c.data_parallel_size == best.data_parallel_size
            and c.expert_parallel == best.expert_parallel
            and c.weight_scheme.name == best.weight_scheme.name
            and c.kv_cache_dtype is best.kv_cache_dtype
        )
        if same and i.name not in out:
            out.append(i.name)
    return out[:MAX_OVERRIDES]


def weights_on_local_nvme(r: ResolvedDeployment, target: Ec2Target) -> bool:
    """Whether the weights go to the instance store. It is wiped when an instance stops, so a stopped (or
    hibernated) warm pool keeps them on EBS instead."""
    warm_stopped = target.warm_pool.enabled and target.warm_pool.state != "Running"
    return r.candidate.instance.local_nvme_gb > 0 and not warm_stopped


class Ec2Fleet(Construct):
    """The fleet; ``platform_metrics`` and ``outputs`` make it a ``TargetConstruct``."""

    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        target = context.resolved.deployment.target
        assert isinstance(target, Ec2Target)
        self._resolved = context.resolved
        self._target = target
        self._rollback_alarms = list(context.rollback_alarms)
        self._network: ServingNetwork = context.network
        self._scaling: ScalingPolicy = context.resolved.scaling
        # Boot to healthy: health-check grace and instance warm-up get the one padded start-up wait of every target.
        self._warmup = Duration.seconds(context.resolved.ready_window_s)
        self._engines = context.resolved.candidate.engines_per_instance

        self.log_group = logs.LogGroup(
            self, "Logs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
        )
        self.role = self._instance_role()
        policy, image = self._instance_policy(context.region)
        self.instance_security_group: ec2.ISecurityGroup = self._network.security_group
        self.launch_template = self._launch_template(image, context.region)
        self.instance_types = fleet_instance_types(self._resolved, warm_pool=target.warm_pool.enabled)
        self.group = self._group()
        self.hooks = self._hooks()
        self._lifecycle_policy()
        self._acknowledge_instance_policy(policy)
        self.warm_pool = self._warm_pool()
        self.lb_security_group, port = self._load_balancer_security_group()
        self.load_balancer = self._load_balancer(context.region)
        self.listener = self._listener(port)
        self.internal_routes_rule = self._refuse_internal_routes(self.listener)
        self.target_groups = self._target_groups(self.listener)
        self.target_group = self.target_groups[0]
        if self._scaling.scales:
            rule = self._scaling.autoscaler
            assert isinstance(rule, OneFewer)  # kvfleet.targets: EC2's autoscaler
            scale_group(self, self.group, deployment_id=self._resolved.deployment_id, rule=rule)
        if (to_zero := self._scaling.to_zero(self._resolved.idle_to_zero_s)) is not None:
            scale_group_to_zero(
                self, self.group, load_balancer=self.load_balancer, target_group=self.target_group, rule=to_zero
            )
        self.platform_metrics = self._platform_metrics()
        self.outputs: Mapping[str, str] = {
            _ADDRESS: self.load_balancer.load_balancer_dns_name,
            TARGET.group_output or "": self.group.auto_scaling_group_name,
            PROBE_OUTPUT: probe_document(self).ref,
        }

    # ---- the instances' identity: least privilege ----------------------------------------------------------

    def _instance_role(self) -> iam.Role:
        role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"kvfleet {self._resolved.deployment_id} GPU instances",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore")],
        )
        acknowledge(
            role,
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
            "Session Manager access instead of SSH: AWS maintains the minimal policy the SSM agent needs.",
        )
        return role

    def _instance_policy(self, region: str | None) -> tuple[iam.Policy, str]:
        """What the user data and the container need: pull the image, read the weights (and the token),
        write logs and metrics, find the instance's group. Returns the policy and the image's URI."""
        model = self._resolved.deployment.model
        policy = iam.Policy(self, "InstancePolicy", roles=[self.role])
        image = serving_image(self, self._resolved, policy, region)
        if model.s3_uri:
            grant_model_read(policy, model.s3_uri)
        if model.hf_token_secret:
            grant_token_read(self, policy, model.hf_token_secret)
        if (tenant_secret := self._resolved.deployment.serving.tenant_secret) is not None:
            grant_token_read(self, policy, tenant_secret, id="TenantSecret")
        policy.add_statements(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[self.log_group.log_group_arn],
            ),
            put_metric_data(),
            iam.PolicyStatement(actions=["autoscaling:DescribeAutoScalingInstances"], resources=["*"]),
        )
        return policy, image

    def _acknowledge_instance_policy(self, policy: iam.Policy) -> None:
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::*]",
            "cloudwatch:PutMetricData, ecr:GetAuthorizationToken and autoscaling:DescribeAutoScalingInstances have "
            "no resource-level permissions (PutMetricData is limited to the kvfleet namespace by condition).",
        )
        acknowledge(
            policy,
            f"AwsSolutions-IAM5[Resource::<{logical_id(self.log_group)}.Arn>]",
            "This deployment's own log group; its ARN ends in :* to cover the group's streams.",
        )

    # ---- what an instance boots ----------------------------------------------------------------------------

    def _pinned_image(self, region: str | None) -> PinnedImage | None:
        """The AMI the environment's lock pins for this deployment's parameter and region, as the bridge resolved it
        (``ResolvedDeployment.host_image``, from the lock the loader read beside the file); None without a lock row,
        or with the region unknown at synth."""
        pin = self._resolved.host_image
        return pin if pin is not None and region is not None and pin.region == region else None

    def _check_driver(self, pin: PinnedImage | None) -> None:
        """The AMI's NVIDIA driver must run the image's CUDA. A pinned AMI is checked by its release (hosts.json
        names each release's driver, and one missing there fails synth); an unpinned one only when it is the default
        parameter, whose driver is as of the release hosts.json names. Another parameter is the user's to vouch for."""
        r, target = self._resolved, self._target
        gpu = nvidia_gpu(r)
        known = {h.setting for h in hosts(HOSTS)}
        if gpu is None or (pin is None and target.ami_parameter not in known):
            return
        host_for_image(
            rule=HOSTS,
            image=f"{r.deployment.image.source} image of {r.engine} {r.deployment.engine.version}",
            cuda=serving_image_cuda(r),
            pinned=pin.image_name if pin is not None else target.ami_parameter,
            gpu=gpu,
        )

    def _launch_template(self, image: str, region: str | None) -> ec2.LaunchTemplate:
        r, target = self._resolved, self._target
        pin = self._pinned_image(region)
        self._check_driver(pin)
        nvme = weights_on_local_nvme(r, target)
        root = root_volume(r, nvme=nvme)
        # Pinned: the AMI id itself, so a deploy replaces no instance until the lock changes. Unpinned: the
        # parameter's value at each deploy (a CloudFormation SSM parameter type), as before the lock.
        machine_image = (
            ec2.MachineImage.generic_linux({pin.region: pin.image_id})
            if pin is not None
            else ec2.MachineImage.from_ssm_parameter(target.ami_parameter)
        )
        return ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            machine_image=machine_image,
            instance_type=ec2.InstanceType(r.candidate.instance.name),
            role=self.role,
            security_group=self._network.security_group,
            require_imdsv2=True,
            # The container is one network hop further than the host: IMDSv2 needs a hop limit of 2.
            http_put_response_hop_limit=2,
            instance_metadata_tags=True,  # the agent finds its group's name in its own instance tags
            block_devices=[
                ec2.BlockDevice(
                    device_name=ROOT_DEVICE,
                    volume=ec2.BlockDeviceVolume.ebs(
                        root.size_gib,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        throughput=root.throughput_mib_s,
                        iops=root.iops,
                        encrypted=True,
                        delete_on_termination=True,
                    ),
                )
            ],
            user_data=self._user_data(image, nvme=nvme),
        )

    def _user_data(self, image: str, *, nvme: bool) -> ec2.UserData:
        boot = Boot(
            image=image,
            log_group=self.log_group.log_group_name,
            local_nvme=nvme,
            drain_hook=LIFECYCLE_HOOK,
            heartbeat_s=HEARTBEAT_S,
            warm_hook=WARM_HOOK if self._target.warm_pool.enabled else None,
        )
        # The whole script, its own #!/bin/bash included: nothing else adds commands to it.
        return ec2.UserData.custom(user_data_script(self._resolved, boot))

    # ---- the group and its hooks ---------------------------------------------------------------------------

    def _launch(self) -> dict[str, Any]:
        """What the group launches: the launch template alone when it has one type (always, with a warm pool),
        else a mixed instances policy trying the plan's type first and the alternatives when it has no capacity."""
        if len(self.instance_types) == 1:
            return {"launch_template": self.launch_template}
        return {
            "mixed_instances_policy": autoscaling.MixedInstancesPolicy(
                launch_template=self.launch_template,
                launch_template_overrides=[
                    autoscaling.LaunchTemplateOverrides(instance_type=ec2.InstanceType(t)) for t in self.instance_types
                ],
                # On-Demand only, in the order above: the plan's type first, alternatives when it has no capacity.
                instances_distribution=autoscaling.InstancesDistribution(
                    on_demand_allocation_strategy=autoscaling.OnDemandAllocationStrategy.PRIORITIZED,
                    on_demand_percentage_above_base_capacity=100,
                ),
            )
        }

    def _group(self) -> autoscaling.AutoScalingGroup:
        s, target = self._scaling, self._target
        group = autoscaling.AutoScalingGroup(
            self,
            "Group",
            vpc=self._network.vpc,
            vpc_subnets=self._network.subnet_selection,
            **self._launch(),
            # The scaling bounds count replicas, the group instances of engines_per_instance replicas each.
            min_capacity=math.ceil(s.min_replicas / self._engines),
            max_capacity=math.ceil(s.max_replicas / self._engines),
            # EC2's status checks, not the load balancer's: an engine restart fails the target group's check (the
            # replica leaves the rotation, which routes by least outstanding requests and would send most new
            # requests to a replica answering 503 at once) and must not replace the instance. The host's watchdog
            # replaces it (SetInstanceHealth) when the restart fails; the grace covers the first start.
            health_checks=autoscaling.HealthChecks.ec2(grace_period=self._warmup),
            default_instance_warmup=self._warmup,
            capacity_rebalance=target.capacity_rebalance,
            group_metrics=[autoscaling.GroupMetrics.all()],
            update_policy=self._update_policy(),
        )
        acknowledge(
            group,
            "AwsSolutions-EC26",
            "The launch template's root volume is encrypted (gp3, encrypted=True); the rule cannot read launch "
            "templates inside a mixed-instances policy and fails instead of checking.",
        )
        cfn_group = group.node.default_child
        assert isinstance(cfn_group, autoscaling.CfnAutoScalingGroup)
        # The plan's count; CloudFormation applies it when it changes, autoscaling moves it in between.
        cfn_group.desired_capacity = str(self._resolved.initial_instance_count)
        acknowledge(
            group,
            "AwsSolutions-AS3",
            "Scaling activity is watched through the deployment's dashboard and alarms, not per-event emails.",
        )
        return group

    def _update_policy(self) -> autoscaling.UpdatePolicy:
        """A launch template change replaces every instance, the warm pool's included (see UPDATE_POLICY_REPLACES),
        keeping ``min_healthy_percent`` in service; each replacement gets the padded start-up wait before the next,
        and the instances it replaces drain through the termination hook."""
        assert UPDATE_POLICY == "AutoScalingInstanceRefresh"
        low, high = refresh_healthy_percentages(self._target.min_healthy_percent)
        return autoscaling.UpdatePolicy.instance_refresh(
            strategy=autoscaling.InstanceRefreshStrategy.ROLLING,
            min_healthy_percentage=low,
            max_healthy_percentage=high,
            instance_warmup=Duration.seconds(self._resolved.ready_window_s),
            skip_matching=True,  # an unchanged deployment replaces nothing
            # The refresh fails when one of them fires, and CloudFormation then rolls the stack (and so the launch
            # template) back (AWS::AutoScaling::AutoScalingGroup UpdatePolicy; RefreshPreferences
            # AlarmSpecification: "fail the operation if an alarm threshold is met", up to 10 alarm names).
            alarms=self._rollback_alarms or None,
        )

    def _hooks(self) -> tuple[autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty, ...]:
        """The group's own lifecycle hooks (see LIFECYCLE_HOOK): the drain hook, and with a warm pool the launch hook.

        The drain hook holds a terminating instance while the agent drains; without heartbeats it still waits the
        whole drain budget before CONTINUE. The launch hook keeps a new instance waiting (Warmed:Pending:Wait into
        the pool, Pending:Wait out of it or straight into service) until the user data's lifecycle step completes it
        (lifecycle.TRANSITIONS): after the image and the weights are on disk going into the pool, once the container
        starts going into service; a longer first boot heartbeats it, and one that hangs is abandoned."""
        spec = autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty
        hooks = [
            spec(
                lifecycle_hook_name=LIFECYCLE_HOOK,
                lifecycle_transition=TERMINATING,
                heartbeat_timeout=min(MAX_HOOK_TIMEOUT_S, self._scaling.drain_budget_s + 2 * HEARTBEAT_S),
                default_result="CONTINUE",
            )
        ]
        if self._target.warm_pool.enabled:
            hooks.append(
                spec(
                    lifecycle_hook_name=WARM_HOOK,
                    lifecycle_transition=LAUNCHING,
                    heartbeat_timeout=min(MAX_HOOK_TIMEOUT_S, self._resolved.ready_window_s),
                    default_result="ABANDON",
                )
            )
        cfn_group = self.group.node.default_child
        assert isinstance(cfn_group, autoscaling.CfnAutoScalingGroup)
        specs: list[IResolvable | autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty] = [*hooks]
        cfn_group.lifecycle_hook_specification_list = specs
        return tuple(hooks)

    def _lifecycle_policy(self) -> iam.Policy:
        """The agent (drain hook) and the user data (warm hook) complete and heartbeat this group's hooks, and the
        watchdog marks its instance unhealthy: GROUP_ACTIONS, on this group only."""
        group_arn = (
            f"arn:{Aws.PARTITION}:autoscaling:{Aws.REGION}:{Aws.ACCOUNT_ID}:autoScalingGroup:*:"
            f"autoScalingGroupName/{self.group.auto_scaling_group_name}"
        )
        lifecycle = iam.Policy(
            self,
            "LifecyclePolicy",
            roles=[self.role],
            statements=[iam.PolicyStatement(actions=list(GROUP_ACTIONS), resources=[group_arn])],
        )
        acknowledge(
            lifecycle,
            "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:autoscaling:<AWS::Region>:<AWS::AccountId>:"
            f"autoScalingGroup:*:autoScalingGroupName/<{logical_id(self.group)}>]",
            "Only this group: its ARN's id part is assigned at creation, so it is a wildcard here.",
        )
        return lifecycle

    def _warm_pool(self) -> autoscaling.WarmPool | None:
        """With a warm pool: the pool (its launch hook is one of the group's own, ``_hooks``)."""
        pool_config = self._target.warm_pool
        if not pool_config.enabled:
            return None
        # Without MaxGroupPreparedCapacity the pool holds max_replicas - desired instances, whatever MinSize says;
        # with both equal it holds exactly that many (PutWarmPool, MaxGroupPreparedCapacity).
        return self.group.add_warm_pool(
            min_size=pool_config.min_size,
            max_group_prepared_capacity=pool_config.min_size,
            pool_state=autoscaling.PoolState(pool_config.state.upper()),
        )

    # ---- the load balancer in front ------------------------------------------------------------------------

    def _load_balancer_security_group(self) -> tuple[ec2.SecurityGroup, int]:
        """Clients reach the listener's port from the configured networks only (default: the VPC's own CIDR).
        Returns the group and that port."""
        lb, network = self._target.load_balancer, self._network
        sg = ec2.SecurityGroup(
            self,
            "LoadBalancerSecurityGroup",
            vpc=network.vpc,
            description="kvfleet load balancer",
            allow_all_outbound=False,
        )
        port = 443 if lb.certificate_arn else 80
        clients = list(lb.allowed_cidrs) or ([network.cidr] if network.cidr else [])
        assert clients, "config validation requires load_balancer.allowed_cidrs with an existing VPC"
        for i, cidr in enumerate(clients):
            sg.add_ingress_rule(ec2.Peer.ipv4(cidr), ec2.Port.tcp(port), f"clients {i + 1}")
        return sg, port

    def _load_balancer(self, region: str | None) -> elbv2.ApplicationLoadBalancer:
        lb, network = self._target.load_balancer, self._network
        alb = elbv2.ApplicationLoadBalancer(
            self,
            "LoadBalancer",
            vpc=network.vpc,
            internet_facing=not lb.internal,
            vpc_subnets=network.subnet_selection
            if lb.internal
            else ec2.SubnetSelection(subnet_type=ec2.SubnetType.PUBLIC),
            security_group=self.lb_security_group,
            idle_timeout=Duration.seconds(lb.idle_timeout_s),
            drop_invalid_header_fields=True,
        )
        self._access_logs(alb, region)
        return alb

    def _access_logs(self, alb: elbv2.ApplicationLoadBalancer, region: str | None) -> None:
        """Access logs into a bucket of their own; that needs the region's ELB account, so a known region."""
        if region is None:
            acknowledge(
                alb,
                "AwsSolutions-ELB2",
                "The stack's region is unknown at synth and ALB log delivery needs the region's ELB account; "
                "name the region in the environment file to get access logs.",
            )
            return
        bucket = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            removal_policy=RemovalPolicy.RETAIN,
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))],
        )
        acknowledge(
            bucket,
            "AwsSolutions-S1",
            "This bucket receives the load balancer's access logs; logging its own access would recurse.",
        )
        alb.log_access_logs(bucket)

    def _listener(self, port: int) -> elbv2.ApplicationListener:
        """HTTPS with the configured certificate, else HTTP inside the VPC; closed to all but the security group."""
        cert = self._target.load_balancer.certificate_arn
        return self.load_balancer.add_listener(
            "Listener",
            port=port,
            protocol=elbv2.ApplicationProtocol.HTTPS if cert else elbv2.ApplicationProtocol.HTTP,
            certificates=[elbv2.ListenerCertificate.from_arn(cert)] if cert else None,
            ssl_policy=elbv2.SslPolicy.RECOMMENDED_TLS if cert else None,
            open=False,
        )

    def _refuse_internal_routes(self, listener: elbv2.ApplicationListener) -> elbv2.ApplicationListenerRule:
        """A fixed 404 for ``INTERNAL_PATHS``, evaluated before the default forward (see INTERNAL_PATHS)."""
        assert len(INTERNAL_PATHS) <= RULE_MAX_VALUES
        assert sum(p.count("*") + p.count("?") for p in INTERNAL_PATHS) <= RULE_MAX_WILDCARDS
        assert all(len(p) <= PATH_PATTERN_MAX_CHARS for p in INTERNAL_PATHS)
        assert all(set(p) <= PATH_PATTERN_CHARACTERS for p in INTERNAL_PATHS)
        return elbv2.ApplicationListenerRule(
            self,
            "InternalRoutes",
            listener=listener,
            priority=INTERNAL_RULE_PRIORITY,
            conditions=[elbv2.ListenerCondition.path_patterns(list(INTERNAL_PATHS))],
            action=elbv2.ListenerAction.fixed_response(
                404,
                content_type="application/json",
                # The agent's own 404 body (an OpenAI-style error), so clients see one shape.
                message_body='{"error":{"message":"not served by this endpoint","type":"not_found_error","code":404}}',
            ),
        )

    def _target_groups(self, listener: elbv2.ApplicationListener) -> list[elbv2.ApplicationTargetGroup]:
        """One target group per engine slot: the group registers every instance in each, on the group's own port
        (AWS::AutoScaling::AutoScalingGroup TargetGroupARNs), which is slot N's host port (the user data maps it to
        the agent's). One engine: the listener's default forward to the one group, as before packing existed.
        Several: one forward action splitting by equal weight between the slots' groups, each health-checking its
        own engine, so an engine restart takes that engine alone out of rotation. An agent balancing its
        instance's engines instead would add a hop and hide each engine from the load balancer's least
        outstanding requests and health checks."""
        if self._engines == 1:
            return [self._target_group(listener)]
        if self._engines > MAX_TARGET_GROUPS_PER_ACTION:  # the planner never packs more (kvfleet.targets.ec2.PACKED)
            raise ValueError(f"{self._engines} engines per instance; a forward action takes 5 target groups")
        groups = [
            elbv2.ApplicationTargetGroup(
                self,
                "Replicas" if slot == 0 else f"Replicas{slot}",
                vpc=self._network.vpc,
                targets=[self.group],
                **self._target_group_props(contract.SERVING_PORT + slot),
            )
            for slot in range(self._engines)
        ]
        listener.add_action(
            "Engines",
            action=elbv2.ListenerAction.weighted_forward(
                [elbv2.WeightedTargetGroup(target_group=g, weight=1) for g in groups]
            ),
        )
        return groups

    def _target_group(self, listener: elbv2.ApplicationListener) -> elbv2.ApplicationTargetGroup:
        """The group's instances on the agent's port, healthy when the agent's health route answers, routed as the
        target's hosting declares (ALGORITHMS)."""
        return listener.add_targets("Replicas", targets=[self.group], **self._target_group_props(contract.SERVING_PORT))

    def _target_group_props(self, port: int) -> dict[str, Any]:
        """A target group's settings on ``port``: the health check goes to the traffic port, the engine's own."""
        s = self._scaling
        algorithm = ALGORITHMS[self._target.hosting.routing]
        return {
            "port": port,
            "protocol": elbv2.ApplicationProtocol.HTTP,
            "health_check": elbv2.HealthCheck(
                path=contract.HEALTH_ROUTE,
                healthy_http_codes="200",
                interval=Duration.seconds(10),
                timeout=Duration.seconds(5),
                healthy_threshold_count=2,
                unhealthy_threshold_count=2,
            ),
            # A deregistered instance keeps its open streams this long: the drain budget.
            "deregistration_delay": Duration.seconds(min(3600, s.drain_budget_s)),
            "load_balancing_algorithm_type": algorithm,
            "slow_start": self._slow_start(algorithm),
        }

    def _slow_start(self, algorithm: elbv2.TargetGroupLoadBalancingAlgorithmType) -> Duration | None:
        """Round robin: a replica that just loaded its model gets traffic gradually (cold caches, first compiles).
        Least outstanding requests cannot have slow start (ALGORITHMS): a new, empty replica takes the next
        arrivals until it holds as many as the others (the burst slow start would have spread out), then as many
        as it answers, so a slow one gets fewer. It is set to 0 (off), not left out, so that an update from a
        round-robin group turns it off in the same change."""
        if algorithm == elbv2.TargetGroupLoadBalancingAlgorithmType.ROUND_ROBIN:
            warm_s = math.ceil(self._resolved.startup.engine_init_s)
            return Duration.seconds(min(SLOW_START_MAX_S, max(SLOW_START_MIN_S, warm_s)))
        if algorithm == elbv2.TargetGroupLoadBalancingAlgorithmType.WEIGHTED_RANDOM:
            return None  # aws-cdk-lib refuses any slow start with weighted random, 0 included
        return Duration.seconds(0)

    # ---- what the fleet reports ----------------------------------------------------------------------------

    def _platform_metrics(self) -> PlatformMetrics:
        """Errors as the load balancer saw them from the targets, and the group's own count of replicas."""
        # Several engine slots: the load balancer's counts over all their target groups.
        metrics = self.target_group.metrics if self._engines == 1 else self.load_balancer.metrics
        return PlatformMetrics(
            errors_4xx=metrics.http_code_target(
                elbv2.HttpCodeTarget.TARGET_4XX_COUNT, period=PERIOD, label="4xx (targets)"
            ),
            errors_5xx=metrics.http_code_target(
                elbv2.HttpCodeTarget.TARGET_5XX_COUNT, period=PERIOD, label="5xx (targets)"
            ),
            instances=cw.Metric(
                namespace="AWS/AutoScaling",
                metric_name="GroupInServiceInstances",
                dimensions_map={"AutoScalingGroupName": self.group.auto_scaling_group_name},
                statistic="Average",
                period=PERIOD,
                label="in service",
            ),
        )
