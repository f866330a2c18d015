"""The in-cluster Prometheus finds the agent and KEDA's queries match what it scrapes.

No Prometheus runs here, so this test applies the scrape job the community chart ships (job
``kubernetes-pods`` in prometheus-community/helm-charts charts/prometheus/values.yaml, serverFiles
prometheus.yml, chart 27.x) to the rendered pod, the way Prometheus's pod discovery would. The relabel
semantics follow the Prometheus documentation (configuration: <relabel_config>): regexes are fully anchored,
source labels are joined with ";", ``keep``/``drop`` filter on the match, ``replace`` writes the expanded
replacement, ``labelmap`` copies matching label names. The agent's real exposition is then read with the
Prometheus client's parser, merged with the target labels under ``honor_labels: true`` as the job says, and
the ScaledObject's two queries are evaluated on the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet import contract
from kvfleet.agent import settings as agent_settings
from kvfleet.agent.metrics import Sample, prometheus_text
from kvfleet.contract import SERVING_PORT
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.targets.eks.infra import manifests as k8s
from kvfleet.targets.eks.infra.manifests import WorkloadOptions
from tests.envs import SAGEMAKER_ENV, environment

OPTS = WorkloadOptions(
    image="123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:0.30.0",
    prometheus_server_address="http://prometheus-server.monitoring.svc.cluster.local:80",
)
POD_IP = "10.64.17.9"
POD_NAME = "test-chat-7d9f8-abcde"

Rule = dict[str, Any]
# The chart's kubernetes-pods job, rule by rule (honor_labels: true; role: pod).
KUBERNETES_PODS_JOB: list[Rule] = [
    {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape_slow"],
        "action": "drop",
        "regex": "true",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scheme"],
        "action": "replace",
        "regex": "(https?)",
        "target_label": "__scheme__",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
        "action": "replace",
        "target_label": "__metrics_path__",
        "regex": "(.+)",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_port", "__meta_kubernetes_pod_ip"],
        "action": "replace",
        "regex": r"(\d+);(([A-Fa-f0-9]{1,4}::?){1,7}[A-Fa-f0-9]{1,4})",
        "replacement": "[$2]:$1",
        "target_label": "__address__",
    },
    {
        "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_port", "__meta_kubernetes_pod_ip"],
        "action": "replace",
        "regex": r"(\d+);((([0-9]+?)(\.|$)){4})",
        "replacement": "$2:$1",
        "target_label": "__address__",
    },
    {
        "action": "labelmap",
        "regex": "__meta_kubernetes_pod_annotation_prometheus_io_param_(.+)",
        "replacement": "__param_$1",
    },
    {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
    {"source_labels": ["__meta_kubernetes_namespace"], "action": "replace", "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "action": "replace", "target_label": "pod"},
    {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Pending|Succeeded|Failed|Completed", "action": "drop"},
]


def _expand(template: str, m: re.Match[str]) -> str:
    # Prometheus writes groups as $1 or ${1}; an unmatched group expands to "".
    return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g[1])) or "", template)


def relabel(labels: Mapping[str, str], rules: list[Rule]) -> dict[str, str] | None:
    """Prometheus relabelling of one target; None when a rule drops it."""
    out = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        regex = re.compile(f"^(?:{rule.get('regex', '(.*)')})$")
        value = ";".join(out.get(name, "") for name in rule.get("source_labels", []))
        if action == "keep" and not regex.match(value):
            return None
        if action == "drop" and regex.match(value):
            return None
        if action == "replace" and (m := regex.match(value)):
            written = _expand(rule.get("replacement", "$1"), m)
            if written:
                out[rule["target_label"]] = written
            else:
                out.pop(rule["target_label"], None)
        if action == "labelmap":
            for name, v in list(out.items()):
                if m := regex.match(name):
                    out[_expand(rule.get("replacement", "$1"), m)] = v
    return out


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered_targets(pod: Mapping[str, Any], *, namespace: str, phase: str = "Running") -> Iterator[dict[str, str]]:
    """What Prometheus's pod discovery yields for a pod: one target per container port, one per portless container."""
    meta = pod["metadata"]
    common = {
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_pod_name": POD_NAME,
        "__meta_kubernetes_pod_ip": POD_IP,
        "__meta_kubernetes_pod_phase": phase,
        **{f"__meta_kubernetes_pod_annotation_{_sanitize(k)}": v for k, v in meta.get("annotations", {}).items()},
        **{f"__meta_kubernetes_pod_label_{_sanitize(k)}": v for k, v in meta.get("labels", {}).items()},
        "__scheme__": "http",
        "__metrics_path__": "/metrics",
    }
    spec = pod["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        ports = container.get("ports", [])
        for port in ports:
            yield {**common, "__address__": f"{POD_IP}:{port['containerPort']}"}
        if not ports:
            yield {**common, "__address__": POD_IP}


def scrape_targets(deployment: Mapping[str, Any], **kw: Any) -> set[tuple[str, str, str]]:
    kept = (relabel(t, KUBERNETES_PODS_JOB) for t in discovered_targets(deployment["spec"]["template"], **kw))
    return {(t["__scheme__"], t["__address__"], t["__metrics_path__"]) for t in kept if t is not None}


def query_selector(query: str) -> tuple[str, dict[str, str]]:
    """The metric name and equality matchers of a one-selector aggregation such as avg(name{k="v"})."""
    m = re.fullmatch(r"\w+\((?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<matchers>[^}]*)\}\)", query)
    assert m, query
    matchers = dict(re.findall(r'(\w+)="([^"]*)"', m["matchers"]))
    return m["name"], matchers


@pytest.fixture(scope="module")
def resolved() -> ResolvedDeployment:
    [r] = resolve_environment(environment(SAGEMAKER_ENV))
    return r


def test_the_chart_scrapes_the_agent_port_and_path_once(resolved: ResolvedDeployment) -> None:
    dep = k8s.deployment(resolved, OPTS)
    assert scrape_targets(dep, namespace=OPTS.namespace) == {("http", f"{POD_IP}:{SERVING_PORT}", "/metrics")}
    # The agent listens there: the port is the serving container's own.
    [serving] = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == k8s.CONTAINER_NAME]
    assert SERVING_PORT in [p["containerPort"] for p in serving["ports"]]


