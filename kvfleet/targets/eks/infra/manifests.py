"""Kubernetes manifests for one deployment: Deployment, Service, PodDisruptionBudget, KEDA ScaledObject.

Pure functions from a ResolvedDeployment to plain dicts (no aws_cdk): the EKS stack applies them, the
tests validate them offline (core kinds against the Kubernetes OpenAPI schemas, the ScaledObject against
``schemas/keda-scaledobject.schema.json``), and ``checks.check_consistency`` proves that the pieces fit
the nodes they land on and the agent inside the pod.

Everything that has a reason elsewhere comes from there: GPUs from the plan's tensor-parallel degree,
the startup window from the model-load estimate, the grace period from the drain budget, the scaling
queries from the signals contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvfleet import contract
from kvfleet.config.schema import SCALE_IN_MIN_S
from kvfleet.contract import (
    AGENT_UID,
    DRAIN_COMMAND,
    HEALTH_ROUTE,
    LIVENESS_ROUTE,
    METRICS_ROUTE,
    SERVE_ARG,
    SERVING_PORT,
)
from kvfleet.contract import HF_HOME as HF_CACHE_DIR
from kvfleet.contract import MODEL_DIR as SAGEMAKER_MODEL_DIR
from kvfleet.deployments import IMAGE_DISK_GIB, LOAD_PADDING, ResolvedDeployment
from kvfleet.scaling import AutoscalerKind, Hpa, HpaTrigger

Manifest = dict[str, Any]

KEDA_SCALEDOBJECT_SCHEMA = Path(__file__).parent / "schemas" / "keda-scaledobject.schema.json"

APP_NAME = "kvfleet"
CONTAINER_NAME = "serving"
PORT_NAME = "http"
# The Service listens on the container's port: the VPC CNI's NetworkPolicy enforcement requires "the service port
# must be the same as the container port" (EKS User Guide, "Limit Pod traffic with Kubernetes network policies",
# Considerations), so that a caller's egress policy matches the Service's address and port.
SERVICE_PORT = SERVING_PORT
STARTUP_ESTIMATE_ANNOTATION = "kvfleet.io/startup-estimate-s"
# The startup probe allows twice the estimate, as the SageMaker and EC2 timeouts do: a probe that gives
# up too early kills a replica that was about to come up, and it then starts the whole load over.
STARTUP_SAFETY = LOAD_PADDING
STARTUP_PERIOD_S = 10
# After preStop returns, SIGTERM stops the agent and the engine frees GPU memory: allow this much.
ENGINE_STOP_S = 60
MIN_SCALE_DOWN_STABILIZATION_S = SCALE_IN_MIN_S
TRIGGER_SATURATION = "replica-saturation"
TRIGGER_QUEUE = "requests-waiting"


@dataclass(frozen=True, kw_only=True)
class WorkloadOptions:
    """What the cluster decides, not the plan: image, node labels and taints, Prometheus, scaling pace."""

    image: str
    prometheus_server_address: str  # Prometheus-compatible query endpoint KEDA polls (AMP: the workspace URL)
    namespace: str = "kvfleet"
    service_account_name: str | None = None  # IRSA / Pod Identity: Secrets Manager (HF token), S3 (weights)
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: Mapping[str, str] = field(default_factory=lambda: {"kvfleet.io/gpu": "true"})
    # Node label naming the deployment a node group is for (value: the deployment id); None: no such label.
    deployment_node_label: str | None = "kvfleet.io/deployment"
    # Pin the planned instance type: the engine flags (memory utilization, max_num_seqs) are sized for it.
    pin_instance_type: bool = True
    taint_key: str = "nvidia.com/gpu"
    taint_value: str = "present"
    taint_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    topology_key: str = "topology.kubernetes.io/zone"
    shm_size_gib: int = 16  # NCCL between tensor-parallel ranks uses /dev/shm
    # Model cache on a node directory (e.g. the instance-store NVMe) instead of an emptyDir. The directory
    # must exist and be writable by the agent's UID; it also rules out the "restricted" Pod Security level.
    model_cache_host_path: str | None = None
    # Image with the AWS CLI for the init container that copies model.s3_uri; required when it is set.
    model_sync_image: str | None = None
    # Share of the node's CPU and memory (per GPU requested) a pod asks for; the rest is for the kubelet,
    # the system daemons and DaemonSets. cpu_request / memory_request override it.
    resource_fraction: float = 0.75
    cpu_request: str | None = None
    memory_request: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    # A scale-down window longer than the deployment's scale-in wait (the HPA's pace and its other numbers are the
    # deployment's autoscaler's: kvfleet.scaling.Hpa).
    scale_down_stabilization_s: int = MIN_SCALE_DOWN_STABILIZATION_S
    # KEDA authentication for the Prometheus endpoint. For Amazon Managed Service for Prometheus: a
    # TriggerAuthentication with podIdentity provider "aws", and the workspace's region for SigV4.
    trigger_authentication: str | None = None
    trigger_authentication_kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] = (
        "TriggerAuthentication"
    )
    prometheus_aws_region: str | None = None
    # Also publish the signals to CloudWatch (the deployment's dashboard and alarms read them there).
    put_metric_data: bool = False
    # Who the NetworkPolicy admits to the serving port: pods in these namespaces (an ingress controller, the
    # applications that call the model, Prometheus for its scrape) and these CIDRs (the subnets of an ALB with
    # target-type ip, whose ENIs connect to the pods' addresses). Nothing else in the cluster reaches the pods.
    client_namespaces: tuple[str, ...] = ()
    client_cidrs: tuple[str, ...] = ()
    # Every namespace's pods are callers (target.clients: cluster): the policy still closes every other port and
    # every address outside the cluster's pods.
    clients_in_every_namespace: bool = False

    def __post_init__(self) -> None:
        if not MIN_SCALE_DOWN_STABILIZATION_S <= self.scale_down_stabilization_s <= 3600:
            raise ValueError(
                f"scale_down_stabilization_s must be {MIN_SCALE_DOWN_STABILIZATION_S}..3600 (HPA's maximum), "
                f"not {self.scale_down_stabilization_s}"
            )
        if not 0 < self.resource_fraction <= 1:
            raise ValueError(f"resource_fraction must be in (0, 1], not {self.resource_fraction}")
        if self.shm_size_gib < 1:
            raise ValueError("shm_size_gib must be 1 or more")


def name(r: ResolvedDeployment) -> str:
    """Object name shared by every manifest of the deployment (a DNS label: env and deployment names are)."""
    return r.deployment_id


def selector_labels(r: ResolvedDeployment) -> dict[str, str]:
    """The labels that select the pods: Deployment selector, Service, PDB and spread constraints."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": r.deployment_id}


