"""kvfleet on a shared cluster with access confined to its namespace (target.cluster.access: namespace): the access
entry's policy and scope, the group the owner's RBAC binds, the RBAC rendered and validated offline, what synth
refuses, and kubectl's prune left off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from aws_cdk import Stack
from aws_cdk.assertions import Template

from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.infra.app import build_app
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.targets.eks.infra import namespace_access as na
from kvfleet.targets.eks.infra.service import EksService
from tests.envs import FEATURE_FLAGS
from tests.infra.helpers import REPO, environment, make_app, props
from tests.infra.test_cfn_lint import cfn_lint

SHARED = (REPO / "environments" / "shared-cluster.yaml").read_text(encoding="utf-8")
K8S_VERSION = "1.33.0"  # as test_manifests: EKS standard support, strict schemas
CLUSTER_LINE = "        name: platform-prod\n"
ADDONS_LINE = "      addons:\n"


def namespaced(text: str = SHARED) -> str:
    """shared-cluster.yaml with namespace access and the device plugin the cluster runs itself."""
    assert CLUSTER_LINE in text and ADDONS_LINE in text
    text = text.replace("        access: cluster\n", "")
    return text.replace(CLUSTER_LINE, CLUSTER_LINE + "        access: namespace\n").replace(
        ADDONS_LINE, ADDONS_LINE + "        device_plugin: false\n"
    )


def _has_kind(text: str, kind: str) -> bool:
    return f'\\"kind\\":\\"{kind}\\"' in text


def _service(app: Any) -> EksService:
    [stack] = [c for c in app.node.children if isinstance(c, Stack) and not c.stack_name.endswith("-alerts")]
    [svc] = [c for c in stack.node.find_all() if isinstance(c, EksService)]
    return svc


@pytest.fixture(scope="module")
def built() -> tuple[Template, EksService]:
    app = build_app(environment(namespaced()), app=make_app())
    svc = _service(app)
    return Template.from_stack(Stack.of(svc)), svc


def test_the_access_entry_is_the_edit_policy_in_the_namespace_with_the_scalers_group(
    built: tuple[Template, EksService],
) -> None:
    t, _ = built
    [entry] = props(t, "AWS::EKS::AccessEntry")
    [policy] = entry["AccessPolicies"]
    assert json.dumps(policy["PolicyArn"]).endswith(':cluster-access-policy/AmazonEKSEditPolicy"]]}')
    assert policy["AccessScope"] == {"Type": "namespace", "Namespaces": ["assistant"]}
    assert entry["KubernetesGroups"] == ["kvfleet-assistant-scalers"]


def test_no_namespace_no_chart_and_no_prune(built: tuple[Template, EksService]) -> None:
    t, _ = built
    assert t.find_resources("Custom::AWSCDK-EKS-HelmChart") == {}
    applied = props(t, "Custom::AWSCDK-EKS-KubernetesResource")
    kinds = []
    for p in applied:
        text = json.dumps(p["Manifest"])
        kinds += [k for k in ("Namespace", "Deployment", "ScaledObject", "ServiceAccount") if _has_kind(text, k)]
        # kubectl apply --prune (the handler's PruneLabel) would list Namespaces and PersistentVolumes cluster-wide.
        assert "PruneLabel" not in p
        assert "aws.cdk.eks/prune-" not in text
    assert "Namespace" not in kinds and {"Deployment", "ScaledObject", "ServiceAccount"} <= set(kinds)


def test_cluster_access_keeps_admin_and_prune() -> None:
    t = Template.from_stack(Stack.of(_service(build_app(environment(SHARED), app=make_app()))))
    [entry] = props(t, "AWS::EKS::AccessEntry")
    assert entry["AccessPolicies"][0]["AccessScope"] == {"Type": "cluster"} and "KubernetesGroups" not in entry
    applied = props(t, "Custom::AWSCDK-EKS-KubernetesResource")
    assert any(json.dumps(p["Manifest"]).count('\\"kind\\":\\"Namespace\\"') for p in applied)
    assert all("PruneLabel" in p for p in applied if "ServiceAccount" not in json.dumps(p["Manifest"]))


def test_the_owner_setup_validates_and_binds_the_entrys_group(built: tuple[Template, EksService]) -> None:
    t, svc = built
    docs = svc.owner_setup
    assert [d["kind"] for d in docs] == ["Namespace", "Role", "RoleBinding"]
    for d in docs:
        assert kubernetes_validate.validate(d, K8S_VERSION, strict=True) == "1.33"
    # The rendered text is what synth prints; it parses back to the same objects.
    assert list(yaml.safe_load_all(na.render(docs))) == docs
    ns, role, binding = docs
    assert ns == k8s.namespace(svc.options)  # as kvfleet would create it, Pod Security label included
    [entry] = props(t, "AWS::EKS::AccessEntry")
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": entry["KubernetesGroups"][0]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "assistant"
    # The Role grants the ScaledObject's group and resource as the applied manifest spells its apiVersion.
    [scaled] = [m for m in svc.manifests if m["kind"] == "ScaledObject"]
    [rule] = role["rules"]
    assert rule["apiGroups"] == [scaled["apiVersion"].split("/")[0]] and rule["resources"] == ["scaledobjects"]
    assert set(rule["verbs"]) >= na.KUBECTL_VERBS


def test_synth_prints_the_owner_setup(built: tuple[Template, EksService]) -> None:
    _, svc = built
    [info] = [e.data for e in svc.node.metadata if e.type == "aws:cdk:info"]
    assert "AmazonEKSEditPolicy in namespace assistant" in str(info)
    assert "kind: RoleBinding" in str(info) and "name: kvfleet-assistant-scalers" in str(info)


def test_the_edit_policy_covers_every_kind_but_the_scaled_object() -> None:
    kinds = ["Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy", "ScaledObject"]
    assert na.uncovered(kinds) == []
    [problem] = na.uncovered(kinds, with_owner_rbac=False)
    assert problem.startswith("ScaledObject (keda.sh/scaledobjects)")
    [ns] = na.uncovered(["Namespace"])  # cluster-scoped: the policy reads it only
    assert "create, delete, patch" in ns


def test_synth_refuses_a_kind_the_access_does_not_cover(monkeypatch: pytest.MonkeyPatch) -> None:
    real = k8s.manifests

    def with_a_config_map(r: Any, opts: Any) -> Any:
        return [*real(r, opts), {"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "x"}}]

    monkeypatch.setattr(k8s, "manifests", with_a_config_map)
    with pytest.raises(KvfleetError, match=r"LimitRange: kvfleet does not know which resource serves it") as err:
        build_app(environment(namespaced()), app=make_app())
    assert (err.value.field or "").endswith("target.cluster.access")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s.replace("        device_plugin: false\n", ""), "addons.device_plugin"),
        (lambda s: s.replace("        keda: false\n", ""), "addons.keda"),
        (lambda s: s.replace("        cluster_autoscaler: false\n", ""), "addons.cluster_autoscaler"),
        (
            lambda s: s.replace("        prometheus_url: http://prometheus.observability.svc.cluster.local:9090\n", ""),
            "addons.prometheus_url",
        ),
    ],
)
def test_namespace_access_refuses_an_addon_kvfleet_would_install(change: Any, field: str) -> None:
    text = change(namespaced())
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert line.startswith("test.yaml:") and f"{field}: cluster.access namespace lets kvfleet write in" in line
    assert "\n" not in line


def test_a_misspelt_access_is_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        environment(namespaced().replace("access: namespace", "access: namespaced"))
    [line] = err.value.lines
    lineno = namespaced().splitlines().index("        access: namespace") + 1
    assert line.startswith(f"test.yaml:{lineno}:") and "access" in line


def test_namespace_access_passes_cdk_nag_and_cfn_lint(tmp_path: Path) -> None:
    # As `make synth` runs it: CloudFormation validation and cdk-nag on; cfn-lint holds KubernetesGroups and the
    # namespace AccessScope to the AWS::EKS::AccessEntry resource specification.
    app = build_app(environment(namespaced()), app=cdk.App(context=FEATURE_FLAGS, outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []
    result = cfn_lint(sorted(tmp_path.glob("*.template.json")), "us-east-1")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
