"""The planner: enumerate instance x tensor parallelism x KV dtype x weight precision for one
deployment, reject what does not fit (saying why), size the fleet for the load and rank the rest.

Per candidate:
 1. the engine's cache at start-up (``capacity``), with ``max_model_len`` = max input + max output;
 2. the sequences of that length the cache holds at once, capped by the concurrency target and by the
    inter-token-latency target (decode slows as the batch grows);
 3. speed under load (the batch step model, ``step.steady_state``, at the batch that runs) -> the ITL and
    TTFT targets -> requests/s per replica -> replicas for the peak load (``perf``: one request alone);
 4. fleet cost per hour and cost per million output tokens at that load.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvfleet.errors import NothingFitsError, SizingError
from kvfleet.sizing.capacity import Capacity, EngineSettings, capacity
from kvfleet.sizing.coverage import unchecked_note
from kvfleet.sizing.engines import EngineName, default_version, engine_profile, engine_title, engine_traits
from kvfleet.sizing.hardware import AcceleratorKind, InstanceType, instance, instances, offered_in_region
from kvfleet.sizing.hosting import Hosting, PriceList, Routing
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.parallel import Layout, data_parallel_sized
from kvfleet.sizing.perf import PerfEstimate, estimate, missing_perf_data
from kvfleet.sizing.precision import KvDtype, Part, WeightScheme, weight_scheme
from kvfleet.sizing.quantization import checkpoint_note, checkpoint_refusal, scheme_refusal
from kvfleet.sizing.speculative import Speculative, acceptance, speculative_tokens
from kvfleet.sizing.step import (
    Limits,
    Replica,
    SteadyState,
    replica,
    request_overhead_s,
    speculative_replica,
    steady_state,
)
from kvfleet.sizing.step import Workload as StepWorkload
from kvfleet.sizing.units import GiB


@dataclass(frozen=True, kw_only=True)
class Workload:
    max_input_tokens: int
    max_output_tokens: int
    concurrency_per_replica: int | None = None  # target concurrent sequences on one replica
    peak_requests_per_s: float | None = None
    avg_input_tokens: int | None = None  # default: max_input_tokens
    avg_output_tokens: int | None = None  # default: max_output_tokens
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    streaming: bool = True  # clients read answers as a stream; False: each answer arrives whole

    def __post_init__(self) -> None:
        for name in ("max_input_tokens", "max_output_tokens"):
            if getattr(self, name) <= 0:
                raise SizingError(f"must be positive, got {getattr(self, name)}", field=f"workload.{name}")
        for name in ("concurrency_per_replica", "avg_input_tokens", "avg_output_tokens"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise SizingError(f"must be positive, got {v}", field=f"workload.{name}")
        for name in ("peak_requests_per_s", "ttft_target_s", "itl_target_s"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise SizingError(f"must be a positive finite number, got {v}", field=f"workload.{name}")
        for avg, mx in (("avg_input_tokens", "max_input_tokens"), ("avg_output_tokens", "max_output_tokens")):
            if (getattr(self, avg) or 0) > getattr(self, mx):
                raise SizingError(f"{getattr(self, avg)} exceeds {mx} ({getattr(self, mx)})", field=f"workload.{avg}")

    @property
    def max_model_len(self) -> int:
        return self.max_input_tokens + self.max_output_tokens

    @property
    def input_tokens(self) -> int:
        return self.avg_input_tokens or self.max_input_tokens

    @property
    def output_tokens(self) -> int:
        return self.avg_output_tokens or self.max_output_tokens


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What one deployment measured on its hardware (a calibration: `kvfleet bench --calibrate`): the KV cache the
    engine allocated and its step times over the step model's. It applies to the candidates of that instance
    type, tensor parallelism, model and engine release, and to no other."""

    instance_type: str  # EC2 or SageMaker name
    tensor_parallel_size: int
    model_id: str
    engine: EngineName
    engine_version: str
    kv_cache_tokens: int | None  # per replica; None: the endpoint did not report it
    step_time_scale: float
    source: str  # where it was measured: the file and its date

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_time_scale) and self.step_time_scale > 0):
            raise SizingError(
                f"step_time_scale must be a positive number, got {self.step_time_scale}", field="calibration"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens <= 0:
            raise SizingError(f"kv_cache_tokens must be positive, got {self.kv_cache_tokens}", field="calibration")

    def applies(self, it: InstanceType, tp: int, model_id: str, engine: EngineName, engine_version: str) -> bool:
        return (
            self.instance_type in (it.name, it.sagemaker_name)
            and self.tensor_parallel_size == tp
            and self.model_id == model_id
            and self.engine == engine
            and self.engine_version == engine_version
        )


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: ModelSpec
    workload: Workload
    engine: EngineName = EngineName.VLLM
    engine_version: str | None = None
    hosting: Hosting
    weight_precisions: tuple[str, ...] = ()  # empty: the checkpoint's own precision
    kv_cache_dtypes: tuple[KvDtype, ...] = (KvDtype.AUTO,)
    families: tuple[str, ...] = ()  # empty: every family
    instance_types: tuple[str, ...] = ()  # non-empty: only these (pinned)
    region: str | None = None
    max_fleet_usd_per_hour: float | None = None
    gpu_memory_utilization: float | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    measured: tuple[Measured, ...] = ()  # calibrations; each prices the candidates it applies to
    speculative: Speculative | None = None  # a drafter every candidate carries (its weights, KV layers, slots)
    # Engine settings every candidate is sized with and started with (EngineSettings' fields of the same names).
    enable_prefix_caching: bool | None = None  # None: the release's default
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()
    mm_encoder_tp_mode: str = "weights"
    mm_max_pixels: int | None = None


@dataclass(frozen=True, kw_only=True)
class Rejection:
    instance_type: str
    tensor_parallel_size: int | None
    kv_cache_dtype: str | None
    weight_precision: str | None
    reason: str
    needed_gib: float | None = None  # per GPU, where memory was the problem
    available_gib: float | None = None
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False
    data_parallel_size: int = 1

    def describe(self) -> str:
        parts = [self.instance_type]
        if self.tensor_parallel_size:
            parts.append(f"tp={self.tensor_parallel_size}")
        if self.pipeline_parallel_size > 1:
            parts.append(f"pp={self.pipeline_parallel_size}")
        if self.data_parallel_size > 1:
            parts.append(f"dp={self.data_parallel_size}")
        if self.expert_parallel:
            parts.append("ep")
        if self.weight_precision:
            parts.append(self.weight_precision)
        if self.kv_cache_dtype:
            parts.append(f"kv={self.kv_cache_dtype}")
        return f"{' '.join(parts)}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    instance: InstanceType
    hosting: Hosting
    tensor_parallel_size: int
    weight_scheme: WeightScheme
    online_quantization: str | None  # the engine's --quantization; None: the checkpoint's own precision
    kv_cache_dtype: KvDtype
    capacity: Capacity
    concurrency_per_replica: int  # sequences of max_model_len run at once (emitted max_num_seqs)
    cache_concurrency: int  # what the cache alone would hold
    perf: PerfEstimate  # one request alone (the roofline)
    under_load: SteadyState  # the batch step model with concurrency_per_replica sequences running
    # The planned load on one replica: Poisson arrivals at peak_requests_per_s / replicas where the workload has a
    # rate (with the queueing that brings), else under_load; ``latency_percentiles`` reads p50/p95/p99 from it.
    planned_load: SteadyState
    planned_requests_per_s: float | None
    alone: SteadyState  # the same model with one sequence: what a request sees on an idle replica
    requests_per_s_per_replica: float
    output_tokens_per_s_per_replica: float
    replicas: int
    engines_per_instance: int
    instance_count: int
    usd_per_hour_per_instance: float
    price_as_of: str
    price_source: str
    limited_by: str  # what capped concurrency: "kv-cache", "itl-target", "concurrency-target", "max_num_seqs"
    notes: tuple[str, ...] = field(default=())
    measured: Measured | None = None  # the calibration this candidate was priced with
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False  # MoE experts whole, spread over the tensor-parallel ranks
    # Data-parallel attention: engine cores in this one engine start, each of tp x pp GPUs with its own cache and
    # scheduler (concurrency_per_replica counts all of them).
    data_parallel_size: int = 1
    # The engine settings this candidate was sized with, at its batch: what the engine must start with.
    settings: EngineSettings = field(default_factory=EngineSettings)

    @property
    def gpus_per_replica(self) -> int:
        """GPUs one engine start takes: tensor x pipeline x data parallelism."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def layout(self) -> Layout:
        return Layout(
            tp=self.tensor_parallel_size,
            pp=self.pipeline_parallel_size,
            ep=self.expert_parallel,
            dp=self.data_parallel_size,
        )

    @property
    def fleet_usd_per_hour(self) -> float:
        return self.instance_count * self.usd_per_hour_per_instance

    @property
    def served_output_tokens_per_s(self) -> float:
        return self.replicas * self.output_tokens_per_s_per_replica

    @property
    def usd_per_million_output_tokens(self) -> float:
        per_hour = self.served_output_tokens_per_s * 3600
        return self.fleet_usd_per_hour / per_hour * 1e6 if per_hour else math.inf

    @property
    def name(self) -> str:
        it = self.instance
        return it.sagemaker_name if self.hosting.price_list is PriceList.SAGEMAKER and it.sagemaker_name else it.name

    def label(self) -> str:
        return f"{self.name} {self.layout.label()} {self.weight_scheme.name} kv={self.kv_cache_dtype.value}"


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What the agent admits per replica (prompt + generation limit reserved per request, 429 past it)."""

    tokens: int
    running: int  # requests the engine runs at once (max_num_seqs)
    queued: int  # requests that may wait for a slot
    request_tokens: int  # the reservation of a typical request: average prompt + max_output_tokens
    reason: str


def admission(c: Candidate, wl: Workload, *, queued: int | None = None) -> Admission:
    """Admit what the engine runs plus the queue that can still start within the TTFT target (``queued``: a queue
    set in the file or chosen on a replay instead).

    A replica completes ``requests_per_s_per_replica`` with its batch full, so a request queued behind q others
    waits about q / that rate for a slot: q = (TTFT target - TTFT under load) x rate. Without a target, one
    batch may wait. Requests reserve their prompt and generation limit: at the workload's average prompt and
    max_output_tokens, never below max_num_seqs requests of max_model_len (a batch of the longest always runs).
    Admitting on the KV cache instead (the cache's tokens times 2) let hundreds of requests queue behind the
    batch where the cache holds far more than max_num_seqs sequences (dev: 160 admitted, 16 running)."""
    running = c.concurrency_per_replica
    rate = c.requests_per_s_per_replica
    per_request = wl.input_tokens + wl.max_output_tokens
    if queued is not None:
        why = f"{running} running and {queued} queued, as scaling.admission_queue sets it (or scaling.derive chose it)"
    elif wl.ttft_target_s is not None:
        room_s = max(0.0, wl.ttft_target_s - c.under_load.ttft_s)
        queued = int(room_s * rate)
        why = (
            f"{running} running and {queued} queued: at {rate:.2f} requests/s a queue of {queued} starts within "
            f"the {wl.ttft_target_s * 1e3:,.0f} ms TTFT target ({c.under_load.ttft_s * 1e3:,.0f} ms of it is the "
            "prefill under load)"
        )
    else:
        queued = running
        why = f"{running} running and {queued} queued (one batch; no TTFT target to derive the queue from)"
    tokens = admission_tokens(
        running=running, queued=queued, request_tokens=per_request, max_model_len=c.capacity.max_model_len
    )
    return Admission(tokens=tokens, running=running, queued=queued, request_tokens=per_request, reason=why)


def admission_tokens(*, running: int, queued: int, request_tokens: int, max_model_len: int) -> int:
    """The token budget that admits ``running`` + ``queued`` typical requests, never below a batch of the longest."""
    return max((running + queued) * request_tokens, running * max_model_len)


@dataclass(frozen=True, kw_only=True)
class Binding:
    """Which limit fills first on a full replica: what the saturation signal (contract.REPLICA_SATURATION) reaches 1
    on, and so what autoscaling, admission and the alarms are about."""

    limit: str  # "sequence slots" or "KV cache"
    kv_at_full_slots: float  # KV use with max_num_seqs sequences at the workload's average lengths, mid-generation
    kv_ceiling: float  # KV use with max_num_seqs sequences of max_model_len (at most 1)
    reason: str


def binding(c: Candidate, wl: Workload) -> Binding:
    """The limit that binds at the planned load. A sequence mid-generation holds its prompt and about half its
    output; max_num_seqs of those against the cache's tokens is the KV use when every slot is taken."""
    n, cap = c.concurrency_per_replica, c.capacity
    typical = n * (wl.input_tokens + wl.output_tokens / 2) / cap.replica_kv_cache_tokens
    ceiling = min(1.0, n * cap.max_model_len / cap.replica_kv_cache_tokens)
    if typical < 1.0:
        return Binding(
            limit="sequence slots",
            kv_at_full_slots=typical,
            kv_ceiling=ceiling,
            reason=(
                f"{n} sequences at the average lengths hold about {typical:.0%} of the KV cache ({ceiling:.0%} at "
                f"{cap.max_model_len} tokens each), so max_num_seqs fills first; saturation reaches 1 on the slots"
            ),
        )
    return Binding(
        limit="KV cache",
        kv_at_full_slots=min(1.0, typical),
        kv_ceiling=ceiling,
        reason=f"{n} sequences at the average lengths would need {typical:.0%} of the KV cache, so it fills first",
    )


@dataclass(frozen=True, kw_only=True)
class Plan:
    request: PlanRequest
    candidates: tuple[Candidate, ...]  # ranked, best first
    rejections: tuple[Rejection, ...]

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


# ---------------------------------------------------------------------------------------------


def _tp_degrees(model: ModelSpec, gpus: int) -> list[int]:
    """Degrees that divide the attention heads and the instance's GPU count (no idle GPUs)."""
    heads = model.num_attention_heads
    kv = model.num_kv_heads
    out = []
    for tp in range(1, gpus + 1):
        if heads % tp or gpus % tp:
            continue
        if model.mla is None and kv % tp and tp % kv:
            continue
        out.append(tp)
    return out


def _layouts(model: ModelSpec, gpus: int, *, data_parallel: bool = False) -> list[Layout]:
    """The layouts planned on an instance of ``gpus`` GPUs, each using a divisor of them.

    Tensor parallelism at every valid degree; for MoE models the same degrees with expert parallelism (both engines
    run it: vLLM --enable-expert-parallel, TensorRT-LLM moe_expert_parallel_size). Pipeline parallelism only where
    no tensor-parallel degree fills the instance (e.g. 40 heads on 8 GPUs: tp=4 pp=2): inside one NVLink instance
    the step model prices a pipeline as one batch passing its stages in turn, never faster than tensor parallelism
    over the same GPUs, so it is worth planning only where it lets one replica use GPUs TP alone cannot.
    ``data_parallel`` (the engine sizes data-parallel attention): for MoE models, every tensor-parallel degree
    below the GPU count as that many engine cores with expert parallelism over all the GPUs (tp x dp = gpus)."""
    tps = _tp_degrees(model, gpus)
    out = [Layout(tp=t) for t in tps]
    if model.moe is not None:
        out += [Layout(tp=t, ep=True) for t in tps if t > 1]
    if model.moe is not None and data_parallel:
        out += [Layout(tp=t, dp=gpus // t, ep=True) for t in tps if t < gpus]
    if gpus not in tps:
        for pp in range(2, min(gpus, model.num_layers) + 1):
            t = gpus // pp
            if gpus % pp or t not in tps:
                continue
            out.append(Layout(tp=t, pp=pp))
            if model.moe is not None and t > 1:
                out.append(Layout(tp=t, pp=pp, ep=True))
    return out


def _schemes(req: PlanRequest) -> list[WeightScheme]:
    if not req.weight_precisions:
        return [req.model.native_scheme]
    out = []
    for name in req.weight_precisions:
        s = weight_scheme(name, field="weight_precisions")
        if req.model.quantization is not None and s.name != req.model.native_scheme.name:
            continue  # a quantized checkpoint has one precision
        out.append(s)
    return out or [req.model.native_scheme]


def _hardware_reason(it: InstanceType, req: PlanRequest) -> str | None:
    acc = it.accelerator
    if acc.kind is AcceleratorKind.NEURON:
        return f"{acc.model} is an AWS Neuron device; {req.engine.value} runs on NVIDIA GPUs (use Neuron's vLLM build)"
    if it.gpu_fraction is not None:
        return f"a fractional GPU ({it.gpu_fraction:g} of an {acc.model}); kvfleet plans whole GPUs"
    if it.gpu_memory_bytes is None:
        return "the catalog has no AWS-reported GPU memory for this type"
    if req.hosting.endpoint_types_only and not it.sagemaker_endpoint:
        return "SageMaker real-time endpoints do not accept this instance type"
    if req.families and it.family not in req.families:
        return f"family {it.family} is not in the allowed families ({', '.join(req.families)})"
    if req.region:
        offered = offered_in_region(it, req.region)
        if offered is False:
            return f"not offered in {req.region} according to the catalog's region list"
    oldest = engine_traits(req.engine).min_compute_capability
    if oldest is not None and acc.compute_capability is not None and acc.compute_capability < oldest:
        title = engine_title(req.engine)
        return f"{acc.model} (compute capability {acc.compute_capability}) is older than {title} supports"
    return missing_perf_data(acc)


def _release_reason(scheme: WeightScheme, req: PlanRequest) -> str | None:
    """Why the chosen engine release would not run the model at ``scheme`` (the engine's quantization table)."""
    q = req.model.quantization
    if q is not None:
        return checkpoint_refusal(q.method, req.model.native_scheme, engine=req.engine, version=req.engine_version)
    return scheme_refusal(scheme, engine=req.engine, version=req.engine_version)


def _coverage_notes(req: PlanRequest, version: str, measured: Measured | None) -> tuple[str, ...]:
    """A release whose sizing no public start-up log checks (a calibration's measured cache stands in for one)."""
    note = unchecked_note(req.engine.value, version) if measured is None or measured.kv_cache_tokens is None else None
    return (note,) if note else ()


def _release_notes(scheme: WeightScheme, req: PlanRequest) -> tuple[str, ...]:
    """A scheme the release loads only as a checkpoint: the plan is sized for that checkpoint."""
    if req.model.quantization is not None:
        return ()
    if scheme.needs_quantized_checkpoint:
        # No engine makes these at load: --quantization awq on an unquantized checkpoint fails at start-up (vLLM
        # reads the method and its scales from the checkpoint's quantization_config), so the flags carry none.
        return (
            f"sized for a checkpoint of this model in {scheme.name} ({scheme.description}): serve one; the engine "
            "reads the method from its config.json, and the flags name none",
        )
    note = checkpoint_note(scheme, engine=req.engine, version=req.engine_version)
    return (note,) if note else ()


def online_quantization(scheme: WeightScheme, model: ModelSpec) -> str | None:
    """The engine's --quantization for ``scheme`` on ``model``: None for the checkpoint's own precision, and for a
    scheme that only comes as a checkpoint (the engine reads it from that checkpoint's config)."""
    if scheme.name == model.native_scheme.name or scheme.needs_quantized_checkpoint:
        return None
    return scheme.name


def _check_release(req: PlanRequest) -> None:
    """A checkpoint the release does not load, or precisions it loads none of, is the file's error (one line at
    the key to change), not a list of misfits."""
    q = req.model.quantization
    if q is not None:
        reason = _release_reason(req.model.native_scheme, req)
        if reason:
            raise SizingError(reason, field="model")
        return
    reasons = [r for r in (_release_reason(s, req) for s in _schemes(req)) if r]
    if req.weight_precisions and len(reasons) == len(_schemes(req)):
        raise SizingError(reasons[0], field="weight_precisions")


def _precision_reason(it: InstanceType, scheme: WeightScheme, kv: KvDtype, req: PlanRequest) -> str | None:
    release = _release_reason(scheme, req)
    if release:
        return release
    acc = it.accelerator
    cc = acc.compute_capability or 0.0
    traits = engine_traits(req.engine)
    fallback = traits.fp8_weights_fallback_compute_capability
    if scheme.name == "fp8" and not acc.fp8_support and (fallback is None or cc < fallback):
        return f"FP8 weights need FP8 tensor cores ({acc.model} has none)"
    if scheme.name == "nvfp4" and cc < 10.0:
        return f"NVFP4 needs a Blackwell GPU ({acc.model} is {acc.architecture})"
    if kv.is_fp8 and traits.fp8_kv_needs_fp8_cores and not acc.fp8_support:
        return f"{engine_title(req.engine)}'s FP8 KV cache needs FP8 tensor cores ({acc.model} has none)"
    return None


def _precision_notes(it: InstanceType, kv: KvDtype, req: PlanRequest) -> tuple[str, ...]:
    """Precisions that run, but not on the fast path: an FP8 KV cache off the one compute capability whose
    FlashAttention backend takes it (``EngineTraits.fp8_kv_flash_attention_compute_capability``; vLLM: Hopper)."""
    cc = it.accelerator.compute_capability
    fast = engine_traits(req.engine).fp8_kv_flash_attention_compute_capability
    if fast is not None and kv.is_fp8 and cc is not None and cc != fast:
        title = engine_title(req.engine)
        return (
            f"{title} runs an FP8 KV cache on {it.accelerator.model} (compute capability {cc:g}) without its "
            "FlashAttention backend (FlashInfer or Triton instead): benchmark decode speed before relying on the "
            "predicted ITL",
        )
    return ()


def _price(it: InstanceType, hosting: Hosting) -> tuple[float, str, str, tuple[str, ...]] | None:
    p = it.price(hosting.price_list)
    if p is not None:
        return p.usd_per_hour, p.as_of, p.source, ()
    if hosting.price_list is PriceList.SAGEMAKER and it.ec2_price is not None:
        e = it.ec2_price
        note = "no SageMaker price in the catalog: the EC2 on-demand price is used (SageMaker costs more)"
        return e.usd_per_hour, e.as_of, e.source, (note,)
    return None


@dataclass(frozen=True, kw_only=True)
class _Option:
    """One point of the search: an instance type, a tensor-parallel degree and the two precisions."""

    req: PlanRequest
    it: InstanceType
    tp: int
    scheme: WeightScheme
    kv: KvDtype
    measured: Measured | None = None
    pp: int = 1
    ep: bool = False
    dp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def reject(self, reason: str, *, needed_gib: float | None = None, available_gib: float | None = None) -> Rejection:
        return Rejection(
            instance_type=self.it.name,
            tensor_parallel_size=self.tp,
            kv_cache_dtype=self.kv.value,
            weight_precision=self.scheme.name,
            reason=reason,
            needed_gib=needed_gib,
            available_gib=available_gib,
            pipeline_parallel_size=self.pp,
            expert_parallel=self.ep,
            data_parallel_size=self.dp,
        )

    def settings(self, *, max_num_seqs: int | None = None) -> EngineSettings:
        req = self.req
        return EngineSettings(
            engine=req.engine,
            version=req.engine_version,
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            enable_expert_parallel=self.ep,
            data_parallel_size=self.dp,
            gpu_memory_utilization=req.gpu_memory_utilization,
            max_model_len=req.workload.max_model_len,
            # The replica's batch; every data-parallel engine core schedules its share.
            max_num_seqs=None if max_num_seqs is None else max(1, max_num_seqs // self.dp),
            kv_cache_dtype=self.kv,
            quantization=self.scheme.name if self.scheme.name != req.model.native_scheme.name else None,
            speculative=req.speculative,
            enable_prefix_caching=req.enable_prefix_caching,
            mamba_cache_dtype=req.mamba_cache_dtype,
            mamba_ssm_cache_dtype=req.mamba_ssm_cache_dtype,
            limit_mm_per_prompt=req.limit_mm_per_prompt,
            mm_encoder_tp_mode=req.mm_encoder_tp_mode,
            mm_max_pixels=req.mm_max_pixels,
        )

    def capacity(self, *, max_num_seqs: int | None = None) -> Capacity:
        assert self.it.usable_gpu_memory_bytes is not None
        return capacity(
            self.req.model,
            gpu_memory_bytes=self.it.usable_gpu_memory_bytes,
            settings=self.settings(max_num_seqs=max_num_seqs),
            accelerator_name=self.it.accelerator.name,
            measured_kv_cache_tokens=self.measured.kv_cache_tokens if self.measured else None,
        )

    def step_replica(self, cap: Capacity) -> Replica:
        """The replica the step model prices: with the drafter the capacity sized, crediting its acceptance length."""
        rep = replica(
            model=self.req.model,
            accelerator=self.it.accelerator,
            tp=self.tp,
            nvlink=self.it.nvlink,
            scheme=self.scheme,
            kv_dtype=self.kv,
            dp=self.dp,
        )
        if self.measured:
            rep = replace(rep, time_scale=self.measured.step_time_scale)
        spec, drafter = self.req.speculative, cap.drafter
        if spec is None or drafter is None:
            return rep
        acc = acceptance(spec, drafter.num_speculative_tokens)
        return speculative_replica(
            rep,
            target=self.req.model,
            target_scheme=self.scheme,
            drafter=drafter,
            accelerator=self.it.accelerator,
            nvlink=self.it.nvlink,
            kv_dtype=self.kv,
            acceptance_length=acc.tokens_per_step,
            acceptance_source=acc.source,
        )

    def under_load(self, cap: Capacity, batch: int, rep: Replica | None = None) -> SteadyState:
        """The batch step model in steady state with ``batch`` sequences kept running: every step carries the
        decodes and its share of prefill chunks, within the engine's token budget."""
        wl = self.req.workload
        ranks = min(self.dp, batch)  # data parallel: the batch spread evenly over the busy engine cores
        state = steady_state(
            rep or self.step_replica(cap),
            StepWorkload(input_tokens=wl.input_tokens, output_tokens=wl.output_tokens, concurrency=batch / ranks),
            limits=Limits(max_num_batched_tokens=cap.max_num_batched_tokens, max_running=max(1, batch // ranks)),
        )
        return _whole_replica(state, ranks, request_overhead_s(self.req.engine.value))

    def at_rate(self, cap: Capacity, batch: int, requests_per_s: float, replicas: int) -> SteadyState:
        """Poisson arrivals at ``requests_per_s`` per replica, each running at most ``batch`` sequences, at the
        workload's average lengths (what ``kvfleet simulate`` replays without a trace), queued as the host routes."""
        wl = self.req.workload
        pooled = replicas if self.req.hosting.routing is Routing.LEAST_OUTSTANDING else 1
        # Data parallel: the server's balancer sends each request to the least-loaded engine core, so the cores
        # queue as one pool of their own.
        state = steady_state(
            self.step_replica(cap),
            StepWorkload(
                input_tokens=wl.input_tokens,
                output_tokens=wl.output_tokens,
                arrival_rate_per_s=requests_per_s / self.dp,
                pooled_replicas=pooled * self.dp,
            ),
            limits=Limits(max_num_batched_tokens=cap.max_num_batched_tokens, max_running=max(1, batch // self.dp)),
        )
        return _whole_replica(state, self.dp, request_overhead_s(self.req.engine.value))

    def perf(self, cap: Capacity, batch: int) -> PerfEstimate:
        wl = self.req.workload
        weights = cap.weights
        return estimate(
            model=self.req.model,
            acc=self.it.accelerator,
            tp=self.tp,
            nvlink=self.it.nvlink,
            scheme=self.scheme,
            weights_bytes_per_gpu=weights.weights_bytes_per_gpu,
            expert_bytes_per_gpu=sum(b for p, b in weights.bytes_by_part if p is Part.EXPERTS),
            kv=cap.kv,
            batch=batch,
            input_tokens=wl.input_tokens,
            output_tokens=wl.output_tokens,
        )


def _whole_replica(state: SteadyState, ranks: int, overhead_s: float) -> SteadyState:
    """One engine core's steady state as the replica's: ``ranks`` of them side by side (latencies are each one's)."""
    return replace(
        state,
        running=state.running * ranks,
        output_tokens_per_s=state.output_tokens_per_s * ranks,
        requests_per_s=state.requests_per_s * ranks,
        request_overhead_s=overhead_s,
    )


def _layout_reason(o: _Option) -> str | None:
    """Precision and hosting rules that rule an option out before any memory is counted."""
    reason = _precision_reason(o.it, o.scheme, o.kv, o.req)
    if reason:
        return reason
    if o.req.hosting.one_engine_per_instance and o.gpus != o.it.accelerator_count:
        return (
            f"this target runs one engine per instance; it would leave "
            f"{o.it.accelerator_count - o.gpus} of {o.it.accelerator_count} GPUs idle"
        )
    most, packed = o.req.hosting.max_engines_per_instance, o.it.accelerator_count // o.gpus
    if not o.req.hosting.one_engine_per_instance and most is not None and packed > most:
        return f"this target routes to at most {most} engines per instance; this layout would put {packed} on one"
    return None


def _startup_capacity(o: _Option) -> Capacity | Rejection:
    """The cache at start-up with the engine's default max_num_seqs, or why it does not start."""
    wl = o.req.workload
    try:
        cap = o.capacity()
    except SizingError as err:
        return o.reject(str(err))
    if cap.problems:
        need = cap.weights_bytes_per_gpu + cap.activation_peak_bytes + cap.non_torch_bytes
        need += cap.kv.bytes_per_sequence(wl.max_model_len)
        return o.reject(cap.problems[0], needed_gib=need / GiB, available_gib=cap.requested_bytes / GiB)
    return cap


def _batch(o: _Option, cap: Capacity) -> tuple[int, str] | Rejection:
    """Sequences one replica runs at once, and what capped them: the cache, the target, or max_num_seqs."""
    wl = o.req.workload
    cache_conc = cap.concurrent_sequences
    target = wl.concurrency_per_replica
    if target is not None and cache_conc < target:
        per_seq = cap.kv.bytes_per_sequence(wl.max_model_len) / GiB
        return o.reject(
            f"the cache holds {cache_conc} sequences of {wl.max_model_len} tokens, target is {target} "
            f"({per_seq:.2f} GiB each, {cap.kv_cache_bytes_per_gpu / GiB:.2f} GiB of cache per GPU)",
            needed_gib=(cap.requested_bytes - cap.kv_cache_bytes_per_gpu + target * per_seq * GiB) / GiB,
            available_gib=cap.requested_bytes / GiB,
        )
    batch = min(cache_conc, target) if target is not None else cache_conc
    batch = max(o.dp, batch // o.dp * o.dp)  # data parallel: every engine core the same share
    limited = "concurrency-target" if target is not None and target <= cache_conc else "kv-cache"
    if batch == cap.max_num_seqs and target is None:
        limited = "max_num_seqs"
    return batch, limited


def _meet_latency(
    o: _Option, cap: Capacity, batch: int, limited: str
) -> tuple[int, str, PerfEstimate, SteadyState] | Rejection:
    """Shrink the batch to the largest that meets the ITL target under load; reject what misses ITL or TTFT anyway.

    Both targets are held to the batch step model at the planned concurrency (decodes sharing every step with
    the prefill chunks of the requests that replace finished ones), not to a request alone."""
    wl = o.req.workload
    rep = o.step_replica(cap)
    load = o.under_load(cap, batch, rep)
    if wl.itl_target_s is not None and load.itl_s > wl.itl_target_s:
        one = o.under_load(cap, 1, rep)
        if one.itl_s > wl.itl_target_s:
            return o.reject(
                f"inter-token latency {one.itl_s * 1e3:.1f} ms even for one sequence, "
                f"target {wl.itl_target_s * 1e3:.1f} ms",
            )
        lo, hi = 1, batch  # itl grows with the batch: largest batch meeting the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if o.under_load(cap, mid, rep).itl_s <= wl.itl_target_s:
                lo = mid
            else:
                hi = mid - 1
        batch, limited = max(o.dp, lo // o.dp * o.dp), "itl-target"
        load = o.under_load(cap, batch, rep)
    perf = o.perf(cap, batch)
    if wl.ttft_target_s is not None and load.ttft_s > wl.ttft_target_s:
        return o.reject(
            f"time to first token {load.ttft_s * 1e3:.0f} ms for a {wl.input_tokens}-token prompt with {batch} "
            f"sequences running, target {wl.ttft_target_s * 1e3:.0f} ms",
        )
    return batch, limited, perf, load


def _answer_time(o: _Option, perf: PerfEstimate, load: SteadyState) -> tuple[str, ...] | Rejection:
    """Where the host bounds a buffered request, the longest answer must fit in it (or be streamed)."""
    limit = o.req.hosting.buffered_response_limit_s
    if limit is None:
        return ()
    wl = o.req.workload
    longest_s = load.ttft_s + wl.max_output_tokens * load.itl_s
    if longest_s <= limit:
        return ()
    what = (
        f"the longest answer ({wl.max_output_tokens} tokens at {load.itl_s * 1e3:.0f} ms each) takes about "
        f"{longest_s:.0f} s"
    )
    if wl.streaming:
        return (f"{what}: stream it (InvokeEndpointWithResponseStream); a buffered call times out at {limit:g} s",)
    fits = max(1, int((limit - load.ttft_s) / load.itl_s))
    return o.reject(
        f"{what}, and a buffered invocation on this target times out at {limit:g} s; stream the answers "
        f"(workload.streaming: true), or lower max_output_tokens to {fits}",
    )


def _requests_per_s(load: SteadyState) -> float:
    # Requests a replica completes per second with its batch kept full: the step model's steady state.
    return load.requests_per_s


def _replicas(
    o: _Option, cap: Capacity, batch: int, rps: float, load: SteadyState
) -> tuple[int, SteadyState] | Rejection:
    """Replicas for the peak rate, and the planned load on each. Enough replicas to complete the peak's requests is
    not enough: Poisson arrivals at 100% of a replica's throughput queue without bound, so replicas are added while
    the planned load's slot queue is unstable or its TTFT misses the target (the figure ``kvfleet plan`` shows)."""
    req, wl = o.req, o.req.workload
    replicas = req.min_replicas
    if wl.peak_requests_per_s is None:
        return replicas, load
    replicas = max(replicas, math.ceil(wl.peak_requests_per_s / rps))
    if req.max_replicas is not None and replicas > req.max_replicas:
        # Before any replay: the peak's requests alone need more replicas than autoscaling may run.
        return o.reject(
            f"needs {replicas} replicas for {wl.peak_requests_per_s} requests/s, max_replicas is {req.max_replicas}",
        )
    most = req.max_replicas if req.max_replicas is not None else 2 * replicas + 4
    n = replicas
    while True:
        state = o.at_rate(cap, batch, wl.peak_requests_per_s / n, n)
        if math.isfinite(state.ttft_s) and (wl.ttft_target_s is None or state.ttft_s <= wl.ttft_target_s):
            return n, state
        if n >= most:
            break
        n += 1
    if not math.isfinite(state.ttft_s):
        why = "requests queue without bound"
    else:
        assert wl.ttft_target_s is not None
        why = f"time to first token is {state.ttft_s * 1e3:,.0f} ms, target {wl.ttft_target_s * 1e3:,.0f} ms"
    return o.reject(
        f"at {n} replicas and {wl.peak_requests_per_s} requests/s (Poisson), {why}"
        + (f"; max_replicas is {req.max_replicas}" if req.max_replicas is not None else ""),
    )


def _evaluate(
    req: PlanRequest, it: InstanceType, layout: Layout, scheme: WeightScheme, kv: KvDtype
) -> Candidate | Rejection:
    version = req.engine_version or default_version(req.engine)
    tp = layout.tp
    measured = None
    if layout.pp == 1 and not layout.ep:  # a calibration names a tensor-parallel degree only
        measured = next((m for m in req.measured if m.applies(it, tp, req.model.model_id, req.engine, version)), None)
    o = _Option(
        req=req, it=it, tp=tp, scheme=scheme, kv=kv, measured=measured, pp=layout.pp, ep=layout.ep, dp=layout.dp
    )
    reason = _layout_reason(o)
    if reason:
        return o.reject(reason)
    sized = _size(o)
    if isinstance(sized, Rejection):
        return sized
    price = _price(it, req.hosting)
    if price is None:
        # Pinning the type does not help: candidates are priced and ranked by the hour (the old text said it would).
        return o.reject(
            "the catalog has no on-demand price for this type (sold as Capacity Blocks or reserved only), and a plan "
            "is priced by the hour; choose a type with an on-demand price"
        )
    cand = _candidate(o, layout, sized, price, version=version)
    if req.max_fleet_usd_per_hour is not None and cand.fleet_usd_per_hour > req.max_fleet_usd_per_hour:
        return o.reject(
            f"fleet costs ${cand.fleet_usd_per_hour:.2f}/h, above the ${req.max_fleet_usd_per_hour:.2f}/h ceiling",
        )
    return cand


@dataclass(frozen=True, kw_only=True)
class _Sized:
    """An option that passed every gate."""

    cap: Capacity
    batch: int
    limited: str  # what capped the batch
    perf: PerfEstimate
    load: SteadyState  # under load at ``batch``
    answer: tuple[str, ...]  # notes on the answer's time where the host bounds a buffered request
    rps: float  # requests per second per replica
    replicas: int
    planned: SteadyState  # the planned load on each replica


def _size(o: _Option) -> _Sized | Rejection:
    """The gates in turn: the engine starts, a batch fits, it meets the latency targets, the answer fits the host's
    limit, and enough replicas carry the peak rate."""
    cap = _startup_capacity(o)
    if isinstance(cap, Rejection):
        return cap
    sized = _batch(o, cap)
    if isinstance(sized, Rejection):
        return sized
    fast = _meet_latency(o, cap, *sized)
    if isinstance(fast, Rejection):
        return fast
    batch, limited, perf, load = fast
    answer = _answer_time(o, perf, load)
    if isinstance(answer, Rejection):
        return answer
    rps = _requests_per_s(load)
    sized_fleet = _replicas(o, cap, batch, rps, load)
    if isinstance(sized_fleet, Rejection):
        return sized_fleet
    replicas, planned = sized_fleet
    return _Sized(
        cap=cap,
        batch=batch,
        limited=limited,
        perf=perf,
        load=load,
        answer=answer,
        rps=rps,
        replicas=replicas,
        planned=planned,
    )


def _candidate(
    o: _Option, layout: Layout, s: _Sized, price: tuple[float, str, str, tuple[str, ...]], *, version: str
) -> Candidate:
    req, it, cap, batch = o.req, o.it, s.cap, s.batch
    per_instance = 1 if req.hosting.one_engine_per_instance else it.accelerator_count // layout.gpus
    rate = req.workload.peak_requests_per_s / s.replicas if req.workload.peak_requests_per_s else None
    return Candidate(
        instance=it,
        hosting=req.hosting,
        tensor_parallel_size=o.tp,
        weight_scheme=o.scheme,
        online_quantization=online_quantization(o.scheme, req.model),
        kv_cache_dtype=o.kv,
        # The engine settings admit exactly `batch` sequences: the breakdown shown is the one the engine prints
        # (the same as at start-up when the batch is the engine's own max_num_seqs).
        capacity=cap if batch == cap.max_num_seqs else o.capacity(max_num_seqs=batch),
        concurrency_per_replica=batch,
        cache_concurrency=cap.concurrent_sequences,
        perf=s.perf,
        under_load=s.load,
        planned_load=s.planned,
        planned_requests_per_s=rate,
        alone=o.under_load(cap, 1),
        requests_per_s_per_replica=s.rps,
        output_tokens_per_s_per_replica=s.rps * req.workload.output_tokens,
        replicas=s.replicas,
        engines_per_instance=per_instance,
        instance_count=math.ceil(s.replicas / per_instance),
        usd_per_hour_per_instance=price[0],
        price_as_of=price[1],
        price_source=price[2],
        limited_by=s.limited,
        data_parallel_size=o.dp,
        notes=price[3]
        + s.answer
        + _precision_notes(it, o.kv, req)
        + _release_notes(o.scheme, req)
        + _coverage_notes(req, version, o.measured)
        + _measured_notes(o.measured)
        + _layout_notes(layout)
        + _speculative_notes(o, cap, batch, s.load),
        measured=o.measured,
        pipeline_parallel_size=layout.pp,
        expert_parallel=layout.ep,
        settings=o.settings(max_num_seqs=batch),
    )


def _layout_notes(layout: Layout) -> tuple[str, ...]:
    out = []
    if layout.pp > 1:
        out.append(
            f"pipeline parallel over {layout.pp} stages: speed is priced as one batch passing the stages in turn "
            "(the engine's overlap of several batches across stages is not counted)"
        )
    if layout.ep and layout.dp == 1:
        out.append("expert parallel: speed is priced as tensor parallelism over the same GPUs (no all-to-all term)")
    if layout.dp > 1:
        out.append(
            f"data-parallel attention: speed is priced per engine core with its share of the batch, the experts' "
            f"all-gather and reduce-scatter over {layout.dp} cores included, and even load on every core"
        )
    return tuple(out)


def _speculative_notes(o: _Option, cap: Capacity, batch: int, load: SteadyState) -> tuple[str, ...]:
    """What tau the speed was priced with and where it comes from, and the same candidate without the drafter's
    credit (its memory stays counted): the speed-up speculation buys at this batch, or what it costs."""
    rep = o.step_replica(cap)
    spec = rep.spec
    if spec is None:
        return ()
    plain = o.under_load(cap, batch, replace(rep, spec=None))
    alone = o.under_load(cap, 1, rep)
    plain_alone = o.under_load(cap, 1, replace(rep, spec=None))
    return (
        f"speculative {spec.method}, {spec.num_speculative_tokens} drafts a step: speed assumes "
        f"{spec.acceptance_length:g} tokens accepted per step ({spec.acceptance_source}); set "
        "speculative.acceptance_length to what your workload measures",
        f"speculation at {batch} sequences: ITL {load.itl_s * 1e3:.1f} ms vs {plain.itl_s * 1e3:.1f} ms without, "
        f"{load.output_tokens_per_s:,.0f} vs {plain.output_tokens_per_s:,.0f} output tokens/s per replica "
        f"(x{load.output_tokens_per_s / plain.output_tokens_per_s:.2f}); one request alone: ITL "
        f"{alone.itl_s * 1e3:.1f} ms vs {plain_alone.itl_s * 1e3:.1f} ms (x{plain_alone.itl_s / alone.itl_s:.2f})",
    )


def _measured_notes(m: Measured | None) -> tuple[str, ...]:
    if m is None:
        return ()
    kv = f"{m.kv_cache_tokens:,} KV tokens" if m.kv_cache_tokens is not None else "the modelled KV cache"
    return (f"calibrated ({m.source}): step times x{m.step_time_scale:.2f} the model's, {kv}",)


def _instances(req: PlanRequest) -> Iterable[InstanceType]:
    if req.instance_types:
        return [instance(n) for n in req.instance_types]
    return instances().values()


def enumerate_candidates(req: PlanRequest) -> Plan:
    cands: list[Candidate] = []
    rejs: list[Rejection] = []
    schemes = _schemes(req)
    for it in _instances(req):
        layouts = _layouts(
            req.model, it.accelerator_count, data_parallel=data_parallel_sized(req.engine, req.engine_version)
        )
        reason = _hardware_reason(it, req) or (
            None
            if layouts
            else f"no tensor-parallel degree divides both {req.model.num_attention_heads} heads and "
            f"{it.accelerator_count} GPUs"
        )
        if reason:
            rejs.append(
                Rejection(
                    instance_type=it.name,
                    tensor_parallel_size=None,
                    kv_cache_dtype=None,
                    weight_precision=None,
                    reason=reason,
                )
            )
            continue
        for layout in layouts:
            for scheme in schemes:
                for kv in req.kv_cache_dtypes:
                    out = _evaluate(req, it, layout, scheme, kv)
                    (cands if isinstance(out, Candidate) else rejs).append(out)  # type: ignore[arg-type]
    # At equal cost plain tensor parallelism first: the simpler layout, and the one the step model prices directly.
    cands.sort(
        key=lambda c: (
            c.fleet_usd_per_hour,
            c.usd_per_million_output_tokens,
            c.instance.name,
            c.expert_parallel,
            c.pipeline_parallel_size,
            c.data_parallel_size,
        )
    )
    return Plan(request=req, candidates=tuple(cands), rejections=tuple(rejs))


def plan(req: PlanRequest) -> Plan:
    """Rank the candidates; raise NothingFitsError with the nearest miss and what would fit."""
    engine_profile(req.engine, req.engine_version)  # an unknown release is the user's error, not a misfit
    _check_release(req)
    if req.speculative is not None:  # a missing acceptance length is the user's to give, not a candidate's misfit
        acceptance(req.speculative, speculative_tokens(req.model, req.speculative))
    result = enumerate_candidates(req)
    if result.candidates:
        return result
    raise NothingFitsError(nothing_fits_message(req, result))


def nothing_fits_message(req: PlanRequest, result: Plan) -> str:
    mem = [r for r in result.rejections if r.needed_gib is not None and r.available_gib]
    wl = req.workload
    head = f"no candidate fits {req.model.model_id} for {wl.max_model_len}-token sequences"
    if wl.concurrency_per_replica:
        head += f" x {wl.concurrency_per_replica} per replica"
    parts = [head]
    if mem:
        best = min(mem, key=lambda r: (r.needed_gib or 0) / (r.available_gib or 1))
        parts.append(
            f"nearest: {best.instance_type} tp={best.tensor_parallel_size} needs {best.needed_gib:.1f} GiB per GPU, "
            f"{best.available_gib:.1f} GiB available"
        )
        fits = _longest_fitting_context(req, best)
        if fits:
            parts.append(fits)
    elif result.rejections:
        parts.append(f"e.g. {result.rejections[0].describe()}")
    fixes = _what_would_fit(req)
    if fixes:
        parts.append("would fit with: " + "; ".join(fixes))
    else:
        parts.append("nothing in the catalog fits even with fp8 KV cache, fp8 weights and every family")
    return "; ".join(parts)


def _longest_fitting_context(req: PlanRequest, best: Rejection) -> str | None:
    it = instance(best.instance_type)
    if it.usable_gpu_memory_bytes is None or best.tensor_parallel_size is None:
        return None
    o = _Option(
        req=req,
        it=it,
        tp=best.tensor_parallel_size,
        scheme=weight_scheme(best.weight_precision) if best.weight_precision else req.model.native_scheme,
        kv=KvDtype(best.kv_cache_dtype or "auto"),
        pp=best.pipeline_parallel_size,
        ep=best.expert_parallel,
        dp=best.data_parallel_size,
    )
    try:
        cap = o.capacity()
    except SizingError:
        return None
    if cap.kv_cache_bytes_per_gpu <= 0:
        return None
    fit_len = cap.max_model_len_that_fits
    conc = int(cap.max_concurrency)
    text = f"there the largest max_model_len that fits is {fit_len}"
    if conc >= 1:
        text += f" and {conc} sequences of {req.workload.max_model_len} tokens fit"
    return text


def _what_would_fit(req: PlanRequest) -> list[str]:
    """Re-plan with one relaxation at a time and name each that yields a candidate."""
    trials = _relaxations(req)
    out = []
    for label, trial in trials:
        found = enumerate_candidates(trial).candidates
        if found:
            out.append(f"{label} -> {found[0].label()}")
    if out:
        return out
    # No single change is enough: try them together, then with the context halved until it fits.
    return _all_relaxed(req, trials)


def _relaxations(req: PlanRequest) -> list[tuple[str, PlanRequest]]:
    """Each change of the request that could let a candidate fit, with its label."""
    trials: list[tuple[str, PlanRequest]] = []
    if KvDtype.FP8 not in req.kv_cache_dtypes:
        trials.append(("fp8 KV cache (kv_cache_dtypes: [fp8])", replace(req, kv_cache_dtypes=(KvDtype.FP8,))))
    if req.model.quantization is None and "fp8" not in req.weight_precisions:
        trials.append(("fp8 weights (weight_precisions: [fp8])", replace(req, weight_precisions=("fp8",))))
    if req.families or req.instance_types:
        trials.append(
            (
                "any instance family (drop families / instance_type)",
                replace(req, families=(), instance_types=()),
            )
        )
    if req.max_fleet_usd_per_hour is not None:
        trials.append(("no price ceiling", replace(req, max_fleet_usd_per_hour=None)))
    if not req.workload.streaming and req.hosting.buffered_response_limit_s is not None:
        trials.append(
            (
                "streamed answers (workload.streaming: true)",
                replace(req, workload=replace(req.workload, streaming=True)),
            )
        )
    if req.hosting.wider is not None:
        trials.append((req.hosting.wider_label, replace(req, hosting=req.hosting.wider)))
    wl = req.workload
    if wl.concurrency_per_replica and wl.concurrency_per_replica > 1:
        trials.append(
            (
                "fewer concurrent sequences per replica (more replicas)",
                replace(req, workload=replace(wl, concurrency_per_replica=1)),
            )
        )
    return trials


def _all_relaxed(req: PlanRequest, trials: list[tuple[str, PlanRequest]]) -> list[str]:
    """Every relaxation at once, then with the context halved (six times at most) until a candidate fits."""
    wl = req.workload
    combined = replace(
        req,
        kv_cache_dtypes=(KvDtype.FP8,),
        weight_precisions=req.weight_precisions if req.model.quantization else ("fp8",),
        families=(),
        instance_types=(),
        max_fleet_usd_per_hour=None,
        hosting=req.hosting.wider or req.hosting,
        workload=replace(wl, concurrency_per_replica=1 if wl.concurrency_per_replica else None),
    )
    labels = " + ".join(label.split(" (")[0] for label, _ in trials)
    for _ in range(6):
        found = enumerate_candidates(combined).candidates
        if found:
            ctx = combined.workload.max_model_len
            suffix = f" + a {ctx}-token context" if ctx < wl.max_model_len else ""
            return [f"{labels}{suffix} together -> {found[0].label()}"]
        w = combined.workload
        if w.max_model_len <= 1024:
            break
        # The averages shrink with the maxima: a trial context is the planner's, and an average left above it
        # would fail as if the file had said so.
        max_in, max_out = max(1, w.max_input_tokens // 2), max(1, w.max_output_tokens // 2)
        combined = replace(
            combined,
            workload=replace(
                w,
                max_input_tokens=max_in,
                max_output_tokens=max_out,
                avg_input_tokens=None if w.avg_input_tokens is None else min(w.avg_input_tokens, max_in),
                avg_output_tokens=None if w.avg_output_tokens is None else min(w.avg_output_tokens, max_out),
            ),
        )
    return []
