"""The environment file's schema: ``environments/<name>.yaml`` as validated, frozen objects.

Unknown keys are rejected; cross-field checks name the field to change first ("scaling.min_replicas: ..."),
so the loader can point at its line. pydantic, never aws_cdk: the CLI plans from a file without CDK. Each
target's own section, and what it checks of the rest of the file, is in its folder (``kvfleet/targets/<name>/
config.py``), reached through the registry (``kvfleet.config.targets``); reading files is ``kvfleet.config.loader``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvfleet import contract, versions
from kvfleet.config import aws, dlc
from kvfleet.config.base import Bool, Float, Frozen, Int
from kvfleet.config.targets import Target, rebuild, target_sections
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError
from kvfleet.sizing.engines import default_version, engine_capacity
from kvfleet.targets import TARGETS
from kvfleet.workload.traces import TraceFormat


class RopeScalingRef(Frozen):
    """A RoPE scaling the model card documents for longer contexts, applied as the engine's config override."""

    rope_type: Literal["yarn", "linear", "dynamic"] = Field(
        description="The scaling: yarn (e.g. Qwen2.5's model cards), linear or dynamic."
    )
    factor: float = Field(gt=1, description="How many times the context grows, e.g. 4.0.")
    original_max_position_embeddings: int | None = Field(
        default=None,
        gt=0,
        description="The length the model was trained at (yarn). Default: the config's max_position_embeddings.",
    )


