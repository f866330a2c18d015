"""The scaling-signals contract: what every serving replica publishes, defined once.

The serving agent in ``containers/`` publishes these (CloudWatch Embedded Metric Format on stdout,
optionally PutMetricData, and Prometheus text on ``/metrics``); the scaling policies, alarms and
dashboards of every deployment target read them. Renaming a signal here renames it everywhere, so an
engine upgrade that renames its own metrics (vLLM's ``gpu_cache_usage_perc`` -> ``kv_cache_usage_perc``)
only changes the agent's mapping table, never an autoscaler.

Pure Python: importable by the agent without aws_cdk.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

NAMESPACE = "Kvfleet"

# Dimension sets. Scaling and alarms use the deployment-wide set: CloudWatch's Average over every
# replica's data points is the per-replica mean that target tracking needs. The per-replica set is
# for finding the one hot or stuck replica.
DEPLOYMENT_DIMENSION = "Deployment"
REPLICA_DIMENSION = "Replica"
DIMENSION_SETS: tuple[tuple[str, ...], ...] = ((DEPLOYMENT_DIMENSION,), (DEPLOYMENT_DIMENSION, REPLICA_DIMENSION))

# Seconds between two publications from one replica. The dashboards count replicas from the number of
# data points per period, so this must match what the agent does.
PUBLISH_INTERVAL_S = 10

# Environment variables the stacks set on the serving container and the agent reads.
ENV_DEPLOYMENT = "KVFLEET_DEPLOYMENT"  # value of the Deployment dimension
ENV_NAMESPACE = "KVFLEET_METRICS_NAMESPACE"
ENV_DRAIN_BUDGET_S = "KVFLEET_DRAIN_BUDGET_S"
ENV_TOKEN_BUDGET = "KVFLEET_TOKEN_BUDGET"  # KV tokens one replica holds (token-aware admission)
ENV_ENGINE = "KVFLEET_ENGINE"
ENV_ENGINE_VERSION = "KVFLEET_ENGINE_VERSION"
ENV_MODEL = "KVFLEET_MODEL"  # a local directory or a Hugging Face id
ENV_ENGINE_ARGS = "KVFLEET_ENGINE_ARGS"  # JSON: vLLM flags without "--", or TensorRT-LLM LLM-API options
ENV_PORT = "KVFLEET_PORT"  # the agent's public port
ENV_HF_TOKEN_SECRET_ARN = "KVFLEET_HF_TOKEN_SECRET_ARN"
ENV_PUT_METRIC_DATA = "KVFLEET_PUT_METRIC_DATA"  # "1": also call PutMetricData (needs network)
# EC2 fleets: the termination lifecycle hook the agent drains for, heartbeats and completes.
ENV_ASG_NAME = "KVFLEET_ASG_NAME"
ENV_LIFECYCLE_HOOK = "KVFLEET_LIFECYCLE_HOOK"
ENV_LIFECYCLE_HEARTBEAT_S = "KVFLEET_LIFECYCLE_HEARTBEAT_S"


class Kind(StrEnum):
    GAUGE = "gauge"  # the value at publication time
    DELTA = "delta"  # a count since the previous publication (from a Prometheus counter)
    DISTRIBUTION = "distribution"  # observations since the previous publication (from a histogram)


@dataclass(frozen=True, kw_only=True)
class Signal:
    name: str  # CloudWatch metric name
    unit: str  # CloudWatch unit
    kind: Kind
    statistic: str  # what scaling, alarms and the dashboard aggregate with by default
    prometheus_name: str  # the agent's re-export on /metrics (Kubernetes scrapes this)
    description: str


KV_CACHE_UTILIZATION = Signal(
    name="KvCacheUtilization",
    unit="None",
    kind=Kind.GAUGE,
    statistic="Average",
    prometheus_name="kvfleet_kv_cache_utilization",
    description="Fraction (0-1) of the replica's KV-cache blocks in use.",
)
REQUESTS_WAITING = Signal(
    name="RequestsWaiting",
    unit="Count",
    kind=Kind.GAUGE,
    statistic="Average",
    prometheus_name="kvfleet_requests_waiting",
    description="Requests queued in the engine, not yet scheduled (no KV blocks yet).",
)
REQUESTS_RUNNING = Signal(
    name="RequestsRunning",
    unit="Count",
    kind=Kind.GAUGE,
    statistic="Average",
    prometheus_name="kvfleet_requests_running",
    description="Sequences the engine is generating for.",
)
TIME_TO_FIRST_TOKEN = Signal(
    name="TimeToFirstToken",
    unit="Milliseconds",
    kind=Kind.DISTRIBUTION,
    statistic="p95",
    prometheus_name="kvfleet_time_to_first_token_seconds",
    description="Time from arrival to the first output token, per request.",
)
INTER_TOKEN_LATENCY = Signal(
    name="InterTokenLatency",
    unit="Milliseconds",
    kind=Kind.DISTRIBUTION,
    statistic="p95",
    prometheus_name="kvfleet_inter_token_latency_seconds",
    description="Time between two output tokens of one sequence.",
)
OUTPUT_TOKENS = Signal(
    name="OutputTokens",
    unit="Count",
    kind=Kind.DELTA,
    statistic="Sum",
    prometheus_name="kvfleet_output_tokens_total",
    description="Tokens generated; Sum / period is the output throughput in tokens/s.",
)
PREEMPTIONS = Signal(
    name="Preemptions",
    unit="Count",
    kind=Kind.DELTA,
    statistic="Sum",
    prometheus_name="kvfleet_preemptions_total",
    description="Sequences evicted from the KV cache to make room (recomputed later): the cache is too small.",
)
REQUESTS_SHED = Signal(
    name="RequestsShed",
    unit="Count",
    kind=Kind.DELTA,
    statistic="Sum",
    prometheus_name="kvfleet_requests_shed_total",
    description="Requests answered 429 by token-aware admission because the replica's token budget was full.",
)
SERVER_ERRORS = Signal(
    name="ServerErrors",
    unit="Count",
    kind=Kind.DELTA,
    statistic="Sum",
    prometheus_name="kvfleet_server_errors_total",
    description="Responses with a 5xx status (drain answers 503 and is not counted).",
)

SIGNALS: tuple[Signal, ...] = (
    KV_CACHE_UTILIZATION,
    REQUESTS_WAITING,
    REQUESTS_RUNNING,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    OUTPUT_TOKENS,
    PREEMPTIONS,
    REQUESTS_SHED,
    SERVER_ERRORS,
)

# The two signals every target scales on.
SCALING_SIGNALS: tuple[Signal, ...] = (KV_CACHE_UTILIZATION, REQUESTS_WAITING)


def deployment_id(environment: str, deployment: str) -> str:
    """Value of the Deployment dimension: unique per environment and deployment."""
    return f"{environment}-{deployment}"


def signal(name: str) -> Signal:
    for s in SIGNALS:
        if s.name == name:
            return s
    raise KeyError(f"no signal named {name!r}; known: {', '.join(s.name for s in SIGNALS)}")
