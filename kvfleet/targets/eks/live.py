"""`kvfleet check` on EKS: the cluster and the node group are ACTIVE with no health issues. The Service is ClusterIP,
so a generation needs access inside the cluster (``kubectl port-forward`` and ``kvfleet bench``); that is said, not
claimed."""

from __future__ import annotations

from kvfleet.bench.live import Check, Deployed
from kvfleet.targets.eks import CLUSTER_OUTPUT, TARGET


def run(d: Deployed, check: Check) -> None:
    cluster, nodegroup = d.outputs[CLUSTER_OUTPUT], d.outputs[TARGET.group_output or ""]
    eks = d.session.client("eks")
    status = eks.describe_cluster(name=cluster)["cluster"].get("status")
    if status != "ACTIVE":
        check.fail(f"cluster {cluster} is {status}")
        return
    group = eks.describe_nodegroup(clusterName=cluster, nodegroupName=nodegroup)["nodegroup"]
    issues = group.get("health", {}).get("issues", [])
    if group.get("status") != "ACTIVE" or issues:
        said = "; ".join(f"{i.get('code')}: {i.get('message')}" for i in issues[:3])
        check.fail(f"node group {nodegroup} is {group.get('status')}" + (f" ({said})" if said else ""))
        return
    size = group.get("scalingConfig", {}).get("desiredSize")
    check.ok(f"cluster {cluster} and node group {nodegroup} are ACTIVE ({size} node(s) desired)")
    check.note(
        "no generation is sent: the Service is ClusterIP; kubectl port-forward to it and run kvfleet bench there"
    )
