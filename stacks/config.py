"""Environment configs: ``environments/<name>.yaml``, parsed once into validated, frozen objects.

Unknown keys are rejected. A bad file gets one line per problem naming the file, the line, the field
path and what is allowed. This module imports pydantic and PyYAML but never aws_cdk, so the CLI can
plan from a file without loading CDK.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sizing.errors import KvfleetError


class ConfigError(KvfleetError):
    """One or more problems in an environment file; ``lines`` holds one line per problem."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Frozen):
    id: str = Field(description="Catalog id or alias (kvfleet models), or a path to a local config.json.")
    s3_uri: str | None = Field(
        default=None,
        pattern=r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$",
        description="Uncompressed model artifacts under this S3 prefix. Default: download from Hugging Face.",
    )
    hf_token_secret: str | None = Field(
        default=None,
        description="Secrets Manager secret name or ARN holding a Hugging Face token (gated models).",
    )


class EngineRef(_Frozen):
    name: Literal["vllm", "trtllm"] = Field(description="Serving engine.")
    version: str = Field(
        pattern=r"^\d+\.\d+(\.\d+)?([.\-+][0-9A-Za-z.]+)?$",
        description="Pinned engine release, e.g. 0.11.0. Capacity semantics differ between releases.",
    )


class WorkloadConfig(_Frozen):
    max_input_tokens: int = Field(gt=0, description="Longest prompt, in tokens.")
    max_output_tokens: int = Field(gt=0, description="Longest generation, in tokens.")
    concurrency_per_replica: int | None = Field(
        default=None, gt=0, description="Concurrent sequences one replica must hold. Default: as many as fit."
    )
    peak_requests_per_s: float | None = Field(default=None, gt=0, description="Peak load across the fleet.")
    avg_input_tokens: int | None = Field(default=None, gt=0, description="Typical prompt length (default: max).")
    avg_output_tokens: int | None = Field(default=None, gt=0, description="Typical output length (default: max).")
    ttft_ms: float | None = Field(default=None, gt=0, description="Time-to-first-token target.")
    itl_ms: float | None = Field(default=None, gt=0, description="Inter-token latency target.")

    @model_validator(mode="after")
    def _averages_within_max(self) -> WorkloadConfig:
        if self.avg_input_tokens and self.avg_input_tokens > self.max_input_tokens:
            raise ValueError("avg_input_tokens must not exceed max_input_tokens")
        if self.avg_output_tokens and self.avg_output_tokens > self.max_output_tokens:
            raise ValueError("avg_output_tokens must not exceed max_output_tokens")
        return self


class SizingConfig(_Frozen):
    weight_precisions: tuple[str, ...] = Field(
        default=(),
        description="Allowed weight precisions (bf16, fp8, awq, ...). Default: the checkpoint's own.",
    )
    kv_cache_dtypes: tuple[Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"], ...] = Field(
        default=("auto",), description="Allowed KV-cache dtypes; fp8 holds about twice the tokens."
    )
    families: tuple[str, ...] = Field(default=(), description="Allowed instance families, e.g. [g6e, p5].")
    instance_type: str | None = Field(default=None, description="Pin one instance type (EC2 or ml.* name).")
    max_fleet_usd_per_hour: float | None = Field(default=None, gt=0, description="Fleet price ceiling.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="Engine memory fraction. Default: the engine's for its version."
    )


class ImageConfig(_Frozen):
    source: Literal["kvfleet", "uri", "dlc"] = Field(
        default="kvfleet",
        description=(
            "kvfleet: the serving image built from containers/<engine> (engine + kvfleet agent, which publishes "
            "the scaling signals and drains), pushed to ECR repository `repository` with tag `tag` in the "
            "deploying account. uri: that image at an explicit `uri`. dlc: the AWS Deep Learning Container for "
            "the pinned engine version, unchanged (no agent: no KV-cache or queue signals, so the replica count "
            "is fixed)."
        ),
    )
    repository: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]+([._/-][a-z0-9]+)*$",
        description="ECR repository for source kvfleet. Default: kvfleet-<engine>.",
    )
    tag: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
        description="Image tag for source kvfleet. Default: the engine version.",
    )
    uri: str | None = Field(
        default=None,
        pattern=r"^\d{12}\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/[a-z0-9._/-]+(:[A-Za-z0-9_.-]+|@sha256:[0-9a-f]{64})$",
        description="Full ECR image URI for source uri (SageMaker pulls only from ECR).",
    )

    @model_validator(mode="after")
    def _fields_match_source(self) -> ImageConfig:
        if self.source == "uri" and self.uri is None:
            raise ValueError("source uri needs `uri`")
        if self.source != "uri" and self.uri is not None:
            raise ValueError("`uri` is only used with source uri")
        if self.source != "kvfleet" and (self.repository or self.tag):
            raise ValueError("`repository` and `tag` are only used with source kvfleet")
        return self


