"""EC2 GPU fleet for one planned deployment: an Auto Scaling group behind a load balancer.

Scale-in never cuts a generation: a terminating instance leaves the target group (deregistration
delay = drain budget) while its lifecycle hook holds it in Terminating:Wait; the agent in the container
sees that through IMDS, drains, heartbeats the hook and completes it, and only then does the instance
terminate.
"""

from __future__ import annotations

import math
import shlex

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from kvfleet import contract
from kvfleet.config.targets import Ec2Target
from kvfleet.contract import SERVING_PORT
from kvfleet.deployments import IMAGE_DISK_GIB, ResolvedDeployment
from kvfleet.infra.context import ServingContext
from kvfleet.infra.iam import grant_model_read, grant_token_read, put_metric_data
from kvfleet.infra.images import serving_image
from kvfleet.infra.metrics import PERIOD, PlatformMetrics
from kvfleet.infra.nag import acknowledge, logical_id
from kvfleet.infra.scaling import scale_group

LIFECYCLE_HOOK = "kvfleet-drain"  # named: the instances read it at boot, before the hook's id is known
WARM_HOOK = "kvfleet-warm"  # with a warm pool: held until the image and weights are on the instance
HEARTBEAT_S = 60  # how often the agent heartbeats the hook while draining
MODEL_DIR = "/opt/kvfleet/model"  # on local NVMe when the instance has it
ROOT_DEVICE = "/dev/xvda"  # Amazon Linux 2023 AMIs
OS_DISK_GIB = 30  # the GPU AMI's own root volume (drivers, CUDA, Docker)


def fleet_instance_types(r: ResolvedDeployment) -> list[str]:
    """The plan's type first, then alternatives the same engine settings run unchanged on (capacity overrides):
    the same accelerator, as many of them, so tensor parallelism and the KV-cache budget still hold."""
    best = r.candidate
    out = [best.instance.name]
    for c in r.alternatives:
        i = c.instance
        same = (
            i.accelerator.name == best.instance.accelerator.name
            and i.accelerator_count == best.instance.accelerator_count
            and c.tensor_parallel_size == best.tensor_parallel_size
            and c.weight_scheme.name == best.weight_scheme.name
            and c.kv_cache_dtype is best.kv_cache_dtype
        )
        if same and i.name not in out:
            out.append(i.name)
    return out[:10]


