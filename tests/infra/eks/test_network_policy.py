"""The serving pods' NetworkPolicy: ingress on the serving port from the file's client namespaces and CIDRs and
Prometheus's namespace only, schema-valid for the cluster's Kubernetes, and the file's clients checked."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, get_args

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from kvfleet.contract import SERVING_PORT
from kvfleet.errors import ConfigError
from kvfleet.targets.eks.config import EksVersion
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.targets.eks.infra.addons import NETWORK_POLICY_SUPPORT, VPC_CNI_ADDON
from tests.infra.eks.test_manifests import K8S_VERSION, OPTS, resolve
from tests.infra.helpers import REPO, environment, props, synth

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


EXAMPLE_CLIENTS = "      clients:\n        namespaces: [gateway]\n"


def _policy(text: str) -> dict[str, Any]:
    [t] = synth(text).values()
    policies: list[dict[str, Any]] = [
        m
        for r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").values()
        for m in _manifest(r)
        if m["kind"] == "NetworkPolicy"
    ]
    [policy] = policies
    return policy


def test_a_shared_cluster_admits_its_prometheus_namespace_and_the_files_clients() -> None:
    assert EXAMPLE_CLIENTS in SHARED
    text = SHARED.replace(EXAMPLE_CLIENTS, EXAMPLE_CLIENTS + "        cidrs: [10.1.0.0/20]\n")
    sources = _policy(text)["spec"]["ingress"][0]["from"]
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
        ("        namespaces: []\n", "names no caller, so the NetworkPolicy would admit nobody"),
    ],
)
def test_bad_clients_are_one_line_errors(clients: str, says: str) -> None:
    text = SHARED.replace(EXAMPLE_CLIENTS, f"      clients:\n{clients}")
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert "deployments[0].target.clients" in line and says in line, line


def test_every_pod_in_the_cluster_is_every_namespace_on_the_serving_port_only() -> None:
    policy = _policy(SHARED.replace(EXAMPLE_CLIENTS, "      clients: cluster\n"))
    assert kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    # Every namespace's pods (Prometheus's among them): no per-namespace rule, and no ipBlock outside the pods.
    assert policy["spec"]["ingress"] == [
        {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": SERVING_PORT}]}
    ]


def test_a_word_other_than_cluster_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError) as err:
        environment(SHARED.replace(EXAMPLE_CLIENTS, "      clients: everyone\n"))
    assert all("deployments[0].target.clients" in line for line in err.value.lines), err.value.lines


def test_the_service_listens_on_the_containers_port() -> None:
    # The VPC CNI's enforcement needs the Service's port to be the container's (k8s.SERVICE_PORT).
    service = k8s.service(resolve(), OPTS)
    [port] = service["spec"]["ports"]
    [container] = k8s.deployment(resolve(), OPTS)["spec"]["template"]["spec"]["containers"]
    [named] = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert port["port"] == named["containerPort"] == SERVING_PORT


PLATFORM = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")


def test_a_new_cluster_enforces_network_policy_through_the_vpc_cni_addon() -> None:
    [t] = synth(PLATFORM).values()
    [addon] = [a for a in props(t, "AWS::EKS::Addon") if a["AddonName"] == "vpc-cni"]
    assert json.loads(addon["ConfigurationValues"]) == {"enableNetworkPolicy": "true"}
    # EKS created the self-managed VPC CNI with the cluster: the add-on takes its objects over.
    assert addon["ResolveConflicts"] == "OVERWRITE"
    [shared] = synth(SHARED).values()
    assert not props(shared, "AWS::EKS::Addon")  # an existing cluster's CNI is the cluster's


def test_every_cluster_version_and_node_kernel_meet_the_vpc_cnis_network_policy_requirements() -> None:
    need = NETWORK_POLICY_SUPPORT
    for version in get_args(EksVersion):
        major, minor = (int(x) for x in version.split("."))
        assert (major, minor) >= need.min_kubernetes, version
    assert need.node_kernel >= need.min_kernel
    assert VPC_CNI_ADDON.configuration == {"enableNetworkPolicy": "true"}
