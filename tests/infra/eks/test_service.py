"""The EKS stack: cluster, GPU node group, device plugin, KEDA, Prometheus, autoscaler, and the workload."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from datetime import date
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import resolve_environment
from kvfleet.engines import EngineArgs
from kvfleet.errors import ConfigError
from kvfleet.infra.app import build_app
from kvfleet.targets.eks.config import EksTarget, support_window_at
from kvfleet.targets.eks.infra.addons import (
    CLUSTER_AUTOSCALER_CHART,
    CLUSTER_AUTOSCALER_IMAGE_TAGS,
    DEVICE_PLUGIN_CHART,
    KEDA_CHART,
    PROMETHEUS_CHART,
)
from kvfleet.targets.eks.infra.service import GPU_TAINT, KUBECTL_LAYERS, KUBECTL_MINORS
from tests.infra.helpers import REPO, environment, make_app, only, props, synth

PLATFORM = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def template() -> Template:
    return only(PLATFORM)


def manifest(t: Template, kind: str) -> str:
    for k, r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").items():
        text = json.dumps(r["Properties"]["Manifest"])
        if f'\\"kind\\":\\"{kind}\\"' in text and "ServiceAccountResource" not in k:
            return text
    raise AssertionError(f"no {kind} manifest")


def applied_manifest(t: Template, kind: str) -> dict[str, Any]:
    """The one object of ``kind`` the kubectl provider applies, parsed; CloudFormation references (the image's
    account and URL suffix) read as "<token>"."""
    [(_, r)] = [
        (k, r)
        for k, r in t.find_resources("Custom::AWSCDK-EKS-KubernetesResource").items()
        if k.startswith(f"EksManifest{kind}")
    ]
    text = r["Properties"]["Manifest"]
    if isinstance(text, dict):
        [sep, parts] = text["Fn::Join"]
        text = sep.join(p if isinstance(p, str) else "<token>" for p in parts)
    [obj] = json.loads(text)
    assert obj["kind"] == kind
    out: dict[str, Any] = obj
    return out


def test_private_cluster_with_logging_and_no_auto_mode(template: Template) -> None:
    [c] = props(template, "AWS::EKS::Cluster")
    assert c["Version"] == "1.35"
    vpc = c["ResourcesVpcConfig"]
    assert vpc["EndpointPrivateAccess"] is True and vpc["EndpointPublicAccess"] is False
    assert len(c["Logging"]["ClusterLogging"]["EnabledTypes"]) == 5
    assert c["ComputeConfig"]["Enabled"] is False


def gpu_nodegroup(t: Template) -> dict[str, Any]:
    [ng] = [n for n in props(t, "AWS::EKS::Nodegroup") if n["AmiType"] == "AL2023_x86_64_NVIDIA"]
    return ng


def test_gpu_node_group_from_the_plan(template: Template) -> None:
    ng = gpu_nodegroup(template)
    [r] = resolve_environment(environment(PLATFORM))
    assert ng["AmiType"] == "AL2023_x86_64_NVIDIA"
    assert ng["InstanceTypes"] == [r.candidate.instance.name]
    assert ng["Taints"] == [{"Effect": "NO_SCHEDULE", "Key": GPU_TAINT["key"], "Value": GPU_TAINT["value"]}]
    assert ng["Labels"] == {
        "kvfleet.io/gpu": "true",
        "kvfleet.io/deployment": "platform-coder",
        "nvidia.com/gpu.present": "true",
    }
    per_node = r.candidate.instance.accelerator_count // r.candidate.tensor_parallel_size
    assert ng["ScalingConfig"]["MaxSize"] == -(-6 // per_node)


def test_pinned_helm_charts(template: Template) -> None:
    charts = {c["Chart"]: c for c in props(template, "Custom::AWSCDK-EKS-HelmChart")}
    for name, repo, version, release in (DEVICE_PLUGIN_CHART, KEDA_CHART, PROMETHEUS_CHART, CLUSTER_AUTOSCALER_CHART):
        assert charts[name]["Version"] == version and charts[name]["Repository"] == repo
        assert charts[name]["Release"] == release
    plugin = json.loads(charts["nvidia-device-plugin"]["Values"])
    assert plugin["tolerations"][0]["key"] == GPU_TAINT["key"]  # it must run on the tainted GPU nodes


def test_the_device_plugin_daemonset_can_land_on_the_gpu_nodes(template: Template) -> None:
    # The chart keeps its default nodeAffinity (values.yaml of nvidia-device-plugin 0.17.x): a node must carry
    # one of these labels, which Node Feature Discovery adds and an EKS node group does not. Without one the
    # DaemonSet never schedules, no GPU is advertised and every serving pod stays Pending.
    chart_affinity_terms = [
        ("feature.node.kubernetes.io/pci-10de.present", "true"),
        ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"),
        ("nvidia.com/gpu.present", "true"),
    ]
    ng = gpu_nodegroup(template)
    assert any(ng["Labels"].get(key) == value for key, value in chart_affinity_terms)
    charts = {c["Chart"]: c for c in props(template, "Custom::AWSCDK-EKS-HelmChart")}
    plugin = json.loads(charts["nvidia-device-plugin"]["Values"])
    assert "affinity" not in plugin  # the default stays, so the label above is what admits the node
    assert all(ng["Labels"].get(k) == v for k, v in plugin["nodeSelector"].items())


def test_cluster_autoscaler_matches_the_clusters_minor_version(template: Template) -> None:
    [chart] = [c for c in props(template, "Custom::AWSCDK-EKS-HelmChart") if c["Chart"] == "cluster-autoscaler"]
    assert '\\"image\\":{\\"tag\\":\\"v1.35.' in json.dumps(chart["Values"])  # platform.yaml runs 1.35
    # Every Kubernetes version a config may name has an autoscaler of the same minor version.
    versions = EksTarget.model_fields["kubernetes_version"].annotation.__args__  # type: ignore[union-attr]
    assert sorted(CLUSTER_AUTOSCALER_IMAGE_TAGS) == sorted(versions)
    assert all(tag.startswith(f"v{v}.") for v, tag in CLUSTER_AUTOSCALER_IMAGE_TAGS.items())


def test_kubectl_is_within_one_minor_of_every_cluster_version() -> None:
    # Each layer is the package of the kubectl minor it is filed under.
    for minor, layer in KUBECTL_LAYERS.items():
        assert layer.__module__.startswith("aws_cdk.lambda_layer_kubectl_v" + minor.replace("1.", "")), minor
    versions = EksTarget.model_fields["kubernetes_version"].annotation.__args__  # type: ignore[union-attr]
    assert sorted(KUBECTL_MINORS) == sorted(versions)
    for v in versions:
        assert abs(int(v.split(".")[1]) - int(KUBECTL_MINORS[v].split(".")[1])) <= 1, v


def test_a_136_cluster_gets_the_135_kubectl_layer_and_autoscaler_136() -> None:
    # The layer's description names the kubectl it bundles (aws-cdk.lambda-layer-kubectl-v35 2.2.2: 1.35.2).
    text = PLATFORM.replace('kubernetes_version: "1.35"', 'kubernetes_version: "1.36"')
    with support_window_at(date(2026, 12, 7)):
        [t] = synth(text).values()
    layers = [x for x in props(t, "AWS::Lambda::LayerVersion") if "kubectl" in x.get("Description", "")]
    [layer] = layers
    assert "/opt/kubectl/kubectl 1.35." in layer["Description"], layer["Description"]
    [chart] = [c for c in props(t, "Custom::AWSCDK-EKS-HelmChart") if c["Chart"] == "cluster-autoscaler"]
    assert '\\"image\\":{\\"tag\\":\\"v1.36.1\\"' in json.dumps(chart["Values"])
    [cluster] = props(t, "AWS::EKS::Cluster")
    assert cluster["Version"] == "1.36"


def test_workload_manifests_with_drain_hooks_and_keda(template: Template) -> None:
    [r] = resolve_environment(environment(PLATFORM))
    pod = applied_manifest(template, "Deployment")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["kvfleet-agent", "drain"]}}
    # The hook runs the agent's console script, the one the package (and so the image) installs.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts["kvfleet-agent"] == "kvfleet.agent.__main__:main"
    assert pod["terminationGracePeriodSeconds"] == r.deployment.scaling.drain_budget_s + 60
    assert c["resources"]["limits"] == {"nvidia.com/gpu": str(r.candidate.tensor_parallel_size)}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env[contract.ENV_PUT_METRIC_DATA] == "1"  # CloudWatch dashboard and alarms
    assert EngineArgs.from_json(env[contract.ENV_ENGINE_ARGS]) == r.engine_args
    from kvfleet.infra.images import kvfleet_tag  # the tag digests the image's inputs (infra/image_build.py)

    assert c["image"] == "<token>.dkr.ecr.us-east-1.<token>/kvfleet-vllm:" + kvfleet_tag(r, "us-east-1")
    assert kvfleet_tag(r, "us-east-1").startswith(contract.image_tag("0.30.0") + "-")
    scaled = manifest(template, "ScaledObject")
    assert contract.REPLICA_SATURATION.prometheus_name in scaled
    assert contract.KV_CACHE_UTILIZATION.prometheus_name not in scaled
    assert contract.REQUESTS_WAITING.prometheus_name in scaled
    assert scaled.count('\\"type\\":\\"prometheus\\"') == 2
    resources = template.find_resources("Custom::AWSCDK-EKS-KubernetesResource")
    [(_, so)] = [(k, r) for k, r in resources.items() if "ScaledObject" in k]
    assert any(d.startswith("EksChartKeda") for d in so["DependsOn"])  # the CRD comes first


def test_cluster_autoscaler_may_scale_only_this_clusters_groups(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [scale] = [s for s in stmts if "autoscaling:SetDesiredCapacity" in s["Action"]]
    assert "StringEquals" in scale["Condition"]


def test_the_pods_read_only_their_token_or_model_and_write_kvfleet_metrics(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [metrics] = [s for s in stmts if s["Action"] == "cloudwatch:PutMetricData"]
    assert metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": contract.NAMESPACE}}
    assert not [s for s in stmts if s["Action"] == "s3:GetObject"]  # this example downloads from Hugging Face


def test_a_wrong_gpu_count_fails_synth(monkeypatch: pytest.MonkeyPatch) -> None:
    # The consistency checks run at synth: a Deployment asking for more GPUs than a node has is refused.
    import kvfleet.targets.eks.infra.manifests as k8s
    from kvfleet.errors import KvfleetError

    real = k8s.deployment

    def too_many_gpus(r: Any, opts: Any) -> Any:
        d = real(r, opts)
        res = d["spec"]["template"]["spec"]["containers"][0]["resources"]
        res["requests"]["nvidia.com/gpu"] = res["limits"]["nvidia.com/gpu"] = 16
        return d

    monkeypatch.setattr(k8s, "deployment", too_many_gpus)
    with pytest.raises(KvfleetError, match=r"^deployments\[\d+\]\.target: "):
        only(PLATFORM)


def test_an_aws_image_without_the_agent_is_refused() -> None:
    # AWS's own vLLM image reads SM_VLLM_* variables and has no agent to drain the pod or publish what KEDA scales
    # on: the file is refused when it is loaded, at the image's line, instead of at synth.
    from kvfleet.errors import ConfigError

    dlc = PLATFORM.replace("max_replicas: 6", "max_replicas: 1") + "    image:\n      source: dlc\n"
    with pytest.raises(ConfigError) as info:
        environment(dlc)
    [line] = info.value.lines
    assert "deployments[0].image.source: dlc runs the engine without the kvfleet agent, and on EKS" in line


def test_cdk_nag_passes(tmp_path: Path) -> None:
    app = build_app(environment(PLATFORM), app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []


# ---- attaching to an existing cluster (environments/shared-cluster.yaml) -------------------------------------

SHARED = (REPO / "environments" / "shared-cluster.yaml").read_text(encoding="utf-8")
SHARED_CLUSTER = "platform-prod"
SHARED_SG = "sg-0123456789abcdef0"
SHARED_SUBNETS = ["subnet-0a1b2c3d4e5f60718", "subnet-0f1e2d3c4b5a69788"]
OIDC_LINE = (
    "        oidc_provider_arn: arn:aws:iam::123456789012:oidc-provider/"
    "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE\n"
)
ADDONS_OFF = (
    "      addons:\n"
    "        keda: false\n"
    "        prometheus_url: http://prometheus.observability.svc.cluster.local:9090\n"
    "        cluster_autoscaler: false\n"
)


@pytest.fixture(scope="module")
def shared() -> Template:
    return only(SHARED)


def kubectl_applied(t: Template) -> dict[str, dict[str, Any]]:
    """Every resource the kubectl provider applies: manifests, service accounts and Helm charts."""
    return {
        **t.find_resources("Custom::AWSCDK-EKS-KubernetesResource"),
        **t.find_resources("Custom::AWSCDK-EKS-HelmChart"),
    }


def test_attach_creates_no_cluster_and_joins_the_named_one(shared: Template) -> None:
    assert shared.find_resources("AWS::EKS::Cluster") == {}
    [ng] = props(shared, "AWS::EKS::Nodegroup")
    assert ng["ClusterName"] == SHARED_CLUSTER
    assert sorted(ng["Subnets"]) == sorted(SHARED_SUBNETS)  # the cluster's VPC, from the config
    assert "Version" not in ng  # follows the cluster's own version
    assert shared.find_resources("AWS::EC2::VPC") == {}


def test_attach_grants_kubectl_cluster_admin_through_an_access_entry(shared: Template) -> None:
    [(entry_id, entry)] = shared.find_resources("AWS::EKS::AccessEntry").items()
    p = entry["Properties"]
    assert p["ClusterName"] == SHARED_CLUSTER
    [policy] = p["AccessPolicies"]
    assert json.dumps(policy["PolicyArn"]).endswith(':cluster-access-policy/AmazonEKSClusterAdminPolicy"]]}')
    assert policy["AccessScope"] == {"Type": "cluster"}
    # The entry is for the role the kubectl function runs as.
    [(fn_id, fn)] = [
        (k, r)
        for k, r in shared.find_resources("AWS::Lambda::Function").items()
        if "kubectl resource provider" in r["Properties"].get("Description", "")
    ]
    assert p["PrincipalArn"] == fn["Properties"]["Role"]
    # It runs in the cluster security group inside the cluster's subnets, to reach a private API endpoint.
    vpc = fn["Properties"]["VpcConfig"]
    assert vpc["SecurityGroupIds"] == [SHARED_SG] and sorted(vpc["SubnetIds"]) == sorted(SHARED_SUBNETS)
    # Nothing is applied before that access exists.
    applied = kubectl_applied(shared)
    assert applied and all(entry_id in r.get("DependsOn", []) for r in applied.values()), fn_id


def test_attach_installs_only_the_addons_the_cluster_lacks(shared: Template) -> None:
    charts = [c["Chart"] for c in props(shared, "Custom::AWSCDK-EKS-HelmChart")]
    assert charts == [DEVICE_PLUGIN_CHART[0]]
    scaled = manifest(shared, "ScaledObject")
    assert scaled.count("http://prometheus.observability.svc.cluster.local:9090") == 2  # both triggers
    # No Cluster Autoscaler role either: the cluster's own autoscaler discovers the node group by its tags.
    stmts = [s for p in props(shared, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    assert not [s for s in stmts if "autoscaling:SetDesiredCapacity" in s["Action"]]


def test_attach_with_every_addon_installs_them_after_the_access_entry() -> None:
    t = only(SHARED.replace(ADDONS_OFF, ""))
    charts = sorted(c["Chart"] for c in props(t, "Custom::AWSCDK-EKS-HelmChart"))
    assert charts == sorted(c[0] for c in (DEVICE_PLUGIN_CHART, KEDA_CHART, PROMETHEUS_CHART, CLUSTER_AUTOSCALER_CHART))
    [entry_id] = t.find_resources("AWS::EKS::AccessEntry")
    assert all(entry_id in r["DependsOn"] for r in kubectl_applied(t).values())
    autoscaler = next(c for c in props(t, "Custom::AWSCDK-EKS-HelmChart") if c["Chart"] == "cluster-autoscaler")
    assert '\\"clusterName\\":\\"platform-prod\\"' in json.dumps(autoscaler["Values"])


def test_attach_with_an_oidc_provider_gives_the_pods_their_role_through_irsa(shared: Template) -> None:
    roles = [
        r["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]
        for r in shared.find_resources("AWS::IAM::Role").values()
    ]
    federated = [s for s in roles if "Federated" in s["Principal"]]
    assert len(federated) == 1  # the serving account (no Cluster Autoscaler here)
    assert federated[0]["Principal"]["Federated"].endswith(
        ":oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
    )
    assert shared.find_resources("AWS::EKS::PodIdentityAssociation") == {}


def test_attach_without_an_oidc_provider_uses_pod_identity() -> None:
    t = only(SHARED.replace(OIDC_LINE, "").replace(ADDONS_OFF, ""))
    associations = props(t, "AWS::EKS::PodIdentityAssociation")
    assert sorted((a["Namespace"], a["ServiceAccount"]) for a in associations) == [
        ("assistant", "kvfleet-serving"),
        ("kube-system", "cluster-autoscaler"),
    ]
    assert all(a["ClusterName"] == SHARED_CLUSTER for a in associations)
    trusts = [
        r["Properties"]["AssumeRolePolicyDocument"]["Statement"] for r in t.find_resources("AWS::IAM::Role").values()
    ]
    pods = [s for stmts in trusts for s in stmts if s.get("Principal", {}).get("Service") == "pods.eks.amazonaws.com"]
    assert len(pods) == 2 and all(s["Action"] == ["sts:AssumeRole", "sts:TagSession"] for s in pods)


def test_attach_cdk_nag_passes(tmp_path: Path) -> None:
    app = build_app(environment(SHARED), app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []


def test_attach_needs_the_clusters_vpc() -> None:
    from kvfleet.errors import ConfigError

    no_vpc = SHARED.split("network:\n")[0] + "deployments:" + SHARED.split("deployments:", 1)[1]
    with pytest.raises(ConfigError) as err:
        environment(no_vpc)
    [line] = err.value.lines
    assert (
        line.startswith("test.yaml:")
        and "network.vpc_id: deployment assistant attaches to cluster platform-prod" in line
    )


def test_a_new_cluster_cannot_leave_out_keda() -> None:
    from kvfleet.errors import ConfigError

    text = PLATFORM.replace(
        '      kubernetes_version: "1.35"\n', '      kubernetes_version: "1.35"\n      addons:\n        keda: false\n'
    )
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert "deployments[0].target.addons.keda: a new cluster has nothing else to provide it" in line
    keda_line = text.splitlines().index("        keda: false") + 1
    assert line.startswith(f"test.yaml:{keda_line}:"), line


def _two_on_the_shared_cluster(second_addons: str = "") -> str:
    """shared-cluster.yaml with a second deployment on the same cluster, in its own namespace."""
    first = SHARED.split("deployments:\n", 1)[1]
    second = (
        first.replace("  - name: assistant", "  - name: summarizer")
        .replace("      namespace: assistant\n", "      namespace: summarizer\n")
        .replace("      addons:\n", "      addons:\n" + second_addons)
    )
    return SHARED + second


def test_two_deployments_on_one_cluster_install_each_addon_once() -> None:
    from kvfleet.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        environment(_two_on_the_shared_cluster())
    [line] = err.value.lines
    assert "deployments[1].target.addons.device_plugin: deployment assistant already installs it" in line
    # Reported at the second deployment's addons (device_plugin is not spelled there), where the fix goes.
    lines = _two_on_the_shared_cluster().splitlines()
    second_addons = [n for n, text in enumerate(lines, start=1) if text == "      addons:"][1]
    assert line.startswith(f"test.yaml:{second_addons}:"), line


def test_two_deployments_on_one_cluster_need_their_own_namespaces() -> None:
    from kvfleet.errors import ConfigError

    text = _two_on_the_shared_cluster().replace("      namespace: summarizer\n", "      namespace: assistant\n")
    with pytest.raises(ConfigError) as err:
        environment(text)
    assert any(
        "deployments[1].target.namespace: deployment assistant already uses namespace assistant" in line
        for line in err.value.lines
    ), err.value.lines


def test_a_second_deployment_on_the_cluster_that_installs_nothing_more_gets_its_own_stack() -> None:
    stacks = synth(_two_on_the_shared_cluster("        device_plugin: false\n"))
    assert sorted(stacks) == ["kvfleet-shared-cluster-assistant", "kvfleet-shared-cluster-summarizer"]
    second = stacks["kvfleet-shared-cluster-summarizer"]
    assert props(second, "Custom::AWSCDK-EKS-HelmChart") == []
    [ng] = props(second, "AWS::EKS::Nodegroup")
    assert ng["ClusterName"] == SHARED_CLUSTER


def test_the_gpu_nodes_driver_runs_the_images_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # The AL2023 NVIDIA AMI's driver (580) runs the vLLM DLC's CUDA 13; an older driver fails synth with the fix.
    from kvfleet.errors import KvfleetError
    from kvfleet.infra import cuda

    synthesized = synth(PLATFORM)
    assert synthesized
    from kvfleet.targets.eks.infra.hosts import HOSTS

    [eks_host] = cuda.hosts(HOSTS)
    assert eks_host.cuda >= (13, 0)
    old = dataclasses.replace(eks_host, driver_branch=550, cuda=(12, 4))
    monkeypatch.setattr(cuda, "hosts", lambda rule: (old,) if rule == HOSTS else ())
    with pytest.raises(KvfleetError, match=r"CUDA 13\.0"):
        only(PLATFORM)


@pytest.mark.parametrize("instance_type", ["p5.48xlarge", "p5en.48xlarge"])
def test_a_gpu_newer_than_cdks_list_gets_the_nvidia_node_group(instance_type: str) -> None:
    """CDK's eks-v2 knows GPU families up to g6e/p4de and refuses the NVIDIA AMI type for any other; the plan picks
    p5 and newer for EKS, so their node group carries the type on the resource itself."""
    from kvfleet.targets.eks.infra.service import CDK_GPU_FAMILIES

    assert instance_type.split(".", maxsplit=1)[0] not in CDK_GPU_FAMILIES
    text = PLATFORM.replace("families: [g6e, g5]", f"instance_type: {instance_type}")
    assert text != PLATFORM
    ng = gpu_nodegroup(only(text))
    assert ng["InstanceTypes"] == [instance_type]


def _node_role_policies(t: Template, nodegroup: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The managed policies and the inline policy statements of a node group's role."""
    role_id = nodegroup["NodeRole"]["Fn::GetAtt"][0]
    role = t.find_resources("AWS::IAM::Role")[role_id]["Properties"]
    managed = [json.dumps(a) for a in role["ManagedPolicyArns"]]
    statements = [
        s
        for p in props(t, "AWS::IAM::Policy")
        if {"Ref": role_id} in p["Roles"]
        for s in p["PolicyDocument"]["Statement"]
    ]
    return managed, statements


