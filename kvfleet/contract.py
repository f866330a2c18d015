"""The stack <-> image contract: everything the infrastructure and the serving image must agree on, defined once.

The serving agent in the image (``kvfleet.agent``) publishes the scaling signals (CloudWatch Embedded Metric
Format on stdout, optionally PutMetricData, and Prometheus text on ``/metrics``) and reads its settings from the
environment variables named here; the scaling policies, alarms, dashboards, probes, hooks and manifests of every
deployment target read the same names. Renaming a signal here renames it everywhere, so an engine upgrade that
renames its own metrics only changes that engine's adapter table, never an autoscaler.

Standard library only: the image copies this module and nothing else of the infrastructure. Any change a
running image would not understand bumps ``CONTRACT_VERSION``; images are tagged with the version they speak
(``image_tag``) and the stacks refuse an image tag that names another one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# Bump on any change an already-built image would not understand (a renamed variable, route or signal).
# 2: the stacks scale on ReplicaSaturation, which only the agent of contract 2 publishes, and name the tenant salt key
#    by KVFLEET_TENANT_SECRET_ARN, which an older agent would ignore (serving without isolation).
# 3: KVFLEET_ENGINE_ARGS may carry hf_overrides (a RoPE scaling that extends the context), mamba_cache_dtype and
#    mamba_ssm_cache_dtype (hybrid models' state), which an agent of contract 2 refuses as unknown settings.
# 4: EC2's host watchdog polls LIVENESS_ROUTE and marks the instance unhealthy when it fails; an agent of contract 3
#    answers 404 there, which would get every instance of a fleet replaced once its grace period ended.
# 5: KVFLEET_ENGINE_ARGS may carry data_parallel_size (vLLM's data-parallel attention), which an agent of contract 4
#    refuses as an unknown setting.
CONTRACT_VERSION = 5

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

# ---- the container ---------------------------------------------------------------------------------------
# SageMaker's container contract: traffic on 8080, health on GET /ping, the container started as `<image> serve`,
# ModelDataSource files under /opt/ml/model. The agent keeps that contract on every target.
SERVING_PORT = 8080
ENGINE_PORT = 8081  # the engine behind the agent, on loopback only
HEALTH_ROUTE = "/ping"
METRICS_ROUTE = "/metrics"  # the agent's Prometheus re-export under the signals' names
DRAIN_ROUTE = "/drain"
# The replica as a host sees it, not as a load balancer does: 200 while the engine serves, or restarts within
# ENV_RESTART_BUDGET_S of when it last served (or of the agent's start), and while the replica drains; 503 once the
# engine has been down longer than that (a restart that failed, a crash loop). HEALTH_ROUTE answers 503 for the
# whole restart, which takes the replica out of a load balancer's rotation; this route tells a restart from a dead
# host (EC2's watchdog polls it on loopback and replaces the instance only when it fails).
LIVENESS_ROUTE = "/alive"
SERVE_ARG = "serve"
MODEL_DIR = "/opt/ml/model"
# The agent's user, which EC2 and EKS run the image as (the image's own user is root, for SageMaker). Fixed (not
# 1000: Ubuntu 24.04 bases already have a user there) so volume permissions and runAsUser policies can name it;
# runAsNonRoot needs it numeric.
AGENT_UID = 10001
AGENT_HOME = "/home/kvfleet"
HF_HOME = f"{AGENT_HOME}/.cache/huggingface"  # where the engine caches Hugging Face downloads
# The agent's console script in the image. `kvfleet-agent drain` asks the running agent to drain and returns
# when it has: what a Kubernetes preStop hook runs.
AGENT_COMMAND = "kvfleet-agent"
DRAIN_COMMAND: tuple[str, ...] = (AGENT_COMMAND, "drain")
# OCI label the image carries with the contract version it was built for.
CONTRACT_LABEL = "io.kvfleet.contract-version"

# ---- environment variables the stacks set on the serving container and the agent reads ------------------------
ENV_CONTRACT_VERSION = "KVFLEET_CONTRACT_VERSION"  # the agent refuses to start under another version
ENV_DEPLOYMENT = "KVFLEET_DEPLOYMENT"  # value of the Deployment dimension
ENV_REPLICA = "KVFLEET_REPLICA"  # value of the Replica dimension (default: the host name)
ENV_NAMESPACE = "KVFLEET_METRICS_NAMESPACE"
ENV_DRAIN_BUDGET_S = "KVFLEET_DRAIN_BUDGET_S"
ENV_TOKEN_BUDGET = "KVFLEET_TOKEN_BUDGET"  # KV tokens one replica holds (token-aware admission)
ENV_ENGINE = "KVFLEET_ENGINE"
ENV_ENGINE_VERSION = "KVFLEET_ENGINE_VERSION"
ENV_MODEL = "KVFLEET_MODEL"  # a local directory or a Hugging Face id
ENV_ENGINE_ARGS = "KVFLEET_ENGINE_ARGS"  # JSON of kvfleet.engines.EngineArgs
ENV_PORT = "KVFLEET_PORT"  # the agent's public port
ENV_HF_TOKEN_SECRET_ARN = "KVFLEET_HF_TOKEN_SECRET_ARN"
ENV_PUT_METRIC_DATA = "KVFLEET_PUT_METRIC_DATA"  # "1": also call PutMetricData (needs network)
# EC2 fleets: the termination lifecycle hook the agent drains for, heartbeats and completes.
ENV_ASG_NAME = "KVFLEET_ASG_NAME"
ENV_LIFECYCLE_HOOK = "KVFLEET_LIFECYCLE_HOOK"
ENV_LIFECYCLE_HEARTBEAT_S = "KVFLEET_LIFECYCLE_HEARTBEAT_S"
# Optional knobs: unset means the agent's default.
ENV_HOST = "KVFLEET_HOST"
ENV_ENGINE_PORT = "KVFLEET_ENGINE_PORT"
ENV_ENGINE_PYTHON = "KVFLEET_ENGINE_PYTHON"  # the interpreter that has the engine installed
ENV_ENGINE_COMMAND = "KVFLEET_ENGINE_COMMAND"  # JSON list replacing the engine's command line (tests)
ENV_ENGINE_READY_TIMEOUT_S = "KVFLEET_ENGINE_READY_TIMEOUT_S"
ENV_GPU_RELEASE_TIMEOUT_S = "KVFLEET_GPU_RELEASE_TIMEOUT_S"  # a restart's wait for the old engine's GPU memory
# How long the engine may be down (since it last served, or since the agent started) before LIVENESS_ROUTE says the
# replica failed; the agent adds what its own restart takes (the old engine's sweep, GPU release, backoff).
ENV_RESTART_BUDGET_S = "KVFLEET_RESTART_BUDGET_S"
ENV_ADMISSION = "KVFLEET_ADMISSION"
ENV_ADMISSION_FACTOR = "KVFLEET_ADMISSION_FACTOR"
# The agent admits up to this multiple of the KV tokens it is given (queued work included) unless told otherwise.
# The stacks always tell it: the plan's admission (kvfleet.sizing.planner.admission) as a factor on the KV tokens,
# which the fleet simulator admits too.
ADMISSION_FACTOR = 2.0
# The shortfall of a replica's KV cache (what the engine allocated against the plan's) past which it is reported: the
# live checks fail (kvfleet check, kvfleet bench --expect-kv-tokens, the pipeline's plan-drift gate) and the agent
# logs it. Less is the rounding of whole blocks and profiling noise.
KV_SHORTFALL_TOLERANCE = 0.05
ENV_RETRY_AFTER_S = "KVFLEET_RETRY_AFTER_S"
ENV_PUBLISH_INTERVAL_S = "KVFLEET_PUBLISH_INTERVAL_S"
ENV_TENANT_HEADER = "KVFLEET_TENANT_HEADER"
ENV_TENANT_SECRET = "KVFLEET_TENANT_SECRET"
# A Secrets Manager secret (name or ARN) the agent reads the tenant salt key from at start-up (what the stacks set).
ENV_TENANT_SECRET_ARN = "KVFLEET_TENANT_SECRET_ARN"
ENV_TENANT_SECRET_FILE = "KVFLEET_TENANT_SECRET_FILE"
ENV_IMDS_URL = "KVFLEET_IMDS_URL"
ENV_LOG_LEVEL = "KVFLEET_LOG_LEVEL"
ENV_REQUEST_LOG = "KVFLEET_REQUEST_LOG"  # "0": no request log lines (see REQUEST_LOG_FIELDS)
# Not kvfleet's own name: the region variable of the AWS CLI and SDKs. The agent reads it (then
# AWS_DEFAULT_REGION, which botocore itself reads) for its AWS clients; SageMaker documents no region variable in
# the container, EKS Pod Identity injects none, and the EC2 user data knows the region only on the instance, so
# each target sets it.
REGION_VARIABLE = "AWS_REGION"

# ---- image tags ----------------------------------------------------------------------------------------------
# `<engine release>-kvfleet<contract version>`, optionally followed by `-<build id>`: 0.30.0-kvfleet2-20261201.
_TAG = re.compile(r"^(?P<engine>[0-9][0-9A-Za-z.+_]*)-kvfleet(?P<contract>[0-9]+)(?:-[A-Za-z0-9_.]+)?$")


def image_tag(engine_version: str) -> str:
    """The tag a serving image built for this contract carries."""
    return f"{engine_version}-kvfleet{CONTRACT_VERSION}"


def parse_image_tag(tag: str) -> tuple[str, int] | None:
    """(engine release, contract version) from a tag made by ``image_tag``; None for any other tag."""
    m = _TAG.match(tag)
    return (m["engine"], int(m["contract"])) if m else None


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
# What autoscaling holds at a target: vLLM's cache-usage figure counts only the blocks of running sequences, which
# max_num_seqs caps, so where the planner sizes the cache for more sequences than max_num_seqs lets run (prod's plan:
# 156 fit, 32 run) KV use can never reach a target of 0.75. The larger of the two fractions reaches 1 whichever
# limit binds. The agent derives it from the engine's KV use, its running sequences and the max_num_seqs it was
# started with (TensorRT-LLM: max_batch_size).
REPLICA_SATURATION = Signal(
    name="ReplicaSaturation",
    unit="None",
    kind=Kind.GAUGE,
    statistic="Average",
    prometheus_name="kvfleet_replica_saturation",
    description=(
        "Fraction (0-1) of the replica's binding limit in use: the larger of KV-cache blocks in use and running "
        "sequences over max_num_seqs. Reaches 1 whichever of the two binds."
    ),
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

CLIENT_CANCELLED = Signal(
    name="ClientCancelled",
    unit="Count",
    kind=Kind.DELTA,
    statistic="Sum",
    prometheus_name="kvfleet_client_cancelled_total",
    description="Requests the client abandoned (disconnected) before the response ended; not server errors.",
)

SIGNALS: tuple[Signal, ...] = (
    REPLICA_SATURATION,
    KV_CACHE_UTILIZATION,
    REQUESTS_WAITING,
    REQUESTS_RUNNING,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    OUTPUT_TOKENS,
    PREEMPTIONS,
    REQUESTS_SHED,
    SERVER_ERRORS,
    CLIENT_CANCELLED,
)


# Every signal the agent publishes (EMF and /metrics): since the dashboards chart ClientCancelled, all of them are
# SIGNALS, which the stacks scale, alarm and chart on.
PUBLISHED_SIGNALS: tuple[Signal, ...] = SIGNALS

# The two signals every target scales on: saturation (not raw KV use, which may be unable to reach its target) and
# the queue.
SCALING_SIGNALS: tuple[Signal, ...] = (REPLICA_SATURATION, REQUESTS_WAITING)


# The engine's KV cache as it allocated it, on the agent's /metrics (gauges labelled ``deployment``): what
# `kvfleet bench` compares with the plan's KV tokens (an engine release or a driver that leaves less memory free
# allocates less than planned). Not published to CloudWatch: it changes only when the engine restarts.
PROM_ENGINE_KV_BLOCKS = "kvfleet_engine_kv_cache_blocks"
PROM_ENGINE_KV_BLOCK_TOKENS = "kvfleet_engine_kv_block_tokens"


# ---- the request log -------------------------------------------------------------------------------------------
# One JSON line per finished request on the agent's stdout (CloudWatch Logs on every target), beside its other
# output: what `kvfleet workload` and `kvfleet simulate` read back as a measured trace. No prompt text, and the
# tenant only as the hash the agent already salts the prefix cache with.
REQUEST_LOG_KIND_KEY = "kind"
REQUEST_LOG_KIND = "kvfleet.request"


@dataclass(frozen=True, kw_only=True)
class RequestLogFields:
    time: str = "ts"  # arrival, Unix seconds
    tenant: str = "tenant"  # the tenant's hash, "" without tenancy
    prompt_tokens: str = "prompt_tokens"
    cached_tokens: str = "cached_tokens"  # prompt tokens the engine served from its prefix cache
    output_tokens: str = "output_tokens"
    ttft_s: str = "ttft_s"
    e2e_s: str = "e2e_s"
    status: str = "status"  # the HTTP status the client got


REQUEST_LOG_FIELDS = RequestLogFields()


def deployment_id(environment: str, deployment: str) -> str:
    """Value of the Deployment dimension: unique per environment and deployment."""
    return f"{environment}-{deployment}"


def signal(name: str) -> Signal:
    for s in PUBLISHED_SIGNALS:
        if s.name == name:
            return s
    raise KeyError(f"no signal named {name!r}; known: {', '.join(s.name for s in PUBLISHED_SIGNALS)}")
