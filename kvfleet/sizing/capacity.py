"""The cache one engine start gets: every term of the memory budget, blocks, tokens, concurrency.

``capacity()`` answers the question the whole toolkit derives from: with this model on this GPU at
these settings, how many tokens of KV cache does the engine allocate, and how many sequences of
``max_model_len`` tokens does that hold at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from kvfleet.engines.capacity import EngineProfile, MemoryBudget
from kvfleet.engines.vocabulary import MM_ENCODER_TP_MODES
from kvfleet.errors import SizingError
from kvfleet.sizing.coverage import unchecked_note
from kvfleet.sizing.engines import (
    ACTIVATIONS,
    EncoderProfile,
    EngineName,
    activation_peak_bytes,
    batch_defaults,
    context_profiling_requests,
    cuda_graph_bytes,
    cuda_graphs_counted,
    default_version,
    encoder_profile,
    engine_capacity,
    engine_profile,
    engine_title,
    engine_traits,
    extensible_kv_bytes,
    in_flight_batches,
    non_torch_bytes,
    rope_rules,
    runs_v2_runner,
    sampler_bytes_per_logit,
    sizing_step_transient_bytes,
    v2_penalty_buffer_bytes,
)
from kvfleet.sizing.memory import (
    KvGroup,
    KvLayout,
    StateLayout,
    WeightBreakdown,
    kv_layout,
    rope_cache_bytes,
    rope_cache_positions,
    weight_bytes,
)
from kvfleet.sizing.models import AttentionKind, ContextLimit, ModelSpec, config_overrides, context_limit
from kvfleet.sizing.parallel import Layout, check_layout, pp_partition
from kvfleet.sizing.precision import KvDtype, Part, WeightScheme, weight_scheme
from kvfleet.sizing.quantization import as_loaded, checkpoint_note, checkpoint_refusal, scheme_refusal
from kvfleet.sizing.speculative import Acceptance, Drafter, Speculative, acceptance, resolve_drafter
from kvfleet.sizing.units import GiB, MiB, cdiv


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The knobs of one engine start. ``None`` means the engine's default for its version."""

    engine: EngineName = EngineName.VLLM
    version: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # vLLM --pipeline-parallel-size, TRT-LLM pipeline_parallel_size
    enable_expert_parallel: bool = False  # vLLM --enable-expert-parallel, TRT-LLM moe_expert_parallel_size = tp
    # vLLM --data-parallel-size: engine cores of tp x pp GPUs each behind one server, the experts over tp x dp ranks.
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # TRT-LLM: free_gpu_memory_fraction
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: KvDtype = KvDtype.AUTO
    quantization: str | None = None  # weight precision; None: the checkpoint's own
    block_size: int | None = None
    enforce_eager: bool = False  # no CUDA graphs
    kv_cache_memory_bytes: int | None = None  # vLLM --kv-cache-memory-bytes: skips profiling
    max_tokens: int | None = None  # TRT-LLM KvCacheConfig.max_tokens cap
    # vLLM --enable-prefix-caching; None: the release's default. For hybrid Mamba models it decides
    # mamba_cache_mode ("align" keeps two state pages per request, "none" one).
    enable_prefix_caching: bool | None = None
    mamba_cache_dtype: str = "auto"  # vLLM --mamba-cache-dtype (conv and SSM state)
    mamba_ssm_cache_dtype: str = "auto"  # vLLM --mamba-ssm-cache-dtype (SSM state only)
    # vLLM --limit-mm-per-prompt: items per prompt by modality ("image", "video"); unnamed ones take vLLM's 999.
    # A modality at 0 is not profiled; with every modality at 0 the vision tower is not loaded (text only).
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()
    mm_encoder_tp_mode: str = "weights"  # vLLM --mm-encoder-tp-mode: "weights" (sharded) or "data" (replicated)
    mm_max_pixels: int | None = None  # vLLM --mm-processor-kwargs '{"max_pixels": N}': Qwen-VL's largest image
    speculative: Speculative | None = None  # a drafter (EAGLE head, MTP layers, draft model, n-gram)


