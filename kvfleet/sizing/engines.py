"""How an engine turns GPU memory into a KV cache: the estimates every engine's release rows are read with.

Each engine's rules are data in its own folder (kvfleet/engines/<name>/profiles.py: release rows, the rules every
release keeps, RoPE length rules, scheduler defaults), reached through the engine registry; this module answers
from them (``engine_profile``, ``engine_traits``, ``rope_rules``, ``batch_defaults``) and holds what they feed. The
two engines modelled today:

vLLM (vllm/v1/worker/gpu_worker.py ``determine_available_memory``)::

    requested      = total_gpu_memory x gpu_memory_utilization
    non_kv         = weights + peak activations (profiling run) + non-torch increase
                     (+ CUDA-graph memory, from the releases that count it before sizing the cache)
    kv_cache_bytes = requested - non_kv            (or --kv-cache-memory-bytes, which skips profiling)

TensorRT-LLM (PyTorch backend, KvCacheConfig)::

    kv_cache_tokens = (total - used after the profiling run) x free_gpu_memory_fraction // bytes per token,
                      capped by max_tokens when it is set, then rounded up to whole tokens_per_block blocks

Peak activations come from a forward pass over ``max_num_batched_tokens`` tokens followed by a
sampler pass over rows of logits: ``max_num_seqs`` rows in vLLM's dummy sampler run, one row per dummy
context request in TensorRT-LLM's profiling run (``context_profiling_requests``). The estimate, per GPU,
in activation-dtype bytes ``a`` (2 for bf16/fp16)::

    forward  = N x [ R x h  +  max( 3 x I/tp  (gate_up + act, MLP or shared expert),
                                    k x (max(2 I_e/tp, h) + I_e/tp)  (fused-MoE caches),
                                    (2 x q + 2 x kv) heads x d / tp  (qkv + attention out) ) ] x a
    sampler  = S x V x b               logits and the dummy sampler's top-k/top-p buffers
    peak     = max(forward, sampler) + workspace

with N = max_num_batched_tokens, S = min(sampled rows, N), h hidden, I intermediate, I_e expert
intermediate, k experts per token, V vocab (logits are gathered to the full vocabulary on every
rank), R the residual-stream copies alive at once, b the bytes the dummy sampler run holds per logit.
b depends on the release (``EngineProfile.sort_sampler``): up to 0.16 the profiling run's top-k/top-p mask
sorts the whole vocabulary (vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p_pytorch: sorted fp32
values, int64 indices, softmax, cumsum and masks beside the bf16 and fp32 logits; before 0.11.1 FlashInfer's
sampler ran instead where flashinfer was installed, an optional extra of the wheel then). From 0.17 no release
sorts: a Triton kernel masks in place (topk_topp_triton.py, vLLM PR 33538), FlashInfer's sampler is the CUDA
default from 0.21; the V1 runner keeps the bf16 and fp32 logits, the probabilities and the noise. Model Runner V2
(the default for dense models from 0.26, for every model it supports from 0.29; ``runs_v2_runner``) samples its
dummy requests on the bf16 logits in place (vllm/v1/worker/gpu/sample/sampler.py) until 0.33 adds a pass with the
full warm-up parameters; beside it sits a penalty state of max_num_seqs x vocabulary int32, which the budget counts
from 0.27 (``v2_penalty_buffer_bytes``), and before 0.29 it gives no CUDA-graph estimate (``cuda_graphs_counted``).
data/vllm_release_markers.json records each of these releases. The constants live in ``ActivationModel``; the
V1 sorting path's is fitted on the FIT records of tests/sizing/data/engine_logs.json (tools/fit_engine_logs.py),
the others are read from the source, and all are held to the CHECK records in
tests/sizing/test_engine_log_calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet import engines as registry
from kvfleet import versions
from kvfleet.engines import ENGINES
from kvfleet.engines.capacity import BatchDefaults, EngineCapacity, EngineProfile, EngineTraits, RopeLengthRules
from kvfleet.errors import SizingError
from kvfleet.sizing.models import ModelSpec
from kvfleet.sizing.units import GiB, MiB, cdiv
from kvfleet.versions import Version

# A registered engine's name (kvfleet.engines.ENGINE_MODULES), as the sizing core's settings name it.
EngineName = registry.EngineName


def parse_version(text: str, *, field: str = "engine_version") -> Version:
    try:
        return versions.parse_version(text)
    except ValueError as err:
        raise SizingError(str(err), field=field) from None


def engine_capacity(engine: str) -> EngineCapacity:
    """The engine's capacity rules, from its adapter (kvfleet/engines/<name>/profiles.py)."""
    return ENGINES[engine].capacity