def _labels(r: ResolvedDeployment) -> dict[str, str]:
    return {**selector_labels(r), "app.kubernetes.io/component": "serving", "app.kubernetes.io/managed-by": "kvfleet"}


def _metadata(r: ResolvedDeployment, opts: WorkloadOptions, **extra: Any) -> dict[str, Any]:
    return {"name": name(r), "namespace": opts.namespace, "labels": _labels(r), **extra}


def startup_window_s(r: ResolvedDeployment) -> int:
    """Seconds the startup probe allows: twice launch-to-ready (image pull, download, load, engine init),
    rounded up to a minute."""
    return r.ready_window_s


def termination_grace_s(r: ResolvedDeployment) -> int:
    """The preStop drain (up to the drain budget) plus the engine's own stop, both within the grace period."""
    return r.scaling.drain_budget_s + ENGINE_STOP_S


def hpa(r: ResolvedDeployment) -> Hpa:
    """The deployment's autoscaler: the HPA its ScaledObject configures."""
    rule = r.scaling.on(AutoscalerKind.HPA)
    assert isinstance(rule, Hpa)
    return rule


def scale_down_stabilization_s(r: ResolvedDeployment, opts: WorkloadOptions) -> int:
    # The scale-in wait every target uses (or a longer one from the options); HPA caps the window at an hour.
    return max(opts.scale_down_stabilization_s, hpa(r).scale_down_window_s)