def test_a_pod_without_the_scrape_annotation_or_still_pending_is_not_scraped(resolved: ResolvedDeployment) -> None:
    dep = k8s.deployment(resolved, OPTS)
    assert scrape_targets(dep, namespace=OPTS.namespace, phase="Pending") == set()
    dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] = "false"
    assert scrape_targets(dep, namespace=OPTS.namespace) == set()


def test_kedas_queries_match_the_series_the_agent_exports(resolved: ResolvedDeployment) -> None:
    dep = k8s.deployment(resolved, OPTS)
    pod = dep["spec"]["template"]
    [serving] = [c for c in pod["spec"]["containers"] if c["name"] == k8s.CONTAINER_NAME]
    # The agent's settings come from the container's environment, as in the pod.
    env = {e["name"]: e["value"] for e in serving["env"] if "value" in e}
    agent = agent_settings.from_env(env)
    sample = Sample(
        gauges={
            contract.REPLICA_SATURATION.name: 0.82,
            contract.KV_CACHE_UTILIZATION.name: 0.2,
            contract.REQUESTS_WAITING.name: 5.0,
        },
        deltas={},
    )
    exposition = prometheus_text(sample, totals={}, deployment=agent.deployment)
    kept = (relabel(t, KUBERNETES_PODS_JOB) for t in discovered_targets(pod, namespace=OPTS.namespace))
    [target] = [t for t in kept if t is not None]
    target_labels = {k: v for k, v in target.items() if not k.startswith("__")}
    series = [
        (s.name, {**target_labels, **s.labels}, s.value)  # honor_labels: the exposition's labels win
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    ]
    for query, expected in ((k8s.saturation_query(resolved), 0.82), (k8s.queue_query(resolved), 5.0)):
        name, matchers = query_selector(query)
        matched = [v for n, labels, v in series if n == name and all(labels.get(k) == v2 for k, v2 in matchers.items())]
        assert matched == [expected], (query, series)
    # A query for another deployment would match nothing: the label is what scopes KEDA to these pods.
    assert matchers["deployment"] == resolved.deployment_id == agent.deployment