def test_the_node_roles_pull_the_addon_images_and_the_serving_image_only(template: Template) -> None:
    for ng in props(template, "AWS::EKS::Nodegroup"):
        managed, statements = _node_role_policies(template, ng)
        assert len(managed) == 2 and all("ContainerRegistry" not in m for m in managed), managed
        assert any("AmazonEKSWorkerNodePolicy" in m for m in managed)
        pulls = [s for s in statements if "ecr:BatchGetImage" in s["Action"]]
        resources = json.dumps([s["Resource"] for s in pulls])
        # us-east-1's EKS add-on registry (registries.ADDON_REGISTRY_ACCOUNTS), and nothing with a bare "*".
        assert ":602401143452:repository/*" in resources
        assert all(s["Resource"] != "*" for s in pulls)
        if ng["AmiType"] == "AL2023_x86_64_NVIDIA":  # and the serving image's one repository
            assert len(pulls) == 2 and ":repository/kvfleet-vllm" in resources, resources
        else:
            assert len(pulls) == 1, resources
    assert "AmazonEC2ContainerRegistryReadOnly" not in json.dumps(
        [r for k, r in template.find_resources("AWS::IAM::Role").items() if "Kubectl" not in k]
    )


def test_a_region_without_a_known_addon_registry_is_refused() -> None:
    from kvfleet.errors import ConfigError
    from kvfleet.targets.eks.infra.registries import ADDON_REGISTRY_ACCOUNTS

    assert "ap-east-2" not in ADDON_REGISTRY_ACCOUNTS
    with pytest.raises((ConfigError, Exception)) as err:
        only(PLATFORM.replace("region: us-east-1", "region: ap-east-2"))
    assert "EKS add-on image registry for ap-east-2" in str(err.value)


def test_the_gpu_nodes_may_pull_the_clusters_own_daemonset_images(shared: Template) -> None:
    # The shared cluster's log shipper tolerates the GPU taint and comes from its own repository: the node role
    # pulls it (EKS User Guide, "Amazon EKS node IAM role"), so the file names it and nothing wider is granted.
    named = "arn:aws:ecr:us-east-1:123456789012:repository/platform/*"
    policies = shared.find_resources("AWS::IAM::Policy")
    [pull] = [p["Properties"] for k, p in policies.items() if "ImagePull" in k]
    statements = pull["PolicyDocument"]["Statement"]
    pulls = [s for s in statements if "ecr:BatchGetImage" in s["Action"]]
    assert any(named in (s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]) for s in pulls)
    without = only(SHARED.replace(f"        node_image_repositories: [{named}]\n", ""))
    assert named not in json.dumps(without.to_json())


def test_a_node_image_repository_must_be_an_ecr_repository_arn() -> None:
    text = SHARED.replace("repository/platform/*]", "repository/platform/*, docker.io/fluent/fluent-bit]")
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert "node_image_repositories" in line and "an ECR repository ARN like" in line, line
