"""Issue "Deployable for real": what a new cluster needs beyond valid manifests, each against the platform's rule.

- the VPC interface endpoints admit the nodes (the cluster security group) on 443;
- every workload the stack installs has a node group it can schedule on;
- KEDA queries the Service the prometheus chart creates for the release the stack installs;
- the Prometheus server needs no PersistentVolume (no EBS CSI driver, no StorageClass on a new cluster);
- the GPU node's disk holds the OS, the image twice and the model cache under the kubelet's 85 % line.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import urlsplit

import pytest
from aws_cdk import aws_ec2 as ec2
from aws_cdk.assertions import Template

from kvfleet.deployments import IMAGE_DISK_GIB, resolve_environment
from kvfleet.errors import KvfleetError
from kvfleet.targets.eks.infra import access, nodes, scheduling
from kvfleet.targets.eks.infra import addons as charts
from kvfleet.targets.eks.infra.service import GPU_TAINT, EksService
from tests.infra.helpers import REPO, environment, only, props

PLATFORM = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")
SHARED = (REPO / "environments" / "shared-cluster.yaml").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def template() -> Template:
    return only(PLATFORM)


def helm_charts(t: Template) -> dict[str, dict[str, Any]]:
    return {c["Chart"]: c for c in props(t, "Custom::AWSCDK-EKS-HelmChart")}


def chart_values(t: Template, chart: str) -> dict[str, Any]:
    """The chart's values as the stack passes them; CloudFormation references (the cluster name) read "<token>"."""
    text = helm_charts(t)[chart]["Values"]
    if isinstance(text, dict):
        [sep, parts] = text["Fn::Join"]
        text = sep.join(p if isinstance(p, str) else "<token>" for p in parts)
    values: dict[str, Any] = json.loads(text)
    return values


def scaled_object(t: Template) -> dict[str, Any]:
    [r] = [r for k, r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").items() if "ScaledObject" in k]
    [obj] = json.loads(r["Properties"]["Manifest"])
    out: dict[str, Any] = obj
    return out


# ---- 1. the interface endpoints admit the nodes -------------------------------------------------------------


def test_the_endpoints_admit_the_cluster_security_group_on_443(template: Template) -> None:
    # Managed node groups without a launch template carry only the cluster security group EKS creates.
    assert all("LaunchTemplate" not in ng for ng in props(template, "AWS::EKS::Nodegroup"))
    cluster_sg = {"Fn::GetAtt": [next(iter(template.find_resources("AWS::EKS::Cluster"))), "ClusterSecurityGroupId"]}
    endpoint_groups = {
        json.dumps(g, sort_keys=True)
        for e in props(template, "AWS::EC2::VPCEndpoint")
        if e.get("VpcEndpointType") == "Interface"
        for g in e["SecurityGroupIds"]
    }
    assert len(endpoint_groups) == 1
    rules = [
        r
        for r in props(template, "AWS::EC2::SecurityGroupIngress")
        if json.dumps(r["GroupId"], sort_keys=True) in endpoint_groups and r.get("SourceSecurityGroupId") == cluster_sg
    ]
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in rules] == [("tcp", 443, 443)]


def test_synth_refuses_nodes_the_endpoints_do_not_admit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The broken variant: the stack as it was, the endpoints admitting only the serving security group.
    real = ec2.SecurityGroup.add_ingress_rule

    def without_the_nodes(self: ec2.SecurityGroup, peer: Any, connection: Any, description: Any = None) -> None:
        if description != "HTTPS from the EKS nodes":
            real(self, peer, connection, description)

    monkeypatch.setattr(ec2.SecurityGroup, "add_ingress_rule", without_the_nodes)
    with pytest.raises(KvfleetError, match=r"the nodes of .*/Eks/Gpu call ecr\.dkr through VPC endpoint .*EcrDocker"):
        only(PLATFORM)


def test_endpoint_access_rule() -> None:
    nodes_sg, other = '"sg-nodes"', '"sg-other"'
    caller = access.Caller(name="the nodes", security_groups=(nodes_sg,), services=frozenset({"ecr.api"}))
    ecr = access.Endpoint(name="EcrApi", service="ecr.api", security_groups=('"sg-endpoints"',))
    ssm = access.Endpoint(name="Ssm", service="ssm", security_groups=('"sg-endpoints"',))

    def rule(source: str, protocol: str = "tcp", ports: tuple[int | None, int | None] = (443, 443)) -> Any:
        return access.IngressRule(
            group='"sg-endpoints"', source_group=source, protocol=protocol, from_port=ports[0], to_port=ports[1]
        )

    assert access.check_endpoint_access([caller], [ecr, ssm], [rule(nodes_sg)]) == []
    assert access.check_endpoint_access([caller], [ecr], [rule(nodes_sg, "-1", (None, None))]) == []
    for wrong in (rule(other), rule(nodes_sg, "udp"), rule(nodes_sg, ports=(80, 80))):
        [problem] = access.check_endpoint_access([caller], [ecr, ssm], [wrong])
        assert problem.startswith("the nodes call ecr.api through VPC endpoint EcrApi")


