"""kvfleet's access to an existing cluster confined to its namespace (target.cluster.access: namespace): what EKS's
namespace-scoped access policy lets the kubectl function apply, what it does not (KEDA's ScaledObject), and the
one-time RBAC the cluster's owner applies for the rest.

Pure data and functions (no aws_cdk): the EKS construct reads them, synth refuses a workload the grants do not
cover, and the tests validate the rendered RBAC offline.

Why the owner applies the RBAC, not kvfleet: EKS's access policies hold no custom resource group (EKS User Guide,
"Review access policy permissions": AmazonEKSEditPolicy and AmazonEKSAdminPolicy list no keda.sh rule), and Kubernetes
lets nobody create a Role, or bind one, granting what they do not hold themselves without the escalate or bind verb
(Kubernetes docs, "Using RBAC Authorization", "Privilege escalation prevention and bootstrapping"). So even
AmazonEKSAdminPolicy, which may create Roles and RoleBindings in the namespace, could not grant keda.sh: the Edit
policy is enough, and the access entry names a Kubernetes group the owner's RoleBinding binds (EKS User Guide,
"Create access entries": group names on a STANDARD entry are authorized by RBAC objects naming them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

# The access policy the kubectl function's entry gets, scoped to the deployment's namespace.
NAMESPACE_POLICY = "AmazonEKSEditPolicy"
# Its rules that let kubectl write (EKS User Guide, "Review access policy permissions", AmazonEKSEditPolicy, read
# 2026-12): (API group, resources, verbs), the write rules with the reads of the same resources, and namespaces read
# only. Subresources (deployments/scale, pods/exec, ...) are left out: kvfleet applies none.
EDIT_POLICY_SOURCE = 'EKS User Guide, "Review access policy permissions", AmazonEKSEditPolicy'
_WRITE = frozenset({"create", "delete", "deletecollection", "patch", "update"})
_READ = frozenset({"get", "list", "watch"})
EDIT_POLICY_RULES: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    ("apps", frozenset({"daemonsets", "deployments", "replicasets", "statefulsets"}), _WRITE | _READ),
    ("autoscaling", frozenset({"horizontalpodautoscalers"}), _WRITE | _READ),
    ("batch", frozenset({"cronjobs", "jobs"}), _WRITE | _READ),
    ("networking.k8s.io", frozenset({"ingresses", "networkpolicies"}), _WRITE | _READ),
    ("policy", frozenset({"poddisruptionbudgets"}), _WRITE | _READ),
    (
        "",
        frozenset(
            {"configmaps", "persistentvolumeclaims", "pods", "replicationcontrollers", "secrets"}
            | {"serviceaccounts", "services"}
        ),
        _WRITE | _READ,
    ),
    ("", frozenset({"namespaces"}), _READ),
)
# What aws-cdk-lib 2.275.0's kubectl handler runs on a manifest (custom-resource-handlers aws-eks-v2
# kubectl-handler/apply/__init__.py): `kubectl create --save-config` (or `apply` with overwrite) on Create, `apply` on
# Update, `delete` on Delete; kubectl's client-side apply reads the object and patches it, or creates it.
KUBECTL_VERBS = frozenset({"create", "get", "patch", "delete"})

# The resource each kind kvfleet applies is served as (the Kubernetes API reference; KEDA's CRD
# config/crd/bases/keda.sh_scaledobjects.yaml names the plural scaledobjects).
RESOURCES: Mapping[str, tuple[str, str]] = {
    "Namespace": ("", "namespaces"),  # cluster-scoped: the Edit policy only reads it
    "Deployment": ("apps", "deployments"),
    "Service": ("", "services"),
    "ServiceAccount": ("", "serviceaccounts"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
    "ScaledObject": ("keda.sh", "scaledobjects"),
}
# What the owner's Role grants beyond the policy: KEDA's ScaledObject, with kubectl's verbs and the reads.
OWNER_RULES: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    ("keda.sh", frozenset({"scaledobjects"}), KUBECTL_VERBS | _READ | {"update"}),
)
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvfleet"}
# Why the manifests are applied without kubectl's prune under namespace access: aws-cdk-lib 2.275.0's handler runs
# `kubectl apply --prune -l <label>` on every Update with no --prune-allowlist, and kubectl 1.34 then lists its
# default allow-list, whose cluster-scoped kinds it lists across the cluster (kubernetes/kubectl v0.34.10
# pkg/util/prune/prune.go defaultNonNamespacedPruneResources; pkg/cmd/apply/prune.go pruneAll), which a
# namespace-scoped identity may not: every update would fail. Each manifest holds one object of a fixed name, so
# prune had nothing to remove (an object dropped from the workload is its own resource, deleted by CloudFormation).
PRUNE_CLUSTER_SCOPED_DEFAULTS = frozenset({"Namespace", "PersistentVolume"})


def scaler_group(namespace: str) -> str:
    """The Kubernetes group the access entry names and the owner's RoleBinding binds: free text to EKS, kept off the
    system: prefix Kubernetes reserves (Kubernetes docs, "Using RBAC Authorization", "Default roles and role
    bindings")."""
    return f"kvfleet-{namespace}-scalers"


def _allowed(rules: Iterable[tuple[str, frozenset[str], frozenset[str]]], group: str, resource: str) -> set[str]:
    return {v for g, resources, verbs in rules if g == group and resource in resources for v in verbs}


def uncovered(kinds: Iterable[str], *, with_owner_rbac: bool = True) -> list[str]:
    """One problem per kind kvfleet applies that neither the namespace policy nor (with_owner_rbac) the owner's Role
    lets kubectl create, read, patch and delete."""
    rules = EDIT_POLICY_RULES + (OWNER_RULES if with_owner_rbac else ())
    problems = []
    for kind in sorted(set(kinds)):
        if kind not in RESOURCES:
            problems.append(f"{kind}: kvfleet does not know which resource serves it, so its access is unchecked")
            continue
        group, resource = RESOURCES[kind]
        missing = KUBECTL_VERBS - _allowed(rules, group, resource)
        if missing:
            problems.append(
                f"{kind} ({group or 'core'}/{resource}): namespace access does not let kubectl "
                f"{', '.join(sorted(missing))} it ({NAMESPACE_POLICY} and the owner's Role)"
            )
    return problems


def owner_setup(namespace_object: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the cluster's owner applies once, before the first deploy: the namespace (as kvfleet would create it,
    with its Pod Security label; applying it to an existing namespace adds the labels) and the Role and RoleBinding
    that let kvfleet's group manage the ScaledObject there."""
    namespace = str(namespace_object["metadata"]["name"])
    name = scaler_group(namespace)
    meta = {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY)}
    rules = [
        {"apiGroups": [group], "resources": sorted(resources), "verbs": sorted(verbs)}
        for group, resources, verbs in OWNER_RULES
    ]
    return [
        dict(namespace_object),
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": name}],
        },
    ]


def render(docs: Sequence[Mapping[str, Any]]) -> str:
    """The documents as one YAML stream (`kubectl apply -f -` reads it)."""
    return yaml.safe_dump_all([dict(d) for d in docs], sort_keys=False)