class ModelRef(Frozen):
    id: str = Field(description="Catalog id or alias (kvfleet models), or a path to a local config.json.")
    rope_scaling: RopeScalingRef | None = Field(
        default=None,
        description=(
            "Extend the context beyond the config's with a RoPE scaling: the plan sizes the longer context and vLLM "
            "starts with it (--hf-overrides with rope_scaling and max_position_embeddings). vLLM only."
        ),
    )
    s3_uri: str | None = Field(
        default=None,
        description=(
            "Uncompressed model artifacts under this S3 prefix, s3://<bucket>/<prefix>. Default: download from "
            "Hugging Face."
        ),
    )
    hf_token_secret: str | None = Field(
        default=None,
        description="Secrets Manager secret name or ARN holding a Hugging Face token (gated models).",
    )

    @field_validator("s3_uri")
    @classmethod
    def _s3_uri(cls, v: str | None) -> str | None:
        if v is not None and (problem := aws.s3_uri_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @field_validator("hf_token_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        if v is not None and (problem := aws.secret_problem(v)) is not None:
            raise ValueError(problem)
        return v


class MmLimits(Frozen):
    """vLLM's --limit-mm-per-prompt: items of each modality one prompt may carry."""

    image: Int | None = Field(default=None, ge=0, description="Images per prompt; 0: none. Default: vLLM's (999).")
    video: Int | None = Field(default=None, ge=0, description="Videos per prompt; 0: none. Default: vLLM's (999).")

    @property
    def pairs(self) -> tuple[tuple[str, int], ...]:
        """The limits set, as (modality, items) pairs."""
        return tuple((m, n) for m, n in (("image", self.image), ("video", self.video)) if n is not None)


# The engine settings an engine may lack (vLLM's options; an adapter's ``refused_settings`` names those its engine has
# no option for, or kvfleet does not size there).
OPTIONAL_SETTINGS = (
    "limit_mm_per_prompt",
    "mm_encoder_tp_mode",
    "mm_max_pixels",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)
MambaDtype = Literal["auto", "float32", "float16", "bfloat16"]  # vllm/config/cache.py MambaDType (vLLM 0.32.0)


class EngineRef(Frozen):
    # The names come from the engine registry (kvfleet.engines.ENGINES): a new engine needs no change here.
    name: str = Field(description="Serving engine.", json_schema_extra={"enum": list(ENGINES)})
    version: str = Field(
        description="Pinned engine release, e.g. 0.11.0. Capacity semantics differ between releases.",
        examples=["0.11.0"],
    )
    # Settings the plan sizes with and the engine starts with, so the two cannot differ.
    enable_prefix_caching: Bool | None = Field(
        default=None,
        description=(
            "Cache prompt prefixes (vLLM --enable-prefix-caching, TensorRT-LLM enable_block_reuse). Default: the "
            "release's, which the plan resolves and the engine is started with: on, except for hybrid "
            "linear-attention / Mamba models on vLLM before 0.28. On a hybrid model it keeps two state pages per "
            "request instead of one (vLLM's mamba_cache_mode align), so false holds more sequences."
        ),
    )
    limit_mm_per_prompt: MmLimits | None = Field(
        default=None,
        description=(
            "Vision-language models (vLLM): items per prompt by modality, e.g. {image: 1, video: 0}. vLLM profiles "
            "the vision encoder for the largest item allowed (by default a video, up to the whole context), so "
            "limiting it leaves more memory for the KV cache; {image: 0, video: 0} serves text only (no vision "
            "tower loaded). Requests with more items are refused by the engine."
        ),
    )
    mm_encoder_tp_mode: Literal["weights", "data"] | None = Field(
        default=None,
        description=(
            "Vision-language models (vLLM --mm-encoder-tp-mode): weights shards the vision tower over the "
            "tensor-parallel ranks; data keeps it whole on each (where the model supports it). Default: weights."
        ),
    )
    mm_max_pixels: Int | None = Field(
        default=None,
        gt=0,
        description=(
            "Qwen-VL models (vLLM --mm-processor-kwargs max_pixels): the largest image, in pixels, e.g. 1003520 "
            "(1280 x 28 x 28); smaller images need a smaller encoder budget. Default: the processor's."
        ),
    )
    mamba_cache_dtype: MambaDtype = Field(
        default="auto",
        description=(
            "Hybrid linear-attention / Mamba models (vLLM --mamba-cache-dtype): the dtype of their conv and SSM "
            "state. auto: the model's."
        ),
    )
    mamba_ssm_cache_dtype: MambaDtype = Field(
        default="auto",
        description=(
            "Hybrid linear-attention / Mamba models (vLLM --mamba-ssm-cache-dtype): the SSM state's dtype alone, "
            "e.g. float32 where the model card asks for it. auto: as mamba_cache_dtype (or the config's "
            "mamba_ssm_dtype)."
        ),
    )

    @field_validator("name")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"use {' or '.join(repr(e) for e in ENGINES)}")
        return v

    @field_validator("version")
    @classmethod
    def _release(cls, v: str) -> str:
        versions.parse_version(v)  # ValueError names what is expected
        return v

    @model_validator(mode="after")
    def _modelled(self) -> EngineRef:
        # The planner sizes memory from a profile of the release (the engine's own rows, through the registry); a
        # release newer than every profile would silently be sized as the newest one.
        if self.name not in ENGINES:
            return self
        table = engine_capacity(self.name).profiles
        v = versions.parse_version(self.version)
        oldest, newest = table[0].since, versions.parse_version(default_version(self.name))
        if v < oldest or v[:2] > newest[:2]:
            releases = ", ".join(".".join(map(str, p.since)) for p in table)
            raise ValueError(
                f"version: kvfleet models {self.name} releases {'.'.join(map(str, oldest))} to "
                f"{newest[0]}.{newest[1]}.x (profiles from {releases}); pin one of those"
            )
        return self

    @model_validator(mode="after")
    def _settings_the_engine_takes(self) -> EngineRef:
        if self.name not in ENGINES:
            return self
        refused = ENGINES[self.name].refused_settings
        unsupported = [f for f in OPTIONAL_SETTINGS if f in refused and getattr(self, f) not in (None, "auto")]
        if unsupported:
            raise ValueError(
                "\n".join(
                    f"{f}: a vLLM setting; {self.name} has no such option, or kvfleet does not size it there; remove "
                    "it, or use engine vllm"
                    for f in unsupported
                )
            )
        return self

    @property
    def mm_limits(self) -> tuple[tuple[str, int], ...]:
        return () if self.limit_mm_per_prompt is None else self.limit_mm_per_prompt.pairs


# The trace percentile that stands for "longest" when the file gives no maximum: the single longest request of a
# trace would set max_model_len, and so the cache every sequence reserves, for one request in thousands.
TRACE_MAX_PERCENTILE = "p99"


class WorkloadTrace(Frozen):
    """A request trace the workload is read from, once, when the environment file is loaded."""

    path: str = Field(
        min_length=1,
        description=(
            "The trace file, relative to this environment file's directory: an Azure or BurstGPT CSV, Mooncake JSON "
            "lines, or the serving agent's request log (the formats kvfleet workload reads). Only this file is read."
        ),
    )
    format: TraceFormat | None = Field(
        default=None, description="The trace's format. Default: from its header or first record."
    )
    start_s: Float = Field(default=0.0, ge=0, description="Skip this many seconds of the trace (on its own clock).")
    duration_s: Float | None = Field(
        default=None, gt=0, description="Keep this many seconds of the trace from start_s. Default: the rest."
    )
    rate_scale: Float = Field(
        default=1.0,
        gt=0,
        description="Replay at this multiple of the recorded rate: arrival gaps are divided by it (2: twice the load).",
    )


def _maxima_or_trace(schema: dict[str, Any]) -> None:
    # The maxima are required unless a trace gives them (the loader fills them in before validation).
    maxima = ("max_input_tokens", "max_output_tokens")
    schema["required"] = [k for k in schema.get("required", []) if k not in maxima]
    if not schema["required"]:
        del schema["required"]
    schema["anyOf"] = [{"required": list(maxima)}, {"required": ["trace"]}]


class WorkloadConfig(Frozen):
    model_config = ConfigDict(json_schema_extra=_maxima_or_trace)

    max_input_tokens: Int = Field(
        gt=0, description=f"Longest prompt, in tokens. With `trace`, default: the trace's {TRACE_MAX_PERCENTILE}."
    )
    max_output_tokens: Int = Field(
        gt=0, description=f"Longest generation, in tokens. With `trace`, default: the trace's {TRACE_MAX_PERCENTILE}."
    )
    concurrency_per_replica: Int | None = Field(
        default=None, gt=0, description="Concurrent sequences one replica must hold. Default: as many as fit."
    )
    peak_requests_per_s: Float | None = Field(
        default=None,
        gt=0,
        description="Peak load across the fleet. With `trace`, default: the trace's busiest minute, per second.",
    )
    avg_input_tokens: Int | None = Field(
        default=None, gt=0, description="Typical prompt length (default: max; with `trace`, the trace's mean)."
    )
    avg_output_tokens: Int | None = Field(
        default=None, gt=0, description="Typical output length (default: max; with `trace`, the trace's mean)."
    )
    ttft_ms: Float | None = Field(default=None, gt=0, description="Time-to-first-token target.")
    itl_ms: Float | None = Field(default=None, gt=0, description="Inter-token latency target.")
    streaming: Bool = Field(
        default=True,
        description=(
            "Clients read answers as a stream (SageMaker InvokeEndpointWithResponseStream, OpenAI stream: true). "
            "false: each answer arrives whole, so on SageMaker the longest one must finish within InvokeEndpoint's "
            "60 s; the plan refuses instance types whose predicted answer takes longer."
        ),
    )
    trace: WorkloadTrace | None = Field(
        default=None,
        description=(
            "Read the workload from a request trace instead of typing it: the requests in the window (after "
            "rate_scale) give what this mapping leaves out: avg_input_tokens and avg_output_tokens their mean "
            f"lengths, max_input_tokens and max_output_tokens their {TRACE_MAX_PERCENTILE} (the longest 1% of "
            "requests then exceed the engine's max_model_len; type the maxima to admit every one), "
            "peak_requests_per_s their busiest minute (the mean rate for a window under a minute). Values typed here "
            "win over the trace's; a mean above a maximum is capped at it. The trace is read once, when the file is "
            "loaded, and `kvfleet simulate` replays it when no --trace is given."
        ),
    )

    @model_validator(mode="after")
    def _averages_within_max(self) -> WorkloadConfig:
        if self.avg_input_tokens and self.avg_input_tokens > self.max_input_tokens:
            raise ValueError("avg_input_tokens must not exceed max_input_tokens")
        if self.avg_output_tokens and self.avg_output_tokens > self.max_output_tokens:
            raise ValueError("avg_output_tokens must not exceed max_output_tokens")
        return self


class SizingConfig(Frozen):
    weight_precisions: tuple[str, ...] = Field(
        default=(),
        description="Allowed weight precisions (bf16, fp8, awq, ...). Default: the checkpoint's own.",
    )
    kv_cache_dtypes: tuple[Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"], ...] = Field(
        default=("auto",), description="Allowed KV-cache dtypes; fp8 holds about twice the tokens."
    )
    families: tuple[str, ...] = Field(default=(), description="Allowed instance families, e.g. [g6e, p5].")
    instance_type: str | None = Field(default=None, description="Pin one instance type (EC2 or ml.* name).")
    max_fleet_usd_per_hour: Float | None = Field(default=None, gt=0, description="Fleet price ceiling.")
    gpu_memory_utilization: Float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "Engine memory fraction. Default: the engine's for its version (vLLM 0.34: unset, the KV cache sized "
            "from the memory free after warm-up; a value given here caps it)."
        ),
    )


