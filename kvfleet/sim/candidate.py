"""One engine start on one instance type, without an environment file: what a user benchmarks.

``kvfleet simulate --model M --instance-type T --tp N ...`` asks what a benchmark of ``vllm serve M
--tensor-parallel-size N`` (or trtllm-serve) on T would show. The engine starts with its own defaults for that device
and release, as the capacity model sizes them (max_num_seqs, max_num_batched_tokens, the KV cache), unless a flag
gives one; the step model prices its steps; the engine's own scheduler runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace

from kvfleet.engines import adapter
from kvfleet.engines.base import EngineArgs
from kvfleet.engines.scheduling import Scheduler
from kvfleet.errors import KvfleetError
from kvfleet.scaling import AutoscalerKind
from kvfleet.sim.fleet import FleetSpec, Scaling
from kvfleet.sim.replica import EngineLimits
from kvfleet.sim.steps import RooflineSteps
from kvfleet.sizing.capacity import Capacity, EngineSettings, capacity, prefix_caching
from kvfleet.sizing.engines import EngineName
from kvfleet.sizing.hardware import InstanceType, accelerator, instance
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.planner import Candidate, Workload
from kvfleet.sizing.precision import kv_dtype, weight_scheme
from kvfleet.sizing.step import StepConstants, nvlink_bytes_per_s, replica, request_overhead_s
from kvfleet.workload.shapes import ClosedLoop, Lengths, PoissonLoad

# One replica that nothing scales (the planned fleet's count is its initial_replicas).
ONE_FIXED = Scaling(kind=AutoscalerKind.NONE, min_replicas=1, max_replicas=1, kv_cache_target=1.0, queue_target=1e9)


@dataclass(frozen=True, kw_only=True)
class EngineStart:
    """One engine start: on an instance type (its GPUs, their links and its price), or on a catalog GPU alone (a
    published benchmark names the GPU, not the instance)."""

    model: ModelSpec
    instance_type: str | None = None
    gpu: str | None = None  # with instance_type None: the catalog accelerator
    tp: int = 1
    engine: str = "vllm"
    engine_version: str | None = None
    precision: str | None = None  # weight precision; None: the checkpoint's own
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    # Chunked prefill where an engine has it off by default (TensorRT-LLM's enable_chunked_prefill); None: the
    # engine's default. vLLM V1 always chunks.
    enable_chunked_prefill: bool | None = None


@dataclass(frozen=True, kw_only=True)
class StartedEngine:
    spec: FleetSpec  # one warm replica, no autoscaler (kvfleet.sim.shapes.fixed sets the count)
    capacity: Capacity
    instance: InstanceType | None
    where: str  # the instance type, or the GPU

    def describe(self) -> str:
        c = self.capacity
        return (
            f"{c.model_id} on {self.where}, {c.engine.value} {c.engine_version}, tp={c.tensor_parallel_size}, "
            f"{c.weights.scheme.name}: {c.num_blocks * c.block_size:,} KV tokens, max_num_seqs {c.max_num_seqs}, "
            f"max_num_batched_tokens {c.max_num_batched_tokens}"
        )


def _settings(e: EngineStart) -> EngineSettings:
    scheme = weight_scheme(e.precision, field="precision") if e.precision else None
    native = e.model.native_scheme
    return EngineSettings(
        engine=EngineName(e.engine),
        version=e.engine_version,
        tensor_parallel_size=e.tp,
        gpu_memory_utilization=e.gpu_memory_utilization,
        max_model_len=e.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_dtype=kv_dtype(e.kv_cache_dtype),
        quantization=scheme.name if scheme is not None and scheme.name != native.name else None,
        enable_prefix_caching=e.enable_prefix_caching,
    )


def start(e: EngineStart, *, longest_request_tokens: int, constants: StepConstants | None = None) -> StartedEngine:
    """The engine as it would start, refused with the engine's own reason where it would not, or where the
    benchmark's longest request would not fit its context."""
    it = instance(e.instance_type) if e.instance_type else None
    acc = it.accelerator if it is not None else accelerator(e.gpu or "")
    if it is not None and e.tp > it.accelerator_count:
        raise KvfleetError(f"{it.name} has {it.accelerator_count} GPUs; give at most that", field="tp")
    mem = it.usable_gpu_memory_bytes if it is not None else acc.usable_memory_bytes or acc.memory_bytes
    if mem is None:
        raise KvfleetError(f"the catalog has no GPU memory figure for {it.name if it else acc.model}", field="model")
    nvlink = it.nvlink if it is not None else nvlink_bytes_per_s(acc) is not None
    settings = _settings(e)
    cap = capacity(e.model, gpu_memory_bytes=mem, settings=settings, accelerator_name=acc.name)
    if cap.problems:
        raise KvfleetError(f"the engine would not start: {cap.problems[0]}", field="model")
    if longest_request_tokens > cap.max_model_len:
        raise KvfleetError(
            f"the longest request ({longest_request_tokens:,} tokens) exceeds the engine's max_model_len "
            f"({cap.max_model_len:,}); give shorter lengths or a larger --max-model-len",
            field="max-model-len",
        )
    rep = replica(
        model=e.model,
        accelerator=acc,
        tp=e.tp,
        nvlink=nvlink,
        scheme=cap.weights.scheme,
        kv_dtype=settings.kv_cache_dtype,
    )
    args = EngineArgs(tensor_parallel_size=e.tp)
    price = it.ec2_price if it is not None else None
    return StartedEngine(
        spec=FleetSpec(
            limits=EngineLimits(
                max_num_seqs=cap.max_num_seqs,
                max_num_batched_tokens=cap.max_num_batched_tokens,
                kv_blocks=cap.num_blocks,
                block_tokens=cap.block_size,
                prefix_caching=prefix_caching(e.model, settings),
            ),
            model=RooflineSteps(rep, constants),
            scheduler=_scheduler(e, args),
            scaling=ONE_FIXED,
            initial_replicas=1,
            cold_start_s=0.0,
            usd_per_replica_hour=price.usd_per_hour * e.tp / it.accelerator_count if price and it else None,
            request_overhead_s=request_overhead_s(e.engine),
        ),
        capacity=cap,
        instance=it,
        where=it.name if it is not None else f"{e.tp} x {acc.name}",
    )