# ---- 2. every workload has a node group it can schedule on ----------------------------------------------------


def test_a_new_cluster_has_an_untainted_system_node_group(template: Template) -> None:
    [system] = [ng for ng in props(template, "AWS::EKS::Nodegroup") if ng["AmiType"] == "AL2023_x86_64_STANDARD"]
    assert "Taints" not in system
    assert system["InstanceTypes"] == [nodes.SYSTEM_INSTANCE_TYPE]
    assert system["ScalingConfig"] == {"MinSize": 2, "MaxSize": 2, "DesiredSize": 2}  # CoreDNS runs two replicas


def test_the_chart_placements_are_read_with_the_values_the_stack_passes(template: Template) -> None:
    # What the check schedules is what the stack installs: the values in the template, merged as Helm does.
    [plugin] = charts.chart_placements(charts.DEVICE_PLUGIN_CHART, chart_values(template, "nvidia-device-plugin"))
    assert plugin.tolerations == ({"key": GPU_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"},)
    assert plugin.node_selector == {"kvfleet.io/gpu": "true"}
    assert (("nvidia.com/gpu.present", "In", ("true",)),) in plugin.affinity  # the chart default stays
    for chart in (charts.KEDA_CHART, charts.PROMETHEUS_CHART, charts.CLUSTER_AUTOSCALER_CHART):
        for p in charts.chart_placements(chart, chart_values(template, chart.chart)):
            assert p.tolerations == (), p  # none of them tolerates the GPU taint


def _without_system_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    def none(self: EksService, *args: Any) -> None:
        self.system_nodegroup = None

    monkeypatch.setattr(EksService, "_system_nodegroup", none)


def test_synth_refuses_a_cluster_where_the_addons_cannot_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    # The broken variant: the GPU node group alone, as before.
    _without_system_nodes(monkeypatch)
    real = EksService.node_pools
    monkeypatch.setattr(EksService, "node_pools", lambda self, r, t: real(self, r, t)[:1])
    with pytest.raises(KvfleetError) as err:
        only(PLATFORM)
    message = str(err.value)
    for workload in ("CoreDNS", "keda-operator", "prometheus-server", "cluster-autoscaler"):
        assert f"{workload} (" in message and "taint nvidia.com/gpu=present:NoSchedule not tolerated" in message
    assert "nvidia-device-plugin" not in message and "the serving pods" not in message


def test_an_existing_cluster_schedules_the_addons_on_its_own_nodes() -> None:
    # shared-cluster.yaml with every add-on: no system group is added; ExistingCluster documents the requirement.
    text = SHARED.replace(
        "      addons:\n        keda: false\n"
        "        prometheus_url: http://prometheus.observability.svc.cluster.local:9090\n"
        "        cluster_autoscaler: false\n",
        "",
    )
    t = only(text)
    assert [ng["AmiType"] for ng in props(t, "AWS::EKS::Nodegroup")] == ["AL2023_x86_64_NVIDIA"]
    from kvfleet.targets.eks.config import ExistingCluster

    assert "schedulable nodes without taints" in (ExistingCluster.__doc__ or "")


def test_scheduling_rule() -> None:
    gpu = scheduling.NodePool(name="gpu", labels={"kubernetes.io/os": "linux", "gpu": "yes"}, taints=(GPU_TAINT,))
    plain = scheduling.NodePool(name="plain", labels={"kubernetes.io/os": "linux"})
    soft = scheduling.NodePool(name="soft", labels={}, taints=({**GPU_TAINT, "effect": "PreferNoSchedule"},))
    p = scheduling.Placement
    assert scheduling.why_not(p(workload="w", source="s"), plain) == []
    assert scheduling.why_not(p(workload="w", source="s"), soft) == []  # PreferNoSchedule only steers
    assert scheduling.why_not(p(workload="w", source="s"), gpu) == [
        "taint nvidia.com/gpu=present:NoSchedule not tolerated"
    ]
    exists = p(workload="w", source="s", tolerations=({"key": "nvidia.com/gpu", "operator": "Exists"},))
    assert scheduling.why_not(exists, gpu) == []
    wrong_value = p(workload="w", source="s", tolerations=({"key": "nvidia.com/gpu", "value": "absent"},))
    assert scheduling.why_not(wrong_value, gpu) != []
    selector = p(workload="w", source="s", node_selector={"gpu": "yes"})
    assert scheduling.why_not(selector, plain) == ["nodeSelector gpu=yes (node has gpu=None)"]
    affinity = p(workload="w", source="s", affinity=((("gpu", "In", ("yes",)),), (("other", "Exists", ()),)))
    assert scheduling.why_not(affinity, plain) == ["no required node-affinity term matches the node labels"]
    assert scheduling.check_placements([affinity], [plain, gpu])[0].startswith("w (s) fits no node group")


# ---- 3. KEDA queries the Service the prometheus chart creates -------------------------------------------------


def test_keda_queries_the_service_the_prometheus_chart_creates(template: Template) -> None:
    chart = helm_charts(template)["prometheus"]
    values = json.loads(chart["Values"])
    # templates/service.yaml names the Service prometheus.server.fullname, in the release namespace, on
    # server.service.servicePort.
    service = charts.prometheus_server_fullname(chart["Release"], values)
    expected = f"{service}.{chart['Namespace']}.svc.cluster.local"
    for trigger in scaled_object(template)["spec"]["triggers"]:
        url = urlsplit(trigger["metadata"]["serverAddress"])
        assert (url.hostname, url.port) == (expected, 80)


def test_prometheus_server_fullname_follows_the_charts_helper() -> None:
    # prometheus.server.fullname, charts/prometheus/templates/_helpers.tpl at prometheus-27.20.0.
    f = charts.prometheus_server_fullname
    assert f("prometheus", {}) == "prometheus-server"  # the release name contains the chart name
    assert f("my-prometheus-1", {}) == "my-prometheus-1-server"
    assert f("metrics", {}) == "metrics-prometheus-server"
    assert f("metrics", {"nameOverride": "prom"}) == "metrics-prom-server"
    assert f("anything", {"server": {"fullnameOverride": "scrape"}}) == "scrape"
    assert f("anything", {"server": {"name": "srv"}}) == "anything-prometheus-srv"
    long = "x" * 45  # 45 + len("-prometheus-") = 57, then "server" is cut to 6 - trunc 63
    assert f(long, {}) == long + "-prometheus-server"[:18]
    assert f("y" * 62, {}) == "y" * 62  # 63rd character is "-": trimSuffix drops it
    # The broken variant: the release name aws-cdk-lib generates without release= (the last 53 characters of the
    # construct's unique id, lowercased) gives another Service than the one KEDA used to query.
    cdk_default = "kvfleetplatformcodereksChartPrometheus5A3F1B2C".lower()
    assert f(cdk_default, {}) == cdk_default + "-server" != "prometheus-server"


# ---- 4. Prometheus needs no PersistentVolume -----------------------------------------------------------------


def test_prometheus_keeps_its_short_history_on_an_emptydir(template: Template) -> None:
    server = chart_values(template, "prometheus")["server"]
    # values.yaml at 27.20.0: server.persistentVolume.enabled true creates a PVC, which on a new cluster (no EBS CSI
    # driver, no StorageClass) stays Pending; false mounts an emptyDir (templates/deploy.yaml).
    assert server["persistentVolume"] == {"enabled": False}
    assert not [a for a in props(template, "AWS::EKS::Addon") if a["AddonName"] == "aws-ebs-csi-driver"]
    # The TSDB stays under the emptyDir's limit, so the kubelet never evicts the server for it.
    assert server["emptyDir"]["sizeLimit"] == "4Gi"
    assert int(server["retentionSize"].removesuffix("GB")) * 1e9 < 4 * 2**30


# ---- 7. the GPU node's disk -------------------------------------------------------------------------------------


def test_the_gpu_node_disk_holds_the_os_the_image_twice_and_the_model_cache(template: Template) -> None:
    [r] = resolve_environment(environment(PLATFORM))
    [gpu] = [ng for ng in props(template, "AWS::EKS::Nodegroup") if ng["AmiType"] == "AL2023_x86_64_NVIDIA"]
    [dep] = [
        x
        for k, x in template.find_resources("Custom::AWSCDK-EKS-KubernetesResource").items()
        if k.startswith("EksManifestDeployment")
    ]
    text = json.dumps(dep["Properties"]["Manifest"])  # the emptyDir the pod really asks for
    cache_gib = int(text.split('\\"model-cache\\",\\"emptyDir\\":{\\"sizeLimit\\":\\"')[1].split("Gi")[0])
    pods_per_node = r.candidate.instance.accelerator_count // r.candidate.tensor_parallel_size
    # EKS's default Linux diskSize (20 GiB) for the OS; containerd's compressed layers and unpacked snapshot of the
    # image; every pod's emptyDir; all under the kubelet's imageGCHighThresholdPercent 85.
    need = 20 + 2 * IMAGE_DISK_GIB + pods_per_node * cache_gib
    assert gpu["DiskSize"] == math.ceil(need / 0.85)
    assert gpu["DiskSize"] > r.disk_gib  # the broken variant: 48 GiB, the image once and the cache
    assert r.disk_gib < need


def test_node_disk_rule() -> None:
    assert nodes.gpu_node_disk_gib(model_cache_gib=18, pods_per_node=1, image_gib=30) == 116  # 98 / 0.85
    assert nodes.gpu_node_disk_gib(model_cache_gib=18, pods_per_node=8, image_gib=30) == math.ceil(224 / 0.85)


def test_a_new_vpc_without_nat_is_refused_for_eks() -> None:
    # The new VPC has no STS or EKS endpoints and the charts come from public repositories: EKS needs a NAT gateway.
    from kvfleet.errors import ConfigError
    from tests.envs import environment as parse

    text = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")
    assert "nat_gateways" not in text
    broken = text.replace("deployments:\n", "network:\n  nat_gateways: 0\ndeployments:\n", 1)
    with pytest.raises(ConfigError) as info:
        parse(broken)
    [line] = info.value.lines
    assert "network.nat_gateways: deployment coder runs on EKS" in line
