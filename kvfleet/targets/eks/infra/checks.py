"""Consistency checks on the Kubernetes manifests: they fit the nodes they land on and the agent inside the pod.

The EKS construct runs ``check_consistency`` at synth and refuses manifests with a problem; the tests run it on
manifests they break on purpose. Pure functions over plain dicts (no aws_cdk), read the way Kubernetes, KEDA
and the agent read them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet import contract
from kvfleet.contract import DRAIN_COMMAND
from kvfleet.engines import EngineArgs
from kvfleet.targets.eks.infra.manifests import CONTAINER_NAME, STARTUP_ESTIMATE_ANNOTATION, STARTUP_SAFETY

MIN_ENGINE_STOP_S = 30  # the least time the grace period leaves the engine after the drain
# How each scaling signal is compared (see manifests.scaled_object): an average as a Value, a sum per replica.
TRIGGER_METRIC_TYPES = {contract.REPLICA_SATURATION.name: "Value", contract.REQUESTS_WAITING.name: "AverageValue"}


def check_consistency(
    manifests: Sequence[Mapping[str, Any]],
    *,
    node_taints: Sequence[Mapping[str, Any]],
    gpus_per_node: int,
    tensor_parallel_size: int,
    drain_budget_s: int,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    gpu_resource: str = "nvidia.com/gpu",
    startup_estimate_s: float | None = None,
    node_labels: Mapping[str, str] | None = None,
) -> list[str]:
    """Problems that would make the manifests fail on these nodes or with the agent; empty: consistent.

    startup_estimate_s: launch-to-ready estimate to hold the startup probe against (default: the one the
    Deployment records in its annotation). node_labels: when given, the nodeSelector must match them.
    """
    dep = _one(manifests, "Deployment")
    if dep is None:
        return ["expected exactly one Deployment"]
    pod = dep.get("spec", {}).get("template", {}).get("spec", {})
    containers = [c for c in pod.get("containers", []) if c.get("name") == CONTAINER_NAME]
    if len(containers) != 1:
        return [f"expected one container named {CONTAINER_NAME!r} in the Deployment"]
    c = containers[0]
    env = {e.get("name"): e.get("value") for e in c.get("env", [])}
    estimate = startup_estimate_s
    if estimate is None:
        estimate = _int(dep.get("metadata", {}).get("annotations", {}).get(STARTUP_ESTIMATE_ANNOTATION))
    return [
        *_check_scheduling(pod, node_taints=node_taints, node_labels=node_labels),
        *_check_gpus(
            c,
            gpu_resource=gpu_resource,
            gpus_per_node=gpus_per_node,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
        ),
        *_check_engine(env, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size),
        *_check_drain(pod, c, env, drain_budget_s=drain_budget_s),
        *_check_startup(c, estimate),
        *_check_selectors(manifests, dep),
        *_check_scaled_object(
            manifests,
            dep_name=dep.get("metadata", {}).get("name"),
            deployment_id=env.get(contract.ENV_DEPLOYMENT),
            dep_replicas=dep.get("spec", {}).get("replicas"),
        ),
    ]


def _check_scheduling(
    pod: Mapping[str, Any], *, node_taints: Sequence[Mapping[str, Any]], node_labels: Mapping[str, str] | None
) -> list[str]:
    """Every hard taint on the nodes needs a toleration, or no pod schedules (NoSchedule) or stays (NoExecute);
    PreferNoSchedule only steers the scheduler. Given the nodes' labels, the nodeSelector must match them."""
    problems = []
    tolerations = pod.get("tolerations") or []
    for taint in node_taints:
        if taint.get("effect") == "PreferNoSchedule":
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            shown = f"{taint.get('key')}={taint.get('value') or ''}:{taint.get('effect')}"
            problems.append(f"node taint {shown} is not tolerated by the pod")
    if node_labels is not None:
        for k, v in (pod.get("nodeSelector") or {}).items():
            if node_labels.get(k) != v:
                problems.append(f"nodeSelector {k}={v} does not match the nodes ({k}={node_labels.get(k)})")
    return problems


