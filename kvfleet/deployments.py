"""The one bridge from config to infrastructure: Environment -> plan requests -> typed resolved deployments.

Everything a stack builds from is decided here, once: the model (resolved once per deployment), the plan's
candidate, the engine settings as typed ``EngineArgs``, the container environment of the stack <-> image
contract, disk and timeouts, and the scaling it deploys (``kvfleet.scaling.ScalingPolicy``: the file's values, or
with ``scaling.derive`` those a ``Deriver`` chooses; the file's own objects are never rewritten). The CDK app, the
tests and the manifests of every target read the same ``ResolvedDeployment``, so the instance type, the engine flags,
the timeouts and the scaling thresholds cannot drift apart.

Pure Python (no aws_cdk); the config schema is only a type here, so ``kvfleet plan`` with flags stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvfleet import contract
from kvfleet.config.host_lock import PinnedImage, PinsHostImage, pinned
from kvfleet.engines import EngineAdapter, EngineArgs, adapter
from kvfleet.errors import KvfleetError
from kvfleet.scaling import ScalingPolicy
from kvfleet.sizing.catalog import resolve_model
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.memory import weight_bytes
from kvfleet.sizing.models import ModelSpec, RopeScaling, with_rope_scaling
from kvfleet.sizing.planner import Admission, Candidate, PlanRequest, Workload, admission, plan
from kvfleet.sizing.precision import KvDtype, kv_dtype
from kvfleet.sizing.speculative import SpecMethod, Speculative, resolve_drafter
from kvfleet.sizing.startup import StartupEstimate, startup_estimate
from kvfleet.sizing.units import GiB
from kvfleet.targets import TARGETS

if TYPE_CHECKING:
    from kvfleet.config.schema import Deployment, Environment

IMAGE_DISK_GIB = 30  # engine image layers on the instance's disk
# Every wait for a replica to come up (SageMaker's health-check timeouts, EC2's health-check grace and warm-up,
# Kubernetes' startup probe) is this many times the start-up estimate: a wait that is too short kills a replica
# that was about to come up, and it then starts the whole load over; one too long only delays a rollback.
LOAD_PADDING = 2.0


def engine_args(c: Candidate) -> EngineArgs:
    """The settings that admit exactly what the plan sized: ``max_num_seqs`` is the concurrency that fits (not
    the engine default), ``max_model_len`` the workload's longest sequence."""
    cap, s = c.capacity, c.settings
    d = cap.drafter
    return EngineArgs(
        tensor_parallel_size=c.tensor_parallel_size,
        pipeline_parallel_size=c.pipeline_parallel_size if c.pipeline_parallel_size > 1 else None,
        enable_expert_parallel=c.expert_parallel,
        data_parallel_size=c.data_parallel_size if c.data_parallel_size > 1 else None,
        max_model_len=cap.max_model_len,
        max_num_seqs=c.concurrency_per_replica // c.data_parallel_size,  # each data-parallel engine core's share
        max_num_batched_tokens=cap.max_num_batched_tokens,
        # vLLM's extensible cache (0.34 on) takes an explicit utilization as a cap below its measured size: left to
        # the engine unless the settings give one.
        gpu_memory_utilization=None
        if cap.extensible_kv_cache and not cap.gpu_memory_utilization_given
        else cap.gpu_memory_utilization,
        kv_cache_dtype=c.kv_cache_dtype.value,
        quantization=c.online_quantization,
        # Resolved (the release's default where the file leaves it) and always given, so the engine caches prefixes
        # exactly as sized: for a hybrid Mamba model it sets the state pages each request holds.
        enable_prefix_caching=cap.prefix_caching,
        limit_mm_per_prompt=s.limit_mm_per_prompt,
        mm_encoder_tp_mode=None if s.mm_encoder_tp_mode == "weights" else s.mm_encoder_tp_mode,  # vLLM's default
        mm_max_pixels=s.mm_max_pixels,
        mamba_cache_dtype=None if s.mamba_cache_dtype == "auto" else s.mamba_cache_dtype,
        mamba_ssm_cache_dtype=None if s.mamba_ssm_cache_dtype == "auto" else s.mamba_ssm_cache_dtype,
        # The drafter the plan sized, with the token count it resolved (mtp: the model's layer count).
        speculative_method=None if d is None else d.method.value,
        # The checkpoint the engine downloads: the drafter's Hugging Face id (catalog id or _name_or_path).
        speculative_model=None if d is None or d.draft_ref is None or d.model is None else d.model.model_id,
        num_speculative_tokens=None if d is None else d.num_speculative_tokens,
        hf_overrides=cap.hf_overrides,
    )


