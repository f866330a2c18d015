"""The deployment targets kvfleet knows: name -> hosting shape. The one registry of target names.

Standard library, the pure sizing core and the autoscaler kinds only, so the ``kvfleet`` command reads it without
loading the config schema or CDK. Each name here has a config class in ``kvfleet.config.targets`` and a construct in
``kvfleet.infra`` (tests check that the three agree).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    summary: str
    hosting: Hosting
    # The autoscaler the target's stacks render and the fleet simulator runs (kvfleet.scaling): Application Auto
    # Scaling target tracking (SageMaker), EC2 Auto Scaling policies (EC2), KEDA's HPA (EKS).
    autoscaler: AutoscalerKind
    # The stack output that says where clients reach the deployment (the construct's ``outputs`` key; `kvfleet
    # bench --env` reads it back from CloudFormation): SageMaker's endpoint name, the EC2 load balancer's DNS name.
    # None: no address outside the cluster (EKS's Service is ClusterIP).
    address_output: str | None = None
    # The stack output naming the group of machines that serves it (`kvfleet check` reads their health from it):
    # the EC2 Auto Scaling group, the EKS node group. None: the endpoint's own status says it (SageMaker).
    group_output: str | None = None
    # Why the target cannot scale to zero (scaling.min_replicas 0); None where it can.
    no_scale_to_zero: str | None = None


# EC2 instances in a Kubernetes node group: any EC2 GPU type, several engines (pods) per instance when the model
# needs fewer GPUs than the instance has.
# A ClusterIP Service: kube-proxy (iptables mode, EKS's default) picks an endpoint at random for each connection.
_FLEET = Hosting(price_list=PriceList.EC2, routing=Routing.RANDOM)
# An Auto Scaling group behind a load balancer: one engine per instance, so that the group's capacity, its
# scaling policies' steps and each instance's drain hook all count replicas; packing engines would need a
# port and a target group per engine (a forward action takes at most 5) and one drain across them.
# The target group's load_balancing.algorithm.type is least_outstanding_requests (kvfleet.infra.ec2.fleet).
_EC2 = Hosting(price_list=PriceList.EC2, one_engine_per_instance=True, routing=Routing.LEAST_OUTSTANDING)

TARGETS: Mapping[str, Target] = {
    t.name: t
    for t in (
        Target(
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
                # ProductionVariant RoutingConfig LEAST_OUTSTANDING_REQUESTS (kvfleet.infra.sagemaker.endpoint).
                routing=Routing.LEAST_OUTSTANDING,
                wider=_FLEET,
                wider_label="platform ec2 or eks (more instance types)",
            ),
            autoscaler=AutoscalerKind.TARGET_TRACKING,
            address_output="EndpointName",
            # Application Auto Scaling takes a variant to zero only for endpoints built from inference components
            # (SageMaker Developer Guide, "Scale an endpoint to zero instances"); kvfleet deploys variants.
            no_scale_to_zero="a real-time endpoint's production variant keeps at least one instance",
        ),
        Target(
            name="ec2",
            summary="an EC2 GPU Auto Scaling group behind a load balancer",
            hosting=_EC2,
            autoscaler=AutoscalerKind.EC2,
            address_output="LoadBalancerDns",
            group_output="AutoScalingGroupName",
        ),
        Target(
            name="eks",
            summary="a GPU node group and Deployment on EKS",
            hosting=_FLEET,
            autoscaler=AutoscalerKind.HPA,
            group_output="NodegroupName",
            no_scale_to_zero="KEDA scales on the pods' own signals, and with no pod there is none to wake on",
        ),
    )
}


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}") from None
