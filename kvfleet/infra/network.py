"""Where replicas run: a new VPC with private subnets and endpoints, or an existing VPC from the config.

No lookups at synth: an existing VPC is described by ids and AZs in the config, a new one takes its AZs
from the config or, for an environment-agnostic stack, from Fn::GetAZs at deploy time.
"""

from __future__ import annotations

from aws_cdk import Annotations, CfnResource, RemovalPolicy, Stack, Token
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

from kvfleet.config.schema import NetworkConfig

VPC_CIDR = "10.64.0.0/16"


def named_zones(config: NetworkConfig, region: str | None) -> list[str] | None:
    """The AZs a new VPC uses: the file's, or for a stack with a concrete account and region (which would look them
    up at synth) the region's first ``max_azs`` by name; None: Fn::GetAZs at deploy time."""
    if config.availability_zones:
        return list(config.availability_zones)
    if region is None:
        return None
    return [f"{region}{letter}" for letter in "abcdef"[: config.max_azs]]


def zones_context(stack: Stack, config: NetworkConfig, region: str | None) -> None:
    """Tell CDK the stack's AZs before anything asks for them. With a concrete account and region, ec2.Vpc
    checks the AZs it is given against ``Stack.availability_zones``, which is a context lookup (an AWS call
    at synth, through the account's lookup role); the zones kvfleet names are then the stack's zones."""
    zones = named_zones(config, region)
    if zones is None or config.vpc_id is not None or Token.is_unresolved(stack.account):
        return
    stack.node.set_context(f"availability-zones:account={stack.account}:region={region}", zones)


class ServingNetwork(Construct):
    """A VPC, private subnets for the serving instances and a security group for them."""

    def __init__(
        self, scope: Construct, id: str, *, config: NetworkConfig, region: str | None, fleet: bool = False
    ) -> None:
        super().__init__(scope, id)
        self.vpc: ec2.IVpc
        self.cidr: str | None
        if config.vpc_id is not None:
            self._import_vpc(config, config.vpc_id)
        else:
            self._new_vpc(config, region, fleet=fleet)

        self.security_group = ec2.SecurityGroup(
            self,
            "ServingSecurityGroup",
            vpc=self.vpc,
            description="kvfleet serving replicas",
            allow_all_outbound=True,  # model download (S3 / Hugging Face), ECR, logs and metrics
        )
        if config.vpc_id is None:
            self.endpoint_security_group.add_ingress_rule(
                self.security_group, ec2.Port.tcp(443), "HTTPS from the serving replicas"
            )

    def _import_vpc(self, config: NetworkConfig, vpc_id: str) -> None:
        """The existing VPC the config names, by its ids and AZs (no lookup)."""
        self.vpc = ec2.Vpc.from_vpc_attributes(
            self,
            "Vpc",
            vpc_id=vpc_id,
            availability_zones=list(config.availability_zones),
            private_subnet_ids=list(config.private_subnet_ids),
        )
        for subnet in self.vpc.private_subnets:
            # CDK warns that route tables of imported subnets are unknown; kvfleet adds no routes to an
            # existing VPC (no gateway endpoints, no NAT), so nothing reads them.
            Annotations.of(subnet).acknowledge_warning(
                "@aws-cdk/aws-ec2:noSubnetRouteTableId", "kvfleet adds no routes to an existing VPC"
            )
        self.subnet_ids = list(config.private_subnet_ids)
        self.cidr = None  # not looked up: callers that need it ask the config
        self.subnet_selection = ec2.SubnetSelection(subnets=self.vpc.private_subnets)

    def _new_vpc(self, config: NetworkConfig, region: str | None, *, fleet: bool) -> None:
        """A new VPC with flow logs, the S3 gateway endpoint and the interface endpoints the replicas call."""
        azs = named_zones(config, region)
        vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(VPC_CIDR),
            max_azs=None if azs else config.max_azs,
            availability_zones=azs,
            nat_gateways=config.nat_gateways,
            subnet_configuration=_subnet_configuration(config),
            restrict_default_security_group=True,
        )
        flow_logs = logs.LogGroup(
            self, "FlowLogs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
        )
        vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs))
        # Image layers, S3 model data, logs and metrics stay off the NAT gateway (and work without one).
        vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        self._add_interface_endpoints(vpc, fleet=fleet)
        if azs is not None:
            _ignore_named_zones(vpc)
        self.vpc = vpc
        self.subnet_ids = vpc.select_subnets(subnet_group_name="serving").subnet_ids
        self.cidr = VPC_CIDR
        self.subnet_selection = ec2.SubnetSelection(subnet_group_name="serving")

    def _add_interface_endpoints(self, vpc: ec2.Vpc, *, fleet: bool) -> None:
        # Only the serving replicas reach the interface endpoints (not the whole VPC CIDR).
        self.endpoint_security_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=vpc,
            description="kvfleet VPC interface endpoints",
            allow_all_outbound=False,
        )
        for name, svc in _interface_endpoints(fleet=fleet):
            vpc.add_interface_endpoint(
                name,
                service=svc,
                private_dns_enabled=True,
                open=False,
                security_groups=[self.endpoint_security_group],
            )


def _subnet_configuration(config: NetworkConfig) -> list[ec2.SubnetConfiguration]:
    """Public subnets only for the NAT gateways; the serving subnets reach out through them, else nowhere."""
    if not config.nat_gateways:
        return [ec2.SubnetConfiguration(name="serving", subnet_type=ec2.SubnetType.PRIVATE_ISOLATED, cidr_mask=20)]
    return [
        ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),
        ec2.SubnetConfiguration(name="serving", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=20),
    ]


def _interface_endpoints(*, fleet: bool) -> list[tuple[str, ec2.InterfaceVpcEndpointAwsService]]:
    endpoints = [
        ("EcrApi", ec2.InterfaceVpcEndpointAwsService.ECR),
        ("EcrDocker", ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER),
        ("Logs", ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS),
        ("Monitoring", ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING),
        ("SecretsManager", ec2.InterfaceVpcEndpointAwsService.SECRETS_MANAGER),
    ]
    if fleet:
        # Instances of a fleet: Session Manager, and the lifecycle calls of the draining agent.
        endpoints += [
            ("Ssm", ec2.InterfaceVpcEndpointAwsService.SSM),
            ("SsmMessages", ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES),
            ("Ec2Messages", ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES),
            ("AutoScaling", ec2.InterfaceVpcEndpointAwsService.AUTOSCALING),
        ]
    return endpoints


def _ignore_named_zones(vpc: ec2.Vpc) -> None:
    """cfn-lint's W3010 ("avoid hardcoding availability zones") prefers Fn::GetAZs; a stack with a concrete account
    and region names its zones instead of looking them up at synth (no AWS calls there), and the file's
    availability_zones chooses them. Ignored on these subnets only."""
    for subnet in (*vpc.public_subnets, *vpc.private_subnets, *vpc.isolated_subnets):
        child = subnet.node.default_child
        assert isinstance(child, CfnResource)
        child.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3010"]}})
