"""One stack per deployment: it composes the network, the target's construct and the monitoring."""

from __future__ import annotations

from aws_cdk import CfnOutput, Environment, Stack, Tags
from constructs import Construct

from stacks.config import Ec2Target, EksTarget, SageMakerTarget
from stacks.ec2_fleet import Ec2Fleet
from stacks.eks_service import EksService
from stacks.monitoring import PlatformMetrics, ServingMonitoring
from stacks.network import ServingNetwork
from stacks.resolve import ResolvedDeployment
from stacks.sagemaker_endpoint import SageMakerEndpoint


class DeploymentStack(Stack):
    def __init__(self, scope: Construct, id: str, *, resolved: ResolvedDeployment) -> None:
        r = resolved
        env_cfg = r.environment
        explicit = env_cfg.account is not None and env_cfg.region is not None
        super().__init__(
            scope,
            id,
            env=Environment(account=env_cfg.account, region=env_cfg.region) if env_cfg.region else None,
            description=(
                f"kvfleet {r.deployment_id}: {r.model_id} on {r.candidate.label()} with {r.engine} "
                f"{r.deployment.engine.version}"
            ),
        )
        for key, value in (
            ("kvfleet:environment", env_cfg.name),
            ("kvfleet:deployment", r.deployment.name),
            ("kvfleet:model", r.model_id),
        ):
            Tags.of(self).add(key, value)

        target = r.deployment.target
        network = ServingNetwork(
            self,
            "Network",
            config=env_cfg.network,
            region=env_cfg.region if explicit else None,
            fleet=isinstance(target, Ec2Target),
        )
        self.network = network
        # The signal alarms come first: a SageMaker endpoint's update rolls back on them.
        self.monitoring = ServingMonitoring(
            self,
            "Monitoring",
            deployment_id=r.deployment_id,
            scaling=r.deployment.scaling,
            signals_published=r.deployment.image.source != "dlc",
        )
        platform: PlatformMetrics
        if isinstance(target, Ec2Target):
            self.fleet = Ec2Fleet(self, "Fleet", resolved=r, target=target, network=network, region=env_cfg.region)
            platform = self.fleet.platform_metrics
            CfnOutput(self, "LoadBalancerDns", value=self.fleet.load_balancer.load_balancer_dns_name)
        elif isinstance(target, EksTarget):
            self.eks = EksService(self, "Eks", resolved=r, target=target, network=network, region=env_cfg.region)
            platform = PlatformMetrics()  # replicas counted from their signals
            CfnOutput(self, "ClusterName", value=self.eks.cluster.cluster_name)
        else:
            assert isinstance(target, SageMakerTarget)
            self.endpoint = SageMakerEndpoint(
                self,
                "Endpoint",
                resolved=r,
                target=target,
                vpc_subnets=network.subnet_ids,
                security_group=network.security_group,
                region=env_cfg.region,
                rollback_alarms=list(self.monitoring.rollback_alarms),
            )
            platform = self.endpoint.platform_metrics
            CfnOutput(self, "EndpointName", value=self.endpoint.endpoint_name)
        dashboard = self.monitoring.add_dashboard(platform)
        CfnOutput(self, "Dashboard", value=dashboard.dashboard_name)