class ImageConfig(Frozen):
    source: Literal["kvfleet", "uri", "dlc"] = Field(
        default="kvfleet",
        description=(
            "kvfleet: the serving image built from containers/Dockerfile (engine + kvfleet agent, which publishes "
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
        description=(
            "Image tag for source kvfleet: <engine version>-kvfleet<contract version>[-<build id>], so the stacks "
            "know the image speaks their contract. Default: <engine version>-kvfleet<this kvfleet's contract>."
        ),
    )
    uri: str | None = Field(
        default=None,
        pattern=r"^[0-9]{12}\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/[a-z0-9._/-]+:[A-Za-z0-9_.-]+(@sha256:[0-9a-f]{64})?$",
        description=(
            "Full ECR image URI for source uri (SageMaker pulls only from ECR), with its tag (and optionally the "
            "digest after it): the tag names the contract version the image speaks, as for `tag`."
        ),
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


class NetworkConfig(Frozen):
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
    max_azs: Int = Field(default=2, ge=2, le=6, description="AZs for a new VPC.")
    nat_gateways: Int = Field(
        default=1, ge=0, le=6, description="NAT gateways for a new VPC (0 when the model comes from S3 only)."
    )

    @field_validator("private_subnet_ids")
    @classmethod
    def _subnet_ids(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if not re.fullmatch(r"subnet-[0-9a-f]{8,17}", s)]
        if bad:
            raise ValueError(f"not a subnet id: {', '.join(bad)}")
        return v

    @field_validator("private_subnet_ids", "availability_zones")
    @classmethod
    def _once_each(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if dup := sorted({x for x in v if v.count(x) > 1}):
            raise ValueError(f"{', '.join(dup)} given more than once; list each once (one subnet per zone)")
        return v

    @field_validator("availability_zones")
    @classmethod
    def _zone_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for zone in v:
            if (problem := aws.zone_problem(zone, None)) is not None:
                raise ValueError(problem)
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


# A replica takes minutes to load a model, so removing one that is needed again soon is expensive.
SCALE_IN_MIN_S = 900


# The settings scaling.derive derives where the file does not set them.
DERIVED_SCALING = frozenset(
    {"saturation_target", "queue_depth_target", "min_replicas", "scale_in_after_s", "admission_queue"}
)
# The HPA's scale-down stabilization window takes at most an hour (Kubernetes API, autoscaling/v2
# HPAScalingRules.stabilizationWindowSeconds: "less than or equal to 3600"; KEDA passes it through); every target
# gets the same wait.
SCALE_IN_MAX_S = 3600
# A bound on the admission queue, so the agent's budget stays a planning figure: past it TTFT is minutes anyway.
ADMISSION_QUEUE_MAX = 100_000


class ScalingConfig(Frozen):
    """Autoscaling on the two signals that run out under LLM traffic.

    Two target-tracking policies run side by side; the one asking for more replicas wins, so the fleet
    grows when either the replica saturates (its cache or its sequence slots) or the queue builds.
    Scale-out reacts within a minute; scale-in waits at least 15 minutes (and twice the drain budget)
    because a replica takes minutes to load a model and every removed replica first drains its generations.
    """

    min_replicas: Int = Field(
        default=1,
        ge=0,
        description=(
            "Replicas kept at all times. 0 scales to zero (EC2, and SageMaker with inference components): the fleet "
            "goes to zero after the scale-in wait (at least the ready window) without a request, and the first "
            "request refused at zero wakes it, with the whole cold start (or a warm pool's) to wait; clients must "
            "retry. A SageMaker variant and EKS need 1 or more. `kvfleet plan` compares a warm minimum, a warm pool "
            "and scale to zero on the workload."
        ),
    )
    max_replicas: Int = Field(
        default=4, ge=1, description="Upper bound for autoscaling (and for the plan's replica count)."
    )
    saturation_target: Float = Field(
        default=0.75,
        gt=0,
        lt=1,
        description=(
            "Average replica saturation to hold the fleet at: the larger of the fraction of KV-cache blocks in use "
            "and running sequences over max_num_seqs (contract signal ReplicaSaturation), so the target is "
            "reachable whichever limit binds (the planner often sizes the cache for more sequences than "
            "max_num_seqs runs, and KV use alone then never gets near 0.75). 0.75 leaves room for the minutes a "
            "new replica takes to load; lower it for spiky traffic or slow-loading models."
        ),
    )
    queue_depth_target: Float = Field(
        default=2.0,
        gt=0,
        description=(
            "Requests waiting (not yet scheduled) per replica to hold the fleet at. Every waiting request is "
            "time-to-first-token already spent; a short queue keeps the batch full without TTFT growing. This "
            "catches what the cache signal misses: requests held back by max_num_seqs while blocks are free."
        ),
    )
    derive: Bool = Field(
        default=False,
        description=(
            "Derive saturation_target, queue_depth_target and min_replicas (those this file does not set) by replaying "
            "the workload through the fleet simulator with this target's autoscaler and the replica's cold start: the "
            "cheapest policy that gets slo_attainment of the requests a first token within workload.ttft_ms. The "
            "replay is workload.trace, or without one 20 minutes at 40% of peak_requests_per_s and 20 at the peak. "
            "`kvfleet plan` prints the values and why; synth deploys them. Needs workload.ttft_ms."
        ),
    )
    slo_attainment: Float = Field(
        default=0.95,
        ge=0.5,
        le=0.999,
        description=(
            "Fraction of requests that must get their first token within workload.ttft_ms in the replay that derives "
            "the thresholds (refused requests miss it). 0.95: the target holds for 19 requests in 20 (p95), "
            "stricter than the plan's own check, which holds the mean TTFT under the planned load to it."
        ),
    )
    scale_in_after_s: Int | None = Field(
        default=None,
        ge=SCALE_IN_MIN_S,
        le=SCALE_IN_MAX_S,
        description=(
            "Seconds of low load before a scale-in acts: the EC2 alarm that removes one instance and its cooldown, "
            "the HPA's stabilization window on EKS; on SageMaker, whose target tracking scales in after its own "
            "15 low minutes, the cooldown between scale-ins. Default and floor: 15 minutes and twice "
            "drain_budget_s. Longer keeps replicas through short lulls instead of relaunching them after; "
            "scaling.derive replays longer waits, up to an hour, and keeps the cheapest that meets the goal."
        ),
    )
    admission_queue: Int | None = Field(
        default=None,
        ge=0,
        le=ADMISSION_QUEUE_MAX,
        description=(
            "Requests per replica the agent lets wait for a sequence slot before it answers 429: its token budget "
            "is max_num_seqs plus this many typical requests (average prompt + max_output_tokens), never below "
            "max_num_seqs requests of max_model_len. Default: what can start within workload.ttft_ms at the "
            "replica's throughput (the plan's). scaling.derive replays 0, half, twice and four times that and keeps "
            "the cheapest that meets the goal, at equal cost the one with the most requests in time. Needs "
            "serving.admission."
        ),
    )
    drain_budget_s: Int = Field(
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
        if self.scale_in_after_s is not None and self.scale_in_after_s < self.scale_in_floor_s:
            raise ValueError(
                f"scale_in_after_s: at least {self.scale_in_floor_s} (twice drain_budget_s {self.drain_budget_s}, so "
                "a scale-in decision outlives the drain it starts); raise it or lower drain_budget_s"
            )
        return self

    @property
    def scale_in_floor_s(self) -> int:
        """The shortest scale-in wait: 15 minutes and twice the drain budget."""
        return max(SCALE_IN_MIN_S, 2 * self.drain_budget_s)

    @property
    def scale_in_wait_s(self) -> int:
        """How long every target waits before acting on a scale-in: scale_in_after_s, or its floor (at least 15
        minutes and twice the drain budget, so a scale-in decision outlives the drain it starts)."""
        return max(self.scale_in_floor_s, self.scale_in_after_s or 0)

    @property
    def pinned(self) -> frozenset[str]:
        """The thresholds this file sets (derive leaves them as written)."""
        return frozenset(self.model_fields_set & DERIVED_SCALING)


# Who shares a replica's prefix cache: one tenant, or tenants the agent keeps apart by salting the cache per tenant.
Tenancy = Literal["single", "isolated"]


class ServingConfig(Frozen):
    """What the serving agent does with requests: tenant isolation of the prefix cache, token-aware admission."""

    tenant_header: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$",
        description=(
            "Request header naming the tenant. With tenant_secret, the agent salts each tenant's prefix cache with "
            "HMAC(secret, tenant), drops salts clients send, and answers 400 to a generation request without it."
        ),
    )
    tenant_secret: str | None = Field(
        default=None,
        description=(
            "Secrets Manager secret name or ARN holding the salt key, read by the agent at start-up (it refuses to "
            "serve if it cannot read it, rather than serve without isolation)."
        ),
    )
    tenancy: Tenancy | None = Field(
        default=None,
        description=(
            "Who shares the prefix cache, said by the file because a caller can time another's cached prompts: "
            "single (one tenant, or callers who may see each other's prompts: every request shares the cache) or "
            "isolated (tenant_header and tenant_secret set; giving them is enough). Synth refuses a deployment "
            "with prefix caching on and neither; `kvfleet plan` says so."
        ),
    )
    admission: bool = Field(
        default=True,
        description=(
            "Token-aware admission: 429 with Retry-After past the plan's budget (what runs plus what can start "
            "within the TTFT target). false admits everything, and queues form in the engine."
        ),
    )

    @field_validator("tenant_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        if v is not None and (problem := aws.secret_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _paired(self) -> ServingConfig:
        if (self.tenant_header is None) != (self.tenant_secret is None):
            missing = "tenant_secret" if self.tenant_secret is None else "tenant_header"
            raise ValueError(f"{missing}: set both tenant_header and tenant_secret to isolate tenants, or neither")
        if self.tenancy == "single" and self.isolated:
            raise ValueError(
                "tenancy: single shares the prefix cache between callers, tenant_header isolates tenants; remove "
                "tenancy, or tenant_header and tenant_secret"
            )
        if self.tenancy == "isolated" and not self.isolated:
            raise ValueError(
                "tenant_header: tenancy isolated needs the request header naming the tenant and tenant_secret "
                "(the salt key's secret); set both, or tenancy: single"
            )
        return self

    @property
    def isolated(self) -> bool:
        return self.tenant_header is not None

    @property
    def declared_tenancy(self) -> Tenancy | None:
        """What the file says of the prefix cache's callers: tenant_header and tenant_secret say isolated."""
        return "isolated" if self.isolated else self.tenancy


class SpeculativeConfig(Frozen):
    """Speculative decoding: a drafter proposes tokens the model verifies in one step (sized by
    kvfleet.sizing.speculative: its weights, its KV layers in the model's cache, its lookahead slots)."""

    method: Literal["eagle", "eagle3", "mtp", "draft_model", "ngram"] = Field(
        description=(
            "eagle / eagle3: an EAGLE head (draft_model); mtp: the model's own multi-token-prediction layers "
            "(DeepSeek-V3/R1); draft_model: a smaller model with the same tokenizer; ngram: prompt lookup, no weights."
        )
    )
    draft_model: str | None = Field(
        default=None,
        description="The EAGLE head or draft model, as model.id: catalog id or alias, or a path to its config.json.",
    )
    num_speculative_tokens: Int | None = Field(
        default=None, ge=1, description="Tokens drafted per step. Default for mtp: the model's MTP layer count."
    )
    acceptance_length: Float | None = Field(
        default=None,
        ge=1,
        description=(
            "Mean tokens accepted per verification step, the bonus token included (1 to num_speculative_tokens + 1): "
            "what the speed model credits. Default: a published measurement for eagle, eagle3 (K 2 to 7) and mtp "
            "(one MTP layer), listed in kvfleet/sizing/data/speculative_acceptance.json; elsewhere (draft_model, "
            "ngram, other K) none is credited (1) until it is given."
        ),
    )

    @model_validator(mode="after")
    def _complete(self) -> SpeculativeConfig:
        with_model = self.method in ("eagle", "eagle3", "draft_model")
        if with_model and self.draft_model is None:
            raise ValueError(f"draft_model: {self.method} needs the head or model that drafts; name it")
        if not with_model and self.draft_model is not None:
            raise ValueError(f"draft_model: {self.method} drafts without one; remove it")
        if self.method != "mtp" and self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens: {self.method} needs it (3 to 5 is usual)")
        k = self.num_speculative_tokens
        if self.acceptance_length is not None and k is not None and self.acceptance_length > k + 1:
            raise ValueError(
                f"acceptance_length: {self.acceptance_length:g} exceeds num_speculative_tokens + 1 ({k + 1}); a step "
                "keeps at most the drafts and one bonus token"
            )
        return self


class Deployment(Frozen):
    name: str = Field(
        pattern=r"^[a-z]([a-z0-9-]{0,29}[a-z0-9])?$",
        description="Short name: lowercase letters, digits, '-' (not last), at most 31 characters.",
    )
    model: ModelRef
    engine: EngineRef
    workload: WorkloadConfig
    target: Target
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    sizing: SizingConfig = Field(default_factory=SizingConfig)
    image: ImageConfig = Field(default_factory=ImageConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    speculative: SpeculativeConfig | None = Field(default=None, description="Speculative decoding. Default: none.")

    @model_validator(mode="after")
    def _consistent(self) -> Deployment:
        # Each problem starts with the field to change; the loader points at that field's line.
        problems = [*self._target_problems(), *self._derive_problems()]
        if (tag_problem := self._image_tag_problem()) is not None:
            problems.append(tag_problem)
        if self.image.source == "dlc":
            problems += self._dlc_problems()
        if self.scaling.admission_queue is not None and not self.admits:
            why = "image.source dlc has no agent" if self.serving.admission else "serving.admission is false"
            problems.append(
                f"scaling.admission_queue: nothing admits requests here ({why}); remove it, or admit with the agent"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _target_problems(self) -> list[str]:
        """What the target's platform cannot do with this deployment: scale to zero where its record says so, and
        what its own section checks."""
        problems = []
        target = TARGETS[self.target.platform]
        no_zero = self.target.no_scale_to_zero()  # the section's say: its shape may allow what the record does not
        if self.scaling.min_replicas < 1 and no_zero is not None:
            able = [name for name, t in TARGETS.items() if t.no_scale_to_zero is None]
            instead = f" (scale to zero is for target.platform {' or '.join(able)})" if able else ""
            problems.append(
                f"scaling.min_replicas: {target.name} cannot scale to zero ({no_zero}); set 1 or more{instead}"
            )
        return problems + self.target.deployment_problems(self)

    def _derive_problems(self) -> list[str]:
        """Derived scaling thresholds need a TTFT target and a load to replay."""
        problems = []
        if self.scaling.derive and self.workload.ttft_ms is None:
            problems.append(
                "scaling.derive: the thresholds are derived for a TTFT target; set workload.ttft_ms, or derive: false"
            )
        if self.scaling.derive and self.workload.peak_requests_per_s is None:
            problems.append(
                "scaling.derive: nothing to replay; set workload.trace or workload.peak_requests_per_s, or "
                "derive: false"
            )
        return problems

    def _dlc_problems(self) -> list[str]:
        """What an AWS container (image.source dlc) cannot do: it runs the engine without the kvfleet agent."""
        problems = []
        try:  # the rule synth applies to the SDK's table (kvfleet/infra/images.py), on kvfleet's copy of it
            dlc.dlc_release(self.engine.name, self.engine.version, dlc.published(self.engine.name))
        except KvfleetError as err:
            problems.append(f"{err.field}: {err.message}")
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
        if self.serving.isolated:
            problems.append(
                "serving.tenant_header: image.source dlc runs the engine without the kvfleet agent, which "
                "isolates tenants; use image.source kvfleet"
            )
        # Without the agent nothing admits: a file that asks for admission (or an admission queue) is refused,
        # one that leaves the default gets none, as Deployment.admits says.
        if "admission" in self.serving.model_fields_set and self.serving.admission:
            problems.append(
                "serving.admission: image.source dlc runs the engine without the kvfleet agent, which admits "
                "requests; set admission: false, or use image.source kvfleet"
            )
        return problems

    @property
    def admits(self) -> bool:
        """Whether the agent admits requests by tokens here (it runs only with image.source kvfleet or uri)."""
        return self.serving.admission and self.image.source != "dlc"

    def _image_tag_problem(self) -> str | None:
        """A kvfleet image must speak this kvfleet's contract and run the pinned engine release."""
        img = self.image
        if img.source == "kvfleet" and img.tag is not None:
            field, tag = "image.tag", img.tag
        elif img.source == "uri" and img.uri is not None:
            field, tag = "image.uri", img.uri.split("@")[0].rsplit(":", 1)[1]
        else:
            return None  # the default tag is made for this contract; AWS's own images have no agent
        want = contract.image_tag(self.engine.version)
        parsed = contract.parse_image_tag(tag)
        if parsed is None:
            return (
                f"{field}: tag {tag} does not say which contract the image speaks; build the image from this "
                f"kvfleet (containers/Dockerfile) and tag it {want}"
            )
        engine, version = parsed
        if version != contract.CONTRACT_VERSION:
            return (
                f"{field}: the image speaks contract {version}, this kvfleet speaks {contract.CONTRACT_VERSION}; "
                f"rebuild it from this kvfleet and tag it {want}"
            )
        if engine != self.engine.version:
            return (
                f"{field}: the image runs {self.engine.name} {engine}, engine.version is {self.engine.version} (the "
                f"plan is sized for that release); use an image tagged {want}, or pin engine.version {engine}"
            )
        return None


# AWS region names: geographic area, optional partition, direction, number (docs.aws.amazon.com/global-infrastructure
# /latest/regions/aws-regions.html lists them; every one has this form).
REGION_PATTERN = (
    r"^(af|ap|ca|cn|eu|il|me|mx|sa|us)(-gov|-iso|-isob)?-"
    r"(central|north|south|east|west|northeast|northwest|southeast|southwest)-[1-9]$"
)
# One stack per deployment, each a few dozen resources: more than this is a file gone wrong.
MAX_DEPLOYMENTS = 100


class NotificationsConfig(Frozen):
    """Who hears about the alarms. Every alarm of every deployment notifies one SNS topic per environment; the file
    names who that reaches: addresses, an existing topic, or `notifications: none`."""

    topic_arn: str | None = Field(
        default=None,
        pattern=r"^arn:aws[a-z-]*:sns:[a-z]{2}(-gov)?-[a-z]+-[0-9]:[0-9]{12}:[A-Za-z0-9_-]{1,256}$",
        description=(
            "Notify this existing topic instead of creating one (kvfleet-<environment>-alerts). Its policy must let "
            "cloudwatch.amazonaws.com publish (sns:Publish) for this environment's account, and if it is encrypted "
            "its customer managed KMS key must let that principal use it (kms:Decrypt, kms:GenerateDataKey*). "
            "kvfleet cannot read either policy: `kvfleet plan` names the topic's account where it is not the "
            "environment's."
        ),
    )
    emails: tuple[str, ...] = Field(
        default=(),
        description=(
            "Addresses subscribed to the topic kvfleet creates. SNS mails each one a confirmation link on deploy, "
            "and an address receives nothing until it is followed."
        ),
    )

    @field_validator("emails")
    @classmethod
    def _emails(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [e for e in v if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", e)]
        if bad:
            raise ValueError(f"not an email address: {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _emails_need_our_topic(self) -> NotificationsConfig:
        if self.topic_arn is not None and self.emails:
            raise ValueError(
                "emails: kvfleet subscribes addresses to the topic it creates; subscribe them to your own topic, "
                "or drop topic_arn"
            )
        if self.model_fields_set and self.topic_arn is None and not self.emails:
            # `emails: []` reads like a choice and notifies nobody; the file says that with `none` instead. (The
            # value `none` stands for sets no field.)
            raise ValueError(f"emails: {NOTIFICATIONS_CHOICES}")
        return self

    @property
    def silent(self) -> bool:
        """``notifications: none``: kvfleet subscribes nobody (the alarms still notify the environment's topic)."""
        return self.topic_arn is None and not self.emails


# What a file writes under `notifications:`, in the words every message about it uses.
NOTIFICATIONS_CHOICES = (
    "name who hears the alarms: notifications: {emails: [oncall@example.com]} (each address confirms by email), "
    "{topic_arn: arn:aws:sns:<region>:<account>:<topic>} (an existing topic), or none (nobody is subscribed)"
)


class Environment(Frozen):
    name: str = Field(
        pattern=r"^[a-z]([a-z0-9-]{0,19}[a-z0-9])?$",
        description="Environment name, e.g. dev: lowercase letters, digits, '-' (not last), at most 21 characters.",
    )
    account: str | None = Field(default=None, pattern=r"^[0-9]{12}$", description="AWS account id (12 digits).")
    region: str | None = Field(
        default=None,
        pattern=REGION_PATTERN,
        description="AWS region, e.g. us-east-1: an area (af, ap, ca, cn, eu, il, me, mx, sa, us), a direction and a "
        "number.",
    )
    network: NetworkConfig = Field(
        default_factory=NetworkConfig,
        description="Where the replicas run: a new VPC per deployment, or an existing one.",
    )
    deployments: tuple[Deployment, ...] = Field(
        min_length=1, max_length=MAX_DEPLOYMENTS, description="What to serve in this environment."
    )
    notifications: NotificationsConfig = Field(
        # Not written: undecided (synth refuses, plan says so); `none` is the same empty value, written.
        default_factory=NotificationsConfig.model_construct,
        description=(
            "Who hears the deployments' alarms: {emails: [...]}, {topic_arn: ...} or none. Synth refuses a file "
            "without it; `kvfleet plan` says so."
        ),
    )

    @field_validator("notifications", mode="before", json_schema_input_type=NotificationsConfig | Literal["none"])
    @classmethod
    def _none_or_mapping(cls, v: Any) -> Any:
        """``none`` is the written choice to subscribe nobody; any other scalar (or an empty key) is a slip."""
        if v == "none":
            return NotificationsConfig.model_construct()
        if not isinstance(v, dict) or not v:
            raise ValueError(NOTIFICATIONS_CHOICES)
        return v

    @property
    def notifications_chosen(self) -> bool:
        """Whether the file says who hears the alarms (addresses, a topic, or none)."""
        return "notifications" in self.model_fields_set

    @model_validator(mode="after")
    def _fits_targets(self) -> Environment:
        # What each target's deployments need of the environment and of each other (its section's checks).
        return self._raise([p for section in target_sections() for p in section.environment_problems(self)])

    @model_validator(mode="after")
    def _same_region(self) -> Environment:
        """ARNs and zones of this environment's region: a certificate, an OIDC provider or a topic elsewhere is
        accepted by synth and refused by CloudFormation or the service at deploy time."""
        problems = []
        for zone_at, zone in enumerate(self.network.availability_zones):
            if (problem := aws.zone_problem(zone, self.region)) is not None:
                problems.append(f"network.availability_zones.{zone_at}: {problem}")
        if self.region is None:
            return self._raise(problems)
        topic = self.notifications.topic_arn
        if topic is not None and (where := aws.arn_region(topic)) != self.region:
            problems.append(
                f"notifications.topic_arn: the topic is in {where}, the environment in {self.region}; CloudWatch "
                f"alarms notify a topic of their own region: use a topic in {self.region}"
            )
        for i, d in enumerate(self.deployments):
            problems += d.target.region_problems(self.region, f"deployments.{i}.target")
        return self._raise(problems)

    def _raise(self, problems: list[str]) -> Environment:
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @field_validator("deployments")
    @classmethod
    def _unique(cls, v: tuple[Deployment, ...]) -> tuple[Deployment, ...]:
        names = [d.name for d in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"deployment names must be unique; repeated: {', '.join(dup)}")
        return v


def rebuild_targets() -> None:
    """Build the models that hold a target's section again, after the target registry changed (the union of
    sections is read from it when a model is built)."""
    rebuild(Deployment, Environment)