def _check_gpus(
    c: Mapping[str, Any],
    *,
    gpu_resource: str,
    gpus_per_node: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int = 1,
) -> list[str]:
    """GPUs: requests == limits == the engine's GPUs (tensor x pipeline x data parallelism), within one node."""
    problems = []
    res = c.get("resources", {})
    req = _int(res.get("requests", {}).get(gpu_resource))
    lim = _int(res.get("limits", {}).get(gpu_resource))
    if req != lim:
        problems.append(f"{gpu_resource} requests ({req}) differ from limits ({lim})")
    gpus = tensor_parallel_size * pipeline_parallel_size * data_parallel_size
    if lim != gpus:
        what = (
            f"the tensor-parallel degree is {tensor_parallel_size}"
            if pipeline_parallel_size == data_parallel_size == 1
            else f"tensor x pipeline x data parallelism is {tensor_parallel_size} x {pipeline_parallel_size} x "
            f"{data_parallel_size}"
        )
        problems.append(f"{gpu_resource} limit is {lim}, {what}")
    if lim is not None and lim > gpus_per_node:
        problems.append(f"{gpu_resource} limit is {lim}, a node has {gpus_per_node}: the pod never schedules")
    return problems


def _check_engine(env: Mapping[str, Any], *, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> list[str]:
    """The engine inside the pod runs the plan's tensor-parallel degree, read the way the agent reads it.

    Every pod here runs the kvfleet agent (its preStop drain and its signals are what the hooks and KEDA use), so
    the settings are always the EngineArgs JSON; AWS's own images, which read engine-specific variables and have
    no agent, cannot serve this Deployment and are refused here.
    """
    raw = env.get(contract.ENV_ENGINE_ARGS)
    if raw is None:
        return [
            f"the serving container sets no {contract.ENV_ENGINE_ARGS}: the pod needs the kvfleet image, whose "
            "agent drains it and publishes the signals KEDA scales on"
        ]
    try:
        args = EngineArgs.from_json(raw)
    except (TypeError, ValueError) as err:
        return [f"{contract.ENV_ENGINE_ARGS} is not engine settings the agent accepts: {err}"]
    # Unset: the engine's own default, which is one GPU for every engine kvfleet runs.
    engine_tp = args.tensor_parallel_size or 1
    if engine_tp != tensor_parallel_size:
        return [f"the engine runs tensor parallel {engine_tp}, the plan says {tensor_parallel_size}"]
    engine_pp = args.pipeline_parallel_size or 1
    if engine_pp != pipeline_parallel_size:
        return [f"the engine runs pipeline parallel {engine_pp}, the plan says {pipeline_parallel_size}"]
    return []


def _check_drain(
    pod: Mapping[str, Any], c: Mapping[str, Any], env: Mapping[str, Any], *, drain_budget_s: int
) -> list[str]:
    """preStop runs the agent's drain, and the grace period outlasts it plus the engine's stop."""
    problems = []
    grace = _int(pod.get("terminationGracePeriodSeconds"))
    if grace is None or grace < drain_budget_s + MIN_ENGINE_STOP_S:
        problems.append(
            f"terminationGracePeriodSeconds {grace} is below the drain budget {drain_budget_s} s + "
            f"{MIN_ENGINE_STOP_S} s for the engine to stop: the kubelet kills in-flight generations"
        )
    command = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command != list(DRAIN_COMMAND):
        problems.append(f"preStop runs {command}, not the agent's drain {list(DRAIN_COMMAND)}")
    if env.get(contract.ENV_DRAIN_BUDGET_S) not in (None, str(drain_budget_s)):
        problems.append(f"the agent's drain budget is {env.get(contract.ENV_DRAIN_BUDGET_S)} s, not {drain_budget_s} s")
    return problems


def _check_startup(c: Mapping[str, Any], estimate: float | None) -> list[str]:
    """The startup probe waits out the model load with the same safety factor as the other targets."""
    probe = c.get("startupProbe") or {}
    window = (_int(probe.get("periodSeconds")) or 10) * (_int(probe.get("failureThreshold")) or 3)
    if not probe:
        return ["the serving container has no startupProbe"]
    if estimate is None:
        return [f"no startup estimate to check the startup probe against ({STARTUP_ESTIMATE_ANNOTATION})"]
    if window < STARTUP_SAFETY * estimate:
        return [
            f"the startup probe allows {window} s, less than {STARTUP_SAFETY:g} x the {estimate:.0f} s model-load "
            "estimate: a slow load is killed and starts over"
        ]
    return []


def _check_selectors(manifests: Sequence[Mapping[str, Any]], dep: Mapping[str, Any]) -> list[str]:
    """The Service, PDB and spread constraints select exactly the Deployment's pods."""
    template = dep.get("spec", {}).get("template", {})
    pod_labels = template.get("metadata", {}).get("labels", {})
    selectors: list[tuple[str, Mapping[str, Any]]] = []
    svc = _one(manifests, "Service")
    if svc is not None:
        selectors.append(("Service", svc.get("spec", {}).get("selector") or {}))
    pdb = _one(manifests, "PodDisruptionBudget")
    if pdb is not None:
        selectors.append(("PodDisruptionBudget", pdb.get("spec", {}).get("selector", {}).get("matchLabels") or {}))
    for i, tsc in enumerate(template.get("spec", {}).get("topologySpreadConstraints") or []):
        selectors.append((f"topologySpreadConstraints[{i}]", tsc.get("labelSelector", {}).get("matchLabels") or {}))
    return [
        f"the {what} selector {dict(sel)} does not select the Deployment's pods"
        for what, sel in selectors
        if not sel or any(pod_labels.get(k) != v for k, v in sel.items())
    ]


def _check_scaled_object(
    manifests: Sequence[Mapping[str, Any]], *, dep_name: Any, deployment_id: Any, dep_replicas: Any = None
) -> list[str]:
    """One ScaledObject scales the Deployment, with one trigger per scaling signal of this deployment."""
    so = _one(manifests, "ScaledObject")
    if so is None:
        return ["expected exactly one ScaledObject"]
    problems = []
    spec = so.get("spec", {})
    ref = spec.get("scaleTargetRef", {})
    if ref.get("name") != dep_name or ref.get("kind", "Deployment") != "Deployment":
        problems.append(f"the ScaledObject scales {ref.get('kind', 'Deployment')}/{ref.get('name')}, not {dep_name}")
    if dep_replicas is not None:
        # Kubernetes docs, Horizontal Pod Autoscaling, "Migrating Deployments and StatefulSets to horizontal
        # autoscaling": remove spec.replicas, or each apply resets what the autoscaler chose.
        problems.append(
            f"the Deployment sets spec.replicas {dep_replicas}: every stack update would reset the autoscaled count"
        )
    if not deployment_id:
        return [*problems, f"the serving container sets no {contract.ENV_DEPLOYMENT}"]
    expected = {s.prometheus_name: TRIGGER_METRIC_TYPES[s.name] for s in contract.SCALING_SIGNALS}
    seen: set[str] = set()
    for t in spec.get("triggers", []):
        query = str(t.get("metadata", {}).get("query", ""))
        metrics = [m for m in expected if m in query]
        if len(metrics) != 1:
            problems.append(f"trigger {t.get('name')!r} queries {query!r}, not exactly one of the contract's signals")
            continue
        metric = metrics[0]
        seen.add(metric)
        if f'deployment="{deployment_id}"' not in query:
            problems.append(f"trigger {t.get('name')!r} does not select deployment={deployment_id!r}: {query!r}")
        if t.get("metricType", "AverageValue") != expected[metric]:
            problems.append(
                f"trigger {t.get('name')!r} on {metric} is {t.get('metricType', 'AverageValue')}, "
                f"expected {expected[metric]}"
            )
    for metric in sorted(set(expected) - seen):
        problems.append(f"no trigger scales on {metric}")
    return problems


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' matching rule: empty effect matches every effect; Exists ignores the value; an empty
    key with Exists matches every taint."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    operator = toleration.get("operator") or "Equal"
    key = toleration.get("key") or ""
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def _one(items: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    found = [m for m in items if m.get("kind") == kind]
    return found[0] if len(found) == 1 else None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
