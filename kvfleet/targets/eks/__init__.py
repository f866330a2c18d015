"""EKS: a GPU node group and a Deployment, in a new cluster or an existing one.

Its parts: ``config`` (the ``target:`` section: cluster, add-ons, Kubernetes version, namespace; and the checks
deployments sharing a cluster need), ``infra`` (the service construct: cluster, add-ons, node group, manifests),
``live`` (`kvfleet check`: the cluster's and the node group's status), ``pipeline`` (the live-check role's grants).
"""

from __future__ import annotations

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.targets import Target

# The stack output naming the cluster, beside the node group's (`kvfleet check` reads both).
CLUSTER_OUTPUT = "ClusterName"

TARGET = Target(
    name="eks",
    summary="a GPU node group and Deployment on EKS",
    # EC2 instances in a Kubernetes node group: any EC2 GPU type, several engines (pods) per instance when the model
    # needs fewer GPUs than the instance has. A ClusterIP Service: kube-proxy (iptables mode, EKS's default) picks an
    # endpoint at random for each connection.
    hosting=Hosting(price_list=PriceList.EC2, routing=Routing.RANDOM),
    autoscaler=AutoscalerKind.HPA,
    group_output="NodegroupName",
    no_scale_to_zero="KEDA scales on the pods' own signals, and with no pod there is none to wake on",
)