def engine_traits(engine: str) -> EngineTraits:
    """The rules every release of the engine keeps."""
    return engine_capacity(engine).traits


def engine_title(engine: str) -> str:
    """The engine's name for people ("vLLM")."""
    return ENGINES[engine].title


def default_version(engine: str) -> str:
    """The newest release of the engine modelled; deployments pin their own."""
    return engine_capacity(engine).default_version


def engine_profile(engine: str, version: str | None = None) -> EngineProfile:
    table = engine_capacity(engine).profiles
    v = parse_version(version or default_version(engine))
    rows = [p for p in table if p.since <= v]
    if not rows:
        oldest = ".".join(map(str, table[0].since))
        raise SizingError(
            f"{engine} {version} is older than the oldest modelled release {oldest}", field="engine_version"
        )
    return rows[-1]


def context_profiling_requests(*, max_num_tokens: int, max_seq_len: int) -> int:
    """Dummy context requests a profiling run of ``max_num_tokens`` holds (``EngineTraits.context_profiling_requests``;
    TensorRT-LLM's KvCacheCreator._create_dummy_context_requests: max_num_tokens split into requests of
    min(max_num_tokens, max_seq_len - 1) tokens); each samples one row."""
    per_request = max(1, min(max_num_tokens, max_seq_len - 1))
    return -(-max_num_tokens // per_request)


def rope_rules(engine: str, version: str | None = None) -> RopeLengthRules:
    table = engine_capacity(engine).rope_rules
    v = parse_version(version or default_version(engine))
    rows = [r for r in table if r.since <= v] or [table[0]]
    return rows[-1].rules


def batch_defaults(engine: str, version: str | None, *, gpu_memory_bytes: int, accelerator_name: str) -> BatchDefaults:
    """The scheduler defaults the release gives this device: by CUDA's total memory and its name (vLLM: H100/H200
    before 0.8.5, A100s excluded after; TensorRT-LLM: the same on every device)."""
    table = engine_capacity(engine).batch_defaults
    v = parse_version(version or default_version(engine))
    rows = [r for r in table if r.since <= v] or [table[0]]
    name = accelerator_name.lower()
    tiers = rows[-1].tiers
    return next((t for t in tiers if t.admits(gpu_memory_bytes, name)), tiers[-1])


def in_flight_batches(profile: EngineProfile, model: ModelSpec, *, pipeline_parallel_size: int) -> int:
    """VllmConfig.max_concurrent_batches, the batches a sliding-window layer holds beyond its window: under async
    scheduling (the default) pp + 1 where Model Runner V2 runs, 2 (pp 1) or pp (the V1 runner, which vLLM
    0.26-0.32 run without async scheduling under pipeline parallelism); vllm/config/vllm.py, read in 0.26.0,
    0.28.0, 0.29.0 and 0.32.0 (0.34.0: pp + 1 always, the V1 runner gone)."""
    pp = pipeline_parallel_size
    if profile.sliding_in_flight_batches < 2 or pp <= 1:
        return profile.sliding_in_flight_batches
    return pp + 1 if runs_v2_runner(profile, model) else pp


def runs_v2_runner(profile: EngineProfile, model: ModelSpec) -> bool:
    """Whether vLLM runs this model on Model Runner V2 by default (VllmConfig.use_v2_model_runner): from 0.26 a
    listed architecture or a model that is neither MoE nor a hybrid state model, from 0.29 every model."""
    listed = not profile.v2_runner_architectures.isdisjoint(model.architectures)
    plain = model.moe is None and model.state is None  # vLLM's is_moe, is_hybrid
    return profile.v2_runner == "all" or (profile.v2_runner == "dense" and (listed or plain))


def v2_penalty_buffer_bytes(*, max_num_seqs: int, vocab_size: int) -> int:
    """Model Runner V2's PenaltiesState (vllm/v1/worker/gpu/sample/penalties.py, 0.26.0-0.34.0), allocated with the
    sampler on the last pipeline rank after the weights load: output_bin_counts, int32 [max_num_reqs, vocab] ("can
    be very large, taking up GBs of GPU memory"), and prompt_bin_mask, int32 [max_num_reqs, cdiv(vocab, 32)]."""
    return max_num_seqs * (vocab_size + cdiv(vocab_size, 32)) * 4


def cuda_graphs_counted(profile: EngineProfile, model: ModelSpec, *, enforce_eager: bool) -> bool:
    """Whether the release subtracts CUDA-graph memory before sizing the cache for this model: the V1 runner from
    0.20, Model Runner V2 from 0.29 (it returned no estimate before), the extensible cache always (it measures)."""
    if enforce_eager:
        return False
    if profile.extensible_kv_cache:
        return True
    if runs_v2_runner(profile, model):
        return profile.counts_cuda_graphs and profile.v2_counts_cuda_graphs
    return profile.counts_cuda_graphs


def sampler_bytes_per_logit(
    profile: EngineProfile, model: ModelSpec, constants: ActivationModel | None = None
) -> float:
    """Bytes per logit the profiling run's sampler holds on the path this release takes for this model (the sorting
    path's constant is ``sampler_sort_bytes_per_logit``, chosen by ``sort_sampler``)."""
    c = constants or ACTIVATIONS
    base = c.v2_sampler_bytes_per_logit if runs_v2_runner(profile, model) else c.sampler_bytes_per_logit
    return base + profile.sampler_extra_bytes_per_logit


@dataclass(frozen=True, kw_only=True)
class ActivationModel:
    """Constants of the activation-peak estimate (see the module docstring).

    The forward slope of ~110 KB per batched token for Llama-3.1-8B (vllm issue 10517: 2.07 GiB at
    20,000 tokens, 2.99 GiB at 29,000) gives 3 residual-stream copies. The sampler's bytes per logit
    are fitted by tools/fit_engine_logs.py on the FIT records of tests/sizing/data/engine_logs.json
    whose peak is the sampler's (one constant per sampler path); the records say which.
    """

    residual_copies: float = 3.0
    # Releases that sort the vocabulary for top-k/top-p (EngineProfile.sort_sampler): bf16 logits (2 B),
    # fp32 logits (4), sorted values (4), int64 sort indices (8), softmax (4), cumsum (4), masks and the
    # scattered result. Fitted 38.0 B: 39.2, 36.9 and 38.2 B on the FIT records vllm PR 10511 (V0), the L40S
    # Qwen3-235B log (0.10.2) and vllm issue 23278 (gpt-oss-120b on an H100, 0.10.1, 1,024 rows).
    sampler_sort_bytes_per_logit: float = 38.0
    # The V1 runner without the sort (0.17 on; from 0.26 only for the models Model Runner V2 does not run): the
    # source's own tensors, bf16 and fp32 logits, probabilities and the exponential noise (vllm/v1/sample/sampler.py,
    # ops/topk_topp_sampler.py), 2 + 4 + 4 + 4 B. No FIT record of this path bounds the sampler
    # (tools/fit_engine_logs.py reports it); the CHECK record of vLLM PR 51590 (0.28.0, gpt-oss-120b) holds it.
    sampler_bytes_per_logit: float = 14.0
    # Model Runner V2's profile run (vllm/v1/worker/gpu/sample/sampler.py, read in 0.26.0 and 0.32.0): its dummy
    # requests need no logits processing, so the sampler works on the bf16 logits in place and draws Gumbel noise a
    # 1,024-column block at a time: the logits' 2 B. Read from the source, not fitted: the warm-boot logs of 0.27.1
    # (peak activation 0.19 GiB for Qwen3-8B, 0.08 GiB for Qwen2.5-0.5B) leave no room for more; a first boot
    # without vLLM's compile cache charges the compiler's temporaries to the same peak (1.18 GiB for that Qwen3-8B
    # run), which is what the older FIT record's 27 B per logit most likely measured (tools/fit_engine_logs.py).
    v2_sampler_bytes_per_logit: float = 2.0
    workspace_bytes: int = 64 * MiB  # cuBLAS / attention workspaces alive at the peak
    # Allocations outside PyTorch made during profiling (vLLM's "non-torch increase"): 0.06 GiB on one
    # GPU (Qwen2.5-7B-AWQ log), 0.17-0.21 GiB per rank at TP8 (Qwen3-235B-FP8 on L40S log).
    non_torch_tp1_bytes: int = 96 * MiB
    non_torch_per_extra_rank_bytes: int = 16 * MiB
    # CUDA-graph pools (vLLM "Graph capturing finished ... took X GiB"): 0.48 GiB for a 28-layer 7B,
    # 0.72 GiB for a 40-layer model, 3.45 GiB for 94-layer Qwen3-235B MoE at TP8.
    cuda_graph_base_bytes: int = 100 * MiB
    cuda_graph_per_layer_bytes: int = 14 * MiB
    cuda_graph_moe_factor: float = 2.5
    # What the CUDA context takes before the engine measures anything. TRT-LLM counts everything outside torch
    # (CUDA context, NCCL, graphs) as used, and vLLM's extensible cache measures free memory, so both lose it; the
    # context alone is ~0.5 GiB (TensorRT-LLM PR 15985: a stray 550 MiB context cut the cache by as much).
    # vLLM's estimate-based sizing leaves it in the 1 - utilization headroom.
    cuda_context_bytes: int = 512 * MiB


# vllm/v1/worker/extensible_kv_cache.py (0.34.0) on CUDA: KV_CACHE_MARGIN_FLOOR_BYTES, KV_CACHE_MARGIN_FRACTION.
EXTENSIBLE_MARGIN_FLOOR_BYTES = 1 * GiB
EXTENSIBLE_MARGIN_FRACTION = 0.75
# vllm/v1/worker/gpu/sample/prompt_logprob.py CHUNK_SIZE: prompt logprobs are computed 1,024 rows of logits at once.
PROMPT_LOGPROBS_CHUNK_ROWS = 1024


@dataclass(frozen=True, kw_only=True)
class ExtensibleBudget:
    """vLLM's post-warm-up sizing of the extensible KV cache on one GPU (measure_kv_cache_bytes, 0.34.0)."""

    kv_bytes: int
    transient_bytes: int  # max(transient peak, torch reservation growth), kept free in full
    margin_bytes: int  # max(1 GiB, 0.75 x transient), kept free below the device's headroom
    capped_by_utilization: bool  # an explicit gpu_memory_utilization, not the device, binds
    withheld_bytes: int  # what an explicit utilization keeps out of the cache (vLLM warns from 1 GiB)


def extensible_kv_bytes(
    *,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    used_bytes: int,
    transient_bytes: int,
    constants: ActivationModel | None = None,
) -> ExtensibleBudget:
    """measure_kv_cache_bytes with what kvfleet predicts in place of what vLLM measures after warm-up::

        non_kv_used = used_bytes                    (weights, CUDA-graph pools, non-torch, buffers: resident)
        headroom    = total - CUDA context - used_bytes            (free memory, the torch cache emptied)
        margin      = max(1 GiB, 0.75 x T)
        kv          = min(utilization x total - used_bytes, headroom - margin) - T

    T: the transient peak (the profile run's activation peak, or the sizing warm-up step's where larger); torch's
    reservation growth over the same step is taken as no larger. At utilization 1.0 (the default) the device's
    headroom binds; an explicit value binds once it withholds more than the margin and the CUDA context."""
    c = constants or ACTIVATIONS
    margin = max(EXTENSIBLE_MARGIN_FLOOR_BYTES, int(transient_bytes * EXTENSIBLE_MARGIN_FRACTION))
    by_budget = int(gpu_memory_bytes * gpu_memory_utilization) - used_bytes
    by_device = gpu_memory_bytes - c.cuda_context_bytes - used_bytes - margin
    return ExtensibleBudget(
        kv_bytes=min(by_budget, by_device) - transient_bytes,
        transient_bytes=transient_bytes,
        margin_bytes=margin,
        capped_by_utilization=by_budget < by_device,
        withheld_bytes=max(0, by_device - by_budget),
    )


def sizing_step_transient_bytes(
    model: ModelSpec,
    *,
    max_num_batched_tokens: int,
    max_model_len: int,
    constants: ActivationModel | None = None,
    activation_bytes: int = 2,
) -> int:
    """The allocated transient of the extensible cache's sizing step that the profile run does not have: the step
    requests prompt logprobs (max_logprobs 20 by default) on one prompt of min(max_num_batched_tokens,
    max_model_len) tokens (vllm/v1/worker/gpu/warmup.py run_kv_cache_sizing_warmup, 0.34.0), so after the forward
    its hidden states stay while one chunk of full-vocabulary logits is computed (prompt_logprob.py: 1,024 rows,
    the model dtype); the forward itself (with attention) is the profile run's."""
    c = constants or ACTIVATIONS
    prompt = min(max_num_batched_tokens, max_model_len)
    rows = min(PROMPT_LOGPROBS_CHUNK_ROWS, prompt)
    hidden = max_num_batched_tokens * model.hidden_size * activation_bytes
    return hidden + rows * model.vocab_size * activation_bytes + c.workspace_bytes


ACTIVATIONS = ActivationModel()


def activation_peak_bytes(
    model: ModelSpec,
    *,
    tp: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    constants: ActivationModel = ACTIVATIONS,
    activation_bytes: int = 2,
    sort_sampler: bool = False,
) -> int:
    n = max_num_batched_tokens
    a = activation_bytes
    h = model.hidden_size
    heads_dim = model.num_attention_heads * model.head_dim
    kv_dim = max(1, model.num_kv_heads // tp) * model.head_dim
    attn = (2 * heads_dim // tp + 2 * kv_dim) if model.mla is None else 3 * heads_dim // tp
    mlp = 3 * model.intermediate_size // tp
    if model.moe is not None:
        e = model.moe
        # fused_moe's intermediate caches: max(2 I_e/tp, h) shared by caches 1 and 3, plus I_e/tp.
        inter = e.expert_intermediate_size // tp
        moe = e.experts_per_token * (max(2 * inter, h) + inter)
        shared = 3 * e.shared_expert_intermediate_size // tp
        mlp = max(moe + shared, mlp if any(not lay.moe for lay in model.layers) else 0)
    forward = n * (constants.residual_copies * h + max(attn, mlp)) * a
    rows = min(max_num_seqs, n)
    per_logit = constants.sampler_sort_bytes_per_logit if sort_sampler else constants.sampler_bytes_per_logit
    sampler = rows * model.vocab_size * per_logit
    return int(max(forward, sampler)) + constants.workspace_bytes


def non_torch_bytes(*, tp: int, constants: ActivationModel = ACTIVATIONS) -> int:
    return constants.non_torch_tp1_bytes + (tp - 1) * constants.non_torch_per_extra_rank_bytes


def cuda_graph_bytes(model: ModelSpec, *, constants: ActivationModel = ACTIVATIONS) -> int:
    factor = constants.cuda_graph_moe_factor if model.moe is not None else 1.0
    return constants.cuda_graph_base_bytes + int(model.num_layers * constants.cuda_graph_per_layer_bytes * factor)


# ---- multimodal start-up profiling (vLLM) ---------------------------------------------------------------
# vLLM 0.32.0: gpu_model_runner.profile_run runs the vision encoder over a dummy batch before the language model's
# dummy forward, and keeps its outputs in the encoder cache while that forward runs, so both land in the profiled
# activation peak. vllm/multimodal/encoder_budget.py MultiModalBudget and vllm/v1/core/encoder_cache_manager.py
# compute_mm_encoder_budget size the batch:
#   budget          = max(max_num_batched_tokens, largest item's tokens)   (encoder compute budget = cache size)
#   items per batch = max(1, min(budget // item tokens, max_num_seqs x max(1, min(limit, max_model_len // item))))
# profiled with the modality whose item has the most tokens; a modality limited to 0 (--limit-mm-per-prompt) is
# not profiled, and with every modality at 0 the tower is not even built (interfaces.py _mark_tower_model).
MM_DEFAULT_LIMIT = 999  # vllm/config/multimodal.py get_limit_per_prompt: an unspecified modality
QWEN_VL_MAX_FRAMES_PER_VIDEO = 14  # vllm/model_executor/models/qwen2_vl.py _MAX_FRAMES_PER_VIDEO
MM_ENCODER_TP_DATA_KINDS = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llama4"})


@dataclass(frozen=True, kw_only=True)
class EncoderProfile:
    """What vLLM's start-up profiling runs through the vision encoder, and the memory that costs one GPU."""

    modality: str
    tokens_per_item: int
    items: int
    budget_tokens: int  # "Encoder cache will be initialized with a budget of N tokens"
    data_parallel: bool  # --mm-encoder-tp-mode data (or vision heads TP cannot split): ranks split the items
    encoder_activation_bytes: int  # the encoder's forward over its share of the dummy batch
    encoder_output_bytes: int  # its outputs, held in the encoder cache through the language model's dummy run
    buffer_bytes: int = 0  # persistent input buffers of the tower's outputs (Qwen3-VL's deepstack levels)


def qwen_vl_video_tokens(frame_tokens: int, max_model_len: int) -> int:
    """Tokens of vLLM's dummy video for one video per prompt (qwen2_vl.py get_max_video_tokens): the most frames
    whose tokens fit max_model_len, at most 14, two frames to a temporal patch."""

    def tokens(frames: int) -> int:
        padded = frames + (-frames % 2)
        return max(padded // 2, 1) * frame_tokens

    frames = 1
    while frames < QWEN_VL_MAX_FRAMES_PER_VIDEO and tokens(frames + 1) <= max_model_len:
        frames += 1
    return tokens(frames)


def encoder_profile(
    model: ModelSpec,
    *,
    tp: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    limits: dict[str, int],
    encoder_tp_mode: str = "weights",
    max_pixels: int | None = None,
    constants: ActivationModel = ACTIVATIONS,
    activation_bytes: int = 2,
) -> EncoderProfile | None:
    """None where nothing is profiled: a text-only model, or every modality limited to 0. ``max_pixels``: the
    processor's (--mm-processor-kwargs), which sizes Qwen-VL's dummy image and video frames."""
    v = model.vision
    if v is None:
        return None
    image_tokens = v.image_tokens_at(max_pixels)
    per_item: dict[str, int] = {}
    if limits.get("image", MM_DEFAULT_LIMIT) > 0:
        per_item["image"] = image_tokens
    if limits.get("video", MM_DEFAULT_LIMIT) > 0:
        if v.video_frame_tokens:
            per_item["video"] = qwen_vl_video_tokens(image_tokens, max_model_len)
        elif v.video_tokens:
            per_item["video"] = v.video_tokens
    if not per_item:
        return None
    modality, t = max(per_item.items(), key=lambda kv: (kv[1], kv[0]))
    budget = max(max_num_batched_tokens, t)
    per_prompt = max(1, min(limits.get(modality, MM_DEFAULT_LIMIT), max_model_len // t))
    items = max(1, min(budget // t, max_num_seqs * per_prompt))
    # --mm-encoder-tp-mode data replicates the tower on every rank, for the towers that declare it
    # (supports_encoder_tp_data in qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py, mllama4.py; qwen3_vl_moe.py inherits it
    # with Qwen3-VL's tower, kind qwen3_vl); vllm/config/model.py falls back to weights for the others.
    data_parallel = encoder_tp_mode == "data" and v.kind in MM_ENCODER_TP_DATA_KINDS and tp > 1
    shards = 1 if data_parallel else tp
    rank_items = -(-items // tp) if data_parallel else items
    patches = rank_items * t * v.patches_per_token
    h = v.hidden_size
    mlp = (3 if v.gated_mlp else 2) * v.intermediate_size // shards
    attn = 4 * h // shards  # q, k, v and the attention output
    forward = int(patches * (constants.residual_copies * h + max(mlp, attn)) * activation_bytes)
    outputs = items * t * model.hidden_size * v.embeds_per_token * activation_bytes
    return EncoderProfile(
        modality=modality,
        tokens_per_item=t,
        items=items,
        budget_tokens=budget,
        data_parallel=data_parallel,
        encoder_activation_bytes=forward,
        encoder_output_bytes=outputs,
        # qwen3_vl.py: one max_num_batched_tokens x hidden buffer per deepstack level, allocated with the model.
        buffer_bytes=(v.embeds_per_token - 1) * max_num_batched_tokens * model.hidden_size * activation_bytes,
    )