_WORKLOAD_KEYS = (
    "max_input_tokens",
    "max_output_tokens",
    "concurrency_per_replica",
    "peak_requests_per_s",
    "avg_input_tokens",
    "avg_output_tokens",
)


def workload(
    *,
    max_input_tokens: int,
    max_output_tokens: int,
    concurrency_per_replica: int | None = None,
    peak_requests_per_s: float | None = None,
    avg_input_tokens: int | None = None,
    avg_output_tokens: int | None = None,
    ttft_ms: float | None = None,
    itl_ms: float | None = None,
    streaming: bool = True,
) -> Workload:
    """The planner's workload in the file's terms (``WorkloadConfig`` fields, also the CLI's flags): targets in
    milliseconds become seconds here and nowhere else."""
    return Workload(
        max_input_tokens=max_input_tokens,
        max_output_tokens=max_output_tokens,
        concurrency_per_replica=concurrency_per_replica,
        peak_requests_per_s=peak_requests_per_s,
        avg_input_tokens=avg_input_tokens,
        avg_output_tokens=avg_output_tokens,
        ttft_target_s=None if ttft_ms is None else ttft_ms / 1e3,
        itl_target_s=None if itl_ms is None else itl_ms / 1e3,
        streaming=streaming,
    )


# The engine settings a deployment's `engine:` section gives the planner, by the same names there and in the planner.
ENGINE_SETTINGS = (
    "enable_prefix_caching",
    "limit_mm_per_prompt",
    "mm_encoder_tp_mode",
    "mm_max_pixels",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)


# The planner's own names for what it was given, as the environment file's key paths (under deployments[i]),
# so an error points at the key the user wrote. Anything else the planner names is said of the deployment.
PLANNER_FIELDS: dict[str, str] = {
    "engine_version": "engine.version",
    "workload.ttft_target_s": "workload.ttft_ms",
    "workload.itl_target_s": "workload.itl_ms",
    "weight_precisions": "sizing.weight_precisions",
    "quantization": "sizing.weight_precisions",
    "kv_cache_dtypes": "sizing.kv_cache_dtypes",
    "kv_cache_dtype": "sizing.kv_cache_dtypes",
    "instance_type": "sizing.instance_type",
    "instance_types": "sizing.instance_type",
    "families": "sizing.families",
    "gpu_memory_utilization": "sizing.gpu_memory_utilization",
    "max_model_len": "workload.max_input_tokens",
    "model": "model.id",
    "rope_scaling": "model.rope_scaling",
    **{k: f"engine.{k}" for k in ENGINE_SETTINGS},
    **{f"workload.{k}": f"workload.{k}" for k in _WORKLOAD_KEYS},
    **{
        f"speculative.{k}": f"speculative.{k}"
        for k in ("method", "draft_model", "num_speculative_tokens", "acceptance_length")
    },
}


def config_error(err: KvfleetError, index: int, *, within: str | None = None) -> KvfleetError:
    """``err`` from the planner or a model lookup for ``deployments[index]``, its field as the file's key path.

    ``within`` is the key the error is about when the planner names a field of something else (a model's
    config.json): that field then goes into the message."""
    where = f"deployments[{index}]"
    if within is not None:
        inner = f"{err.field}: " if err.field and err.field != "model" else ""
        return KvfleetError(f"{inner}{err.message}", field=f"{where}.{within}")
    if err.field == "region":  # the environment's, not the deployment's
        return KvfleetError(err.message, field="region")
    key = PLANNER_FIELDS.get(err.field or "")
    return KvfleetError(err.message, field=f"{where}.{key}" if key else where)


@dataclass(frozen=True, kw_only=True)
class DeploymentRequest:
    """One deployment of the file with its model resolved and the planner's request built from it."""

    index: int  # its place in the file: deployments[index]
    deployment: Deployment
    model: ModelSpec
    request: PlanRequest