class NetworkConfig(_Frozen):
    vpc_id: str | None = Field(
        default=None,
        pattern=r"^vpc-[0-9a-f]{8,17}$",
        description="Use this existing VPC instead of creating one (no lookup at synth: give subnets and AZs).",
    )
    private_subnet_ids: tuple[str, ...] = Field(
        default=(), description="Private subnets of the existing VPC, one per availability zone."
    )
    availability_zones: tuple[str, ...] = Field(
        default=(),
        description="AZs of those subnets, in the same order; for a new VPC, the AZs to use (default: two).",
    )
    max_azs: int = Field(default=2, ge=2, le=6, description="AZs for a new VPC.")
    nat_gateways: int = Field(
        default=1, ge=0, le=6, description="NAT gateways for a new VPC (0 when the model comes from S3 only)."
    )

    @field_validator("private_subnet_ids")
    @classmethod
    def _subnet_ids(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if not re.fullmatch(r"subnet-[0-9a-f]{8,17}", s)]
        if bad:
            raise ValueError(f"not a subnet id: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _existing(self) -> NetworkConfig:
        if self.vpc_id is not None:
            if len(self.private_subnet_ids) < 2:
                raise ValueError("an existing VPC needs private_subnet_ids in at least two AZs")
            if len(self.availability_zones) != len(self.private_subnet_ids):
                raise ValueError("give one availability_zones entry per private subnet, in the same order")
        elif self.private_subnet_ids:
            raise ValueError("private_subnet_ids needs vpc_id")
        return self


class SageMakerTarget(_Frozen):
    platform: Literal["sagemaker"] = Field(description="A SageMaker real-time endpoint.")
    network_isolation: bool = Field(
        default=False,
        description="Run the container with no network access: the model must come from S3 (model.s3_uri).",
    )
    update: Literal["blue_green", "rolling"] = Field(
        default="blue_green",
        description=(
            "How an endpoint update replaces instances. blue_green: a full new fleet, old instances kept "
            "scaling.drain_budget_s after traffic moves. rolling: batches of instances, waiting "
            "scaling.drain_budget_s between batches (needs no spare capacity for a whole fleet)."
        ),
    )
    canary_percent: int | None = Field(
        default=None,
        ge=1,
        le=50,
        description="blue_green only: send this share of capacity to the new fleet first, then the rest.",
    )
    canary_wait_s: int = Field(
        default=600, ge=0, le=3600, description="Seconds the canary runs (alarms watched) before the rest moves."
    )

    @model_validator(mode="after")
    def _canary(self) -> SageMakerTarget:
        if self.canary_percent is not None and self.update != "blue_green":
            raise ValueError("canary_percent applies to update blue_green only")
        return self


class LoadBalancerConfig(_Frozen):
    internal: bool = Field(default=True, description="An internal load balancer (reachable from inside the VPC).")
    certificate_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:acm:[a-z0-9-]+:\d{12}:certificate/[0-9a-f-]+$",
        description="ACM certificate: serve HTTPS on 443 with it (default: HTTP on 80 inside the VPC).",
    )
    allowed_cidrs: tuple[str, ...] = Field(
        default=(),
        description="Client networks allowed to reach the load balancer. Default: the VPC's own CIDR.",
    )
    idle_timeout_s: int = Field(
        default=900,
        ge=60,
        le=4000,
        description="Seconds a connection may stay silent: a non-streaming generation sends nothing until done.",
    )

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for c in v:
            try:
                net = ipaddress.ip_network(c, strict=True)
            except ValueError:
                raise ValueError(f"not a CIDR block: {c}") from None
            if net.prefixlen == 0:
                raise ValueError(f"{c} opens the load balancer to every address; name your client networks")
        return v