def _gpus(r: ResolvedDeployment) -> int:
    # One pod is one engine: it gets exactly its GPUs (tensor x pipeline ranks), so several engines can share a node.
    return r.candidate.gpus_per_replica


def _cpu_memory(r: ResolvedDeployment, opts: WorkloadOptions) -> tuple[str, str]:
    it = r.candidate.instance
    share = _gpus(r) / max(1, it.accelerator_count) * opts.resource_fraction
    cpu = opts.cpu_request or str(max(1, math.floor((it.vcpus or 4) * share)))
    memory = opts.memory_request or f"{max(4, math.floor((it.ram_gib or 16) * share))}Gi"
    return cpu, memory


def model_cache_gib(r: ResolvedDeployment) -> int:
    return max(1, r.disk_gib - IMAGE_DISK_GIB)  # the weights with room for a retried download


def _env(r: ResolvedDeployment, opts: WorkloadOptions) -> list[dict[str, str]]:
    env = dict(r.container_environment())
    if opts.put_metric_data:
        # No log driver turns stdout into metrics here: the agent sends the signals to CloudWatch itself.
        env[contract.ENV_PUT_METRIC_DATA] = "1"
    # The agent's Secrets Manager client needs a region; IRSA injects one, EKS Pod Identity does not.
    if r.environment.region:
        env.setdefault(contract.REGION_VARIABLE, r.environment.region)
    return [{"name": k, "value": env[k]} for k in sorted(env)]


def _security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": AGENT_UID,
        "runAsGroup": AGENT_UID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _model_volume(r: ResolvedDeployment, opts: WorkloadOptions) -> dict[str, Any]:
    if opts.model_cache_host_path:
        return {"name": "model-cache", "hostPath": {"path": opts.model_cache_host_path, "type": "Directory"}}
    return {"name": "model-cache", "emptyDir": {"sizeLimit": f"{model_cache_gib(r)}Gi"}}


def _model_sync(r: ResolvedDeployment, opts: WorkloadOptions) -> dict[str, Any] | None:
    """Init container copying model.s3_uri to where the engine reads it (as the EC2 target's user data)."""
    uri = r.deployment.model.s3_uri
    if not uri:
        return None
    if not opts.model_sync_image:
        raise ValueError(f"deployment {r.deployment.name!r} loads from {uri}: set WorkloadOptions.model_sync_image")
    env = [{"name": "HOME", "value": "/tmp"}]  # the CLI writes its cache under HOME; the image's may be /root
    if r.environment.region:
        env.append({"name": contract.REGION_VARIABLE, "value": r.environment.region})
    return {
        "name": "model-sync",
        "image": opts.model_sync_image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": ["aws", "s3", "sync", "--only-show-errors", uri, SAGEMAKER_MODEL_DIR],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "model-cache", "mountPath": SAGEMAKER_MODEL_DIR}],
    }


def _resources(r: ResolvedDeployment, opts: WorkloadOptions) -> dict[str, Any]:
    gpus = str(_gpus(r))
    cpu, memory = _cpu_memory(r, opts)
    requests: dict[str, str] = {"cpu": cpu, "memory": memory, opts.gpu_resource: gpus}
    if not opts.model_cache_host_path:
        requests["ephemeral-storage"] = f"{model_cache_gib(r)}Gi"  # schedules onto a node with room for the weights
    # Extended resources need limits equal to requests; cpu and memory get no limits: a CPU limit
    # throttles tokenization and scheduling on the token path, and a memory limit counts the page
    # cache of memory-mapped weights and /dev/shm against the engine.
    return {"requests": requests, "limits": {opts.gpu_resource: gpus}}


