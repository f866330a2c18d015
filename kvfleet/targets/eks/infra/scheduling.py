"""Where each workload the EKS stack installs can run: its pods' tolerations, node selector and required node
affinity against the node groups' taints and labels, read the way the Kubernetes scheduler reads them.

Pure data and functions (no aws_cdk). The EKS construct describes its node groups as ``NodePool``s and every
workload it installs (the charts' Deployments and DaemonSets, CoreDNS, the serving pods) as a ``Placement``, and
``check_placements`` refuses the stack when one of them has no node group it can schedule on: a GPU-only cluster
whose nodes are tainted leaves CoreDNS, KEDA and Prometheus Pending for ever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.targets.eks.infra.checks import tolerates

# One matchExpression of a nodeSelectorTerm: key, operator (In, NotIn, Exists, DoesNotExist), values.
Requirement = tuple[str, str, tuple[str, ...]]

# The labels the kubelet puts on every node (kubernetes.io/docs/reference/labels-annotations-taints/:
# kubernetes.io/os, kubernetes.io/arch, node.kubernetes.io/instance-type).
OS_LABEL = "kubernetes.io/os"
ARCH_LABEL = "kubernetes.io/arch"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def kubelet_labels(instance_type: str, *, arch: str = "amd64") -> dict[str, str]:
    """The well-known labels of a Linux node of this instance type (the x86_64 EKS AMIs: amd64)."""
    return {OS_LABEL: "linux", ARCH_LABEL: arch, INSTANCE_TYPE_LABEL: instance_type}


@dataclass(frozen=True, kw_only=True)
class NodePool:
    """A node group as the scheduler sees it."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Mapping[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Placement:
    """What a workload's pods ask of a node, and where that was read."""

    workload: str
    source: str
    tolerations: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    # requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: any one term, all of its expressions.
    affinity: tuple[tuple[Requirement, ...], ...] = ()


def affinity_terms(affinity: Mapping[str, Any] | None) -> tuple[tuple[Requirement, ...], ...]:
    """The required node-affinity terms of a pod's ``affinity`` (preferred terms do not block scheduling)."""
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = (required or {}).get("nodeSelectorTerms") or []
    return tuple(
        tuple(
            (str(e["key"]), str(e["operator"]), tuple(str(v) for v in e.get("values") or ()))
            for e in t.get("matchExpressions") or []
        )
        for t in terms
    )


def pod_placement(workload: str, source: str, pod: Mapping[str, Any]) -> Placement:
    """A pod spec's scheduling constraints."""
    return Placement(
        workload=workload,
        source=source,
        tolerations=tuple(pod.get("tolerations") or ()),
        node_selector=dict(pod.get("nodeSelector") or {}),
        affinity=affinity_terms(pod.get("affinity")),
    )


def why_not(p: Placement, pool: NodePool) -> list[str]:
    """Why the workload's pods cannot schedule on the pool; empty: they can.

    A NoSchedule or NoExecute taint needs a toleration (PreferNoSchedule only steers); every nodeSelector entry
    must equal a node label; with required node affinity, one term must have all its expressions hold."""
    reasons = []
    for taint in pool.taints:
        if taint.get("effect") != "PreferNoSchedule" and not any(tolerates(t, taint) for t in p.tolerations):
            reasons.append(f"taint {taint.get('key')}={taint.get('value') or ''}:{taint.get('effect')} not tolerated")
    for k, v in p.node_selector.items():
        if pool.labels.get(k) != v:
            reasons.append(f"nodeSelector {k}={v} (node has {k}={pool.labels.get(k)})")
    if p.affinity and not any(all(_holds(r, pool.labels) for r in term) for term in p.affinity):
        reasons.append("no required node-affinity term matches the node labels")
    return reasons


def check_placements(placements: Sequence[Placement], pools: Sequence[NodePool]) -> list[str]:
    """One problem per workload that fits no node pool, with the reason for each pool."""
    problems = []
    for p in placements:
        reasons = {pool.name: why_not(p, pool) for pool in pools}
        if pools and all(reasons.values()):
            shown = "; ".join(f"{name}: {', '.join(r)}" for name, r in reasons.items())
            problems.append(f"{p.workload} ({p.source}) fits no node group and stays Pending: {shown}")
        elif not pools:
            problems.append(f"{p.workload} ({p.source}): the cluster has no node group")
    return problems


def _holds(r: Requirement, labels: Mapping[str, str]) -> bool:
    key, op, values = r
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # Gt / Lt: not used by anything installed here; refuse rather than guess
