"""Each target routes as kvfleet.targets declares (Hosting.routing, what the planner sizes for), read back from what
kvfleet deploys: the synthesized template or the Kubernetes manifests, through readings of the services' own
settings that these tests keep apart from the constructs' tables."""

from __future__ import annotations

from collections.abc import Callable

from kvfleet.deployments import resolve_environment
from kvfleet.sizing.hosting import Routing
from kvfleet.targets import TARGETS
from kvfleet.targets.eks.infra import manifests as k8s
from tests.infra.ec2.envs import EC2_ENV
from tests.infra.helpers import REPO, SAGEMAKER_ENV, environment, only, props

# ProductionVariantRoutingConfig RoutingStrategy; without a RoutingConfig SageMaker routes at random
# (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_ProductionVariantRoutingConfig.html).
SAGEMAKER_STRATEGIES = {"LEAST_OUTSTANDING_REQUESTS": Routing.LEAST_OUTSTANDING, "RANDOM": Routing.RANDOM}
# Target group attribute load_balancing.algorithm.type, round_robin when unset
# (https://docs.aws.amazon.com/elasticloadbalancing/latest/application/edit-target-group-attributes.html).
ALB_ALGORITHMS = {
    "round_robin": Routing.ROUND_ROBIN,
    "least_outstanding_requests": Routing.LEAST_OUTSTANDING,
    "weighted_random": Routing.RANDOM,
}
# What a ClusterIP Service's spec may hold without changing how kube-proxy picks an endpoint: at random per
# connection in iptables mode, EKS's default (no sessionAffinity pinning a client, no traffic policy).
PLAIN_SERVICE_SPEC = {"type", "selector", "ports"}


def sagemaker_routing() -> Routing:
    [config] = props(only(SAGEMAKER_ENV), "AWS::SageMaker::EndpointConfig")
    [variant] = config["ProductionVariants"]
    return SAGEMAKER_STRATEGIES[variant.get("RoutingConfig", {}).get("RoutingStrategy", "RANDOM")]


def ec2_routing() -> Routing:
    [tg] = props(only(EC2_ENV), "AWS::ElasticLoadBalancingV2::TargetGroup")
    attrs = {a["Key"]: a["Value"] for a in tg.get("TargetGroupAttributes", [])}
    return ALB_ALGORITHMS[attrs.get("load_balancing.algorithm.type", "round_robin")]


def eks_routing() -> Routing:
    [r] = resolve_environment(environment((REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")))
    opts = k8s.WorkloadOptions(
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:0.30.0",
        prometheus_server_address="http://prometheus-server.monitoring.svc:9090",
    )
    [svc] = [m for m in k8s.manifests(r, opts) if m["kind"] == "Service"]
    spec = svc["spec"]
    assert spec["type"] == "ClusterIP" and set(spec) <= PLAIN_SERVICE_SPEC, spec
    return Routing.RANDOM


DEPLOYED: dict[str, Callable[[], Routing]] = {
    "sagemaker": sagemaker_routing,
    "ec2": ec2_routing,
    "eks": eks_routing,
}


def test_every_target_routes_as_its_hosting_declares() -> None:
    assert sorted(DEPLOYED) == sorted(TARGETS)
    deployed = {name: read() for name, read in DEPLOYED.items()}
    assert deployed == {name: t.hosting.routing for name, t in TARGETS.items()}