@dataclass(frozen=True, kw_only=True)
class Capacity:
    model_id: str
    engine: EngineName
    engine_version: str
    profile: EngineProfile
    tensor_parallel_size: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int  # vLLM: total x utilization. TRT-LLM: total
    weights: WeightBreakdown
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int  # estimate; subtracted only where the engine counts it
    cuda_graph_counted: bool
    kv_cache_bytes_per_gpu: int
    kv: KvLayout
    block_size: int
    num_blocks: int
    kv_cache_tokens: int  # as the engine reports "GPU KV cache size: N tokens"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    blocks_per_max_len_request: int
    max_concurrency: float  # sequences of max_model_len that fit at once
    max_model_len_that_fits: int  # the longest single request the cache can hold
    state_pages_per_request: int = 0  # pages each state-layer group holds per request (hybrid Mamba models)
    encoder: EncoderProfile | None = None  # vLLM's multimodal profiling (vision-language models)
    max_model_len_limit: int = 0  # the longest max_model_len this engine release accepts for the model
    max_model_len_source: str = ""  # where that limit comes from (config keys and RoPE scaling)
    hf_overrides: str | None = None  # JSON of the config changes the engine must start with (vLLM --hf-overrides)
    problems: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    drafter: Drafter | None = None  # its weights are in weights_bytes_per_gpu, its layers in kv.groups
    # With pipeline parallelism every figure above is the stage that holds the fewest KV blocks: the engine gives
    # every stage that many (vllm/v1/core/kv_cache_utils.py get_kv_cache_configs, vLLM 0.32.0).
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False
    # Data-parallel attention: every figure above is one rank's (each engine core logs its own "GPU KV cache size"
    # and schedules its own max_num_seqs); the replica holds data_parallel_size of them.
    data_parallel_size: int = 1
    stage_num_blocks: tuple[int, ...] = field(default=())  # each stage's own count before the minimum
    # Each stage's own start-up (weights, activation peak, cache) before the minimum, first stage first. A log
    # shows the first stage's: vLLM prints "Model loading took" and "Available KV cache memory" once per node, from
    # its first rank (logger.info_once, scope "local": vllm/logger.py, v1/worker/gpu_model_runner.py load_model,
    # v1/worker/gpu_worker.py determine_available_memory, vLLM 0.32.0), and only "GPU KV cache size" is the minimum.
    stages: tuple[Capacity, ...] = field(default=())
    # Whether the engine caches prefixes at these settings (the setting, else the release's default): the engine
    # must start with the same, since for hybrid Mamba models it sets the state pages each request holds.
    prefix_caching: bool = True
    # vLLM's extensible KV cache (0.34 on): sized after warm-up from measured memory. Then the CUDA context, a
    # margin of max(1 GiB, 0.75 x transient) and the transient itself are what is kept out of the cache, and the
    # engine is started without --gpu-memory-utilization unless the settings give one.
    extensible_kv_cache: bool = False
    cuda_context_bytes: int = 0  # counted where the engine measures free memory (extensible cache, TensorRT-LLM)
    kv_margin_bytes: int = 0
    transient_bytes: int = 0  # extensible cache: the larger of the profile run's peak and the sizing step's
    gpu_memory_utilization_given: bool = False  # the settings named a utilization (else the release's default)
    # Buffers the engine allocates after loading that its budget counts (Model Runner V2's penalty state).
    runner_buffer_bytes: int = 0

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def replica_kv_cache_tokens(self) -> int:
        """KV tokens the whole replica holds: every data-parallel rank's cache (one sequence fits one rank's)."""
        return self.kv_cache_tokens * self.data_parallel_size

    @property
    def weights_bytes_per_gpu(self) -> int:
        """The target's weights and the drafter's, per GPU."""
        return self.weights.weights_bytes_per_gpu + (self.drafter.weights_bytes_per_gpu if self.drafter else 0)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.kv.kv_bytes_per_token_per_gpu

    @property
    def concurrent_sequences(self) -> int:
        """Sequences of max_model_len that run at once: cache-bound, and capped by max_num_seqs, on every
        data-parallel rank (each rank's scheduler admits its own)."""
        return min(int(self.max_concurrency), self.max_num_seqs) * self.data_parallel_size

    def as_dict(self) -> dict[str, object]:
        g = GiB
        return {
            "model": self.model_id,
            "engine": self.engine.value,
            "engine_version": self.engine_version,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "expert_parallel": self.expert_parallel,
            "data_parallel_size": self.data_parallel_size,
            "replica_kv_cache_tokens": self.replica_kv_cache_tokens,
            "stage_num_blocks": list(self.stage_num_blocks),
            "gpu_memory_gib": round(self.gpu_memory_bytes / g, 3),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "requested_gib": round(self.requested_bytes / g, 3),
            "extensible_kv_cache": self.extensible_kv_cache,
            "cuda_context_gib": round(self.cuda_context_bytes / g, 3),
            "kv_margin_gib": round(self.kv_margin_bytes / g, 3),
            "transient_gib": round(self.transient_bytes / g, 3),
            "runner_buffer_gib": round(self.runner_buffer_bytes / g, 3),
            "weight_precision": self.weights.scheme.name,
            "weights_gib_per_gpu": round(self.weights_bytes_per_gpu / g, 3),
            "activation_peak_gib": round(self.activation_peak_bytes / g, 3),
            "non_torch_gib": round(self.non_torch_bytes / g, 3),
            "cuda_graph_gib": round(self.cuda_graph_bytes / g, 3),
            "cuda_graph_counted": self.cuda_graph_counted,
            "kv_cache_gib_per_gpu": round(self.kv_cache_bytes_per_gpu / g, 3),
            "kv_cache_dtype": self.kv.kv_dtype.value,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_concurrency": round(self.max_concurrency, 2),
            "max_model_len_that_fits": self.max_model_len_that_fits,
            "max_model_len_limit": self.max_model_len_limit,
            "max_model_len_source": self.max_model_len_source,
            "hf_overrides": None if self.hf_overrides is None else json.loads(self.hf_overrides),
            "kv_groups": [_kv_group_dict(grp) for grp in self.kv.groups],
            "state_layers": (
                _state_dict(self.kv.state, self.state_pages_per_request) if self.kv.state is not None else None
            ),
            "weights_by_part_gib": {p.value: round(b / g, 3) for p, b in self.weights.bytes_by_part},
            "encoder": None if self.encoder is None else _encoder_dict(self.encoder),
            "speculative": None if self.drafter is None else _drafter_dict(self.drafter),
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


# The modalities of the vision-language models kvfleet sizes (vLLM's --limit-mm-per-prompt keys).
MM_MODALITIES = ("image", "video")


def mm_limits(s: EngineSettings) -> dict[str, int]:
    """--limit-mm-per-prompt as a mapping, checked."""
    if s.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
        raise SizingError(
            f"must be one of {', '.join(MM_ENCODER_TP_MODES)}, got {s.mm_encoder_tp_mode!r}", field="mm_encoder_tp_mode"
        )
    out: dict[str, int] = {}
    for modality, count in s.limit_mm_per_prompt:
        if modality not in MM_MODALITIES:
            raise SizingError(
                f"unknown modality {modality!r}; use {', '.join(MM_MODALITIES)} (e.g. image=0,video=0 for text only)",
                field="limit_mm_per_prompt",
            )
        if count < 0:
            raise SizingError(f"{modality} must be 0 or more, got {count}", field="limit_mm_per_prompt")
        out[modality] = count
    return out


# A RoPE cache this large is worth a line in the plan (Llama 4 Scout's 10M positions: 2.5 GiB per GPU).
_ROPE_NOTE_BYTES = 256 * MiB


def _vision_weights(
    model: ModelSpec, weights: WeightBreakdown, *, loaded: bool, replicated: bool, scheme: WeightScheme
) -> WeightBreakdown:
    """The vision tower as vLLM holds it: absent when every modality is limited to 0, whole on every rank when the
    encoder runs data parallel (--mm-encoder-tp-mode data)."""
    if not model.vision_params:
        return weights
    parts: list[tuple[Part, int]] = []
    for part, b in weights.bytes_by_part:
        if part is not Part.VISION:
            parts.append((part, b))
        elif loaded:
            full = round(model.vision_params * scheme.bytes_per_param(Part.VISION, unquantized_bytes=2.0))
            parts.append((part, full if replicated else b))
    return replace(weights, bytes_by_part=tuple(parts))


def _kv_group_dict(grp: KvGroup) -> dict[str, object]:
    return {
        "attention": grp.attention.value,
        "window_tokens": grp.window_tokens,
        "layers": grp.num_layers,
        "bytes_per_token_per_layer": grp.bytes_per_token_per_layer,
        **({"draft": True} if grp.draft else {}),
    }


def _state_dict(state: StateLayout, pages_per_request: int) -> dict[str, object]:
    return {
        "kind": state.kind.value,
        "layers": state.num_layers,
        "bytes_per_layer": state.bytes_per_layer,
        "pages_per_request": pages_per_request,
    }


def _encoder_dict(e: EncoderProfile) -> dict[str, object]:
    return {
        "modality": e.modality,
        "tokens_per_item": e.tokens_per_item,
        "items": e.items,
        "budget_tokens": e.budget_tokens,
        "data_parallel": e.data_parallel,
        "encoder_activation_gib": round(e.encoder_activation_bytes / GiB, 3),
        "encoder_output_gib": round(e.encoder_output_bytes / GiB, 3),
        "buffer_gib": round(e.buffer_bytes / GiB, 3),
    }


def _drafter_dict(d: Drafter) -> dict[str, object]:
    return {
        "method": d.method.value,
        "draft_model": None if d.model is None else d.model.model_id,
        "num_speculative_tokens": d.num_speculative_tokens,
        "weights_gib_per_gpu": round(d.weights_bytes_per_gpu / GiB, 3),
        "shares_with_target": list(d.shares),
        "kv_layers": d.layers,
        "kv_bytes_per_token_per_gpu": d.kv_bytes_per_token_per_gpu,
        "lookahead_tokens": d.lookahead_tokens,
        "extra_slots_per_request": d.extra_slots_per_request,
    }


def _positive(value: int | None, name: str) -> None:
    if value is not None and value <= 0:
        raise SizingError(f"must be positive, got {value}", field=name)


def resolve_scheme(
    model: ModelSpec,
    quantization: str | None,
    *,
    engine: EngineName = EngineName.VLLM,
    version: str | None = None,
) -> WeightScheme:
    """The weights' scheme, refused where the engine release would not load it (``EngineCapacity.quantization``): a
    checkpoint whose quant_method the release does not load (field ``model``), or a scheme it does not apply to an
    unquantized checkpoint (field ``quantization``). The scheme returned is the one the release holds in memory
    (``quantization.as_loaded``: vLLM's bitsandbytes absmax in fp32 from 0.9.2)."""
    native = model.native_scheme
    q = model.quantization
    if q is not None:
        reason = checkpoint_refusal(q.method, native, engine=engine, version=version)
        if reason:
            raise SizingError(reason, field="model")
    if quantization is None:
        return as_loaded(native, engine=engine, version=version)
    scheme = weight_scheme(quantization)
    if q is not None and scheme.name != native.name:
        raise SizingError(
            f"the checkpoint is already quantized as {native.name}; drop --quantization or pick another checkpoint",
            field="quantization",
        )
    if q is None:
        reason = scheme_refusal(scheme, engine=engine, version=version)
        if reason:
            raise SizingError(reason, field="quantization")
    return as_loaded(scheme, engine=engine, version=version)


# A change the hint proposes must leave a fifth of the memory free for the KV cache and the activations.
_HINT_FILL = 0.8


def _memory_hint(
    model: ModelSpec,
    tp: int,
    scheme: WeightScheme,
    requested: int,
    runtime: int,
    *,
    buffer: int = 0,
    engine: str = EngineName.VLLM,
) -> str:
    """The nearest change that leaves room: more tensor parallelism, else a 4-bit checkpoint. ``buffer``: what every
    rank holds whole whatever the parallelism (the engine's RoPE cache, ``EngineTraits.holds_rope_cache``)."""
    if buffer + runtime >= requested * _HINT_FILL:
        positions = (
            f"{rope_cache_positions(model):,} positions (max_position_embeddings {model.max_position_embeddings:,}"
        )
        return (
            f"{engine_title(engine)}'s RoPE cache alone takes {buffer / GiB:.2f} GiB on every GPU whatever the "
            f"parallelism: it covers {positions} and the rope scaling); correct those values in the model's config or "
            f"--rope-scaling, or, if they are right, use a GPU with more than "
            f"{(buffer + runtime) / _HINT_FILL / GiB:.0f} GiB"
        )
    runtime += buffer
    heads = model.num_attention_heads
    for larger in (d for d in range(tp + 1, 65) if heads % d == 0):
        try:
            w = weight_bytes(model, tp=larger, scheme=scheme).weights_bytes_per_gpu
        except SizingError:
            continue
        if w + runtime < requested * _HINT_FILL:
            return f"at tensor_parallel_size {larger} the weights take {w / GiB:.2f} GiB per GPU"
    if scheme.weight_bits > 4:
        w4 = weight_bytes(model, tp=tp, scheme=weight_scheme("awq")).weights_bytes_per_gpu
        if w4 + runtime < requested * _HINT_FILL:
            return f"a 4-bit checkpoint (awq/gptq) takes {w4 / GiB:.2f} GiB per GPU"
    return "use a GPU with more memory or more GPUs"


@dataclass(frozen=True, kw_only=True)
class _Pool:
    """vLLM's KV-cache layout: layers grouped so that every group has the same number of layers."""

    group_size: int
    groups: tuple[tuple[AttentionKind, int | None], ...]  # one entry per KV-cache group
    page_bytes: int  # one block of one group's layer (of every layer where there is one group)
    state_pages: int = 0  # pages a state-layer group holds per request


# FlashAttention's kernel block sizes on CUDA: MultipleOf(16) (vllm/v1/attention/backends/flash_attn.py
# get_supported_kernel_block_sizes, v0.32.0): the alignment of a hybrid model's raised block size.
ATTENTION_KERNEL_BLOCK_ALIGNMENT = 16


def hybrid_block_size(kv: KvLayout, *, block_size: int) -> int:
    """The attention block size vLLM picks so that one attention page holds one Mamba state page.

    vllm/platforms/interface.py ``_align_hybrid_block_size`` (v0.32.0): with ``a`` = max(kernel
    alignment, block_size), block = a x cdiv(state page, a x attention bytes per token), rounded up to the
    kernel alignment, and never below the configured block size (it overrides --block-size). The state
    page is then padded to the attention page.
    """
    if kv.state is None or not kv.groups:
        return block_size
    per_token = max(g.bytes_per_token_per_layer for g in kv.groups)
    align = max(ATTENTION_KERNEL_BLOCK_ALIGNMENT, block_size)
    raised = align * cdiv(kv.state.bytes_per_layer, align * per_token)
    raised = ATTENTION_KERNEL_BLOCK_ALIGNMENT * cdiv(raised, ATTENTION_KERNEL_BLOCK_ALIGNMENT)
    return max(block_size, raised)


def _grouped(
    by_kind: dict[tuple[AttentionKind, int | None], int], *, page_bytes: int, group_ratio: float, state_pages: int = 0
) -> _Pool:
    """Layers of several kinds in one block pool (vllm/v1/core/kv_cache_utils.py
    _get_kv_cache_groups_uniform_page_size): the group size is the smallest per-kind layer count (the "1" of the
    n:1 patterns), or the largest when every kind is within ``group_ratio`` of the others."""
    counts = list(by_kind.values())
    group_size = min(counts)
    if max(counts) < min(counts) * group_ratio:
        group_size = max(counts)
    groups: list[tuple[AttentionKind, int | None]] = []
    for key, n in by_kind.items():
        groups.extend([key] * cdiv(n, group_size))
    return _Pool(group_size=group_size, groups=tuple(groups), page_bytes=page_bytes, state_pages=state_pages)


def _pool(
    kv: KvLayout,
    *,
    block_size: int,
    hybrid: bool,
    group_ratio: float,
    state_pages: int = 1,
    chunked_local: bool = True,
) -> _Pool:
    if not kv.groups:
        raise SizingError("the model has no attention layers that hold a KV cache", field="model")
    page = block_size * max(g.bytes_per_token_per_layer for g in kv.groups)
    # Layers of one kind and window (a drafter's among the target's) fill one group.
    by_kind: dict[tuple[AttentionKind, int | None], int] = {}
    for g in kv.groups:
        key = (g.attention, g.window_tokens)
        if g.attention is AttentionKind.CHUNKED and not chunked_local:
            key = (AttentionKind.FULL, None)  # FullAttentionSpec until ChunkedLocalAttentionSpec came
        by_kind[key] = by_kind.get(key, 0) + g.num_layers
    if kv.state is not None:
        # State layers join the pool with their page padded to the attention page.
        by_kind[AttentionKind.STATE, None] = kv.state.num_layers
        return _grouped(by_kind, page_bytes=page, group_ratio=group_ratio, state_pages=state_pages)
    if not hybrid or len(by_kind) == 1:
        # One group holding every layer; windowed layers are treated as full when hybrid is off. A block holds
        # one page of every layer, each at its own size (UniformTypeKVCacheSpecs when a drafter's heads differ).
        block_bytes = block_size * kv.kv_bytes_per_token_per_gpu
        only = next(iter(by_kind)) if len(by_kind) == 1 else (AttentionKind.FULL, None)
        return _Pool(group_size=1, groups=(only,), page_bytes=block_bytes)
    return _grouped(by_kind, page_bytes=page, group_ratio=group_ratio)


def _blocks_per_request(
    kind: AttentionKind,
    window: int | None,
    *,
    max_model_len: int,
    block_size: int,
    max_num_batched_tokens: int,
    in_flight_batches: int = 1,
    state_pages: int = 1,
) -> int:
    """Blocks one layer of this kind needs for one request of max_model_len (vLLM's KV specs)."""
    if kind is AttentionKind.STATE:
        return state_pages  # MambaSpec.max_memory_usage_bytes: 1 page, 2 in mamba_cache_mode "align"
    if window is None or kind in (AttentionKind.FULL, AttentionKind.MLA):
        return cdiv(max_model_len, block_size)
    # The window (or chunk) plus the tokens scheduled but not yet freed: VllmConfig.max_in_flight_tokens,
    # in_flight_batches x max_num_batched_tokens.
    in_flight = in_flight_batches * max_num_batched_tokens
    if kind is AttentionKind.SLIDING:
        # SlidingWindowSpec.max_admission_blocks_per_request: plus one block because the window need not
        # start at a block boundary.
        tokens = min(window - 1 + in_flight, max_model_len)
        return cdiv(tokens, block_size) + 1
    tokens = min(window + in_flight, max_model_len)  # ChunkedLocalAttentionSpec
    return cdiv(tokens, block_size)


@dataclass(frozen=True, kw_only=True)
class _Knobs:
    """The settings with every engine default filled in for this model, GPU and release."""

    util: float
    max_len: int
    max_seqs: int
    batched: int
    block: int
    limit: ContextLimit


def _knobs(
    model: ModelSpec, s: EngineSettings, profile: EngineProfile, *, gpu_memory_bytes: int, accelerator_name: str
) -> _Knobs:
    for name, value in (
        ("max_model_len", s.max_model_len),
        ("max_num_seqs", s.max_num_seqs),
        ("max_num_batched_tokens", s.max_num_batched_tokens),
        ("block_size", s.block_size),
        ("kv_cache_memory_bytes", s.kv_cache_memory_bytes),
        ("max_tokens", s.max_tokens),
        ("mm_max_pixels", s.mm_max_pixels),
    ):
        _positive(value, name)
    if gpu_memory_bytes <= 0:
        raise SizingError(f"must be positive, got {gpu_memory_bytes / GiB:.2f} GiB", field="gpu_memory_gib")
    util = profile.gpu_memory_utilization if s.gpu_memory_utilization is None else s.gpu_memory_utilization
    fixed = profile.fixed_cache_gpu_memory_utilization
    if s.gpu_memory_utilization is None and profile.extensible_kv_cache and s.kv_cache_memory_bytes is not None:
        # CacheConfig.resolved_gpu_memory_utilization: 1.0 only with the extensible cache, which a fixed size turns off.
        util = util if fixed is None else fixed
    if not 0 < util <= 1:
        raise SizingError(f"must be in (0, 1], got {util}", field="gpu_memory_utilization")
    traits = engine_traits(profile.engine)
    if model.rope_override and not traits.takes_config_overrides:
        raise SizingError(
            f"{engine_title(profile.engine)} takes no config override at start-up; use vLLM (--hf-overrides), or a "
            "checkpoint whose config.json carries this rope_scaling",
            field="rope_scaling",
        )
    limit = context_limit(model, rope_rules(profile.engine, s.version))
    max_len = limit.default_len_tokens if s.max_model_len is None else s.max_model_len
    if max_len > limit.max_len_tokens:
        raise SizingError(_too_long(model, profile, max_len, limit), field="max_model_len")
    max_seqs, batched = _batch_limits(s, profile, max_len, gpu_memory_bytes=gpu_memory_bytes, name=accelerator_name)
    block = s.block_size or profile.block_size
    _check_block_size(profile.engine, block)
    return _Knobs(util=util, max_len=max_len, max_seqs=max_seqs, batched=batched, block=block, limit=limit)


def _batch_limits(
    s: EngineSettings, profile: EngineProfile, max_len: int, *, gpu_memory_bytes: int, name: str
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the settings, else the release's defaults for this device."""
    tier = batch_defaults(profile.engine, s.version, gpu_memory_bytes=gpu_memory_bytes, accelerator_name=name)
    max_seqs = s.max_num_seqs or tier.max_num_seqs
    if s.max_num_batched_tokens is not None:
        batched = s.max_num_batched_tokens
    elif profile.schedules_whole_prompts:
        # Without chunked prefill a step schedules a whole prompt at once.
        batched = max(max_len, 2048) if max_len <= 32768 else 2048
    else:
        batched = tier.max_num_batched_tokens
    traits = engine_traits(profile.engine)
    if traits.max_num_batched_tokens_at_least_seqs and batched < max_seqs and s.max_num_batched_tokens is not None:
        raise SizingError(
            f"{batched} is below max_num_seqs ({max_seqs}); {engine_title(profile.engine)} requires "
            "max_num_batched_tokens >= max_num_seqs",
            field="max_num_batched_tokens",
        )
    return (min(max_seqs, batched) if s.max_num_seqs is None else max_seqs), batched


def _check_block_size(engine: str, block: int) -> None:
    """The block sizes the engine accepts (``EngineTraits.block_sizes``, ``block_size_power_of_two``)."""
    traits = engine_traits(engine)
    if traits.block_sizes and block not in traits.block_sizes:
        allowed = ", ".join(map(str, sorted(traits.block_sizes)))
        raise SizingError(f"{engine_title(engine)} accepts block sizes {allowed}; got {block}", field="block_size")
    if traits.block_size_power_of_two and block & (block - 1):
        raise SizingError(
            f"{engine_title(engine)} {traits.block_size_option} must be a power of two, got {block}",
            field="block_size",
        )


def _too_long(model: ModelSpec, profile: EngineProfile, max_len: int, limit: ContextLimit) -> str:
    """The engine's refusal in the user's terms: its limit, where the limit comes from, and what to change."""
    engine = engine_title(profile.engine)
    text = f"{max_len:,} exceeds {engine}'s limit for {model.model_id}, {limit.max_len_tokens:,} ({limit.source}); "
    text += f"use at most {limit.max_len_tokens:,}"
    if model.rope_override:
        return text
    text += (
        ', or extend the context with a RoPE scaling the model supports (--rope-scaling \'{"rope_type": "yarn", '
        '"factor": F, "original_max_position_embeddings": N}\', deployments[].model.rope_scaling: vLLM --hf-overrides)'
    )
    override = engine_traits(profile.engine).max_len_override
    if override:
        text += (
            f"; {engine}'s own override {override} starts it anyway, but positions past the limit give NaN with RoPE "
            "or read out of bounds with absolute positions"
        )
    return text


@dataclass(frozen=True, kw_only=True)
class _Budget:
    requested: int
    kv_bytes: int
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    extensible: bool = False
    context: int = 0
    margin: int = 0
    transient: int = 0


def _kv_budget(
    s: EngineSettings,
    profile: EngineProfile,
    mem: _StageMemory,
    *,
    gpu_memory_bytes: int,
    sizing_transient: int = 0,
) -> _Budget:
    """The bytes the engine gives the KV cache (``EngineTraits.memory_budget``): a share of the total minus what is
    not cache (vLLM; with the extensible cache, what warm-up leaves free less a margin), or a share of what is free
    after profiling (TensorRT-LLM)."""
    if profile.extensible_kv_cache and s.kv_cache_memory_bytes is None:
        return _extensible_budget(s, mem, gpu_memory_bytes=gpu_memory_bytes, sizing_transient=sizing_transient)
    if engine_traits(profile.engine).memory_budget is MemoryBudget.SHARE_OF_TOTAL:
        return _share_of_total_budget(s, mem, gpu_memory_bytes=gpu_memory_bytes)
    return _share_of_free_budget(s, profile, mem, gpu_memory_bytes=gpu_memory_bytes)


def _extensible_budget(
    s: EngineSettings, mem: _StageMemory, *, gpu_memory_bytes: int, sizing_transient: int
) -> _Budget:
    """vLLM 0.34 on: the cache is sized after warm-up from measured free memory."""
    util = mem.knobs.util
    requested = int(gpu_memory_bytes * util)
    transient = max(mem.activation_bytes, sizing_transient)
    ext = extensible_kv_bytes(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=util,
        used_bytes=mem.loaded_bytes + mem.non_torch_bytes + mem.graph_bytes,
        transient_bytes=transient,
    )
    notes = [
        f"the KV cache is sized after warm-up and CUDA-graph capture from measured free memory: less the CUDA "
        f"context ({ACTIVATIONS.cuda_context_bytes / GiB:.2f} GiB), a margin of {ext.margin_bytes / GiB:.2f} GiB "
        f"(max of 1 GiB and 0.75 x the transient) and the transient peak ({transient / GiB:.2f} GiB)"
    ]
    if s.gpu_memory_utilization is not None and ext.withheld_bytes >= GiB:
        notes.append(
            f"gpu_memory_utilization {util} keeps {ext.withheld_bytes / GiB:.2f} GiB of free memory out of the "
            "cache (vLLM warns); leave it unset unless something else shares the GPU"
        )
    return _Budget(
        requested=requested,
        kv_bytes=ext.kv_bytes,
        problems=(),
        notes=tuple(notes),
        extensible=True,
        context=ACTIVATIONS.cuda_context_bytes,
        margin=ext.margin_bytes,
        transient=transient,
    )


def _share_of_total_budget(s: EngineSettings, mem: _StageMemory, *, gpu_memory_bytes: int) -> _Budget:
    """A share of the total less what is not cache (vLLM before the extensible cache, or with a fixed cache size)."""
    notes: list[str] = []
    problems: list[str] = []
    requested = int(gpu_memory_bytes * mem.knobs.util)
    graphs = mem.graph_bytes
    non_kv = mem.loaded_bytes + mem.activation_bytes + mem.non_torch_bytes + (graphs if mem.graphs_counted else 0)
    if s.kv_cache_memory_bytes is not None:
        kv_bytes = s.kv_cache_memory_bytes
        notes.append("kv_cache_memory_bytes set: the cache size is fixed and profiling is skipped")
        if kv_bytes + non_kv > gpu_memory_bytes:
            problems.append(
                f"kv_cache_memory_bytes {kv_bytes / GiB:.2f} GiB plus {non_kv / GiB:.2f} GiB of weights and "
                f"runtime exceed the GPU's {gpu_memory_bytes / GiB:.2f} GiB; at most "
                f"{max(0, gpu_memory_bytes - non_kv) / GiB:.2f} GiB fits"
            )
    else:
        kv_bytes = requested - non_kv
    if not mem.graphs_counted and graphs:
        notes.append("CUDA graphs are captured after the cache is sized, from the 1 - utilization headroom")
    return _Budget(requested=requested, kv_bytes=kv_bytes, problems=tuple(problems), notes=tuple(notes))


def _share_of_free_budget(
    s: EngineSettings, profile: EngineProfile, mem: _StageMemory, *, gpu_memory_bytes: int
) -> _Budget:
    """A fraction of what profiling leaves free, in whole blocks (TensorRT-LLM)."""
    k = mem.knobs
    used = (
        mem.loaded_bytes + mem.activation_bytes + mem.non_torch_bytes + mem.graph_bytes + ACTIVATIONS.cuda_context_bytes
    )
    kv_bytes = int((gpu_memory_bytes - used) * k.util)
    kv_bytes_per_token = mem.kv.kv_bytes_per_token_per_gpu
    if kv_bytes > 0 and kv_bytes_per_token > 0:
        # _cal_max_tokens floors to whole tokens and KvCacheConfig.max_tokens caps them; calculate_max_num_blocks
        # then rounds the tokens up to whole blocks (ceil), so a cap that is not a block multiple gains a block.
        tokens = kv_bytes // kv_bytes_per_token
        if s.max_tokens is not None:
            tokens = min(tokens, s.max_tokens)
        kv_bytes = cdiv(tokens, k.block) * k.block * kv_bytes_per_token
    notes: tuple[str, ...] = ()
    if engine_traits(profile.engine).context_profiling_requests:
        runs = context_profiling_requests(max_num_tokens=k.batched, max_seq_len=k.max_len)
        notes = (
            f"profiled with {runs} dummy context request(s) filling max_num_tokens {k.batched}, one sampled row each",
        )
    return _Budget(
        requested=gpu_memory_bytes,
        kv_bytes=kv_bytes,
        problems=(),
        notes=notes,
        context=ACTIVATIONS.cuda_context_bytes,
    )


def _state_pages(model: ModelSpec, s: EngineSettings, profile: EngineProfile) -> int:
    """State pages per request for a hybrid Mamba model; refuses engines whose state cache is not modelled."""
    if model.state is None or model.state_layers == 0:
        return 0
    separate = engine_traits(profile.engine).separate_state_cache
    if separate:
        raise SizingError(
            f"{model.model_id} has {model.state.kind.value} layers; {engine_title(profile.engine)}'s {separate} is "
            "not modelled here; size it with engine vllm",
            field="engine",
        )
    if not profile.mamba_state_cache:
        # Earlier releases ran these models on V0 by default, whose state cache is a separate pool.
        since = _first_release(profile.engine, "mamba_state_cache")
        raise SizingError(
            f"{model.model_id} has {model.state.kind.value} layers, whose state shares the hybrid KV-cache "
            f"allocator from the release where V1 runs them by default; releases before it are not modelled; use "
            f"engine_version {since} or later",
            field="engine_version",
        )
    # vllm/model_executor/models/config.py MambaModelConfig: prefix caching sets mamba_cache_mode "align";
    # MambaSpec.max_memory_usage_bytes then holds 2 pages per request (no speculative or checkpoint blocks).
    return 2 if prefix_caching(model, s) else 1


def prefix_caching(model: ModelSpec, s: EngineSettings) -> bool:
    """Whether the engine caches prefixes: the setting, else the release's default. vLLM turns it on for every
    generative decoder, hybrid ones included, from 0.28.0 (vllm/engine/arg_utils.py
    _set_default_chunked_prefill_and_prefix_caching_args, vllm/config/model.py is_prefix_caching_supported);
    earlier releases left it off for hybrid Mamba models (``mamba_align_by_default``). TensorRT-LLM's
    KvCacheConfig.enable_block_reuse defaults to on, for every model."""
    if s.enable_prefix_caching is not None:
        return s.enable_prefix_caching
    profile = engine_profile(s.engine, s.version)
    if model.state is not None and model.state_layers:
        return profile.mamba_align_by_default
    return True


def _tokens(pool: _Pool, *, num_blocks: int, concurrency: float, k: _Knobs, profile: EngineProfile) -> int:
    """The token count the engine reports ("GPU KV cache size: N tokens"), as each release computes it."""
    if len(pool.groups) > 1 and profile.hybrid_tokens_from_concurrency:
        return int(concurrency * k.max_len)  # group-aware capacity, as newer releases log it
    if len(pool.groups) > 1:
        return num_blocks // len(pool.groups) * k.block  # _report_kv_cache_config of older releases
    return num_blocks * k.block


def capacity(
    model: ModelSpec,
    *,
    gpu_memory_bytes: int,
    settings: EngineSettings,
    accelerator_name: str = "",
    measured_kv_cache_tokens: int | None = None,
) -> Capacity:
    """Predict what the engine allocates at start-up. Raises SizingError for settings it rejects.

    ``gpu_memory_bytes`` is the total memory of one GPU as the engine sees it; ``accelerator_name``
    matters only where defaults depend on the device (vLLM gives A100s the small scheduler defaults).
    ``measured_kv_cache_tokens``: what this engine reported for these settings on this hardware (a calibration);
    the cache's bytes are scaled so that its tokens are that, and everything that follows from them (blocks,
    concurrency, the longest request) is computed from the measured cache.

    With pipeline parallelism each stage is sized on its own layers (the first holding the embedding, the last the
    lm_head, and the embedding too where it is tied), and the replica gets the fewest blocks of any stage.
    """
    s = settings
    version = s.version or default_version(s.engine)
    engine_profile(s.engine, s.version)
    _check_pipeline_size(s)
    layout = Layout(
        tp=s.tensor_parallel_size, pp=s.pipeline_parallel_size, ep=s.enable_expert_parallel, dp=s.data_parallel_size
    )
    layout_notes = check_layout(
        model,
        layout,
        engine=s.engine,
        version=version,
        scheme=resolve_scheme(model, s.quantization, engine=s.engine, version=version),
    )
    if layout.pp == 1:
        cap = _stage_capacity(
            model,
            model,
            without=frozenset(),
            gpu_memory_bytes=gpu_memory_bytes,
            s=s,
            accelerator_name=accelerator_name,
            measured_kv_cache_tokens=measured_kv_cache_tokens,
        )
        dp_notes = _data_parallel_notes(cap, layout)
        return replace(
            cap, expert_parallel=layout.ep, data_parallel_size=layout.dp, notes=cap.notes + layout_notes + dp_notes
        )
    return _pipeline_capacity(
        model,
        layout,
        layout_notes,
        gpu_memory_bytes=gpu_memory_bytes,
        s=s,
        accelerator_name=accelerator_name,
        measured_kv_cache_tokens=measured_kv_cache_tokens,
    )


def _data_parallel_notes(cap: Capacity, layout: Layout) -> tuple[str, ...]:
    if layout.dp == 1:
        return ()
    return (
        f"data-parallel attention: {layout.dp} engine cores of {layout.tp * layout.pp} GPU(s) each, every one with "
        f"{cap.kv_cache_tokens:,} KV tokens and up to {cap.max_num_seqs} sequences of its own "
        f"({cap.kv_cache_tokens * layout.dp:,} tokens in the replica; one request is held by one rank); the experts "
        f"spread over {layout.expert_ranks} ranks",
    )


def _check_pipeline_size(s: EngineSettings) -> None:
    pp = s.pipeline_parallel_size
    if pp < 1:
        raise SizingError(f"must be at least 1, got {pp}", field="pipeline_parallel_size")
    if pp > 1 and s.speculative is not None:
        raise SizingError(
            "a drafter with pipeline parallelism is not modelled (where its layers and lookahead slots sit across "
            "stages); plan speculative decoding with tensor parallelism only (pipeline_parallel_size 1)",
            field="speculative",
        )


def _pipeline_capacity(
    model: ModelSpec,
    layout: Layout,
    layout_notes: tuple[str, ...],
    *,
    gpu_memory_bytes: int,
    s: EngineSettings,
    accelerator_name: str,
    measured_kv_cache_tokens: int | None,
) -> Capacity:
    """Each stage sized on its own layers; the replica is the stage with the fewest blocks, which every stage gets."""
    pp = layout.pp
    stages = []
    first = 0
    split = pp_partition(model.num_layers, pp, engine=s.engine)
    for i, n in enumerate(split):
        layers = model.layers[first : first + n]
        first += n
        stage = replace(model, layers=layers, num_layers=n)
        stages.append(
            _stage_capacity(
                stage,
                model,
                without=_left_out_of_stage(model, i, pp),
                gpu_memory_bytes=gpu_memory_bytes,
                s=s,
                accelerator_name=accelerator_name,
                measured_kv_cache_tokens=measured_kv_cache_tokens,
            )
        )
    binding = min(stages, key=lambda c: (c.num_blocks, -c.weights_bytes_per_gpu))
    counts = tuple(c.num_blocks for c in stages)
    per_stage, blocks = ", ".join(map(str, split)), ", ".join(map(str, counts))
    note = (
        f"{pp} pipeline stages of [{per_stage}] layers hold {blocks} KV blocks; every stage gets the fewest, "
        f"{binding.num_blocks}"
    )
    problems = binding.problems or next((c.problems for c in stages if c.problems), ())
    return replace(
        binding,
        pipeline_parallel_size=pp,
        expert_parallel=layout.ep,
        stage_num_blocks=counts,
        stages=tuple(stages),
        problems=problems,
        notes=binding.notes + layout_notes + (note,),
    )


def _left_out_of_stage(model: ModelSpec, i: int, pp: int) -> frozenset[Part]:
    """The parts pipeline stage ``i`` of ``pp`` does not hold."""
    without: set[Part] = set()
    if i > 0 and not (model.tie_word_embeddings and i == pp - 1):
        without.add(Part.EMBEDDING)
    if i < pp - 1:
        without.add(Part.LM_HEAD)
    if i > 0:
        without.add(Part.VISION)  # the vision tower runs where the embeddings are merged, on the first stage
    return frozenset(without)


def _sampler_rows(profile: EngineProfile, k: _Knobs) -> int:
    """Rows of logits the profiling run samples. vLLM's dummy sampler run takes max_num_seqs rows. TensorRT-LLM 1.0
    samples its dummy context requests (_util.py KvCacheCreator._create_dummy_context_requests, max_tokens=1), and
    the model returns one logit row per context request, its last token's (model_engine.py _prepare_tp_inputs:
    gather_ids), so its sampler sees one row per request, not max_batch_size (``context_profiling_requests``)."""
    if engine_traits(profile.engine).context_profiling_requests:
        return context_profiling_requests(max_num_tokens=k.batched, max_seq_len=k.max_len)
    return k.max_seqs


@dataclass(frozen=True, kw_only=True)
class _StageMemory:
    """What one GPU of a stage holds beside its KV cache, and the cache's layout."""

    knobs: _Knobs  # the block size raised where a hybrid model's state page needs it
    weights: WeightBreakdown
    kv: KvLayout  # the drafter's layers included
    state_pages: int
    drafter: Drafter | None
    activation_bytes: int  # the profile run's peak: the encoder's and the drafter's included
    encoder: EncoderProfile | None
    mm_notes: tuple[str, ...]
    non_torch_bytes: int
    graph_bytes: int  # the drafter's included
    graphs_counted: bool
    runner_buffer_bytes: int

    @property
    def loaded_bytes(self) -> int:
        """The target's weights, the drafter's and the runner's resident buffers."""
        drafter = self.drafter.weights_bytes_per_gpu if self.drafter is not None else 0
        return self.weights.weights_bytes_per_gpu + drafter + self.runner_buffer_bytes


def _stage_capacity(
    model: ModelSpec,
    full: ModelSpec,
    *,
    without: frozenset[Part],
    gpu_memory_bytes: int,
    s: EngineSettings,
    accelerator_name: str,
    measured_kv_cache_tokens: int | None,
) -> Capacity:
    """One GPU's start-up: ``model`` holds the layers it serves (a pipeline stage's, or all), ``full`` the rest."""
    profile = engine_profile(s.engine, s.version)
    version = s.version or default_version(s.engine)
    k = _knobs(full, s, profile, gpu_memory_bytes=gpu_memory_bytes, accelerator_name=accelerator_name)
    scheme = resolve_scheme(full, s.quantization, engine=s.engine, version=version)
    mem = _stage_memory(model, full, s, profile, k, without=without, scheme=scheme)
    k = mem.knobs
    budget = _kv_budget(
        s,
        profile,
        mem,
        gpu_memory_bytes=gpu_memory_bytes,
        sizing_transient=sizing_step_transient_bytes(model, max_num_batched_tokens=k.batched, max_model_len=k.max_len)
        if profile.extensible_kv_cache
        else 0,
    )
    notes = [profile.note, *budget.notes, *mem.mm_notes]
    notes.extend(_start_notes(model, full, s, profile, mem, scheme=scheme, version=version))
    problems = list(budget.problems)
    kv_bytes = budget.kv_bytes
    if kv_bytes <= 0:
        problems.append(_no_room_problem(full, s, mem, budget, scheme=scheme))
        kv_bytes = 0
    blocks = _blocks(model, full, s, profile, mem, kv_bytes=kv_bytes, measured_kv_cache_tokens=measured_kv_cache_tokens)
    notes.extend(blocks.notes)
    if not problems and blocks.concurrency < 1:
        problems.append(_too_short_problem(k, blocks, extensible=budget.extensible))
    return _stage_record(
        model,
        full,
        s,
        profile,
        version=version,
        gpu_memory_bytes=gpu_memory_bytes,
        mem=mem,
        budget=budget,
        blocks=blocks,
        problems=tuple(problems),
        notes=tuple(notes),
    )


def _stage_memory(
    model: ModelSpec,
    full: ModelSpec,
    s: EngineSettings,
    profile: EngineProfile,
    k: _Knobs,
    *,
    without: frozenset[Part],
    scheme: WeightScheme,
) -> _StageMemory:
    """What one GPU of the stage holds beside its cache: weights, KV layout, drafter, activation peak, vision
    encoder, CUDA graphs and resident buffers (the block size raised where a state page needs it)."""
    tp = s.tensor_parallel_size
    limits = mm_limits(s)
    weights = weight_bytes(model, tp=tp, scheme=scheme, ep=s.enable_expert_parallel, without=without)
    if s.data_parallel_size > 1:
        weights = _experts_over_ranks(model, weights, scheme, ranks=tp * s.data_parallel_size, without=without)
    if engine_traits(profile.engine).holds_rope_cache:
        weights = replace(weights, buffer_bytes=rope_cache_bytes(full))
    kv = kv_layout(
        model,
        tp=tp,
        kv_dtype=s.kv_cache_dtype,
        mamba_cache_dtype=s.mamba_cache_dtype,
        mamba_ssm_cache_dtype=s.mamba_ssm_cache_dtype,
    )
    state_pages = _state_pages(model, s, profile)
    if kv.state is not None:
        k = replace(k, block=hybrid_block_size(kv, block_size=k.block))
    _check_kv_dtype(full, s, profile)
    drafter = _drafter(model, s, k, profile, tp=tp, scheme=scheme)
    act = _activation_bytes(model, full, profile, k, without=without, tp=tp, drafter=drafter)
    act += all_to_all_bytes(model, tp=tp, dp=s.data_parallel_size, max_num_batched_tokens=k.batched)
    encoder, weights, act, mm_notes = _vision_encoder(
        model, s, profile, k, without=without, limits=limits, weights=weights, scheme=scheme, act=act
    )
    # The data-parallel and expert-parallel groups' communicators join the tensor-parallel group's.
    non_torch = non_torch_bytes(tp=tp * s.data_parallel_size)
    graphs = 0 if s.enforce_eager else cuda_graph_bytes(model)
    graphs_counted = cuda_graphs_counted(profile, full, enforce_eager=s.enforce_eager)
    if drafter is not None:
        # Its layers join the target's pool; its forward follows the target's in the profile run, reading the
        # target's hidden states (see sizing/speculative.py).
        kv = replace(kv, groups=kv.groups + drafter.kv_groups)
        act = max(act, drafter.activation_peak_bytes + ACTIVATIONS.workspace_bytes) + drafter.hidden_state_bytes
        graphs += 0 if s.enforce_eager else drafter.cuda_graph_bytes
    return _StageMemory(
        knobs=k,
        weights=weights,
        kv=kv,
        state_pages=state_pages,
        drafter=drafter,
        activation_bytes=act,
        encoder=encoder,
        mm_notes=tuple(mm_notes),
        non_torch_bytes=non_torch,
        graph_bytes=graphs,
        graphs_counted=graphs_counted,
        runner_buffer_bytes=_runner_buffer_bytes(full, profile, k, without=without),
    )


def _experts_over_ranks(
    model: ModelSpec, weights: WeightBreakdown, scheme: WeightScheme, *, ranks: int, without: frozenset[Part]
) -> WeightBreakdown:
    """The routed experts whole over ``ranks`` (tensor x data parallel): the fullest rank holds ceil(E / ranks)
    (vllm/config/parallel.py data_parallel_size: MoE layers are sharded over the product of the sizes; vLLM's
    determine_expert_map gives the first E % ranks ranks one more); the rest stays as tensor parallelism holds it."""
    moe = model.moe
    if moe is None:
        return weights
    inter = moe.expert_intermediate_size
    pad = max(1, scheme.expert_intermediate_pad)
    padded = cdiv(inter, pad) * pad
    per_param = scheme.bytes_per_param(Part.EXPERTS, unquantized_bytes=2.0)
    held = [g for g in model.param_groups if g.part not in without]  # weight_bytes' order, one entry per group
    parts = tuple(
        (p, round(g.count * cdiv(moe.num_experts, ranks) // moe.num_experts * padded // inter * per_param))
        if p is Part.EXPERTS
        else (p, b)
        for g, (p, b) in zip(held, weights.bytes_by_part, strict=True)
    )
    return replace(weights, bytes_by_part=parts)


# vllm/envs.py VLLM_FUSED_MOE_CHUNK_SIZE (16 * 1024): fused_moe runs its intermediate caches over at most this many
# tokens at a time (vllm-project/vllm at 00193b82).
FUSED_MOE_CHUNK_TOKENS = 16 * 1024


def all_to_all_bytes(model: ModelSpec, *, tp: int, dp: int, max_num_batched_tokens: int, act_bytes: int = 2) -> int:
    """What data-parallel attention adds to one rank's profile-run peak: its MoE layers take every rank's tokens.

    With the default all2all backend (vllm/config/parallel.py all2all_backend "allgather_reducescatter",
    use_all2all when data_parallel_size > 1) a rank all-gathers the dp ranks' hidden states before the experts and
    reduce-scatters after: dp x max_num_batched_tokens rows of the hidden size, and fused_moe's caches grow from
    this rank's tokens to the gathered ones, up to its chunk (FUSED_MOE_CHUNK_TOKENS)."""
    moe = model.moe
    if dp == 1 or moe is None:
        return 0
    n = max_num_batched_tokens
    gathered = dp * n
    inter = moe.expert_intermediate_size // tp
    per_token = moe.experts_per_token * (max(2 * inter, model.hidden_size) + inter)
    grown = max(0, min(gathered, FUSED_MOE_CHUNK_TOKENS) - min(n, FUSED_MOE_CHUNK_TOKENS)) * per_token
    return (gathered * model.hidden_size + grown) * act_bytes


def _activation_bytes(
    model: ModelSpec,
    full: ModelSpec,
    profile: EngineProfile,
    k: _Knobs,
    *,
    without: frozenset[Part],
    tp: int,
    drafter: Drafter | None,
) -> int:
    """The language model's activation peak in the profile run, its sampler's rows included."""
    # The non-sorting sampler's bytes per logit on the runner this model takes (Model Runner V2 or the V1 runner).
    constants = replace(ACTIVATIONS, sampler_bytes_per_logit=sampler_bytes_per_logit(profile, full, ACTIVATIONS))
    if drafter is not None:
        # The dummy sampler run then runs the rejection sampler over one draft per request (gpu_model_runner.py
        # _dummy_sampler_run): bf16 logits of twice the rows (4 B per request's logit) stay alive while it samples
        # the bonus tokens through the same path as the sampler (v1/sample/rejection_sampler.py forward).
        constants = replace(
            constants,
            sampler_bytes_per_logit=constants.sampler_bytes_per_logit + 4,
            sampler_sort_bytes_per_logit=constants.sampler_sort_bytes_per_logit + 4,
        )
    return activation_peak_bytes(
        model,
        tp=tp,
        max_num_batched_tokens=k.batched,
        # Only the last pipeline stage computes logits and samples (gpu/model_runner.py profile_run: is_last_pp_rank).
        max_num_seqs=0 if Part.LM_HEAD in without else _sampler_rows(profile, k),
        sort_sampler=profile.sort_sampler,
        constants=constants,
    )


def _vision_encoder(
    model: ModelSpec,
    s: EngineSettings,
    profile: EngineProfile,
    k: _Knobs,
    *,
    without: frozenset[Part],
    limits: dict[str, int],
    weights: WeightBreakdown,
    scheme: WeightScheme,
    act: int,
) -> tuple[EncoderProfile | None, WeightBreakdown, int, list[str]]:
    """vLLM's multimodal profiling: the encoder's run, the vision tower's weights as loaded, and the activation peak
    with the encoder's outputs in it. With pipeline parallelism the tower runs on the first stage only (its weights
    are left out of the others by ``without``)."""
    if model.vision is None or Part.VISION in without:
        return None, weights, act, []
    title = engine_title(profile.engine)
    if not engine_traits(profile.engine).profiles_vision_encoder:
        return None, weights, act, [f"{title}'s vision encoder memory beyond its weights is not modelled"]
    tp = s.tensor_parallel_size
    notes: list[str] = []
    encoder = encoder_profile(
        model,
        tp=tp,
        max_model_len=k.max_len,
        max_num_batched_tokens=k.batched,
        max_num_seqs=k.max_seqs,
        limits=limits,
        encoder_tp_mode=s.mm_encoder_tp_mode,
        max_pixels=s.mm_max_pixels,
    )
    if encoder is not None and s.mm_encoder_tp_mode == "data" and not encoder.data_parallel and tp > 1:
        notes.append(f"this vision tower has no data-parallel mode in {title}; it stays sharded (weights)")
    if s.mm_max_pixels is not None and not model.vision.pixel_unit:
        notes.append("mm_max_pixels sizes Qwen-VL images only; this model's images have a fixed size")
    weights = _vision_weights(
        model,
        weights,
        loaded=encoder is not None,  # encoder_profile is None only when every tower modality is at 0
        replicated=encoder is not None and encoder.data_parallel,
        scheme=scheme,
    )
    if encoder is None:
        notes.append(f"every modality is limited to 0: {title} loads no vision tower and profiles no encoder")
    else:
        # The encoder runs first; its outputs stay in the encoder cache through the language model's dummy run.
        act = max(encoder.encoder_activation_bytes, encoder.encoder_output_bytes + act) + encoder.buffer_bytes
        notes.append(
            f"encoder profiled with {encoder.items} {encoder.modality} item(s) of {encoder.tokens_per_item:,} "
            f"tokens (budget {encoder.budget_tokens:,} tokens); lower it with limit_mm_per_prompt"
        )
    return encoder, weights, act, notes


def _runner_buffer_bytes(full: ModelSpec, profile: EngineProfile, k: _Knobs, *, without: frozenset[Part]) -> int:
    """Model Runner V2's penalty state on the last stage: resident, and counted from the release that subtracts what
    is resident (before, the engine's budget leaves it out and the cache is sized as if it were not there)."""
    if Part.LM_HEAD not in without and runs_v2_runner(profile, full) and profile.persistent_buffers_counted:
        return v2_penalty_buffer_bytes(max_num_seqs=k.max_seqs, vocab_size=full.vocab_size)
    return 0


def _start_notes(
    model: ModelSpec,
    full: ModelSpec,
    s: EngineSettings,
    profile: EngineProfile,
    mem: _StageMemory,
    *,
    scheme: WeightScheme,
    version: str,
) -> list[str]:
    """What a start-up holds that its budget does not say: the RoPE cache, the drafter, the compile cache, the
    checkpoint's precision as loaded, and whether a public log of the release was checked."""
    notes = []
    if mem.weights.buffer_bytes >= _ROPE_NOTE_BYTES:
        notes.append(
            f"{engine_title(profile.engine)}'s RoPE cos/sin cache takes {mem.weights.buffer_bytes / GiB:.2f} GiB per "
            f"GPU (in the weights): it covers the model's {rope_cache_positions(full):,} positions whatever "
            "max_model_len is"
        )
    if mem.drafter is not None:
        assert s.speculative is not None
        notes.extend(_drafter_notes(mem.drafter, acceptance(s.speculative, mem.drafter.num_speculative_tokens)))
    if profile.compile_cache_note and not s.enforce_eager:
        notes.append(profile.compile_cache_note)
    if model.quantization is None and (as_checkpoint := checkpoint_note(scheme, engine=s.engine, version=version)):
        notes.append(as_checkpoint)
    if unchecked := unchecked_note(s.engine.value, version):
        notes.append(unchecked)
    return notes


def _no_room_problem(
    full: ModelSpec, s: EngineSettings, mem: _StageMemory, budget: _Budget, *, scheme: WeightScheme
) -> str:
    """Nothing is left for the cache: what the rest needs, and the nearest change that leaves room."""
    graphs = mem.graph_bytes if mem.graphs_counted else 0
    runtime = (
        max(mem.activation_bytes, budget.transient) + budget.margin + budget.context + mem.non_torch_bytes + graphs
    )
    need = (mem.loaded_bytes + runtime) / GiB
    hint = _memory_hint(
        full,
        s.tensor_parallel_size,
        scheme,
        budget.requested,
        runtime,
        buffer=mem.weights.buffer_bytes,
        engine=s.engine,
    )
    return (
        f"no memory left for the KV cache: weights + activations + runtime need {need:.2f} GiB per GPU, "
        f"{budget.requested / GiB:.2f} GiB available; {hint}"
    )


@dataclass(frozen=True, kw_only=True)
class _Blocks:
    """The cache cut into the engine's blocks, and what they hold."""

    kv_bytes: int  # scaled to a measured cache where one is given
    num_blocks: int
    concurrency: float  # requests of max_model_len the blocks hold
    per_request: int  # blocks one request of max_model_len needs
    tokens: int  # as the engine reports them
    fits_len: int  # the longest request the blocks hold
    notes: tuple[str, ...]


def _blocks(
    model: ModelSpec,
    full: ModelSpec,
    s: EngineSettings,
    profile: EngineProfile,
    mem: _StageMemory,
    *,
    kv_bytes: int,
    measured_kv_cache_tokens: int | None,
) -> _Blocks:
    """The stage's pool as the release groups it, its blocks, and a measured cache's scale where one is given."""
    k = mem.knobs
    pool, notes = _stage_pool(model, profile, mem)
    in_flight = in_flight_batches(profile, full, pipeline_parallel_size=s.pipeline_parallel_size)
    per_request = _request_blocks(
        pool, k.max_len, block_size=k.block, max_num_batched_tokens=k.batched, in_flight_batches=in_flight
    )

    def blocks_for(kv_bytes: int) -> tuple[int, float]:
        num_blocks = kv_bytes // (pool.page_bytes * pool.group_size)
        return num_blocks, num_blocks / per_request if per_request else 0.0

    num_blocks, concurrency = blocks_for(kv_bytes)
    if measured_kv_cache_tokens is not None and kv_bytes > 0:
        predicted = _tokens(pool, num_blocks=num_blocks, concurrency=concurrency, k=k, profile=profile)
        if predicted > 0:
            kv_bytes = int(kv_bytes * measured_kv_cache_tokens / predicted)
            num_blocks, concurrency = blocks_for(kv_bytes)
            notes.append(
                f"KV cache as measured: {measured_kv_cache_tokens:,} tokens per replica (this model predicts "
                f"{predicted:,})"
            )
    fits_len = _longest_request(
        pool,
        num_blocks=num_blocks,
        block_size=k.block,
        max_num_batched_tokens=k.batched,
        limit=k.max_len,
        in_flight_batches=in_flight,
    )
    return _Blocks(
        kv_bytes=kv_bytes,
        num_blocks=num_blocks,
        concurrency=concurrency,
        per_request=per_request,
        tokens=_tokens(pool, num_blocks=num_blocks, concurrency=concurrency, k=k, profile=profile),
        fits_len=fits_len,
        notes=tuple(notes),
    )


def _stage_pool(model: ModelSpec, profile: EngineProfile, mem: _StageMemory) -> tuple[_Pool, list[str]]:
    """The block pool this release builds from the stage's layers, and what it does with their kinds."""
    k, kv = mem.knobs, mem.kv
    hybrid = profile.hybrid_kv_cache
    pool = _pool(
        kv,
        block_size=k.block,
        hybrid=hybrid,
        group_ratio=profile.hybrid_group_ratio,
        state_pages=mem.state_pages,
        chunked_local=profile.hybrid_chunked_local,
    )
    notes = []
    if model.is_hybrid and not hybrid:
        notes.append("this engine version gives sliding-window layers the full context (no hybrid allocator)")
    elif hybrid and not profile.hybrid_chunked_local and any(g.attention is AttentionKind.CHUNKED for g in kv.groups):
        notes.append("this engine version gives chunked local attention layers the full context (no chunk spec)")
    if kv.state is not None:
        notes.append(
            f"{kv.state.num_layers} {kv.state.kind.value} layers hold {kv.state.bytes_per_layer:,} bytes of state per "
            f"sequence each, padded to a {pool.page_bytes:,}-byte page of {k.block} attention tokens; "
            f"{mem.state_pages} page(s) per request (mamba_cache_mode {'align' if mem.state_pages > 1 else 'none'})"
        )
    return pool, notes


def _too_short_problem(k: _Knobs, blocks: _Blocks, *, extensible: bool) -> str:
    """One request of max_model_len does not fit the blocks."""
    return (
        f"one request of max_model_len {k.max_len} needs {blocks.per_request} KV blocks but only {blocks.num_blocks} "
        f"fit; the largest max_model_len that fits is {blocks.fits_len} (lower max_model_len, use kv_cache_dtype fp8, "
        + (
            "or spread the model over more GPUs)"
            if extensible and k.util == 1.0
            else "or raise gpu_memory_utilization)"
        )
    )


def _stage_record(
    model: ModelSpec,
    full: ModelSpec,
    s: EngineSettings,
    profile: EngineProfile,
    *,
    version: str,
    gpu_memory_bytes: int,
    mem: _StageMemory,
    budget: _Budget,
    blocks: _Blocks,
    problems: tuple[str, ...],
    notes: tuple[str, ...],
) -> Capacity:
    """The stage's figures as ``capacity()`` reports them."""
    k, kv = mem.knobs, mem.kv
    overrides = config_overrides(model)
    return Capacity(
        model_id=full.model_id,
        engine=s.engine,
        engine_version=version,
        profile=profile,
        tensor_parallel_size=s.tensor_parallel_size,
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=k.util,
        requested_bytes=budget.requested,
        weights=mem.weights,
        activation_peak_bytes=mem.activation_bytes,
        non_torch_bytes=mem.non_torch_bytes,
        cuda_graph_bytes=mem.graph_bytes,
        cuda_graph_counted=mem.graphs_counted,
        kv_cache_bytes_per_gpu=blocks.kv_bytes,
        kv=kv,
        block_size=k.block,
        num_blocks=blocks.num_blocks,
        kv_cache_tokens=blocks.tokens,
        max_model_len=k.max_len,
        max_num_seqs=k.max_seqs,
        max_num_batched_tokens=k.batched,
        blocks_per_max_len_request=blocks.per_request,
        max_concurrency=blocks.concurrency,
        max_model_len_that_fits=blocks.fits_len,
        state_pages_per_request=mem.state_pages if kv.state is not None else 0,
        prefix_caching=prefix_caching(full, s),
        encoder=mem.encoder,
        max_model_len_limit=k.limit.max_len_tokens,
        max_model_len_source=k.limit.source,
        hf_overrides=None if overrides is None else json.dumps(overrides, sort_keys=True),
        problems=problems,
        notes=notes,
        drafter=mem.drafter,
        extensible_kv_cache=budget.extensible,
        runner_buffer_bytes=mem.runner_buffer_bytes,
        cuda_context_bytes=budget.context,
        kv_margin_bytes=budget.margin,
        transient_bytes=budget.transient,
        gpu_memory_utilization_given=s.gpu_memory_utilization is not None,
    )


def _first_release(engine: str, flag: str) -> str:
    """The engine's first release whose profile row sets ``flag``, as text."""
    return ".".join(map(str, next(p.since for p in engine_capacity(engine).profiles if getattr(p, flag))))


# The model dtype vLLM resolves from a checkpoint's config ("auto"): float16 and bfloat16 stay as they are; float32
# becomes bfloat16 or float16 by device (vllm/config/model.py _resolve_auto_dtype), which is not checked here.
_HALF_DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _check_kv_dtype(model: ModelSpec, s: EngineSettings, profile: EngineProfile) -> None:
    """vLLM 0.33 on refuses a bfloat16/float16 kv_cache_dtype that differs from the model dtype
    (vllm/config/vllm.py VllmConfig._reject_mismatched_float_kv_cache): 'kv_cache_dtype="bfloat16" is incompatible
    with dtype="float16"'."""
    if not profile.kv_dtype_must_match_model or s.kv_cache_dtype not in (KvDtype.BF16, KvDtype.FP16):
        return
    cast = weight_scheme(s.quantization).name if s.quantization is not None else None
    model_dtype = _HALF_DTYPES.get(cast or "") or _HALF_DTYPES.get(model.torch_dtype.lower())
    kv = _HALF_DTYPES[s.kv_cache_dtype.value]
    if model_dtype is not None and model_dtype != kv:
        since = f"{engine_title(profile.engine)} {_first_release(profile.engine, 'kv_dtype_must_match_model')}"
        raise SizingError(
            f"{since} and later refuse a {kv} KV cache for a {model_dtype} model (kv_cache_dtype must equal the model "
            f"dtype); use kv_cache_dtype auto (the model's {model_dtype}) or fp8",
            field="kv_cache_dtype",
        )


def _drafter(
    model: ModelSpec, s: EngineSettings, k: _Knobs, profile: EngineProfile, *, tp: int, scheme: WeightScheme
) -> Drafter | None:
    if s.speculative is None:
        return None
    d = resolve_drafter(
        model,
        s.speculative,
        tp=tp,
        kv_dtype=s.kv_cache_dtype,
        target_scheme=scheme,
        max_num_batched_tokens=k.batched,
        engine=s.engine,
    )
    if engine_traits(profile.engine).refuses_batch_within_draft_slots and k.batched <= d.new_slots_for_drafting:
        # config/vllm.py _set_max_num_scheduled_tokens: "not enough slots to schedule a token"
        raise SizingError(
            f"{k.batched} leaves no token per step beside the draft model's {d.new_slots_for_drafting} slot; "
            f"use at least {d.new_slots_for_drafting + 1}",
            field="max_num_batched_tokens",
        )
    return d


def _drafter_notes(d: Drafter, tau: Acceptance) -> list[str]:
    shared = f", reading the target's {' and '.join(d.shares)}" if d.shares else ""
    out = [
        f"speculative {d.method.value}, {d.num_speculative_tokens} tokens: drafter weights "
        f"{d.weights_bytes_per_gpu / GiB:.2f} GiB per GPU{shared}; {d.layers} drafter KV layer(s) "
        f"({d.kv_bytes_per_token_per_gpu:,} B per token) share the target's blocks",
    ]
    if d.extra_slots_per_request:
        out.append(
            f"a decoding request holds {d.extra_slots_per_request} slots past its next token (drafts and "
            "lookahead), capped at max_model_len"
        )
    # What the speed model (kvfleet.sizing.perf) does with it, so that a plan's speed is not read as speculation-free.
    k = d.num_speculative_tokens
    passes = f"the drafter's {k} passes and " if d.model is not None else "n-gram lookups (no GPU pass) and "
    out.append(
        f"speed: a step is {passes}one target pass verifying {k + 1} tokens per sequence, crediting "
        f"{tau.tokens_per_step:g} tokens per step ({tau.source})"
    )
    return [*out, *d.notes]


def _longest_request(
    pool: _Pool,
    *,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    limit: int,
    in_flight_batches: int = 1,
) -> int:
    """Largest max_model_len (multiple of block_size, at most ``limit``) whose one request fits."""

    def blocks(length: int) -> int:
        return _request_blocks(
            pool,
            length,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            in_flight_batches=in_flight_batches,
        )

    if blocks(limit) <= num_blocks:
        return limit
    lo, hi = 0, limit  # blocks() is monotone in length: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks(mid) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo // block_size * block_size


def _request_blocks(
    pool: _Pool, length: int, *, block_size: int, max_num_batched_tokens: int, in_flight_batches: int
) -> int:
    """Blocks one request of ``length`` tokens holds in every group of the pool."""
    return sum(
        _blocks_per_request(
            kind,
            window,
            max_model_len=length,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            in_flight_batches=in_flight_batches,
            state_pages=pool.state_pages,
        )
        for kind, window in pool.groups
    )