def plan_requests(env: Environment) -> tuple[DeploymentRequest, ...]:
    """One plan request per deployment, resolving each model once (no AWS calls)."""
    out = []
    for i, d in enumerate(env.deployments):
        try:
            model = resolve_model(d.model.id)
        except KvfleetError as err:
            raise config_error(err, i, within="model.id") from None
        if d.model.rope_scaling is not None:
            rope = d.model.rope_scaling
            model = with_rope_scaling(
                model,
                RopeScaling(
                    rope_type=rope.rope_type,
                    factor=rope.factor,
                    original_max_position_embeddings=rope.original_max_position_embeddings,
                ),
            )
        try:
            req = _request(env, d, model)
        except KvfleetError as err:
            raise config_error(err, i) from None
        out.append(DeploymentRequest(index=i, deployment=d, model=model, request=req))
    return tuple(out)


def _request(env: Environment, d: Deployment, model: ModelSpec) -> PlanRequest:
    return PlanRequest(
        model=model,
        workload=workload(**d.workload.model_dump(exclude={"trace"})),  # the loader read the trace into numbers
        engine=EngineName(d.engine.name),
        engine_version=d.engine.version,
        hosting=d.target.hosting,
        weight_precisions=d.sizing.weight_precisions,
        kv_cache_dtypes=tuple(kv_dtype(k) for k in d.sizing.kv_cache_dtypes),
        families=d.sizing.families,
        instance_types=(d.sizing.instance_type,) if d.sizing.instance_type else (),
        region=env.region,
        max_fleet_usd_per_hour=d.sizing.max_fleet_usd_per_hour,
        gpu_memory_utilization=d.sizing.gpu_memory_utilization,
        min_replicas=max(1, d.scaling.min_replicas),
        max_replicas=d.scaling.max_replicas,
        speculative=_speculative(d, model),
        **_engine_settings(d, model),
    )


def _engine_settings(d: Deployment, model: ModelSpec) -> dict[str, Any]:
    """The `engine:` section's settings for the planner, refused where the model has nothing they would change (the
    engine would ignore them, and the plan would size nothing different)."""
    e = d.engine
    if model.vision is None:
        for name in ("limit_mm_per_prompt", "mm_encoder_tp_mode", "mm_max_pixels"):
            if getattr(e, name) is not None:
                raise KvfleetError(
                    f"{model.model_id} takes no images or videos (no vision tower), so vLLM ignores it; remove it",
                    field=name,
                )
    if model.state is None or not model.state_layers:
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(e, name) != "auto":
                raise KvfleetError(
                    f"{model.model_id} has no linear-attention / Mamba layers, so there is no state to store; "
                    "remove it",
                    field=name,
                )
    return {
        "enable_prefix_caching": e.enable_prefix_caching,
        "limit_mm_per_prompt": e.mm_limits,
        "mm_encoder_tp_mode": e.mm_encoder_tp_mode or "weights",
        "mm_max_pixels": e.mm_max_pixels,
        "mamba_cache_dtype": e.mamba_cache_dtype,
        "mamba_ssm_cache_dtype": e.mamba_ssm_cache_dtype,
    }


def _speculative(d: Deployment, model: ModelSpec) -> Speculative | None:
    """The deployment's drafter, checked once against its model (the planner sizes it per candidate)."""
    s = d.speculative
    if s is None:
        return None
    spec = Speculative(
        method=SpecMethod(s.method),
        draft_model=s.draft_model,
        num_speculative_tokens=s.num_speculative_tokens,
        acceptance_length=s.acceptance_length,
    )
    resolve_drafter(  # a drafter that fits no tensor parallelism fails here, naming the field, not per candidate
        model,
        spec,
        tp=1,
        kv_dtype=KvDtype.AUTO,
        target_scheme=model.native_scheme,
        max_num_batched_tokens=1,
        engine=EngineName(d.engine.name),
    )
    return spec


