"""EC2: a GPU Auto Scaling group behind an Application Load Balancer.

Its parts: ``config`` (the ``target:`` section: load balancer, warm pool, AMI; and its checks), ``infra`` (the fleet
construct, the instances' user data and lifecycle hooks, the AMI's driver), ``live`` (`kvfleet check`: the group's
health, and a generation and the KV cache on one instance through Run Command), ``pipeline`` (the live-check role's
grants).
"""

from __future__ import annotations

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.targets import Target

# The stack output naming the Run Command document `kvfleet check` sends an instance (infra/probe.py).
PROBE_OUTPUT = "ProbeDocument"

TARGET = Target(
    name="ec2",
    summary="an EC2 GPU Auto Scaling group behind a load balancer",
    # One engine per instance, so that the group's capacity, its scaling policies' steps and each instance's drain
    # hook all count replicas; packing engines would need a port and a target group per engine (a forward action
    # takes at most 5) and one drain across them. The target group's load_balancing.algorithm.type is
    # least_outstanding_requests (kvfleet.targets.ec2.infra.fleet).
    hosting=Hosting(price_list=PriceList.EC2, one_engine_per_instance=True, routing=Routing.LEAST_OUTSTANDING),
    autoscaler=AutoscalerKind.EC2,
    address_output="LoadBalancerDns",
    group_output="AutoScalingGroupName",
    warm_pools=True,
)
