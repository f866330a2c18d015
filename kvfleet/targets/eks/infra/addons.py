"""The cluster add-ons the EKS target installs, pinned: NVIDIA device plugin, KEDA, Prometheus, Cluster Autoscaler.

Each chart is pinned to one version here, with the reason for that version beside it; the Helm values are plain
data built by the functions below, and ``cluster_autoscaler_statements`` is the autoscaler's IAM policy. The EKS
construct (``kvfleet.targets.eks.infra.service``) installs what the config asks for.

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
from dataclasses import dataclass
from typing import Any, NamedTuple

from aws_cdk import CfnJson
from aws_cdk import aws_iam as iam

from kvfleet.targets.eks.infra.scheduling import OS_LABEL, Placement, affinity_terms


class ChartPin(NamedTuple):
    chart: str
    repository: str
    version: str
    # The Helm release name, set explicitly: aws-cdk-lib's HelmChart otherwise names it after the construct's
    # unique id, and the charts derive their object names (Services KEDA queries) from the release name.
    release: str


DEVICE_PLUGIN_CHART = ChartPin(
    "nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin", "0.17.1", "nvidia-device-plugin"
)
# The chart's default nodeAffinity (values.yaml, 0.17.x) admits nodes carrying one of NFD's NVIDIA labels or this one.
DEVICE_PLUGIN_NODE_LABEL = ("nvidia.com/gpu.present", "true")
# KEDA supports the Kubernetes minor it was released with and the two before it (keda.sh, Operate > Cluster), so
# 2.17 would already be outside its window on 1.33; 2.19 is the newest minor pinned here. Its ScaledObject API
# (keda.sh/v1alpha1) only grows between minors, so the manifests still validate against the project's schema,
# written from 2.17's fields.
KEDA_CHART = ChartPin("keda", "https://kedacore.github.io/charts", "2.19.0", "keda")
# The Kubernetes minors each KEDA release is tested on (keda.sh/docs/2.22/operate/cluster, "Kubernetes
# Compatibility"; read 2026-12-08): 2.19 is tested on 1.32-1.34 only, so clusters on 1.35 and 1.36 run it outside
# its tested window (tests/infra/eks/test_versions.py holds the gap); 2.21 is tested on 1.34-1.36.
KEDA_TESTED_KUBERNETES = {"2.19.0": ("1.32", "1.34"), "2.20.0": ("1.33", "1.35"), "2.21.0": ("1.34", "1.36")}
PROMETHEUS_CHART = ChartPin("prometheus", "https://prometheus-community.github.io/helm-charts", "27.20.0", "prometheus")
CLUSTER_AUTOSCALER_CHART = ChartPin(
    "cluster-autoscaler", "https://kubernetes.github.io/autoscaler", "9.59.0", "cluster-autoscaler"
)
# Cluster Autoscaler's minor version must match the cluster's (its compatibility policy); the chart's default image
# follows one release (appVersion 1.35.0 in 9.59.0), so the image is chosen by Kubernetes version: the newest patch
# of each minor, from the git tags of kubernetes/autoscaler (cluster-autoscaler-1.33.6, -1.34.5, -1.35.2, all
# 2026-07-22; checked 2026-12-01), published as registry.k8s.io/autoscaling/cluster-autoscaler:v<tag>. 1.36: the
# git tag cluster-autoscaler-1.36.1 (2026-07-22, the newest 1.36 tag in a snapshot of 2026-08-22; its release notes
# list registry.k8s.io/autoscaling/cluster-autoscaler:v1.36.1). None of the four pinned charts bounds Kubernetes
# from above (Chart.yaml kubeVersion at the pinned tags: KEDA 2.19.0 ">=v1.23.0-0", Prometheus 27.20.0
# ">=1.19.0-0", NVIDIA device plugin 0.17.1 ">= 1.10.0-0", cluster-autoscaler 9.59.0 none), so Helm takes 1.36.
CLUSTER_AUTOSCALER_IMAGE_TAGS = {"1.33": "v1.33.6", "1.34": "v1.34.5", "1.35": "v1.35.2", "1.36": "v1.36.1"}


class ChartWorkload(NamedTuple):
    """One Deployment or DaemonSet a chart renders, and where its scheduling constraints come from."""

    name: str
    source: str  # the chart's template and values.yaml keys, at the pinned version
    values_path: tuple[str, ...]  # where its tolerations / nodeSelector / affinity sit in the values
    defaults: Mapping[str, Any]  # the chart's values.yaml defaults of those keys
    fixed_node_selector: Mapping[str, str] = {}  # what the template writes whatever the values


# The pods each chart runs, with the scheduling defaults of the pinned versions. None tolerates a taint kvfleet
# puts on its GPU nodes but the device plugin, so they need an untainted node group (service.py adds one).
CHART_WORKLOADS: dict[str, tuple[ChartWorkload, ...]] = {
    DEVICE_PLUGIN_CHART.chart: (
        ChartWorkload(
            "nvidia-device-plugin DaemonSet",
            "NVIDIA/k8s-device-plugin v0.17.1 deployments/helm/nvidia-device-plugin/values.yaml: tolerations, "
            "nodeSelector, affinity",
            (),
            {
                "tolerations": [
                    {"key": "CriticalAddonsOnly", "operator": "Exists"},
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                ],
                "nodeSelector": {},
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": k, "operator": "In", "values": [v]}]}
                                for k, v in (
                                    ("feature.node.kubernetes.io/pci-10de.present", "true"),
                                    ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"),
                                    ("nvidia.com/gpu.present", "true"),
                                )
                            ]
                        }
                    }
                },
            },
        ),
    ),
    KEDA_CHART.chart: tuple(
        ChartWorkload(
            name,
            f"kedacore/charts v2.19.0 keda/templates/{template} (nodeSelector kubernetes.io/os: linux), "
            "keda/values.yaml: tolerations [], nodeSelector {}",
            (),
            {"tolerations": [], "nodeSelector": {}},
            {OS_LABEL: "linux"},
        )
        for name, template in (
            ("keda-operator", "manager/deployment.yaml"),
            ("keda-operator-metrics-apiserver", "metrics-server/deployment.yaml"),
            ("keda-admission-webhooks", "webhooks/deployment.yaml"),
        )
    ),
    PROMETHEUS_CHART.chart: (
        ChartWorkload(
            "prometheus-server",
            "prometheus-community/helm-charts prometheus-27.20.0 charts/prometheus/values.yaml: server.tolerations "
            "[], server.nodeSelector {}, server.affinity {} (templates/deploy.yaml)",
            ("server",),
            {"tolerations": [], "nodeSelector": {}, "affinity": {}},
        ),
    ),
    CLUSTER_AUTOSCALER_CHART.chart: (
        ChartWorkload(
            "cluster-autoscaler",
            "kubernetes/autoscaler cluster-autoscaler-chart-9.59.0 charts/cluster-autoscaler/values.yaml: "
            "tolerations [], nodeSelector {}, affinity {}",
            (),
            {"tolerations": [], "nodeSelector": {}, "affinity": {}},
        ),
    ),
}

# EKS creates CoreDNS (two replicas, kube-system) on a new cluster, as it does every self-managed default add-on
# (CreateCluster bootstrapSelfManagedAddons, default true). Its Deployment tolerates only CriticalAddonsOnly and
# the control-plane taint and requires a Linux amd64/arm64 node (the EKS CoreDNS manifest, the defaults of the
# coredns add-on's configuration schema: `aws eks describe-addon-configuration --addon-name coredns`).
COREDNS_PLACEMENT = Placement(
    workload="CoreDNS",
    source="EKS default add-on coredns (kube-system/coredns Deployment)",
    tolerations=(
        {"key": "CriticalAddonsOnly", "operator": "Exists"},
        {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
    ),
    affinity=((("kubernetes.io/os", "In", ("linux",)), ("kubernetes.io/arch", "In", ("amd64", "arm64"))),),
)


def chart_placements(chart: ChartPin, values: Mapping[str, Any]) -> list[Placement]:
    """The chart's workloads with the values given: Helm merges maps key by key into the defaults and replaces
    lists (tolerations) whole."""
    out = []
    for w in CHART_WORKLOADS[chart.chart]:
        given: Any = values
        for key in w.values_path:
            given = (given or {}).get(key) or {}
        merged = _coalesce(dict(w.defaults), {k: given[k] for k in w.defaults if k in (given or {})})
        out.append(
            Placement(
                workload=f"{w.name} (chart {chart.chart} {chart.version})",
                source=w.source,
                tolerations=tuple(merged.get("tolerations") or ()),
                node_selector={**w.fixed_node_selector, **(merged.get("nodeSelector") or {})},
                affinity=affinity_terms(merged.get("affinity")),
            )
        )
    return out


def _coalesce(default: Any, given: Any) -> Any:
    if isinstance(default, Mapping) and isinstance(given, Mapping):
        return {k: _coalesce(default.get(k), given[k]) if k in given else default[k] for k in {*default, *given}}
    return default if given is None else given


class ManagedAddon(NamedTuple):
    """An EKS add-on (AWS::EKS::Addon) kvfleet sets on a cluster it creates."""

    name: str
    configuration: Mapping[str, Any]  # the add-on's configurationValues
    # EKS creates the VPC CNI self-managed with a new cluster (CreateCluster bootstrapSelfManagedAddons, default
    # true); the managed add-on takes over its objects only with OVERWRITE (EKS User Guide, "Create the Amazon VPC
    # CNI (Amazon EKS add-on)": "--resolve-conflicts OVERWRITE" when the self-managed add-on is installed).
    resolve_conflicts: str
    source: str


# The VPC CNI enforces NetworkPolicy only with this setting (EKS User Guide, "Limit Pod traffic with Kubernetes
# network policies", "Configure your cluster for Kubernetes network policies", Amazon EKS add-on:
# { "enableNetworkPolicy": "true" }). No addonVersion: EKS installs its default for the cluster's Kubernetes
# version, as the self-managed one it replaces was.
VPC_CNI_ADDON = ManagedAddon(
    name="vpc-cni",
    configuration={"enableNetworkPolicy": "true"},
    resolve_conflicts="OVERWRITE",
    source='EKS User Guide, "Limit Pod traffic with Kubernetes network policies" (Amazon EKS add-on)',
)


@dataclass(frozen=True, kw_only=True)
class NetworkPolicySupport:
    """What the VPC CNI's NetworkPolicy enforcement needs, and what kvfleet's nodes have."""

    min_kubernetes: tuple[int, int]
    min_vpc_cni: tuple[int, int]
    min_kernel: tuple[int, int]
    node_kernel: tuple[int, int]  # the AL2023 AMIs' kernel, GPU (NVIDIA) and system node groups alike
    source: str


# EKS User Guide, "Limit Pod traffic with Kubernetes network policies": clusters 1.25 and later, VPC CNI 1.14 or
# later, Linux kernel 5.10 or later, and the BPF file system, which every EKS optimized Amazon Linux AMI for 1.27
# or later mounts. Amazon Linux 2023's kernel is 6.1 or later (Amazon Linux 2023 User Guide, "Kernel"). The VPC CNI
# version is EKS's default for the cluster's version: 1.14 came out in 2023, two years before the oldest
# Kubernetes version kvfleet creates a cluster on (tests/infra/eks/test_network_policy.py holds the rest).
NETWORK_POLICY_SUPPORT = NetworkPolicySupport(
    min_kubernetes=(1, 25),
    min_vpc_cni=(1, 14),
    min_kernel=(5, 10),
    node_kernel=(6, 1),
    source='EKS User Guide, "Limit Pod traffic with Kubernetes network policies" (Prerequisites)',
)


# Namespaces the charts go into.
DEVICE_PLUGIN_NAMESPACE = "kube-system"
KEDA_NAMESPACE = "keda"
PROMETHEUS_NAMESPACE = "monitoring"
CLUSTER_AUTOSCALER_NAMESPACE = "kube-system"
CLUSTER_AUTOSCALER_ACCOUNT = "cluster-autoscaler"


def prometheus_server_fullname(release: str, values: Mapping[str, Any]) -> str:
    """The name the prometheus chart gives the server's Service (and Deployment): ``prometheus.server.fullname``
    in charts/prometheus/templates/_helpers.tpl of prometheus-community/helm-charts at prometheus-27.20.0,
    used by templates/service.yaml. ``.Chart.Name`` is "prometheus"; sprig's ``contains A B`` is "B contains A";
    ``trunc 63 | trimSuffix "-"`` cuts to 63 characters, then drops one trailing dash."""
    server = values.get("server") or {}
    override = server.get("fullnameOverride")
    if override:
        return _trunc63(str(override))
    name = values.get("nameOverride") or PROMETHEUS_CHART.chart
    server_name = server.get("name", "server")  # values.yaml: server.name
    if name in release:
        return _trunc63(f"{release}-{server_name}")
    return _trunc63(f"{release}-{name}-{server_name}")


def _trunc63(s: str) -> str:
    s = s[:63]
    return s[:-1] if s.endswith("-") else s


def prometheus_url(*, release: str, namespace: str, values: Mapping[str, Any]) -> str:
    """The server Service as KEDA reaches it over the cluster network (values.yaml: server.service.servicePort 80;
    the chart puts objects in the release namespace unless forceNamespace is set)."""
    port = ((values.get("server") or {}).get("service") or {}).get("servicePort", 80)
    ns = values.get("forceNamespace") or namespace
    return f"http://{prometheus_server_fullname(release, values)}.{ns}.svc.cluster.local:{port}"


def device_plugin_values(*, gpu_taint: Mapping[str, str], node_selector: Mapping[str, str]) -> dict[str, Any]:
    """On the tainted GPU nodes only. The chart's default nodeAffinity stays (see DEVICE_PLUGIN_NODE_LABEL)."""
    return {
        "tolerations": [{"key": gpu_taint["key"], "operator": "Exists", "effect": gpu_taint["effect"]}],
        "nodeSelector": dict(node_selector),
    }