def _serving_container(r: ResolvedDeployment, opts: WorkloadOptions, *, synced: bool) -> dict[str, Any]:
    """The agent and its engine: ports, resources, probes, the drain hook and the model cache (read-only where the
    init container synced the model into it)."""
    model_mount = (
        {"name": "model-cache", "mountPath": SAGEMAKER_MODEL_DIR, "readOnly": True}
        if synced
        else {"name": "model-cache", "mountPath": HF_CACHE_DIR}
    )
    period = STARTUP_PERIOD_S
    return {
        "name": CONTAINER_NAME,
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "args": [SERVE_ARG],
        "env": _env(r, opts),
        "ports": [{"name": PORT_NAME, "containerPort": SERVING_PORT, "protocol": "TCP"}],
        "resources": _resources(r, opts),
        # Startup covers the model load: it runs until /ping first answers 200, and liveness and readiness
        # only start after it.
        "startupProbe": _http_probe(HEALTH_ROUTE, period=period, failures=startup_window_s(r) // period, timeout=5),
        # Readiness takes the pod out of the Service within ~10 s of /ping turning 503 (draining, engine
        # restarting) and back in when it recovers.
        "readinessProbe": _http_probe(HEALTH_ROUTE, period=5, failures=2, timeout=3),
        # Liveness is the agent's liveness route, not the health route: /ping answers 503 while the replica drains
        # and while the agent restarts a crashed engine, both states the agent handles itself, and a probe on it
        # would kill the pod mid-drain or mid-reload. LIVENESS_ROUTE stays 200 through both and turns 503 once the
        # engine has been down past its restart budget (a restart that failed), which a TCP check never saw; a
        # refused or timed-out request (the agent gone) fails it too. Six misses, 60 s, ride out a slow answer.
        "livenessProbe": _http_probe(LIVENESS_ROUTE, period=10, failures=6, timeout=5),
        "lifecycle": {"preStop": {"exec": {"command": list(DRAIN_COMMAND)}}},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, model_mount],
    }


def _node_selector(r: ResolvedDeployment, opts: WorkloadOptions) -> dict[str, str]:
    node_selector = dict(opts.node_selector)
    if opts.deployment_node_label:
        node_selector[opts.deployment_node_label] = r.deployment_id
    if opts.pin_instance_type:
        node_selector["node.kubernetes.io/instance-type"] = r.candidate.instance.name
    return node_selector


def _pod_spec(r: ResolvedDeployment, opts: WorkloadOptions) -> dict[str, Any]:
    sync = _model_sync(r, opts)
    pod_spec: dict[str, Any] = {
        # The agent does not call the Kubernetes API; IRSA and Pod Identity mount their own tokens.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(r),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": AGENT_UID,
            "runAsGroup": AGENT_UID,
            "fsGroup": AGENT_UID,  # emptyDir volumes writable by the agent
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "nodeSelector": _node_selector(r, opts),
        "tolerations": [
            {"key": opts.taint_key, "operator": "Equal", "value": opts.taint_value, "effect": opts.taint_effect}
        ],
        # Spread replicas over zones, but never leave one pending for it: GPU capacity is often in one zone.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": opts.topology_key,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector_labels(r)},
                "matchLabelKeys": ["pod-template-hash"],  # spread each rollout revision on its own
            }
        ],
        "containers": [_serving_container(r, opts, synced=sync is not None)],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{opts.shm_size_gib}Gi"}},
            _model_volume(r, opts),
        ],
    }
    if sync:
        pod_spec["initContainers"] = [sync]
    if opts.service_account_name:
        pod_spec["serviceAccountName"] = opts.service_account_name
    return pod_spec


