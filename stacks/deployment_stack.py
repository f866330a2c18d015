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
        signals_published = r.deployment.image.source != "dlc"
        self.network = network
        if isinstance(target, Ec2Target):
            monitoring = ServingMonitoring(
                self,
                "Monitoring",
                deployment_id=r.deployment_id,
                scaling=r.deployment.scaling,
                signals_published=signals_published,
            )
            fleet = Ec2Fleet(self, "Fleet", resolved=r, target=target, network=network, region=env_cfg.region)
            dashboard = monitoring.add_dashboard(fleet.platform_metrics)
            CfnOutput(self, "LoadBalancerDns", value=fleet.load_balancer.load_balancer_dns_name)
            CfnOutput(self, "Dashboard", value=dashboard.dashboard_name)
            self.fleet = fleet
            self.monitoring = monitoring
            return
        if isinstance(target, EksTarget):
            monitoring = ServingMonitoring(
                self,
                "Monitoring",
                deployment_id=r.deployment_id,
                scaling=r.deployment.scaling,
                signals_published=signals_published,
            )
            service = EksService(self, "Eks", resolved=r, target=target, network=network, region=env_cfg.region)
            dashboard = monitoring.add_dashboard(PlatformMetrics())
            CfnOutput(self, "ClusterName", value=service.cluster.cluster_name)
            CfnOutput(self, "Dashboard", value=dashboard.dashboard_name)
            self.eks = service
            self.monitoring = monitoring
            return
        assert isinstance(target, SageMakerTarget)

        # The signal alarms come first: the endpoint's update rolls back on them.
        monitoring = ServingMonitoring(
            self,
            "Monitoring",
            deployment_id=r.deployment_id,
            scaling=r.deployment.scaling,
            signals_published=signals_published,
        )
        endpoint = SageMakerEndpoint(
            self,
            "Endpoint",
            resolved=r,
            target=target,
            vpc_subnets=network.subnet_ids,
            security_group=network.security_group,
            region=env_cfg.region,
            rollback_alarms=list(monitoring.rollback_alarms),
        )
        dashboard = monitoring.add_dashboard(endpoint.platform_metrics)
        CfnOutput(self, "EndpointName", value=endpoint.endpoint_name)
        CfnOutput(self, "Dashboard", value=dashboard.dashboard_name)
        self.endpoint = endpoint
        self.monitoring = monitoring
        self.network = network
