"""EC2: a GPU Auto Scaling group behind an Application Load Balancer.

Its parts: ``config`` (the ``target:`` section: load balancer, warm pool, AMI; and its checks), ``infra`` (the fleet
construct, the instances' user data and lifecycle hooks, the AMI's driver), ``live`` (`kvfleet check`: the group's
health, and the agent's health and KV cache on one instance through the fleet's probe document), ``pipeline``
(the live-check role's grants).
"""

from __future__ import annotations

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.targets import Target

# The stack output naming the Run Command document `kvfleet check` sends an instance (infra/probe.py).
PROBE_OUTPUT = "ProbeDocument"
# The marker lines the document prints before each thing it reads, which the check reads its output by.
PROBE_MARK = "kvfleet-check"


def read_probe(text: str) -> tuple[int | None, str]:
    """(/ping's status, the /metrics lines) from the probe document's output (infra/probe.py)."""
    ping: int | None = None
    metrics: list[str] = []
    in_metrics = False
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if in_metrics:
            metrics.append(line)
        elif word == f"{PROBE_MARK}-ping":
            ping = int(rest) if rest.strip().isdigit() else None
        elif word == f"{PROBE_MARK}-metrics":
            in_metrics = True
    return ping or None, "\n".join(metrics)


# An application load balancer's forward action takes at most this many target groups ("Target groups per action:
# 5", Elastic Load Balancing User Guide for Application Load Balancers, "Quotas for your Application Load
# Balancers"; ForwardConfig in "Listener rules"). With several engines per instance each engine slot is a target
# group on its own port (an Auto Scaling group registers every instance on each of its target groups' port,
# AWS::AutoScaling::AutoScalingGroup TargetGroupARNs), so this bounds the engines on one instance.
MAX_TARGET_GROUPS_PER_ACTION = 5
TARGET_GROUPS_SOURCE = "https://docs.aws.amazon.com/elasticloadbalancing/latest/application/load-balancer-limits.html"

# With `target.pack_engines`: instance GPUs / engine GPUs engines on each instance, one target group per engine slot
# behind one weighted forward action (kvfleet.targets.ec2.infra.fleet). Each slot's group routes by least
# outstanding requests among its engines; the forward action splits by equal weight between the slots, so the fleet
# queues as that many pools rather than one.
PACKED = Hosting(
    price_list=PriceList.EC2,
    max_engines_per_instance=MAX_TARGET_GROUPS_PER_ACTION,
    routing=Routing.LEAST_OUTSTANDING,
)

TARGET = Target(
    name="ec2",
    summary="an EC2 GPU Auto Scaling group behind a load balancer",
    # One engine per instance by default, so that the group's capacity, its scaling policies' steps and each
    # instance's drain hook all count replicas; `target.pack_engines` asks for PACKED instead. The target group's
    # load_balancing.algorithm.type is least_outstanding_requests (kvfleet.targets.ec2.infra.fleet).
    hosting=Hosting(price_list=PriceList.EC2, one_engine_per_instance=True, routing=Routing.LEAST_OUTSTANDING),
    autoscaler=AutoscalerKind.EC2,
    address_output="LoadBalancerDns",
    group_output="AutoScalingGroupName",
    warm_pools=True,
)