# The server's TSDB on an emptyDir, not the chart's default PersistentVolumeClaim (server.persistentVolume.enabled:
# true in values.yaml at 27.20.0): a new EKS cluster has no EBS CSI driver and no StorageClass, so the claim would
# stay Pending and the server with it. KEDA reads only the last minutes of two signals; what a restart loses
# (at most the retention) does not matter to a scale decision, and longer history is CloudWatch's (the agent
# publishes the same signals there). retentionSize keeps the TSDB under the emptyDir's sizeLimit, so the kubelet
# never evicts the server for exceeding it.
PROMETHEUS_EMPTYDIR_GIB = 4
PROMETHEUS_RETENTION_SIZE = "3GB"


def prometheus_values() -> dict[str, Any]:
    """The server alone, scraping the annotated pods (the chart's kubernetes-pods job); short retention."""
    return {
        "alertmanager": {"enabled": False},
        "prometheus-pushgateway": {"enabled": False},
        "prometheus-node-exporter": {"enabled": False},
        "kube-state-metrics": {"enabled": False},
        "server": {
            "global": {"scrape_interval": "15s"},
            "retention": "2d",
            "retentionSize": PROMETHEUS_RETENTION_SIZE,
            "persistentVolume": {"enabled": False},
            "emptyDir": {"sizeLimit": f"{PROMETHEUS_EMPTYDIR_GIB}Gi"},
        },
    }


PROMETHEUS_URL = prometheus_url(
    release=PROMETHEUS_CHART.release, namespace=PROMETHEUS_NAMESPACE, values=prometheus_values()
)


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