class Ec2Fleet(Construct):
    def __init__(self, scope: Construct, id: str, *, context: ServingContext) -> None:
        super().__init__(scope, id)
        r = context.resolved
        d = r.deployment
        target = d.target
        assert isinstance(target, Ec2Target)
        network = context.network
        region = context.region
        s = d.scaling
        startup = r.startup
        warmup = Duration.seconds(math.ceil(startup.ready_s))

        self.log_group = logs.LogGroup(
            self, "Logs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
        )

        # ---- instance role: least privilege ---------------------------------------------------------
        self.role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"kvfleet {r.deployment_id} GPU instances",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore")],
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
            "Session Manager access instead of SSH: AWS maintains the minimal policy the SSM agent needs.",
        )
        policy = iam.Policy(self, "InstancePolicy", roles=[self.role])
        image = serving_image(self, r, policy, region)
        if d.model.s3_uri:
            grant_model_read(policy, d.model.s3_uri)
        if d.model.hf_token_secret:
            grant_token_read(self, policy, d.model.hf_token_secret)
        policy.add_statements(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[self.log_group.log_group_arn],
            ),
            put_metric_data(),
            iam.PolicyStatement(actions=["autoscaling:DescribeAutoScalingInstances"], resources=["*"]),
        )

        # ---- launch template ------------------------------------------------------------------------
        instance = r.candidate.instance
        # Instance store is wiped when an instance stops: a stopped warm pool keeps the weights on EBS.
        warm_stopped = target.warm_pool.enabled and target.warm_pool.state != "Running"
        nvme = instance.local_nvme_gb > 0 and not warm_stopped
        # The AMI itself, then the image, and the weights too when they do not go to local NVMe.
        root_gib = OS_DISK_GIB + (IMAGE_DISK_GIB if nvme else r.disk_gib)
        self.instance_security_group = network.security_group
        self.launch_template = ec2.LaunchTemplate(
            self,
            "LaunchTemplate",
            machine_image=ec2.MachineImage.from_ssm_parameter(target.ami_parameter),
            instance_type=ec2.InstanceType(instance.name),
            role=self.role,
            security_group=network.security_group,
            require_imdsv2=True,
            # The container is one network hop further than the host: IMDSv2 needs a hop limit of 2.
            http_put_response_hop_limit=2,
            instance_metadata_tags=True,  # the agent finds its group's name in its own instance tags
            block_devices=[
                ec2.BlockDevice(
                    device_name=ROOT_DEVICE,
                    volume=ec2.BlockDeviceVolume.ebs(
                        root_gib, volume_type=ec2.EbsDeviceVolumeType.GP3, encrypted=True, delete_on_termination=True
                    ),
                )
            ],
            user_data=self._user_data(r, target, image, nvme=nvme),
        )

        # ---- Auto Scaling group -----------------------------------------------------------------------
        types = fleet_instance_types(r)
        self.instance_types = types
        initial = r.initial_instance_count
        self.group = autoscaling.AutoScalingGroup(
            self,
            "Group",
            vpc=network.vpc,
            vpc_subnets=network.subnet_selection,
            mixed_instances_policy=autoscaling.MixedInstancesPolicy(
                launch_template=self.launch_template,
                launch_template_overrides=[
                    autoscaling.LaunchTemplateOverrides(instance_type=ec2.InstanceType(t)) for t in types
                ],
                instances_distribution=autoscaling.InstancesDistribution(
                    on_demand_allocation_strategy=autoscaling.OnDemandAllocationStrategy.PRIORITIZED,
                    on_demand_percentage_above_base_capacity=100,
                ),
            ),
            min_capacity=s.min_replicas,
            max_capacity=s.max_replicas,
            health_checks=autoscaling.HealthChecks.with_additional_checks(
                additional_types=[autoscaling.AdditionalHealthCheckType.ELB], grace_period=warmup
            ),
            default_instance_warmup=warmup,
            capacity_rebalance=target.capacity_rebalance,
            group_metrics=[autoscaling.GroupMetrics.all()],
            update_policy=autoscaling.UpdatePolicy.rolling_update(
                max_batch_size=max(1, math.floor(s.max_replicas * (100 - target.min_healthy_percent) / 100)),
                min_instances_in_service=math.ceil(s.min_replicas * target.min_healthy_percent / 100),
                pause_time=Duration.seconds(min(3600, math.ceil(startup.ready_s + s.drain_budget_s))),
            ),
        )
        acknowledge(
            self.group,
            "AwsSolutions-EC26",
            "The launch template's root volume is encrypted (gp3, encrypted=True); the rule cannot read launch "
            "templates inside a mixed-instances policy and fails instead of checking.",
        )
        cfn_group = self.group.node.default_child
        assert isinstance(cfn_group, autoscaling.CfnAutoScalingGroup)
        # The plan's count; CloudFormation applies it when it changes, autoscaling moves it in between.
        cfn_group.desired_capacity = str(initial)
        acknowledge(
            self.group,
            "AwsSolutions-AS3",
            "Scaling activity is watched through the deployment's dashboard and alarms, not per-event emails.",
        )
        # The hook holds a terminating instance while the agent drains; without heartbeats it still waits
        # the whole drain budget before CONTINUE.
        self.lifecycle_hook = self.group.add_lifecycle_hook(
            "Drain",
            lifecycle_hook_name=LIFECYCLE_HOOK,
            lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_TERMINATING,
            heartbeat_timeout=Duration.seconds(min(7200, s.drain_budget_s + 2 * HEARTBEAT_S)),
            default_result=autoscaling.DefaultResult.CONTINUE,
        )
        group_arn = (
            f"arn:{Aws.PARTITION}:autoscaling:{Aws.REGION}:{Aws.ACCOUNT_ID}:autoScalingGroup:*:"
            f"autoScalingGroupName/{self.group.auto_scaling_group_name}"
        )
        lifecycle = iam.Policy(
            self,
            "LifecyclePolicy",
            roles=[self.role],
            statements=[
                iam.PolicyStatement(
                    actions=["autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"],
                    resources=[group_arn],
                )
            ],
        )
        acknowledge(
            lifecycle,
            "AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:autoscaling:<AWS::Region>:<AWS::AccountId>:"
            f"autoScalingGroup:*:autoScalingGroupName/<{logical_id(self.group)}>]",
            "Only this group: its ARN's id part is assigned at creation, so it is a wildcard here.",
        )
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
        self.warm_pool = None
        self.launch_hook = None
        if target.warm_pool.enabled:
            self.warm_pool = self.group.add_warm_pool(
                min_size=target.warm_pool.min_size,
                pool_state=autoscaling.PoolState(target.warm_pool.state.upper()),
            )
            # A new instance stays in Pending:Wait until its user data has pulled the image and the weights
            # and completes this hook; only then does the group stop it into the pool (or put it in service).
            self.launch_hook = self.group.add_lifecycle_hook(
                "Warm",
                lifecycle_hook_name=WARM_HOOK,
                lifecycle_transition=autoscaling.LifecycleTransition.INSTANCE_LAUNCHING,
                heartbeat_timeout=Duration.seconds(
                    min(7200, math.ceil(2 * (startup.image_pull_s + startup.download_s)))
                ),
                default_result=autoscaling.DefaultResult.ABANDON,
            )

        # ---- load balancer ----------------------------------------------------------------------------
        lb = target.load_balancer
        self.lb_security_group = ec2.SecurityGroup(
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
            self.lb_security_group.add_ingress_rule(ec2.Peer.ipv4(cidr), ec2.Port.tcp(port), f"clients {i + 1}")
        self.load_balancer = elbv2.ApplicationLoadBalancer(
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
        if region is not None:
            logs_bucket = s3.Bucket(
                self,
                "AccessLogs",
                encryption=s3.BucketEncryption.S3_MANAGED,
                block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
                enforce_ssl=True,
                removal_policy=RemovalPolicy.RETAIN,
                lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))],
            )
            acknowledge(
                logs_bucket,
                "AwsSolutions-S1",
                "This bucket receives the load balancer's access logs; logging its own access would recurse.",
            )
            self.load_balancer.log_access_logs(logs_bucket)
        else:
            acknowledge(
                self.load_balancer,
                "AwsSolutions-ELB2",
                "The stack's region is unknown at synth and ALB log delivery needs the region's ELB account; "
                "name the region in the environment file to get access logs.",
            )
        listener = self.load_balancer.add_listener(
            "Listener",
            port=port,
            protocol=elbv2.ApplicationProtocol.HTTPS if lb.certificate_arn else elbv2.ApplicationProtocol.HTTP,
            certificates=[elbv2.ListenerCertificate.from_arn(lb.certificate_arn)] if lb.certificate_arn else None,
            ssl_policy=elbv2.SslPolicy.RECOMMENDED_TLS if lb.certificate_arn else None,
            open=False,
        )
        self.target_group = listener.add_targets(
            "Replicas",
            port=SERVING_PORT,
            protocol=elbv2.ApplicationProtocol.HTTP,
            targets=[self.group],
            health_check=elbv2.HealthCheck(
                path=contract.HEALTH_ROUTE,
                healthy_http_codes="200",
                interval=Duration.seconds(10),
                timeout=Duration.seconds(5),
                healthy_threshold_count=2,
                unhealthy_threshold_count=2,
            ),
            # A deregistered instance keeps its open streams this long: the drain budget.
            deregistration_delay=Duration.seconds(min(3600, s.drain_budget_s)),
            # A replica that just loaded its model gets traffic gradually (cold caches, first compiles).
            slow_start=Duration.seconds(min(900, max(30, math.ceil(startup.engine_init_s)))),
        )

        # ---- scaling on the signals ---------------------------------------------------------------------
        if s.max_replicas > s.min_replicas:
            scale_group(self, self.group, deployment_id=r.deployment_id, scaling=s)

        self.platform_metrics = PlatformMetrics(
            errors_4xx=self.target_group.metrics.http_code_target(
                elbv2.HttpCodeTarget.TARGET_4XX_COUNT, period=PERIOD, label="4xx (targets)"
            ),
            errors_5xx=self.target_group.metrics.http_code_target(
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
        self.outputs = {"LoadBalancerDns": self.load_balancer.load_balancer_dns_name}

    def _user_data(self, r: ResolvedDeployment, target: Ec2Target, image: str, *, nvme: bool) -> ec2.UserData:
        d = r.deployment
        env = r.container_environment()
        env[contract.ENV_PUT_METRIC_DATA] = "0"  # the awslogs driver turns the EMF lines into metrics
        if d.model.s3_uri:
            env[contract.ENV_MODEL] = contract.MODEL_DIR
        env_lines = "\n".join(f"{k}={v}" for k, v in sorted(env.items()))
        mount = (
            f"-v {MODEL_DIR}:/opt/ml/model:ro" if d.model.s3_uri else f"-v {MODEL_DIR}:/home/kvfleet/.cache/huggingface"
        )
        ud = ec2.UserData.for_linux()
        ud.add_commands(
            "set -euo pipefail",
            'imds() { curl -sf -H "X-aws-ec2-metadata-token: $TOKEN" "http://169.254.169.254/latest/$1"; }',
            'TOKEN=$(curl -sf -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 21600" '
            "http://169.254.169.254/latest/api/token)",
            "REGION=$(imds meta-data/placement/region)",
            "INSTANCE_ID=$(imds meta-data/instance-id)",
            # The group's name from the instance's own tags (metadata tags are on); the API as a fallback.
            "GROUP=$(imds meta-data/tags/instance/aws:autoscaling:groupName || aws autoscaling "
            'describe-auto-scaling-instances --region "$REGION" --instance-ids "$INSTANCE_ID" '
            "--query 'AutoScalingInstances[0].AutoScalingGroupName' --output text)",
            f"mkdir -p {MODEL_DIR} /etc/kvfleet",
        )
        if nvme:
            ud.add_commands(
                "# Local NVMe (instance store) holds the weights: faster than EBS, and free.",
                "DEVS=$(lsblk -dpno NAME,MODEL | awk '/Instance Storage/ {print $1}')",
                'if [ -n "$DEVS" ]; then',
                '  if [ "$(echo "$DEVS" | wc -l)" -gt 1 ]; then',
                '    mdadm --create /dev/md0 --run --level=0 --raid-devices=$(echo "$DEVS" | wc -l) $DEVS',
                "    DEV=/dev/md0",
                '  else DEV="$DEVS"; fi',
                f'  mkfs.xfs -f "$DEV" && mount "$DEV" {MODEL_DIR}',
                "fi",
            )
        ud.add_commands(f"chown 10001:10001 {MODEL_DIR}")
        if d.model.s3_uri:
            ud.add_commands(f"aws s3 sync --only-show-errors {shlex.quote(d.model.s3_uri)} {MODEL_DIR}")
        ud.add_commands(
            f"cat > /etc/kvfleet/env <<'KVFLEET_ENV'\n{env_lines}\nKVFLEET_ENV",
            f'echo "{contract.ENV_ASG_NAME}=$GROUP" >> /etc/kvfleet/env',
            f'echo "{contract.ENV_LIFECYCLE_HOOK}={LIFECYCLE_HOOK}" >> /etc/kvfleet/env',
            f'echo "{contract.ENV_LIFECYCLE_HEARTBEAT_S}={HEARTBEAT_S}" >> /etc/kvfleet/env',
            'echo "AWS_REGION=$REGION" >> /etc/kvfleet/env',
            f"IMAGE={image}",
            'aws ecr get-login-password --region "$REGION" '
            '| docker login --username AWS --password-stdin "${IMAGE%%/*}"',
            'docker pull "$IMAGE"',
            # A container, started by systemd at every boot: an instance that comes out of a stopped warm
            # pool starts serving without re-running this script.
            "docker create --name kvfleet --gpus all "
            f"--shm-size {target.shm_size_gib}g -p {SERVING_PORT}:{SERVING_PORT} "
            f"--stop-timeout {d.scaling.drain_budget_s + 30} "
            f'--log-driver awslogs --log-opt awslogs-region="$REGION" '
            f"--log-opt awslogs-group={self.log_group.log_group_name} "
            '--log-opt awslogs-stream="$INSTANCE_ID" '
            f'--env-file /etc/kvfleet/env {mount} "$IMAGE" serve',
            "cat > /etc/systemd/system/kvfleet.service <<'KVFLEET_UNIT'\n"
            "[Unit]\nDescription=kvfleet serving container\nAfter=docker.service\nRequires=docker.service\n"
            f"[Service]\nExecStart=/usr/bin/docker start -a kvfleet\nExecStop=/usr/bin/docker stop kvfleet\n"
            f"TimeoutStopSec={d.scaling.drain_budget_s + 60}\nRestart=always\nRestartSec=5\n"
            "[Install]\nWantedBy=multi-user.target\nKVFLEET_UNIT",
            "systemctl daemon-reload && systemctl enable kvfleet.service",
            "STATE=$(imds meta-data/autoscaling/target-lifecycle-state || echo InService)",
            # Going into the warm pool: ready on disk, not loaded on the GPU.
            'case "$STATE" in Warmed:*) ;; *) systemctl start kvfleet.service ;; esac',
        )
        if target.warm_pool.enabled:
            ud.add_commands(
                'aws autoscaling complete-lifecycle-action --region "$REGION" '
                f'--lifecycle-hook-name {WARM_HOOK} --auto-scaling-group-name "$GROUP" '
                '--instance-id "$INSTANCE_ID" --lifecycle-action-result CONTINUE',
            )
        return ud