@dataclass(frozen=True, kw_only=True)
class ResolvedDeployment:
    environment: Environment
    deployment: Deployment
    model: ModelSpec
    candidate: Candidate  # the plan's choice
    alternatives: tuple[Candidate, ...]  # the next feasible instance types, best first
    engine_args: EngineArgs
    checkpoint_bytes: int  # the checkpoint as stored (what is downloaded and read from disk)
    startup: StartupEstimate
    workload: Workload  # what the plan was made for (averages and targets in the planner's units)
    # The scaling it deploys, decided once: the file's values, or with scaling.derive the replay's where the file
    # leaves them. Stacks, manifests, the plan and the simulator read this, never the file's scaling section.
    scaling: ScalingPolicy
    # The host image the environment's lock pins for this deployment's target and region (kvfleet.config.host_lock,
    # read by the loader beside the file); None: unpinned, the target resolves its image at deploy.
    host_image: PinnedImage | None = None

    @property
    def model_id(self) -> str:
        return self.model.model_id  # Hugging Face id (catalog id)

    @property
    def deployment_id(self) -> str:
        return contract.deployment_id(self.environment.name, self.deployment.name)

    @property
    def stack_name(self) -> str:
        return f"kvfleet-{self.deployment_id}"

    @property
    def engine(self) -> str:
        return self.deployment.engine.name

    @property
    def adapter(self) -> EngineAdapter:
        return adapter(self.engine)

    @property
    def instance_type(self) -> str:
        return self.candidate.name

    @property
    def initial_instance_count(self) -> int:
        # The scaling bounds count replicas; an instance holds engines_per_instance of them.
        s, per = self.scaling, self.candidate.engines_per_instance
        least, most = math.ceil(s.min_replicas / per), math.ceil(s.max_replicas / per)
        return min(max(self.candidate.instance_count, least, 1), most)

    @property
    def kv_cache_tokens(self) -> int:
        return self.candidate.capacity.replica_kv_cache_tokens  # every data-parallel engine core's cache

    @property
    def admission(self) -> Admission:
        """The agent's token budget: what runs plus the file's admission queue, or the plan's (what can start within
        the TTFT target) where the scaling leaves it (scaling.derive decides the one it chose)."""
        return admission(self.candidate, self.workload, queued=self.scaling.admission_queue)

    @property
    def admission_factor(self) -> float:
        """``admission.tokens`` as the agent's multiple of the KV tokens it is given (rounded up)."""
        return math.ceil(self.admission.tokens / self.kv_cache_tokens * 1e6) / 1e6

    @property
    def model_location(self) -> str:
        """What the engine loads: the local copy of the S3 prefix, or the Hugging Face id."""
        return contract.MODEL_DIR if self.deployment.model.s3_uri else self.model_id

    @property
    def disk_gib(self) -> int:
        """Disk for the image plus the weights, with room for a second copy during a download retry."""
        return IMAGE_DISK_GIB + math.ceil(1.2 * self.checkpoint_bytes / GiB)

    @property
    def download_timeout_s(self) -> int:
        return _clamp(LOAD_PADDING * (self.startup.download_s + self.startup.image_pull_s))

    @property
    def startup_timeout_s(self) -> int:
        # An engine that downloads from Hugging Face itself does so inside the health-check window.
        s = self.startup.container_start_s + (0 if self.deployment.model.s3_uri else self.startup.download_s)
        return _clamp(LOAD_PADDING * s)

    @property
    def ready_window_s(self) -> int:
        """How long any target waits for a launched replica to serve: the padded launch-to-ready estimate (image
        pull, download, load, engine start), in whole minutes."""
        return int(math.ceil(LOAD_PADDING * self.startup.ready_s / 60) * 60)

    @property
    def idle_to_zero_s(self) -> int:
        """With scaling.min_replicas 0, the time without requests before the fleet goes to zero: the scale-in wait,
        and never shorter than the ready window, so the replica a request woke can come up and serve it (and the
        client's retries) before the idle rule can remove it."""
        return max(self.scaling.scale_in_wait_s, self.ready_window_s)

    @property
    def restart_budget_s(self) -> int:
        """How long the engine may be down before the replica counts as failed (contract.ENV_RESTART_BUDGET_S, the
        agent's liveness route): its start from the weights already on the host (no image pull, no download: a
        restart reads the host's copy and the container's compile cache), padded as every start-up wait is, in
        whole minutes. The agent adds its own restart overhead (the old engine's sweep, the GPU's release, the
        backoff)."""
        return int(math.ceil(LOAD_PADDING * self.startup.container_start_s / 60) * 60)

    def container_environment(self, *, isolated: bool = False) -> dict[str, str]:
        """Environment of the serving container. AWS's own engine images take their engine's variables."""
        if self.deployment.image.source == "dlc":
            w = self.deployment.workload
            return self.adapter.dlc_environment(
                self.engine_args,
                model=self.model_location,
                max_input_tokens=w.max_input_tokens,
                max_output_tokens=w.max_output_tokens,
            )
        env = {
            contract.ENV_CONTRACT_VERSION: str(contract.CONTRACT_VERSION),
            contract.ENV_ENGINE: self.engine,
            contract.ENV_ENGINE_VERSION: self.deployment.engine.version,
            contract.ENV_MODEL: self.model_location,
            contract.ENV_ENGINE_ARGS: self.engine_args.to_json(),
            contract.ENV_PORT: str(contract.SERVING_PORT),
            contract.ENV_DEPLOYMENT: self.deployment_id,
            contract.ENV_NAMESPACE: contract.NAMESPACE,
            contract.ENV_DRAIN_BUDGET_S: str(self.scaling.drain_budget_s),
            contract.ENV_RESTART_BUDGET_S: str(self.restart_budget_s),
            contract.ENV_TOKEN_BUDGET: str(self.kv_cache_tokens),
            contract.ENV_ADMISSION_FACTOR: f"{self.admission_factor:.6f}",
            # EMF lines on stdout become metrics through the container's log stream, which also works with
            # no network; PutMetricData on top would count every data point twice.
            contract.ENV_PUT_METRIC_DATA: "0",
        }
        if self.deployment.model.hf_token_secret and not isolated:
            env[contract.ENV_HF_TOKEN_SECRET_ARN] = self.deployment.model.hf_token_secret
        serving = self.deployment.serving
        if serving.tenant_header is not None and serving.tenant_secret is not None:
            env[contract.ENV_TENANT_HEADER] = serving.tenant_header
            env[contract.ENV_TENANT_SECRET_ARN] = serving.tenant_secret
        if not serving.admission:
            env[contract.ENV_ADMISSION] = "0"
        return env


