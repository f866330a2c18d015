"""The cluster add-ons the EKS target installs, pinned: NVIDIA device plugin, KEDA, Prometheus, Cluster Autoscaler.

Each chart is pinned to one version here, with the reason for that version beside it; the Helm values are plain
data built by the functions below, and ``cluster_autoscaler_statements`` is the autoscaler's IAM policy. The EKS
construct (``kvfleet.infra.eks.service``) installs what the config asks for.

Choices, and why:
- Node autoscaling is Cluster Autoscaler on the managed GPU node group. The plan fixes the instance
  types, and managed node groups already carry the auto-discovery tags it reads; Karpenter would bypass
  the node group (its own NodePool and EC2NodeClass, an interruption queue) for flexibility this
  workload does not use.
- Prometheus runs in the cluster (the community chart's server, scraping the annotated pods). KEDA
  queries it over the cluster network with no SigV4 credentials, and a scale decision never depends on
  a remote service; long-term retention can remote-write to Amazon Managed Service for Prometheus.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from aws_cdk import CfnJson
from aws_cdk import aws_iam as iam


class ChartPin(NamedTuple):
    chart: str
    repository: str
    version: str


DEVICE_PLUGIN_CHART = ChartPin("nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin", "0.17.1")
# The chart's default nodeAffinity (values.yaml, 0.17.x) admits nodes carrying one of NFD's NVIDIA labels or this one.
DEVICE_PLUGIN_NODE_LABEL = ("nvidia.com/gpu.present", "true")
# KEDA supports the Kubernetes minor it was released with and the two before it (keda.sh, Operate > Cluster), so
# 2.17 would already be outside its window on 1.33; 2.19 is the newest minor pinned here. Its ScaledObject API
# (keda.sh/v1alpha1) only grows between minors, so the manifests still validate against the project's schema,
# written from 2.17's fields.
KEDA_CHART = ChartPin("keda", "https://kedacore.github.io/charts", "2.19.0")
PROMETHEUS_CHART = ChartPin("prometheus", "https://prometheus-community.github.io/helm-charts", "27.20.0")
CLUSTER_AUTOSCALER_CHART = ChartPin("cluster-autoscaler", "https://kubernetes.github.io/autoscaler", "9.59.0")
# Cluster Autoscaler's minor version must match the cluster's (its compatibility policy); the chart's default image
# follows one release, so the image is chosen by Kubernetes version. Tags from the project's release notes
# (registry.k8s.io/autoscaling/cluster-autoscaler).
CLUSTER_AUTOSCALER_IMAGE_TAGS = {"1.33": "v1.33.6", "1.34": "v1.34.5", "1.35": "v1.35.0"}

# Namespaces the charts go into.
DEVICE_PLUGIN_NAMESPACE = "kube-system"
KEDA_NAMESPACE = "keda"
PROMETHEUS_NAMESPACE = "monitoring"
CLUSTER_AUTOSCALER_NAMESPACE = "kube-system"
CLUSTER_AUTOSCALER_ACCOUNT = "cluster-autoscaler"
# The Prometheus chart's server Service, as KEDA reaches it over the cluster network.
PROMETHEUS_URL = f"http://prometheus-server.{PROMETHEUS_NAMESPACE}.svc.cluster.local:80"


def device_plugin_values(*, gpu_taint: Mapping[str, str], node_selector: Mapping[str, str]) -> dict[str, Any]:
    """On the tainted GPU nodes only. The chart's default nodeAffinity stays (see DEVICE_PLUGIN_NODE_LABEL)."""
    return {
        "tolerations": [{"key": gpu_taint["key"], "operator": "Exists", "effect": gpu_taint["effect"]}],
        "nodeSelector": dict(node_selector),
    }


def prometheus_values() -> dict[str, Any]:
    """The server alone, scraping the annotated pods (the chart's kubernetes-pods job); short retention."""
    return {
        "alertmanager": {"enabled": False},
        "prometheus-pushgateway": {"enabled": False},
        "prometheus-node-exporter": {"enabled": False},
        "kube-state-metrics": {"enabled": False},
        "server": {"global": {"scrape_interval": "15s"}, "retention": "2d"},
    }


def cluster_autoscaler_values(*, cluster_name: str, kubernetes_version: str, region: str) -> dict[str, Any]:
    return {
        "image": {"tag": CLUSTER_AUTOSCALER_IMAGE_TAGS[kubernetes_version]},
        "autoDiscovery": {"clusterName": cluster_name},
        "awsRegion": region,
        "rbac": {"serviceAccount": {"create": False, "name": CLUSTER_AUTOSCALER_ACCOUNT}},
        # Slow scale-in, like the pods: a GPU node takes minutes to come back.
        "extraArgs": {"scale-down-unneeded-time": "15m", "scale-down-delay-after-add": "15m"},
    }


def cluster_autoscaler_statements(owned_condition: CfnJson) -> list[iam.PolicyStatement]:
    """Describe anything; scale only the groups ``owned_condition`` (a StringEquals on the owner tag) matches."""
    return [
        iam.PolicyStatement(
            actions=[
                "autoscaling:DescribeAutoScalingGroups",
                "autoscaling:DescribeAutoScalingInstances",
                "autoscaling:DescribeLaunchConfigurations",
                "autoscaling:DescribeScalingActivities",
                "autoscaling:DescribeTags",
                "ec2:DescribeImages",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplateVersions",
                "ec2:GetInstanceTypesFromInstanceRequirements",
                "eks:DescribeNodegroup",
            ],
            resources=["*"],
        ),
        iam.PolicyStatement(
            actions=["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
            resources=["*"],
            # Only the groups of this cluster's node groups.
            conditions={"StringEquals": owned_condition},
        ),
    ]
