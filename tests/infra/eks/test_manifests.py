"""Kubernetes manifests: schema-valid offline, consistent with the nodes and the agent, and the checks bite."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from kvfleet import contract
from kvfleet.contract import MODEL_DIR as SAGEMAKER_MODEL_DIR
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.engines import EngineArgs
from kvfleet.targets.eks.config import EksVersion
from kvfleet.targets.eks.infra import checks
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.targets.eks.infra.manifests import WorkloadOptions
from tests.envs import SAGEMAKER_ENV, environment

K8S_VERSION = "1.33.0"  # EKS standard support; the strict schemas reject unknown fields
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OPTS = WorkloadOptions(
    image="123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:0.30.0",
    prometheus_server_address="http://prometheus-server.monitoring.svc:9090",
)
BIG_ENV = SAGEMAKER_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.3-70B-Instruct").replace(
    "instance_type: ml.g6e.xlarge", "instance_type: ml.p4de.24xlarge"
)
S3_ENV = SAGEMAKER_ENV.replace(
    "      hf_token_secret: kvfleet/hf-token\n", "      s3_uri: s3://model-bucket/llama/8b/\n"
)
S3_OPTS = WorkloadOptions(
    image=OPTS.image,
    prometheus_server_address=OPTS.prometheus_server_address,
    model_sync_image="public.ecr.aws/aws-cli/aws-cli:2.27.0",
)


def resolve(text: str = SAGEMAKER_ENV) -> ResolvedDeployment:
    [r] = resolve_environment(environment(text))
    return r


@pytest.fixture(scope="module")
def small() -> ResolvedDeployment:
    return resolve()


@pytest.fixture(scope="module")
def big() -> ResolvedDeployment:
    r = resolve(BIG_ENV)
    assert r.candidate.tensor_parallel_size == 8  # the case where TP, node size and startup matter
    return r


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(k8s.KEDA_SCALEDOBJECT_SCHEMA.read_text(encoding="utf-8"))
    return doc


def by_kind(ms: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [m] = [m for m in ms if m["kind"] == kind]
    return m


def container(ms: list[dict[str, Any]]) -> dict[str, Any]:
    [c] = by_kind(ms, "Deployment")["spec"]["template"]["spec"]["containers"]
    out: dict[str, Any] = c
    return out


def pod_spec(ms: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(ms, "Deployment")["spec"]["template"]["spec"]
    return spec


def problems(r: ResolvedDeployment, ms: list[dict[str, Any]], **overrides: Any) -> list[str]:
    kw: dict[str, Any] = {
        "node_taints": [TAINT],
        "gpus_per_node": r.candidate.instance.accelerator_count,
        "tensor_parallel_size": r.candidate.tensor_parallel_size,
        "drain_budget_s": r.deployment.scaling.drain_budget_s,
    }
    return checks.check_consistency(ms, **(kw | overrides))


def triggers(ms: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in by_kind(ms, "ScaledObject")["spec"]["triggers"]}


# ---- schema validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "opts"), [(SAGEMAKER_ENV, OPTS), (BIG_ENV, OPTS), (S3_ENV, S3_OPTS)])
@pytest.mark.parametrize("version", get_args(EksVersion))
def test_core_manifests_validate_strictly(text: str, opts: WorkloadOptions, version: str) -> None:
    # Against the schemas of every Kubernetes version a config may name (kubernetes-validate ships 1.33-1.37).
    ms = [k8s.namespace(opts), *k8s.manifests(resolve(text), opts)]
    core = [m for m in ms if m["kind"] != "ScaledObject"]
    assert {m["kind"] for m in core} == {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    for m in core:
        assert kubernetes_validate.validate(m, f"{version}.0", strict=True) == version


def test_strict_validation_rejects_an_unknown_field(small: ResolvedDeployment) -> None:
    dep = k8s.deployment(small, OPTS)
    dep["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 1
    with pytest.raises(kubernetes_validate.ValidationError, match="gpuCount"):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    pdb = k8s.pod_disruption_budget(small, OPTS)
    pdb["spec"]["maxUnavailable"] = {"pods": 1}  # int-or-string, never an object
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)


def test_keda_schema_is_a_valid_draft_2020_12_schema(schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "KEDA 2.17" in schema["$comment"]


@pytest.mark.parametrize(("text", "opts"), [(SAGEMAKER_ENV, OPTS), (BIG_ENV, OPTS)])
def test_scaled_object_validates_against_the_keda_schema(
    schema: dict[str, Any], text: str, opts: WorkloadOptions
) -> None:
    jsonschema.validate(k8s.scaled_object(resolve(text), opts), schema)
    authed = WorkloadOptions(
        image=OPTS.image,
        prometheus_server_address="https://aps-workspaces.us-east-1.amazonaws.com/workspaces/ws-0123",
        trigger_authentication="amp-pod-identity",
        prometheus_aws_region="us-east-1",
    )
    so = k8s.scaled_object(resolve(text), authed)
    jsonschema.validate(so, schema)
    for t in so["spec"]["triggers"]:
        assert t["authenticationRef"] == {"name": "amp-pod-identity", "kind": "TriggerAuthentication"}
        assert t["metadata"]["awsRegion"] == "us-east-1"


def _numeric_threshold(so: dict[str, Any]) -> None:
    so["spec"]["triggers"][1]["metadata"]["threshold"] = 2


def _unknown_spec_key(so: dict[str, Any]) -> None:
    so["spec"]["minReplicas"] = 1  # the HPA's spelling, not KEDA's


def _no_scale_target(so: dict[str, Any]) -> None:
    del so["spec"]["scaleTargetRef"]


def _unknown_trigger_key(so: dict[str, Any]) -> None:
    so["spec"]["triggers"][0]["threshold"] = "0.75"  # belongs in metadata


def _bad_metric_type(so: dict[str, Any]) -> None:
    so["spec"]["triggers"][0]["metricType"] = "Average"


def _prometheus_without_query(so: dict[str, Any]) -> None:
    del so["spec"]["triggers"][0]["metadata"]["query"]


def _unknown_behavior_key(so: dict[str, Any]) -> None:
    so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["cooldown"] = 300


def _bad_policy_type(so: dict[str, Any]) -> None:
    so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["policies"][0]["type"] = "Replicas"


@pytest.mark.parametrize(
    "break_it",
    [
        _numeric_threshold,
        _unknown_spec_key,
        _no_scale_target,
        _unknown_trigger_key,
        _bad_metric_type,
        _prometheus_without_query,
        _unknown_behavior_key,
        _bad_policy_type,
    ],
)
def test_keda_schema_rejects(schema: dict[str, Any], small: ResolvedDeployment, break_it: Any) -> None:
    so = k8s.scaled_object(small, OPTS)
    jsonschema.validate(so, schema)  # valid before the change: the change is what fails
    break_it(so)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, schema)


# ---- consistency -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "opts"), [(SAGEMAKER_ENV, OPTS), (BIG_ENV, OPTS), (S3_ENV, S3_OPTS)])
def test_generated_manifests_are_consistent(text: str, opts: WorkloadOptions) -> None:
    r = resolve(text)
    assert problems(r, k8s.manifests(r, opts)) == []


@pytest.mark.parametrize(
    ("taint", "why"),
    [
        ({**TAINT, "effect": "NoExecute"}, "nvidia.com/gpu=present:NoExecute"),
        ({**TAINT, "key": "example.com/dedicated"}, "example.com/dedicated=present:NoSchedule"),
        ({**TAINT, "value": "true"}, "nvidia.com/gpu=true:NoSchedule"),
    ],
)
def test_a_changed_node_taint_fails(small: ResolvedDeployment, taint: dict[str, str], why: str) -> None:
    found = problems(small, k8s.manifests(small, OPTS), node_taints=[taint])
    assert found == [f"node taint {why} is not tolerated by the pod"]


def test_a_changed_toleration_fails(small: ResolvedDeployment) -> None:
    ms = k8s.manifests(small, OPTS)
    pod_spec(ms)["tolerations"][0]["effect"] = "NoExecute"
    assert problems(small, ms) == ["node taint nvidia.com/gpu=present:NoSchedule is not tolerated by the pod"]


def test_toleration_matching_honors_exists_and_empty_effect(small: ResolvedDeployment) -> None:
    other = {"key": "nvidia.com/gpu", "value": "anything", "effect": "NoExecute"}
    ms = k8s.manifests(small, OPTS)
    assert problems(small, ms, node_taints=[other])  # Equal with value "present" does not match
    pod_spec(ms)["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]  # any value, any effect
    assert problems(small, ms, node_taints=[TAINT, other]) == []
    assert problems(small, ms, node_taints=[{**TAINT, "key": "other"}])  # but only that key
    pod_spec(ms)["tolerations"] = [{"operator": "Exists"}]  # everything
    assert problems(small, ms, node_taints=[TAINT, other, {**TAINT, "key": "other"}]) == []
    # A soft taint only steers the scheduler: it needs no toleration.
    pod_spec(ms)["tolerations"] = []
    assert problems(small, ms, node_taints=[{**TAINT, "effect": "PreferNoSchedule"}]) == []


def test_a_wrong_gpu_count_fails(small: ResolvedDeployment, big: ResolvedDeployment) -> None:
    ms = k8s.manifests(small, OPTS)
    res = container(ms)["resources"]
    res["requests"]["nvidia.com/gpu"] = res["limits"]["nvidia.com/gpu"] = "2"
    found = problems(small, ms)
    assert any("limit is 2, the tensor-parallel degree is 1" in p for p in found)
    assert any("a node has 1: the pod never schedules" in p for p in found)
    # Requests differing from limits.
    ms = k8s.manifests(small, OPTS)
    container(ms)["resources"]["requests"]["nvidia.com/gpu"] = "0"
    assert problems(small, ms) == ["nvidia.com/gpu requests (0) differ from limits (1)"]
    # TP 8 on nodes with 4 GPUs.
    assert problems(big, k8s.manifests(big, OPTS), gpus_per_node=4) == [
        "nvidia.com/gpu limit is 8, a node has 4: the pod never schedules"
    ]
    # The engine flags disagree with the plan's degree.
    assert problems(big, k8s.manifests(big, OPTS), tensor_parallel_size=4) == [
        "nvidia.com/gpu limit is 8, the tensor-parallel degree is 4",
        "the engine runs tensor parallel 8, the plan says 4",
    ]


@pytest.mark.parametrize("short_by", [1, 0, -29])  # under the budget, at it, and under the stop margin
def test_a_grace_period_below_the_drain_budget_fails(small: ResolvedDeployment, short_by: int) -> None:
    ms = k8s.manifests(small, OPTS)
    pod_spec(ms)["terminationGracePeriodSeconds"] = small.deployment.scaling.drain_budget_s - short_by
    [p] = problems(small, ms)
    assert p.startswith("terminationGracePeriodSeconds")
    assert problems(small, k8s.manifests(small, OPTS), drain_budget_s=small.deployment.scaling.drain_budget_s + 40)


def test_the_other_checks_fail_when_broken(small: ResolvedDeployment) -> None:
    def broken(change: Any) -> list[str]:
        ms = k8s.manifests(small, OPTS)
        change(ms)
        return problems(small, ms)

    def short_startup(ms: list[dict[str, Any]]) -> None:
        container(ms)["startupProbe"]["failureThreshold"] = 30  # 300 s for a ~390 s load

    def no_drain(ms: list[dict[str, Any]]) -> None:
        container(ms)["lifecycle"]["preStop"]["exec"]["command"] = ["sleep", "30"]

    def wrong_target(ms: list[dict[str, Any]]) -> None:
        by_kind(ms, "ScaledObject")["spec"]["scaleTargetRef"]["name"] = "chat"

    def summed_saturation(ms: list[dict[str, Any]]) -> None:
        triggers(ms)[k8s.TRIGGER_SATURATION]["metricType"] = "AverageValue"

    def raw_kv_use(ms: list[dict[str, Any]]) -> None:
        t = triggers(ms)[k8s.TRIGGER_SATURATION]["metadata"]
        t["query"] = t["query"].replace(
            contract.REPLICA_SATURATION.prometheus_name, contract.KV_CACHE_UTILIZATION.prometheus_name
        )

    def other_deployment(ms: list[dict[str, Any]]) -> None:
        t = triggers(ms)[k8s.TRIGGER_QUEUE]["metadata"]
        t["query"] = t["query"].replace("test-chat", "prod-chat")

    def renamed_metric(ms: list[dict[str, Any]]) -> None:
        t = triggers(ms)[k8s.TRIGGER_QUEUE]["metadata"]
        t["query"] = t["query"].replace(contract.REQUESTS_WAITING.prometheus_name, "vllm:num_requests_waiting")

    def service_selects_nothing(ms: list[dict[str, Any]]) -> None:
        by_kind(ms, "Service")["spec"]["selector"]["app.kubernetes.io/instance"] = "chat"

    assert any("startup probe allows 300 s" in p for p in broken(short_startup))
    assert any(p.startswith("preStop runs ['sleep', '30']") for p in broken(no_drain))
    assert any("scales Deployment/chat, not test-chat" in p for p in broken(wrong_target))
    assert any("is AverageValue, expected Value" in p for p in broken(summed_saturation))
    # A trigger on raw KV use (the old signal, which may never reach its target) is no trigger on saturation.
    assert f"no trigger scales on {contract.REPLICA_SATURATION.prometheus_name}" in broken(raw_kv_use)
    assert any("does not select deployment='test-chat'" in p for p in broken(other_deployment))
    found = broken(renamed_metric)
    assert any("not exactly one of the contract's signals" in p for p in found)
    assert f"no trigger scales on {contract.REQUESTS_WAITING.prometheus_name}" in found
    assert any(p.startswith("the Service selector") for p in broken(service_selects_nothing))


def _set_env(ms: list[dict[str, Any]], name: str, value: str | None) -> None:
    env = [e for e in container(ms)["env"] if e["name"] != name]
    container(ms)["env"] = env if value is None else [*env, {"name": name, "value": value}]


def test_the_engine_degree_is_read_from_the_engine_args(big: ResolvedDeployment) -> None:
    tp8 = big.engine_args
    ms = k8s.manifests(big, OPTS)
    _set_env(ms, contract.ENV_ENGINE_ARGS, dataclasses.replace(tp8, tensor_parallel_size=4).to_json())
    assert problems(big, ms) == ["the engine runs tensor parallel 4, the plan says 8"]
    # Unset, the engine runs its default of one GPU.
    _set_env(ms, contract.ENV_ENGINE_ARGS, dataclasses.replace(tp8, tensor_parallel_size=None).to_json())
    assert problems(big, ms) == ["the engine runs tensor parallel 1, the plan says 8"]
    # Settings the agent would refuse, or none at all (an image without the agent), fail too.
    _set_env(ms, contract.ENV_ENGINE_ARGS, '{"tensor-parallel-size": 8}')
    [p] = problems(big, ms)
    assert p.startswith(f"{contract.ENV_ENGINE_ARGS} is not engine settings") and "'tensor-parallel-size'" in p
    _set_env(ms, contract.ENV_ENGINE_ARGS, None)
    [p] = problems(big, ms)
    assert p.startswith(f"the serving container sets no {contract.ENV_ENGINE_ARGS}")
    # vLLM's flag spelling in some other variable is not what the agent reads: it changes nothing.
    ms = k8s.manifests(big, OPTS)
    _set_env(ms, "SM_VLLM_TENSOR_PARALLEL_SIZE", "4")
    assert problems(big, ms) == []


def test_node_labels_are_checked_when_given(small: ResolvedDeployment) -> None:
    ms = k8s.manifests(small, OPTS)
    labels = dict(pod_spec(ms)["nodeSelector"])
    assert problems(small, ms, node_labels=labels) == []
    labels["node.kubernetes.io/instance-type"] = "g6e.2xlarge"
    assert problems(small, ms, node_labels=labels) == [
        "nodeSelector node.kubernetes.io/instance-type=g6e.xlarge does not match the nodes "
        "(node.kubernetes.io/instance-type=g6e.2xlarge)"
    ]


# ---- properties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [SAGEMAKER_ENV, BIG_ENV])
def test_gpus_requested_are_the_tensor_parallel_degree(text: str) -> None:
    r = resolve(text)
    res = container(k8s.manifests(r, OPTS))["resources"]
    tp = str(r.candidate.tensor_parallel_size)
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == tp
    assert set(res["limits"]) == {"nvidia.com/gpu"}  # no CPU throttling, no memory OOM on page cache


def test_cpu_and_memory_are_the_pods_share_of_the_node(small: ResolvedDeployment, big: ResolvedDeployment) -> None:
    # g6e.xlarge: 4 vCPUs, 32 GiB, 1 GPU; p4de.24xlarge: 96 vCPUs, 1152 GiB, 8 GPUs; both one pod per node.
    assert {"cpu": "3", "memory": "24Gi"}.items() <= container(k8s.manifests(small, OPTS))["resources"][
        "requests"
    ].items()
    assert container(k8s.manifests(big, OPTS))["resources"]["requests"]["cpu"] == "72"


@pytest.mark.parametrize("text", [SAGEMAKER_ENV, BIG_ENV])
def test_startup_probe_waits_twice_the_model_load(text: str) -> None:
    r = resolve(text)
    probe = container(k8s.manifests(r, OPTS))["startupProbe"]
    assert probe["httpGet"] == {"path": "/ping", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 2 * r.startup.ready_s
    readiness = container(k8s.manifests(r, OPTS))["readinessProbe"]
    assert (readiness["httpGet"]["path"], readiness["periodSeconds"], readiness["failureThreshold"]) == ("/ping", 5, 2)


def test_a_bigger_model_waits_longer(small: ResolvedDeployment, big: ResolvedDeployment) -> None:
    assert k8s.startup_window_s(big) > k8s.startup_window_s(small)


def test_liveness_survives_a_drain_and_an_engine_restart_but_not_a_failed_one(small: ResolvedDeployment) -> None:
    # /ping is 503 while draining and restarting: liveness must not look at it. The liveness route is 200 through
    # both (tests/agent/test_liveness.py) and 503 once the restart budget, in the container's environment, is spent.
    c = container(k8s.manifests(small, OPTS))
    live = c["livenessProbe"]
    assert live["httpGet"] == {"path": contract.LIVENESS_ROUTE, "port": "http"}
    assert live["httpGet"]["path"] != contract.HEALTH_ROUTE
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[contract.ENV_RESTART_BUDGET_S] == str(small.restart_budget_s)


def test_prestop_drains_within_the_grace_period(small: ResolvedDeployment) -> None:
    ms = k8s.manifests(small, OPTS)
    assert container(ms)["lifecycle"]["preStop"] == {"exec": {"command": ["kvfleet-agent", "drain"]}}
    grace = pod_spec(ms)["terminationGracePeriodSeconds"]
    assert grace == small.deployment.scaling.drain_budget_s + 60 == 480


def test_security_context_is_the_images_non_root_user(small: ResolvedDeployment) -> None:
    ms = k8s.manifests(small, OPTS)
    assert {"runAsNonRoot": True, "runAsUser": 10001}.items() <= pod_spec(ms)["securityContext"].items()
    sc = container(ms)["securityContext"]
    assert (sc["runAsNonRoot"], sc["runAsUser"], sc["allowPrivilegeEscalation"]) == (True, 10001, False)


def test_scheduling_tolerates_the_default_taint_and_spreads_over_zones(small: ResolvedDeployment) -> None:
    spec = pod_spec(k8s.manifests(small, OPTS))
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"}
    ]
    assert spec["nodeSelector"] == {
        "kvfleet.io/gpu": "true",
        "kvfleet.io/deployment": "test-chat",
        "node.kubernetes.io/instance-type": "g6e.xlarge",
    }
    [spread] = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == k8s.selector_labels(small)


def test_pod_is_scraped_and_mounts_shm_and_the_model_cache(small: ResolvedDeployment) -> None:
    dep = k8s.deployment(small, OPTS)
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8080",
        "prometheus.io/path": "/metrics",
    }
    spec = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts == {"/dev/shm": "dshm", "/home/kvfleet/.cache/huggingface": "model-cache"}
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert "replicas" not in dep["spec"]  # the HPA's (see test_the_autoscaler_owns_the_replica_count)


def test_the_autoscaler_owns_the_replica_count(small: ResolvedDeployment) -> None:
    # Kubernetes docs (Horizontal Pod Autoscaling, "Migrating Deployments and StatefulSets to horizontal
    # autoscaling"): with an HPA, spec.replicas is left out of the manifest, or every apply of it (the kubectl
    # provider applies each stack update with `kubectl apply`) scales the Deployment back to that value.
    ms = k8s.manifests(small, OPTS)
    assert "replicas" not in by_kind(ms, "Deployment")["spec"]
    assert problems(small, ms) == []
    # The broken variant: the manifest the stack used to apply.
    by_kind(ms, "Deployment")["spec"]["replicas"] = small.initial_instance_count
    assert problems(small, ms) == [
        f"the Deployment sets spec.replicas {small.initial_instance_count}: every stack update would reset the "
        "autoscaled count"
    ]


def test_container_environment_is_the_resolved_one_sorted(small: ResolvedDeployment) -> None:
    c = container(k8s.manifests(small, OPTS))
    names = [e["name"] for e in c["env"]]
    assert names == sorted(names)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == small.container_environment() | {"AWS_REGION": "us-east-1"}
    # The engine settings travel as the plan decided them, engine-neutral.
    args = EngineArgs.from_json(env[contract.ENV_ENGINE_ARGS])
    assert args == small.engine_args
    assert (args.tensor_parallel_size, args.max_num_seqs) == (1, 16)
    assert c["args"] == ["serve"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]


def test_s3_weights_are_copied_by_an_init_container(small: ResolvedDeployment) -> None:
    r = resolve(S3_ENV)
    spec = pod_spec(k8s.manifests(r, S3_OPTS))
    [sync] = spec["initContainers"]
    assert sync["command"][-2:] == ["s3://model-bucket/llama/8b/", SAGEMAKER_MODEL_DIR]
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts[SAGEMAKER_MODEL_DIR]["readOnly"] is True
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env[contract.ENV_MODEL] == SAGEMAKER_MODEL_DIR
    with pytest.raises(ValueError, match="model_sync_image"):
        k8s.manifests(r, OPTS)
    assert "initContainers" not in pod_spec(k8s.manifests(small, OPTS))


def test_service_and_pdb(small: ResolvedDeployment) -> None:
    svc = k8s.service(small, OPTS)
    assert svc["spec"]["type"] == "ClusterIP"
    # The container's port, as the VPC CNI's NetworkPolicy enforcement requires (k8s.SERVICE_PORT).
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": contract.SERVING_PORT, "targetPort": "http", "protocol": "TCP"}
    ]
    pdb = k8s.pod_disruption_budget(small, OPTS)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"] == k8s.selector_labels(small)


def test_scale_up_is_fast_and_scale_down_stabilized(small: ResolvedDeployment) -> None:
    spec = by_kind(k8s.manifests(small, OPTS), "ScaledObject")["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    assert {(p["type"], p["value"], p["periodSeconds"]) for p in up["policies"]} == {
        ("Pods", 2, 60),
        ("Percent", 100, 60),
    }
    # The wait every target uses: 15 minutes here, since twice the 420 s drain budget is only 840 s.
    assert down["stabilizationWindowSeconds"] == small.scaling.scale_in_wait_s == 900
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 300)
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "test-chat"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    with pytest.raises(ValueError, match="scale_down_stabilization_s"):
        WorkloadOptions(image="i", prometheus_server_address="p", scale_down_stabilization_s=300)
    # A longer wait from the file (or scaling.derive) is the window; the HPA takes at most an hour.
    longer = dataclasses.replace(small, scaling=dataclasses.replace(small.scaling, scale_in_wait_s=2700))
    down = by_kind(k8s.manifests(longer, OPTS), "ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    assert down["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 2700


def test_triggers_use_the_contracts_signals_and_the_configs_targets(small: ResolvedDeployment) -> None:
    s = small.scaling
    ts = triggers(k8s.manifests(small, OPTS))
    assert set(ts) == {k8s.TRIGGER_SATURATION, k8s.TRIGGER_QUEUE}
    sat, queue = ts[k8s.TRIGGER_SATURATION], ts[k8s.TRIGGER_QUEUE]
    assert sat["metadata"]["query"] == f'avg({contract.REPLICA_SATURATION.prometheus_name}{{deployment="test-chat"}})'
    assert queue["metadata"]["query"] == f'sum({contract.REQUESTS_WAITING.prometheus_name}{{deployment="test-chat"}})'
    assert {contract.REPLICA_SATURATION, contract.REQUESTS_WAITING} == set(contract.SCALING_SIGNALS)
    assert (sat["metricType"], queue["metricType"]) == ("Value", "AverageValue")
    assert sat["metadata"]["threshold"] == "0.75"
    assert float(sat["metadata"]["threshold"]) == s.saturation_target
    assert isinstance(queue["metadata"]["threshold"], str)
    assert float(queue["metadata"]["threshold"]) == s.queue_depth_target
    for t in (sat, queue):
        assert t["type"] == "prometheus"
        assert t["metadata"]["serverAddress"] == OPTS.prometheus_server_address
        assert all(isinstance(v, str) for v in t["metadata"].values())
    tuned = resolve(
        SAGEMAKER_ENV.replace(
            "      drain_budget_s: 420\n",
            "      drain_budget_s: 420\n      queue_depth_target: 3.5\n      saturation_target: 0.6\n",
        )
    )
    tuned_triggers = triggers(k8s.manifests(tuned, OPTS))
    assert tuned_triggers[k8s.TRIGGER_QUEUE]["metadata"]["threshold"] == "3.5"
    assert tuned_triggers[k8s.TRIGGER_SATURATION]["metadata"]["threshold"] == "0.6"


def test_manifests_are_plain_json_data(small: ResolvedDeployment) -> None:
    ms = [k8s.namespace(OPTS), *k8s.manifests(small, OPTS)]
    assert json.loads(json.dumps(ms)) == ms  # no tuples, sets or objects that a YAML dump would mangle
    assert [m["kind"] for m in k8s.manifests(small, OPTS)] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ScaledObject",
        "NetworkPolicy",
    ]


def test_gpus_follow_the_tensor_parallel_degree_not_the_node_size(big: ResolvedDeployment) -> None:
    # Two TP-2 engines' worth of an 8-GPU node: each pod asks for its 2 GPUs and a quarter of the node. The typed
    # engine settings are decided once, with the candidate: a plan of TP 2 carries TP 2 in both.
    r = dataclasses.replace(
        big,
        candidate=dataclasses.replace(big.candidate, tensor_parallel_size=2),
        engine_args=dataclasses.replace(big.engine_args, tensor_parallel_size=2),
    )
    ms = k8s.manifests(r, OPTS)
    res = container(ms)["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "2"
    assert res["requests"]["cpu"] == "18"  # 96 vCPUs x 2/8 x 0.75
    assert problems(r, ms, gpus_per_node=8) == []
    # Changing only the candidate leaves the engine at TP 8 on 2 GPUs: the check sees it.
    stale = dataclasses.replace(r, engine_args=big.engine_args)
    assert problems(stale, k8s.manifests(stale, OPTS), gpus_per_node=8) == [
        "the engine runs tensor parallel 8, the plan says 2"
    ]


def test_host_path_model_cache(small: ResolvedDeployment) -> None:
    opts = dataclasses.replace(OPTS, model_cache_host_path="/mnt/nvme/kvfleet")
    ms = [k8s.namespace(opts), *k8s.manifests(small, opts)]
    for m in ms:
        if m["kind"] != "ScaledObject":
            kubernetes_validate.validate(m, K8S_VERSION, strict=True)
    volumes = {v["name"]: v for v in pod_spec(ms)["volumes"]}
    assert volumes["model-cache"] == {
        "name": "model-cache",
        "hostPath": {"path": "/mnt/nvme/kvfleet", "type": "Directory"},
    }
    assert "ephemeral-storage" not in container(ms)["resources"]["requests"]
    # hostPath is outside the "restricted" Pod Security level; the emptyDir default is inside it.
    assert "pod-security.kubernetes.io/enforce" not in by_kind(ms, "Namespace")["metadata"]["labels"]
    labels = k8s.namespace(OPTS)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