def _scheduler(e: EngineStart, args: EngineArgs) -> Scheduler:
    """The engine's scheduler, with chunked prefill as the start gives it where the engine's scheduler has the
    switch (a scheduler without one always chunks or never does)."""
    sched = adapter(e.engine).scheduler(args)
    switch = e.enable_chunked_prefill
    if (
        switch is not None
        and is_dataclass(sched)
        and not isinstance(sched, type)
        and "enable_chunked_context" in {f.name for f in fields(sched)}
    ):
        sched = replace(sched, enable_chunked_context=switch)
    return sched


# The planned load is simulated for this long at the peak rate (at least PLANNED_REQUESTS_MIN requests, at most
# PLANNED_REQUESTS_MAX): long enough for the queue to settle, short enough that a plan prints in well under a second.
PLANNED_SECONDS = 300.0
PLANNED_REQUESTS_MIN = 400
PLANNED_REQUESTS_MAX = 3000


def planned_fleet(c: Candidate, model: ModelSpec, wl: Workload) -> tuple[FleetSpec, ClosedLoop | PoissonLoad]:
    """A plan's candidate as the simulator's fleet (its replicas, routing, engine limits, step model and the engine's
    own scheduler) and its planned load: Poisson arrivals at the peak rate, or each replica's planned sequences as
    a closed loop where the workload gives no rate."""
    cap = c.capacity
    spec = FleetSpec(
        # A data-parallel replica is dp engine cores, each with the capacity model's cache and token budget: the
        # simulator runs it as one engine with all of them (kvfleet.sim.steps prices a step per core).
        limits=EngineLimits(
            max_num_seqs=c.concurrency_per_replica,
            max_num_batched_tokens=cap.max_num_batched_tokens * c.data_parallel_size,
            kv_blocks=cap.num_blocks * c.data_parallel_size,
            block_tokens=cap.block_size,
            prefix_caching=False,  # the planned load's prompts share nothing
        ),
        model=RooflineSteps.for_candidate(c, model),
        scheduler=adapter(cap.engine.value).scheduler(EngineArgs(tensor_parallel_size=c.tensor_parallel_size)),
        scaling=ONE_FIXED,
        initial_replicas=c.replicas,
        cold_start_s=0.0,
        usd_per_replica_hour=c.usd_per_hour_per_instance / c.engines_per_instance,
        router=c.hosting.routing,
        request_overhead_s=request_overhead_s(cap.engine.value),
    )
    lengths = Lengths(input_tokens=wl.input_tokens, output_tokens=wl.output_tokens)
    if wl.peak_requests_per_s is not None:
        n = round(wl.peak_requests_per_s * PLANNED_SECONDS)
        n = min(PLANNED_REQUESTS_MAX, max(PLANNED_REQUESTS_MIN, n))
        return spec, PoissonLoad(rate_per_s=wl.peak_requests_per_s, requests=n, lengths=lengths)
    clients = c.concurrency_per_replica * c.replicas
    return spec, ClosedLoop(concurrency=clients, requests=min(PLANNED_REQUESTS_MAX, 4 * clients), lengths=lengths)