def _clamp(seconds: float) -> int:
    # SageMaker accepts 60..3600 s for both health-check timeouts.
    return int(min(3600, max(600, math.ceil(seconds / 60) * 60)))


def _alternatives(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """The best candidate of each other instance type, in the plan's order."""
    seen = {candidates[0].instance.name}
    out = []
    for c in candidates[1:]:
        if c.instance.name not in seen:
            seen.add(c.instance.name)
            out.append(c)
    return tuple(out)


# How a file's scaling.derive is decided: the thresholds for a deployment as planned (with the file's values) and its
# index in the file. kvfleet.tuning.deriver replays it through the fleet simulator, which reads the
# ResolvedDeployment built here (so this module cannot call it).
Deriver = Callable[["ResolvedDeployment", int], ScalingPolicy]


def file_scaling(d: Deployment) -> ScalingPolicy:
    """The scaling the file writes (its defaults where it leaves a value), on its target's autoscaler."""
    s = d.scaling
    return ScalingPolicy(
        kind=TARGETS[d.target.platform].autoscaler,
        min_replicas=s.min_replicas,
        max_replicas=s.max_replicas,
        saturation_target=s.saturation_target,
        queue_depth_target=s.queue_depth_target,
        scale_in_wait_s=s.scale_in_wait_s,
        drain_budget_s=s.drain_budget_s,
        admission_queue=s.admission_queue,
    )


def resolve(
    env: Environment,
    dr: DeploymentRequest,
    *,
    derive: Deriver | None = None,
    host_images: Iterable[PinnedImage] = (),
) -> ResolvedDeployment:
    """Plan one deployment and decide its scaling: the file's values, or with scaling.derive what ``derive`` chooses
    for the planned deployment (without ``derive``, the values as written); ``host_images`` are the lock's (the
    loader's ``LoadedEnvironment.host_images``). A deployment that cannot be planned is the user's error (one line)."""
    d = dr.deployment
    try:
        result = plan(dr.request)
    except KvfleetError as err:
        raise config_error(err, dr.index) from None
    scheme = result.best.weight_scheme
    if scheme.needs_quantized_checkpoint and dr.model.quantization is None:
        # The plan was sized for weights the engine cannot make from this checkpoint at load (it would load them as
        # they are, in 16 bits, and the cache the plan promised would not fit).
        raise config_error(
            KvfleetError(
                f"{scheme.name} was chosen, but the checkpoint {dr.model.model_id} is {dr.model.native_scheme.name} "
                f"and no engine quantizes to {scheme.name} at load: put a checkpoint of this model in {scheme.name} "
                "in model.id, or allow only precisions applied at load (bf16, fp16, fp8)",
                field="weight_precisions",
            ),
            dr.index,
        )
    if "/" not in dr.model.model_id and d.model.s3_uri is None:
        raise KvfleetError(
            f"{d.model.id!r} is not a Hugging Face id, so the engine cannot download it: set model.s3_uri",
            field=f"deployments[{dr.index}].model.id",
        )
    ckpt = _checkpoint_bytes(dr, result.best)
    r = ResolvedDeployment(
        environment=env,
        deployment=d,
        model=dr.model,
        candidate=result.best,
        alternatives=_alternatives(result.candidates),
        engine_args=engine_args(result.best),
        checkpoint_bytes=ckpt,
        startup=startup_estimate(checkpoint_bytes=ckpt),
        workload=dr.request.workload,
        scaling=file_scaling(d),
        host_image=pinned(host_images, d.target.host_image_parameter(), env.region)
        if isinstance(d.target, PinsHostImage)
        else None,
    )
    _check_disk(r, dr.index)
    if d.scaling.derive and derive is not None:
        r = replace(r, scaling=derive(r, dr.index))
    return r


def _checkpoint_bytes(dr: DeploymentRequest, best: Candidate) -> int:
    """The checkpoints the engine downloads and reads at start-up: the model's, and a drafter's of its own."""
    ckpt = weight_bytes(dr.model, tp=1, scheme=dr.model.native_scheme).weights_bytes_per_gpu
    drafter = best.capacity.drafter
    if drafter is not None and drafter.draft_ref is not None and drafter.model is not None:
        # An EAGLE head or draft model is a checkpoint of its own: downloaded by its id and read at start-up.
        if "/" not in drafter.model.model_id:  # as for model.id: a local config.json without _name_or_path
            raise KvfleetError(
                f"{drafter.draft_ref!r} names no Hugging Face id, so the engine cannot download it: use a catalog id, "
                "or a config.json whose _name_or_path is the checkpoint's id",
                field=f"deployments[{dr.index}].speculative.draft_model",
            )
        ckpt += weight_bytes(drafter.model, tp=1, scheme=drafter.model.native_scheme).weights_bytes_per_gpu
    return ckpt


def resolve_environment(
    env: Environment, *, derive: Deriver | None = None, host_images: Iterable[PinnedImage] = ()
) -> tuple[ResolvedDeployment, ...]:
    images = tuple(host_images)
    return tuple(resolve(env, dr, derive=derive, host_images=images) for dr in plan_requests(env))


def _check_disk(r: ResolvedDeployment, index: int) -> None:
    """The image and weights fit the host's storage: its instance store, or the largest volume it attaches."""
    limit = r.candidate.hosting.max_volume_gib
    if limit is None:
        return
    nvme = r.candidate.instance.local_nvme_gb
    need_gb = math.ceil(r.disk_gib * GiB / 1e9)
    if nvme and nvme < need_gb:
        raise KvfleetError(
            f"{r.instance_type} has {nvme} GB of instance storage, the image and weights need {need_gb} GB; "
            "pin a larger sizing.instance_type or a smaller weight precision",
            field=f"deployments[{index}].sizing",
        )
    if r.disk_gib > limit and not nvme:
        raise KvfleetError(
            f"the weights need a {r.disk_gib} GiB volume, this target allows {limit}: choose an instance type with "
            "local NVMe storage (sizing.families)",
            field=f"deployments[{index}].sizing",
        )