def deployment(r: ResolvedDeployment, opts: WorkloadOptions) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(r, opts, annotations={STARTUP_ESTIMATE_ANNOTATION: str(math.ceil(r.startup.ready_s))}),
        "spec": {
            # No replicas: the ScaledObject's HPA owns the scale. Kubernetes' "Migrating Deployments and
            # StatefulSets to horizontal autoscaling" (Horizontal Pod Autoscaling): with spec.replicas in the
            # manifest, every apply (the kubectl provider's update is `kubectl apply`) scales back to that value.
            # The first rollout starts at the default 1 and KEDA raises it to minReplicaCount. A stack deployed
            # with replicas drops to 1 once on the update that removes it (the same page: run `kubectl apply
            # edit-last-applied` on the Deployment first to avoid that).
            "revisionHistoryLimit": 3,
            # A rollout waits for new pods to load the model (and maybe for a node): the default 600 s
            # would report a healthy slow rollout as failed.
            "progressDeadlineSeconds": startup_window_s(r) + 600,
            "selector": {"matchLabels": selector_labels(r)},
            # One extra replica at a time and none removed before its replacement is ready: capacity never
            # drops during a rollout, and the surge is one node's worth of GPUs at most.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": _labels(r),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SERVING_PORT),
                        "prometheus.io/path": METRICS_ROUTE,
                    },
                },
                "spec": _pod_spec(r, opts),
            },
        },
    }


def service(r: ResolvedDeployment, opts: WorkloadOptions) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(r, opts),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(r),
            "ports": [{"name": PORT_NAME, "port": SERVICE_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(r: ResolvedDeployment, opts: WorkloadOptions) -> Manifest:
    # maxUnavailable 1 rather than a minAvailable: with minAvailable = the replica count a one-replica
    # deployment could never be evicted and would block every node drain and cluster upgrade. One at a
    # time, each evicted pod drains through its preStop hook first. Pods that are not ready (still
    # loading, or stuck) may always be evicted: they serve nothing.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(r, opts),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(r)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _number(x: float) -> str:
    return format(x, "g")  # KEDA's trigger metadata is map[string]string


# The PromQL that gives each HPA metric type its number: an average over the pods as a Value, their sum as an
# AverageValue (the HPA divides it by the replica count).
AGGREGATIONS = {"Value": "avg", "AverageValue": "sum"}
TRIGGER_NAMES = {contract.REPLICA_SATURATION.name: TRIGGER_SATURATION, contract.REQUESTS_WAITING.name: TRIGGER_QUEUE}


def trigger_query(r: ResolvedDeployment, trigger: HpaTrigger) -> str:
    """The fleet's figure for one trigger. Saturation is the larger of KV-cache use and running over max_num_seqs,
    per pod (KV use alone may never reach its target where the cache holds more sequences than max_num_seqs runs)."""
    name = trigger.target.signal.prometheus_name
    return f'{AGGREGATIONS[trigger.metric_type]}({name}{{deployment="{r.deployment_id}"}})'


def _query(r: ResolvedDeployment, signal: contract.Signal) -> str:
    [trigger] = [t for t in hpa(r).triggers if t.target.signal == signal]
    return trigger_query(r, trigger)


def saturation_query(r: ResolvedDeployment) -> str:
    """The fleet's mean saturation."""
    return _query(r, contract.REPLICA_SATURATION)


def queue_query(r: ResolvedDeployment) -> str:
    """The fleet's queue, summed over the pods."""
    return _query(r, contract.REQUESTS_WAITING)


def _trigger(opts: WorkloadOptions, name: str, query: str, threshold: float, metric_type: str) -> dict[str, Any]:
    metadata = {
        "serverAddress": opts.prometheus_server_address,
        "query": query,
        "threshold": _number(threshold),
        # A lost scrape is an error, not a zero: with "true" an empty result reads as an idle fleet and
        # scales it in; as an error the HPA holds the current count.
        "ignoreNullValues": "false",
    }
    if opts.prometheus_aws_region:
        metadata["awsRegion"] = opts.prometheus_aws_region
    t: dict[str, Any] = {"type": "prometheus", "name": name, "metricType": metric_type, "metadata": metadata}
    if opts.trigger_authentication:
        t["authenticationRef"] = {"name": opts.trigger_authentication, "kind": opts.trigger_authentication_kind}
    return t


def scaled_object(r: ResolvedDeployment, opts: WorkloadOptions) -> Manifest:
    """The KEDA ScaledObject rendering the deployment's HPA (``kvfleet.scaling.Hpa``): its bounds, pace, window and
    one trigger per signal, compared as the HPA's metric type says."""
    rule = hpa(r)
    up, down = rule.scale_up_period_s, rule.scale_down_period_s
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(r, opts),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name(r)},
            "pollingInterval": rule.polling_interval_s,
            "cooldownPeriod": rule.cooldown_period_s,
            # Never zero (the config refuses it on EKS): both signals come from the pods themselves, so with no pod
            # there would be no queue to see and nothing would ever scale the deployment back up.
            "minReplicaCount": rule.min_replicas,
            "maxReplicaCount": rule.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": 0,
                            "selectPolicy": "Max",
                            "policies": [
                                {"type": "Pods", "value": rule.scale_up_pods, "periodSeconds": up},
                                {"type": "Percent", "value": rule.scale_up_percent, "periodSeconds": up},
                            ],
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": scale_down_stabilization_s(r, opts),
                            "selectPolicy": "Min",
                            "policies": [
                                {"type": "Pods", "value": rule.scale_down_pods, "periodSeconds": down},
                            ],
                        },
                    }
                }
            },
            "triggers": [
                _trigger(opts, TRIGGER_NAMES[t.target.signal.name], trigger_query(r, t), t.target.value, t.metric_type)
                for t in rule.triggers
            ],
        },
    }