class WarmPoolConfig(_Frozen):
    enabled: bool = Field(
        default=False, description="Keep pre-initialized instances so scale-out skips boot and image pull."
    )
    min_size: int = Field(default=0, ge=0, description="Instances kept in the warm pool at least.")
    state: Literal["Stopped", "Running", "Hibernated"] = Field(
        default="Stopped", description="Stopped: pay only for volumes; Running: fastest, pay for the instances."
    )


class Ec2Target(_Frozen):
    platform: Literal["ec2"] = Field(description="An EC2 GPU Auto Scaling group behind a load balancer.")
    load_balancer: LoadBalancerConfig = Field(default_factory=LoadBalancerConfig)
    warm_pool: WarmPoolConfig = Field(default_factory=WarmPoolConfig)
    ami_parameter: str = Field(
        default="/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-amazon-linux-2023/latest/ami-id",
        pattern=r"^/aws/service/[A-Za-z0-9_./-]+$",
        description=(
            "Public SSM parameter of the GPU AMI (NVIDIA driver, Docker and the container toolkit), resolved at "
            "deploy time. Default: the Deep Learning Base OSS NVIDIA Driver AMI on Amazon Linux 2023."
        ),
    )
    min_healthy_percent: int = Field(
        default=90, ge=0, le=100, description="Share of the fleet kept in service while instances are replaced."
    )
    capacity_rebalance: bool = Field(
        default=True, description="Replace instances at elevated risk of interruption before they are reclaimed."
    )
    shm_size_gib: int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )


class ExistingCluster(_Frozen):
    """An EKS cluster kvfleet attaches to: it adds the GPU node group, the add-ons asked for and the workload in its
    own namespace (target.namespace, created and deleted with the stack: give each deployment one of its own).

    Nothing is looked up at synth, so the config names what the templates need. kvfleet's kubectl function gets
    cluster-admin through an EKS access entry, which needs the cluster's authentication mode to be API or
    API_AND_CONFIG_MAP (`aws eks update-cluster-config --name NAME --access-config
    authenticationMode=API_AND_CONFIG_MAP` switches a ConfigMap-only cluster without disruption). It runs in the
    cluster security group inside network.private_subnet_ids, so those subnets need a route to the EKS and STS
    APIs (NAT or VPC endpoints); the Helm charts it installs come from their public repositories.
    """

    name: str = Field(
        pattern=r"^[0-9A-Za-z][A-Za-z0-9_-]{0,99}$", description="Name of the existing cluster (in this region)."
    )
    security_group_id: str = Field(
        pattern=r"^sg-[0-9a-f]{8,17}$",
        description=(
            "The cluster security group EKS created for the cluster (`aws eks describe-cluster` "
            "resourcesVpcConfig.clusterSecurityGroupId): the kubectl function runs in it to reach the API endpoint."
        ),
    )
    oidc_provider_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:iam::\d{12}:oidc-provider/oidc\.eks\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/id/[0-9A-Za-z]+$",
        description=(
            "The cluster's IAM OIDC provider: pods get their AWS roles through IRSA. Without it they get them "
            "through EKS Pod Identity, which needs the eks-pod-identity-agent add-on on the cluster."
        ),
    )


class EksAddons(_Frozen):
    """The cluster add-ons the workload needs. A new cluster gets all of them; an existing one may already run some."""

    device_plugin: bool = Field(
        default=True,
        description="Install the NVIDIA device plugin (off when the cluster already runs it or the GPU Operator).",
    )
    keda: bool = Field(default=True, description="Install KEDA (off when the cluster already runs KEDA 2.x).")
    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://[A-Za-z0-9.-]+(:\d+)?(/[^\s]*)?$",
        description=(
            "Query this Prometheus instead of installing one. It must scrape pods annotated prometheus.io/scrape "
            "(the kubernetes-pods job of the community chart does) and answer KEDA without authentication."
        ),
    )
    cluster_autoscaler: bool = Field(
        default=True,
        description=(
            "Install Cluster Autoscaler for the GPU node group (off when the cluster already runs one with "
            "node group auto-discovery: EKS tags managed node groups for it)."
        ),
    )


