"""The EKS stack: cluster, GPU node group, device plugin, KEDA, Prometheus, autoscaler, and the workload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from stacks import signals
from stacks.app import build_app
from stacks.eks_service import (
    CLUSTER_AUTOSCALER_CHART,
    DEVICE_PLUGIN_CHART,
    GPU_TAINT,
    KEDA_CHART,
    PROMETHEUS_CHART,
)
from stacks.resolve import resolve_environment
from tests.stacks.conftest import REPO, environment, make_app, only

PLATFORM = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def template() -> Template:
    return only(PLATFORM)


def props(t: Template, kind: str) -> list[dict[str, Any]]:
    return [r["Properties"] for r in t.find_resources(kind).values()]


def manifest(t: Template, kind: str) -> str:
    for k, r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").items():
        text = json.dumps(r["Properties"]["Manifest"])
        if f'\\"kind\\":\\"{kind}\\"' in text and "ServiceAccountResource" not in k:
            return text
    raise AssertionError(f"no {kind} manifest")


def test_private_cluster_with_logging_and_no_auto_mode(template: Template) -> None:
    [c] = props(template, "AWS::EKS::Cluster")
    assert c["Version"] == "1.33"
    vpc = c["ResourcesVpcConfig"]
    assert vpc["EndpointPrivateAccess"] is True and vpc["EndpointPublicAccess"] is False
    assert len(c["Logging"]["ClusterLogging"]["EnabledTypes"]) == 5
    assert c["ComputeConfig"]["Enabled"] is False


def test_gpu_node_group_from_the_plan(template: Template) -> None:
    [ng] = props(template, "AWS::EKS::Nodegroup")
    [r] = resolve_environment(environment(PLATFORM))
    assert ng["AmiType"] == "AL2023_x86_64_NVIDIA"
    assert ng["InstanceTypes"] == [r.candidate.instance.name]
    assert ng["Taints"] == [{"Effect": "NO_SCHEDULE", "Key": GPU_TAINT["key"], "Value": GPU_TAINT["value"]}]
    assert ng["Labels"] == {"kvfleet.io/gpu": "true", "kvfleet.io/deployment": "platform-coder"}
    assert ng["DiskSize"] == r.disk_gib
    per_node = r.candidate.instance.accelerator_count // r.candidate.tensor_parallel_size
    assert ng["ScalingConfig"]["MaxSize"] == -(-6 // per_node)


def test_pinned_helm_charts(template: Template) -> None:
    charts = {c["Chart"]: c for c in props(template, "Custom::AWSCDK-EKS-HelmChart")}
    for name, repo, version in (DEVICE_PLUGIN_CHART, KEDA_CHART, PROMETHEUS_CHART, CLUSTER_AUTOSCALER_CHART):
        assert charts[name]["Version"] == version and charts[name]["Repository"] == repo
    plugin = json.loads(charts["nvidia-device-plugin"]["Values"])
    assert plugin["tolerations"][0]["key"] == GPU_TAINT["key"]  # it must run on the tainted GPU nodes


def test_workload_manifests_with_drain_hooks_and_keda(template: Template) -> None:
    dep = manifest(template, "Deployment")
    assert "containers.agent" in dep and "drain" in dep and "preStop" in dep
    assert "terminationGracePeriodSeconds" in dep and '\\"nvidia.com/gpu\\":' in dep
    assert f'\\"{signals.ENV_PUT_METRIC_DATA}\\",\\"value\\":\\"1\\"' in dep  # CloudWatch dashboard and alarms
    scaled = manifest(template, "ScaledObject")
    assert signals.KV_CACHE_UTILIZATION.prometheus_name in scaled
    assert signals.REQUESTS_WAITING.prometheus_name in scaled
    assert scaled.count('\\"type\\":\\"prometheus\\"') == 2
    resources = template.find_resources("Custom::AWSCDK-EKS-KubernetesResource")
    [(_, so)] = [(k, r) for k, r in resources.items() if "ScaledObject" in k]
    assert any(d.startswith("EksClusterchartKeda") for d in so["DependsOn"])  # the CRD comes first


def test_cluster_autoscaler_may_scale_only_this_clusters_groups(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [scale] = [s for s in stmts if "autoscaling:SetDesiredCapacity" in s["Action"]]
    assert "StringEquals" in scale["Condition"]


def test_the_pods_read_only_their_token_or_model_and_write_kvfleet_metrics(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [metrics] = [s for s in stmts if s["Action"] == "cloudwatch:PutMetricData"]
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": signals.NAMESPACE}}
    assert not [s for s in stmts if s["Action"] == "s3:GetObject"]  # this example downloads from Hugging Face


def test_a_wrong_gpu_count_fails_synth(monkeypatch: pytest.MonkeyPatch) -> None:
    # The consistency checks run at synth: a Deployment asking for more GPUs than a node has is refused.
    import stacks.k8s_manifests as k8s
    from sizing.errors import KvfleetError

    real = k8s.deployment

    def too_many_gpus(r: Any, opts: Any) -> Any:
        d = real(r, opts)
        res = d["spec"]["template"]["spec"]["containers"][0]["resources"]
        res["requests"]["nvidia.com/gpu"] = res["limits"]["nvidia.com/gpu"] = 16
        return d

    monkeypatch.setattr(k8s, "deployment", too_many_gpus)
    with pytest.raises(KvfleetError, match=r"deployments\.coder\.target: "):
        only(PLATFORM)


def test_cdk_nag_passes(tmp_path: Path) -> None:
    app = build_app(environment(PLATFORM), app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []
