"""The serving pods' NetworkPolicy: ingress on the serving port from the file's client namespaces and CIDRs and
Prometheus's namespace only, schema-valid for the cluster's Kubernetes, and the file's clients checked."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from kvfleet.contract import SERVING_PORT
from kvfleet.errors import ConfigError
from kvfleet.targets.eks.infra import manifests as k8s
from tests.infra.eks.test_manifests import K8S_VERSION, OPTS, resolve
from tests.infra.helpers import REPO, environment, synth

SHARED = (REPO / "environments" / "shared-cluster.yaml").read_text(encoding="utf-8")


def test_with_no_clients_the_pods_admit_nothing() -> None:
    policy = k8s.network_policy(resolve(), OPTS)
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []
    assert policy["spec"]["podSelector"]["matchLabels"] == k8s.selector_labels(resolve())
    assert kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_clients_are_admitted_on_the_serving_port_only() -> None:
    opts = replace(OPTS, client_namespaces=("ingress-nginx", "monitoring"), client_cidrs=("10.0.0.0/24",))
    policy = k8s.network_policy(resolve(), opts)
    assert kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": SERVING_PORT}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"ipBlock": {"cidr": "10.0.0.0/24"}},
    ]


def test_a_shared_cluster_admits_its_prometheus_namespace_and_the_files_clients() -> None:
    text = SHARED.replace(
        "      namespace: assistant\n",
        "      namespace: assistant\n      clients:\n        namespaces: [gateway]\n        cidrs: [10.1.0.0/20]\n",
    )
    [t] = synth(text if "\nnotifications:" in text else text + "notifications: none\n").values()
    policies: list[dict[str, Any]] = [
        m
        for r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").values()
        for m in _manifest(r)
        if m["kind"] == "NetworkPolicy"
    ]
    [policy] = policies
    sources = policy["spec"]["ingress"][0]["from"]
    # prometheus_url is http://prometheus.observability.svc.cluster.local:9090: the scrape comes from there.
    names = [
        s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for s in sources
        if "namespaceSelector" in s
    ]
    assert names == ["gateway", "observability"]
    assert {"ipBlock": {"cidr": "10.1.0.0/20"}} in sources


def _manifest(resource: Mapping[str, Any]) -> list[dict[str, Any]]:
    value = resource["Properties"]["Manifest"]
    text = value if isinstance(value, str) else "".join(p for p in value["Fn::Join"][1] if isinstance(p, str))
    try:
        loaded: list[dict[str, Any]] = json.loads(text)
    except ValueError:
        return []
    return loaded


@pytest.mark.parametrize(
    ("clients", "says"),
    [
        ("        cidrs: [10.1.0.0/33]\n", "is not a CIDR block"),
        ("        namespaces: [Gateway]\n", "is not a namespace name"),
    ],
)
def test_bad_clients_are_one_line_errors(clients: str, says: str) -> None:
    text = SHARED.replace("      namespace: assistant\n", f"      namespace: assistant\n      clients:\n{clients}")
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert "deployments[0].target.clients" in line and says in line, line