class EksTarget(_Frozen):
    platform: Literal["eks"] = Field(description="A GPU node group and Deployment on EKS.")
    cluster: ExistingCluster | None = Field(
        default=None, description="Attach to this existing cluster instead of creating one (needs network.vpc_id)."
    )
    addons: EksAddons = Field(default_factory=EksAddons)
    kubernetes_version: Literal["1.33", "1.34", "1.35"] = Field(
        default="1.33",
        description=(
            "Kubernetes version of a new cluster, or of the existing one (pinned: manifests are validated for it)."
        ),
    )
    namespace: str = Field(
        default="kvfleet", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", description="Namespace of the workload."
    )
    shm_size_gib: int = Field(
        default=16, ge=1, le=512, description="Shared memory for the engine (tensor parallelism)."
    )

    @model_validator(mode="after")
    def _new_cluster_addons(self) -> EksTarget:
        if self.cluster is None:
            missing = [name for name in ("device_plugin", "keda") if not getattr(self.addons, name)]
            if missing:
                raise ValueError(
                    f"addons.{missing[0]}: a new cluster has nothing else to provide it; set it to true, or attach "
                    "to an existing cluster with target.cluster"
                )
        return self


Target = Annotated[SageMakerTarget | Ec2Target | EksTarget, Field(discriminator="platform")]


# A replica takes minutes to load a model, so removing one that is needed again soon is expensive.
SCALE_IN_MIN_S = 900


class ScalingConfig(_Frozen):
    """Autoscaling on the two signals that run out under LLM traffic.

    Two target-tracking policies run side by side; the one asking for more replicas wins, so the fleet
    grows when either the cache fills or the queue builds. Scale-out reacts within a minute; scale-in
    waits at least 15 minutes (and twice the drain budget) because a replica takes minutes to load a
    model and every removed replica first drains its generations.
    """

    min_replicas: int = Field(
        default=1,
        ge=0,
        description="Replicas kept at all times. SageMaker endpoints need 1 or more; 0 allows scale to zero elsewhere.",
    )
    max_replicas: int = Field(
        default=4, ge=1, description="Upper bound for autoscaling (and for the plan's replica count)."
    )
    kv_cache_utilization_target: float = Field(
        default=0.75,
        gt=0,
        lt=1,
        description=(
            "Average fraction of KV-cache blocks in use to hold the fleet at. The cache is sized for "
            "max_num_seqs full-length sequences, so typical traffic sits well below 1; past about 0.9 new "
            "sequences wait for blocks or running ones are preempted and recomputed. 0.75 leaves room for the "
            "minutes a new replica takes to load; lower it for spiky traffic or slow-loading models."
        ),
    )
    queue_depth_target: float = Field(
        default=2.0,
        gt=0,
        description=(
            "Requests waiting (not yet scheduled) per replica to hold the fleet at. Every waiting request is "
            "time-to-first-token already spent; a short queue keeps the batch full without TTFT growing. This "
            "catches what the cache signal misses: requests held back by max_num_seqs while blocks are free."
        ),
    )
    drain_budget_s: int = Field(
        default=300,
        ge=0,
        le=3600,
        description=(
            "Seconds a replica that is being removed may take to finish its in-flight generations (set it "
            "above your longest generation: max_output_tokens x inter-token latency). Endpoint updates wait "
            "this long before removing the old instances."
        ),
    )

    @model_validator(mode="after")
    def _bounds(self) -> ScalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self

    @property
    def scale_in_wait_s(self) -> int:
        """How long every target waits before acting on a scale-in: at least 15 minutes and twice the drain
        budget, so a scale-in decision outlives the drain it starts."""
        return max(SCALE_IN_MIN_S, 2 * self.drain_budget_s)