def namespace(opts: WorkloadOptions) -> Manifest:
    labels = {"app.kubernetes.io/managed-by": "kvfleet"}
    # The pods meet the "restricted" Pod Security Standard (non-root, no privilege escalation, no
    # capabilities, RuntimeDefault seccomp, emptyDir volumes only). A hostPath model cache is outside
    # even "baseline", so that namespace gets no enforcement label and the cluster's default applies.
    if not opts.model_cache_host_path:
        labels["pod-security.kubernetes.io/enforce"] = "restricted"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": opts.namespace, "labels": labels}}


# The label the API server sets on every namespace, its name (Kubernetes docs, "Well-Known Labels, Annotations and
# Taints": kubernetes.io/metadata.name, immutable, since 1.22): a namespaceSelector by name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def network_policy(r: ResolvedDeployment, opts: WorkloadOptions) -> Manifest:
    """Ingress to the serving pods on the serving port from the client namespaces and CIDRs only; with neither,
    none (a policy selecting a pod isolates it for ingress: Kubernetes docs, "Network Policies", "Isolated and
    Non-isolated Pods"). kubectl port-forward and the kubelet's probes are not pod-to-pod traffic and still reach
    the pods (same page: "traffic to and from the node where a Pod is running is always allowed")."""
    # An empty namespaceSelector selects every namespace (Kubernetes API reference, NetworkPolicyPeer.namespaceSelector:
    # "if present but empty, it selects all namespaces"): every pod of the cluster, no address outside it.
    sources: list[dict[str, Any]] = (
        [{"namespaceSelector": {}}]
        if opts.clients_in_every_namespace
        else [
            {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
            for ns in sorted(set(opts.client_namespaces))
        ]
    )
    sources += [{"ipBlock": {"cidr": cidr}} for cidr in opts.client_cidrs]
    rules = [{"from": sources, "ports": [{"protocol": "TCP", "port": SERVING_PORT}]}] if sources else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(r, opts),
        "spec": {"podSelector": {"matchLabels": selector_labels(r)}, "policyTypes": ["Ingress"], "ingress": rules},
    }


def manifests(r: ResolvedDeployment, opts: WorkloadOptions) -> list[Manifest]:
    """Every object of the deployment in its namespace, in apply order (the Namespace is applied first, apart)."""
    return [
        deployment(r, opts),
        service(r, opts),
        pod_disruption_budget(r, opts),
        scaled_object(r, opts),
        network_policy(r, opts),
    ]