class Deployment(_Frozen):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$", description="Short name: lowercase letters, digits, '-'.")
    model: ModelRef
    engine: EngineRef
    workload: WorkloadConfig
    target: Target
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    sizing: SizingConfig = Field(default_factory=SizingConfig)
    image: ImageConfig = Field(default_factory=ImageConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Deployment:
        # Each problem starts with the field to change; the loader points at that field's line.
        problems = []
        t = self.target
        if isinstance(t, SageMakerTarget):
            if self.scaling.min_replicas < 1:
                problems.append(
                    "scaling.min_replicas: a SageMaker real-time endpoint keeps at least one instance; set 1 or more"
                )
            if t.network_isolation and self.model.s3_uri is None:
                problems.append(
                    "model.s3_uri: required with target.network_isolation, which leaves the container no network to "
                    "download the model"
                )
        if self.image.source == "dlc":
            if self.scaling.min_replicas != self.scaling.max_replicas:
                problems.append(
                    "image.source: dlc runs the engine without the kvfleet agent, so nothing publishes the KV-cache "
                    "and queue signals to scale on; use source kvfleet, or set scaling.max_replicas equal to "
                    "min_replicas"
                )
            if self.model.hf_token_secret and self.model.s3_uri is None:
                problems.append(
                    "model.hf_token_secret: image.source dlc cannot read it at start-up; set model.s3_uri, or use "
                    "image.source kvfleet"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self


class Environment(_Frozen):
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,20}$", description="Environment name, e.g. dev.")
    account: str | None = Field(default=None, pattern=r"^\d{12}$", description="AWS account id (12 digits).")
    region: str | None = Field(default=None, pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d$", description="AWS region.")
    network: NetworkConfig = Field(
        default_factory=NetworkConfig,
        description="Where the replicas run: a new VPC per deployment, or an existing one.",
    )
    deployments: tuple[Deployment, ...] = Field(min_length=1, description="What to serve in this environment.")

    @model_validator(mode="after")
    def _network_fits_targets(self) -> Environment:
        # Deployments that share an existing cluster share what lives in it: one namespace each, and each add-on
        # installed by one of them only (a second Helm release of KEDA or the device plugin would collide).
        namespaces: dict[tuple[str, str], str] = {}
        installs: dict[tuple[str, str], str] = {}
        for i, d in enumerate(self.deployments):
            if not (isinstance(d.target, EksTarget) and d.target.cluster is not None):
                continue
            cluster = d.target.cluster.name
            if self.network.vpc_id is None:
                raise ValueError(
                    f"network.vpc_id: deployment {d.name} attaches to cluster {cluster}; give the "
                    "cluster's VPC (vpc_id, private_subnet_ids, availability_zones) so its GPU nodes join it"
                )
            where = f"deployments.{i}.target"
            if (other := namespaces.setdefault((cluster, d.target.namespace), d.name)) != d.name:
                raise ValueError(
                    f"{where}.namespace: deployment {other} already uses namespace {d.target.namespace} on cluster "
                    f"{cluster}; give {d.name} a namespace of its own"
                )
            a = d.target.addons
            for addon, installed in (
                ("device_plugin", a.device_plugin),
                ("keda", a.keda),
                ("prometheus_url", a.prometheus_url is None),
                ("cluster_autoscaler", a.cluster_autoscaler),
            ):
                if installed and (other := installs.setdefault((cluster, addon), d.name)) != d.name:
                    fix = "set prometheus_url to its Prometheus" if addon == "prometheus_url" else "set it to false"
                    raise ValueError(
                        f"{where}.addons.{addon}: deployment {other} already installs it on cluster {cluster}; {fix}"
                    )
        if self.network.vpc_id is not None:
            for d in self.deployments:
                if isinstance(d.target, Ec2Target) and not d.target.load_balancer.allowed_cidrs:
                    raise ValueError(
                        f"network.vpc_id: deployment {d.name} needs target.load_balancer.allowed_cidrs with an "
                        "existing VPC (its CIDR is not looked up at synth)"
                    )
        return self

    @field_validator("deployments")
    @classmethod
    def _unique(cls, v: tuple[Deployment, ...]) -> tuple[Deployment, ...]:
        names = [d.name for d in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"deployment names must be unique; repeated: {', '.join(dup)}")
        return v


def environment_schema_json() -> str:
    """The JSON Schema editors use to complete and check environment files."""
    import json

    schema = Environment.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvfleet environment"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


# ---- loading with line numbers ---------------------------------------------------------------------


def _lines(
    node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int], repeated: list[tuple[tuple[Any, ...], int]]
) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for k, v in node.value:
            if k.value in seen:
                # YAML loaders keep the last one silently; a repeated key is almost always an edit gone wrong.
                repeated.append(((*path, k.value), k.start_mark.line + 1))
            seen.add(k.value)
            _lines(v, (*path, k.value), out, repeated)
            out[(*path, k.value)] = k.start_mark.line + 1  # a key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, (*path, i), out, repeated)


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    s = ""
    for part in loc:
        s += f"[{part}]" if isinstance(part, int) else (f".{part}" if s else str(part))
    return s or "(top level)"


def _allowed(err: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling"
    if kind == "missing":
        return "required field is missing"
    msg = str(err["msg"])  # pydantic's message says what is allowed (literals, bounds, types)
    return msg.removeprefix("Value error, ")


def parse_environment(text: str, *, source: str = "<config>") -> Environment:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError([f"{source}{line}: not valid YAML: {problem}"]) from None
    if not isinstance(data, dict) or node is None:
        raise ConfigError([f"{source}:1: expected a mapping with 'name' and 'deployments'"])
    lines: dict[tuple[Any, ...], int] = {}
    repeated: list[tuple[tuple[Any, ...], int]] = []
    _lines(node, (), lines, repeated)
    if repeated:
        raise ConfigError(
            [
                f"{source}:{line}: {_fmt_loc(where)}: key repeated; keep one (a loader would silently use the last)"
                for where, line in repeated
            ]
        )
    try:
        return Environment.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        deeper = {tuple(e["loc"][:-1]) for e in errors if len(e["loc"]) > 1}
        deeper |= {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
        out = []
        for problem in errors:
            # pydantic re-checks min_length on the items that validated; that echo is noise when the
            # real problem sits inside one of the items.
            if problem["type"] == "too_short" and tuple(problem["loc"]) in deeper:
                continue
            loc = tuple(p for p in problem["loc"] if not (isinstance(p, str) and p in ("sagemaker", "ec2", "eks")))
            for problem_text in _allowed(problem).split("\n"):
                where, msg = loc, problem_text
                # A cross-field check names the field to change first: "scaling.min_replicas: ...".
                m = (
                    re.match(r"^([a-z][a-z0-9_]*(?:\.(?:[a-z][a-z0-9_]*|\d+))*): (.*)$", problem_text)
                    if problem["type"] == "value_error"
                    else None
                )
                if m:
                    where = (*loc, *(int(part) if part.isdigit() else part for part in m[1].split(".")))
                    msg = m[2]
                line_no = next((lines[where[:i]] for i in range(len(where), -1, -1) if where[:i] in lines), 1)
                out.append(f"{source}:{line_no}: {_fmt_loc(where)}: {msg}")
        raise ConfigError(out) from None


def load_environment(path: str | Path) -> Environment:
    p = Path(path)
    if not p.is_file():
        hint = (
            ", ".join(sorted(x.stem for x in p.parent.glob("*.yaml") if x.stem != "schema"))
            if p.parent.is_dir()
            else ""
        )
        raise KvfleetError(f"no environment file at {p}" + (f"; found: {hint}" if hint else ""), field="environment")
    return parse_environment(p.read_text(encoding="utf-8"), source=str(path))


def plan_requests(env: Environment) -> list[tuple[str, Any]]:
    """One sizing.PlanRequest per deployment (resolving the model; no AWS calls)."""
    from sizing.catalog import resolve_model
    from sizing.engines import EngineName
    from sizing.planner import PlanRequest, Platform, Workload
    from sizing.precision import kv_dtype

    out = []
    for d in env.deployments:
        try:
            model = resolve_model(d.model.id)
        except KvfleetError as err:
            raise KvfleetError(str(err), field=f"deployments.{d.name}.model") from None
        w = d.workload
        req = PlanRequest(
            model=model,
            workload=Workload(
                max_input_tokens=w.max_input_tokens,
                max_output_tokens=w.max_output_tokens,
                concurrency_per_replica=w.concurrency_per_replica,
                peak_requests_per_s=w.peak_requests_per_s,
                avg_input_tokens=w.avg_input_tokens,
                avg_output_tokens=w.avg_output_tokens,
                ttft_target_s=None if w.ttft_ms is None else w.ttft_ms / 1e3,
                itl_target_s=None if w.itl_ms is None else w.itl_ms / 1e3,
            ),
            engine=EngineName(d.engine.name),
            engine_version=d.engine.version,
            platform=Platform(d.target.platform),
            weight_precisions=d.sizing.weight_precisions,
            kv_cache_dtypes=tuple(kv_dtype(k) for k in d.sizing.kv_cache_dtypes),
            families=d.sizing.families,
            instance_types=(d.sizing.instance_type,) if d.sizing.instance_type else (),
            region=env.region,
            max_fleet_usd_per_hour=d.sizing.max_fleet_usd_per_hour,
            gpu_memory_utilization=d.sizing.gpu_memory_utilization,
            min_replicas=max(1, d.scaling.min_replicas),
            max_replicas=d.scaling.max_replicas,
        )
        out.append((d.name, req))
    return out
