"""vLLM's capacity rules: what each release does with GPU memory, as kvfleet.sizing reads them.

The release rows (``VLLM_PROFILES``), the rules every release keeps (``TRAITS``), the RoPE length rules, the
scheduler defaults by device, the parallel layouts vLLM refuses and the weight precisions it loads (quantization.py),
each with the file and release it was read from. ``tools/vllm_release_markers.py`` reads the releases from PyPI,
``kvfleet/sizing/data/vllm_release_markers.json`` keeps what it read, and ``tests/sizing/test_release_markers.py``
holds every boundary here to it.
"""

from __future__ import annotations

from dataclasses import replace

from kvfleet.engines.capacity import (
    BatchDefaults,
    BatchDefaultsRule,
    EngineCapacity,
    EngineProfile,
    EngineTraits,
    LayoutRule,
    MemoryBudget,
    RopeLengthRules,
    RopeRules,
    releases,
)
from kvfleet.engines.vllm.quantization import QUANTIZATION
from kvfleet.engines.vocabulary import SpecMethod

_GIB = 1 << 30
# The newest release modelled; environment files pin their own up to it.
DEFAULT_VERSION = "0.34.0"

# vllm/config/vllm.py DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES in the 0.26.0 sdist: MoE architectures Model Runner V2
# runs by default although other MoE models stay on the V1 runner.
_V2_ARCHS_0_26 = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)


# Public pair (tests/sizing/data/engine_logs.json, coldstart-qwen3-8b-rtx4090-warm): vLLM 0.27.1, Qwen3-8B on an
# RTX 4090, the first boot compiling for 39 s printed 1.18 GiB of peak activation, the second 0.19 GiB. Noted from the
# first V1 row on.
_COMPILE_CACHE_NOTE = (
    "sized for a boot that finds vLLM's compile cache: a first boot without it charges torch.compile's "
    "temporaries to the activation peak and starts with a smaller cache (about 1 GiB less for an 8B model "
    "on vLLM 0.27.1). An EC2 warm pool's instances compile before they enter the pool; other new replicas "
    "boot cold, and their agent then admits by the smaller cache the engine reports. Persist VLLM_CACHE_ROOT "
    "across boots, or plan that much headroom"
)
# vllm/config/cache.py DEFAULT_GPU_MEMORY_UTILIZATION (0.34.0): the default where the extensible cache is off
# (--kv-cache-memory-bytes given, or a driver without virtual memory management).
_ESTIMATED_SIZING_UTILIZATION = 0.92

# Sources: vllm/v1/worker/gpu_worker.py determine_available_memory (three generations), vllm/v1/core/
# kv_cache_utils.py (grouping, num_blocks, _report_kv_cache_config), vllm/engine/arg_utils.py (scheduler defaults),
# vllm/config/cache.py (gpu_memory_utilization, block_size). Each row's release is the first whose own files show
# the change, read from the release's sdist (wheel for 0.15.x) on PyPI by tools/vllm_release_markers.py; the
# marker named in each note is in data/vllm_release_markers.json with the line read and the release before it,
# and tests/sizing/test_release_markers.py holds the rows to it.
VLLM_PROFILES: tuple[EngineProfile, ...] = releases(
    EngineProfile(
        engine="vllm",
        since=(0, 6, 0),
        gpu_memory_utilization=0.90,
        block_size=16,
        counts_cuda_graphs=False,
        hybrid_kv_cache=False,
        hybrid_chunked_local=False,
        mamba_state_cache=False,
        hybrid_group_ratio=1.0,
        hybrid_tokens_from_concurrency=False,
        sort_sampler=True,
        sliding_in_flight_batches=1,
        v2_runner="none",
        mamba_align_by_default=False,
        note="V0 engine: every layer holds max_model_len; CUDA graphs use the 1 - utilization headroom",
        schedules_whole_prompts=True,  # V0 without chunked prefill
    ),
    (
        (0, 8, 0),
        "V1 engine by default (vllm/envs.py VLLM_USE_V1; v1-engine-default)",
        {"schedules_whole_prompts": False, "compile_cache_note": _COMPILE_CACHE_NOTE},
    ),
    (
        (0, 9, 1),
        "hybrid KV-cache manager: sliding-window layers hold only their window, groups sized by the smallest layer "
        "count (vllm/v1/core/kv_cache_utils.py; hybrid-kv-cache-manager)",
        {"hybrid_kv_cache": True},
    ),
    (
        (0, 10, 0),
        "chunked local attention layers hold one chunk (vllm/v1/kv_cache_interface.py ChunkedLocalAttentionSpec; "
        "chunked-local-attention-spec)",
        {"hybrid_chunked_local": True},
    ),
    (
        (0, 10, 2),
        "V1 runs hybrid Mamba models by default, their state in the hybrid allocator (vllm/engine/arg_utils.py no "
        "longer falls back to V0; v1-mamba-by-default)",
        {"mamba_state_cache": True},
    ),
    (
        (0, 12, 0),
        "hybrid KV-cache grouping pads to the larger layer count below a 1.25 ratio (vllm/v1/core/"
        "kv_cache_utils.py; hybrid-group-ratio)",
        {"hybrid_group_ratio": 1.25},
    ),
    (
        (0, 17, 0),
        "top-k/top-p masked in place by a Triton kernel, no vocabulary sort while profiling (PR 33538; "
        "vllm/v1/sample/ops/topk_topp_sampler.py; triton-top-k-top-p)",
        {"sort_sampler": False},
    ),
    (
        (0, 18, 0),
        "hybrid KV-cache grouping pads to the larger layer count below a 1.5 ratio (hybrid-group-ratio-1.5)",
        {"hybrid_group_ratio": 1.5},
    ),
    (
        (0, 20, 0),
        "CUDA-graph memory is profiled and subtracted before the cache is sized (PR 30515), and "
        "gpu_memory_utilization defaults to 0.92 (vllm/envs.py, vllm/config/cache.py; the log line says 'default "
        "since v0.21.0', but 0.20.0 ships it; cuda-graph-memory-profiled, gpu-memory-utilization-0.92)",
        {"counts_cuda_graphs": True, "gpu_memory_utilization": 0.92},
    ),
    (
        (0, 20, 1),
        "hybrid models log max_concurrency x max_model_len tokens (vllm/v1/core/kv_cache_utils.py; "
        "kv-tokens-from-concurrency)",
        {"hybrid_tokens_from_concurrency": True},
    ),
    (
        (0, 26, 0),
        "sliding-window layers reserve two in-flight batches under async scheduling (vllm/config/vllm.py "
        "max_in_flight_tokens; sliding-window-in-flight-tokens); Model Runner V2 the default for dense models "
        "(vllm/config/vllm.py _is_default_v2_model_runner_model and its architecture list, 0.26.0)",
        {"sliding_in_flight_batches": 2, "v2_runner": "dense", "v2_runner_architectures": _V2_ARCHS_0_26},
    ),
    (
        (0, 27, 0),
        "the budget subtracts everything resident after profiling, buffers allocated after loading included "
        "(vllm/utils/mem_utils.py memory_profiling total_consumed; budget-counts-persistent-allocations)",
        {"persistent_buffers_counted": True},
    ),
    (
        (0, 28, 0),
        "hybrid Mamba models cache prefixes by default, in mamba_cache_mode align (vllm/engine/arg_utils.py, "
        "vllm/config/model.py is_prefix_caching_supported; hybrid-prefix-caching-by-default); Model Runner V2 "
        "lists two more architectures (vllm/config/vllm.py DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, 0.28.0)",
        # 0.27.1 already lists KimiK3ForConditionalGeneration (no catalog model); 0.27.x keeps the 0.26.0 list here.
        {
            "mamba_align_by_default": True,
            "v2_runner_architectures": _V2_ARCHS_0_26 | {"DeepseekV4ForCausalLM", "KimiK3ForConditionalGeneration"},
        },
    ),
    (
        (0, 29, 0),
        "Model Runner V2 the default for every generative model it supports (vllm/config/vllm.py "
        "use_v2_model_runner; v2-model-runner-default); it estimates CUDA-graph memory before sizing the cache "
        "(gpu/model_runner.py profile_cudagraph_memory; v2-cudagraph-estimate)",
        {"v2_runner": "all", "v2_counts_cuda_graphs": True},
    ),
    (
        (0, 33, 0),
        "Model Runner V2's profiling sampler runs the full warm-up parameters, top-k/top-p included (vllm/v1/"
        "worker/gpu/model_runner.py, SamplingParams.for_sampler_warmup; v2-profiling-sampler-full-params); a "
        "bfloat16/float16 kv_cache_dtype must equal the model dtype (vllm/config/vllm.py; kv-dtype-must-match-model)",
        {"sampler_extra_bytes_per_logit": 7.1, "kv_dtype_must_match_model": True},
    ),
    (
        (0, 34, 0),
        "extensible KV cache: sized after warm-up and CUDA-graph capture from measured free memory, "
        "gpu_memory_utilization unset (1.0) unless given (vllm/config/cache.py, vllm/v1/worker/extensible_kv_cache.py; "
        "extensible-kv-cache-default); 64-token blocks by default (vllm/config/cache.py DEFAULT_BLOCK_SIZE; "
        "default-block-size-64); the V1 runner removed",
        {
            "extensible_kv_cache": True,
            "gpu_memory_utilization": 1.0,
            "block_size": 64,
            "fixed_cache_gpu_memory_utilization": _ESTIMATED_SIZING_UTILIZATION,
        },
    ),
)

_VLLM_MODEL_PY = "vllm/config/model.py _get_and_verify_max_len"
_VLLM_MODEL_PY = "vllm/config/model.py _get_and_verify_max_len"
VLLM_ROPE_RULES: tuple[RopeRules, ...] = (
    RopeRules(
        since=(0, 6, 0),
        rules=RopeLengthRules(
            # `if rope_type not in ("su", "longrope", "llama3")`: factor x max_position_embeddings, but YaRN
            # resets the base to rope_scaling["original_max_position_embeddings"] first.
            no_factor_types=frozenset({"su", "longrope", "llama3"}),
            yarn_from_original=True,
            gemma3_exempt=True,
            longrope_default_original=False,
            source=f"{_VLLM_MODEL_PY} (vllm/config.py before 0.10)",
        ),
    ),
    RopeRules(
        # PR 27431: with no --max-model-len, LongRoPE models start at original_max_position_embeddings, where the
        # short factors hold. First in 0.11.1 (vllm/config/model.py; marker longrope-default-original-length).
        since=(0, 11, 1),
        rules=RopeLengthRules(
            no_factor_types=frozenset({"su", "longrope", "llama3"}),
            yarn_from_original=True,
            gemma3_exempt=True,
            longrope_default_original=True,
            source=f"{_VLLM_MODEL_PY} 0.11.1; PR 27431 (LongRoPE default length)",
        ),
    ),
    RopeRules(
        # PR 56446 aligned YaRN with transformers: max_position_embeddings is already the scaled length and
        # `factor` no longer lengthens it (YaRN variants join the list). First in 0.30.0 (vllm/config/model.py;
        # marker yarn-not-rescaled).
        since=(0, 30, 0),
        rules=RopeLengthRules(
            no_factor_types=frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}),
            yarn_from_original=False,
            gemma3_exempt=True,
            longrope_default_original=True,
            source=f"{_VLLM_MODEL_PY} 0.30.0; PR 56446 (YaRN no longer rescales)",
        ),
    ),
)

# 70 GiB: vLLM's threshold for its larger scheduler defaults (H100-class GPUs).
LARGE_GPU_BYTES = 70 * _GIB
_SMALL = BatchDefaults(min_memory_bytes=0, excluded_names=(), max_num_batched_tokens=2048, max_num_seqs=256)
_LARGE = BatchDefaults(
    min_memory_bytes=LARGE_GPU_BYTES, excluded_names=("a100",), max_num_batched_tokens=8192, max_num_seqs=1024
)
_BY_NAME = BatchDefaults(
    min_memory_bytes=0,
    excluded_names=(),
    required_names=("h100", "h200"),
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
)
_HUGE = BatchDefaults(min_memory_bytes=160 * _GIB, excluded_names=(), max_num_batched_tokens=16384, max_num_seqs=1024)
# Each rule's release is the first whose vllm/engine/arg_utils.py shows it (data/vllm_release_markers.json, marker in
# the source); the V1 defaults start with V1 as the default engine, 0.8.0 (the H100/H200 test is older, V1 only).
VLLM_BATCH_DEFAULTS: tuple[BatchDefaultsRule, ...] = (
    BatchDefaultsRule(since=(0, 6, 0), tiers=(_SMALL,), source="V0 scheduler: 256 sequences, no chunked prefill"),
    BatchDefaultsRule(
        since=(0, 8, 0),
        tiers=(_BY_NAME, replace(_SMALL, max_num_seqs=1024)),
        source="vllm/engine/arg_utils.py _set_default_args_v1, 0.8.0: H100/H200 by name (PR 12369); max_num_seqs "
        "1,024 on every device (v1-engine-default, batch-large-tier)",
    ),
    BatchDefaultsRule(
        since=(0, 8, 4),
        tiers=(_BY_NAME, _SMALL),
        source="vllm/engine/arg_utils.py, 0.8.4: max_num_seqs 256 off the large tier (batch-seqs-by-tier)",
    ),
    BatchDefaultsRule(
        since=(0, 8, 5),
        tiers=(replace(_LARGE, excluded_names=()), _SMALL),
        source="vllm/engine/arg_utils.py, 0.8.5: the large tier by memory, >= 70 GiB (PR 17073; batch-70gib-tier)",
    ),
    BatchDefaultsRule(
        since=(0, 9, 0),
        tiers=(_LARGE, _SMALL),
        source="vllm/engine/arg_utils.py, 0.9.0: A100s excluded, larger budgets cut their throughput (PR 17885; "
        "batch-a100-excluded)",
    ),
    BatchDefaultsRule(
        since=(0, 28, 0),
        tiers=(_HUGE, _LARGE, _SMALL),
        source="vllm/engine/arg_utils.py get_batch_defaults, 0.28.0: >= 160 GiB (B200/B300) the largest defaults "
        "(batch-160gib-tier)",
    ),
    BatchDefaultsRule(
        since=(0, 33, 0),
        tiers=(_HUGE, replace(_LARGE, excluded_names=("a100", "gb10")), _SMALL),
        # vLLM tests compute capability (12, 1), not the name; the name stands for it here (no AWS instance has one).
        source="vllm/engine/arg_utils.py get_batch_defaults, 0.33.0: GB10 (DGX Spark) kept on the small tier "
        "(batch-gb10-excluded)",
    ),
)


# Each rule as vLLM's source states it. The releases are those read; a rule's ``since`` is the oldest release whose
# source was read for it, not necessarily the release that introduced it.
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        name="attention-heads",
        since=(0, 0, 0),
        until=None,
        source="vllm/config/model.py ModelConfig.verify_with_parallel_config (vLLM 0.32.0)",
        what="the attention heads divide evenly over the tensor-parallel ranks",
    ),
    LayoutRule(
        name="kv-heads",
        since=(0, 0, 0),
        until=None,
        source="vllm/model_executor/layers/linear.py QKVParallelLinear (vLLM 0.32.0)",
        what="KV heads divide over the ranks, or the ranks over the KV heads (then each KV head is replicated)",
    ),
    LayoutRule(
        name="fp8-block-linear",
        since=(0, 0, 0),
        until=None,
        source="vllm/model_executor/layers/quantization/utils/fp8_utils.py validate_fp8_block_shape (vLLM 0.32.0)",
        what=(
            "block-quantized FP8: each rank's output shard of a column-parallel layer is whole block_n blocks and "
            "its input shard of a row-parallel layer whole block_k blocks"
        ),
    ),
    LayoutRule(
        name="fp8-block-moe",
        since=(0, 0, 0),
        # The first release with refine_fp8_moe_block_shape (data/vllm_release_markers.json fp8-moe-block-refine);
        # 0.28.0's Fp8MoEMethod.create_weights still raises.
        until=(0, 29, 0),
        source=(
            "vllm/model_executor/layers/quantization/fp8.py Fp8MoEMethod.create_weights (the same check as "
            "fp8_utils.py validate_fp8_block_shape_moe) up to vLLM 0.28.0; vLLM 0.8.5 refuses Qwen3-235B-A22B-FP8 at "
            "TP 8: 'The output_size of gate's and up's weight = 192 is not divisible by weight quantization "
            "block_n = 128' (vllm-project/vllm issue 17569)"
        ),
        what="block-quantized FP8 MoE: each rank's expert intermediate shard is whole blocks",
    ),
    LayoutRule(
        name="fp8-block-moe-refined",
        since=(0, 29, 0),
        until=None,
        source=(
            "vllm/model_executor/layers/fused_moe/oracle/fp8.py refine_fp8_moe_block_shape (vLLM 0.29.0 on) and "
            "resolve_fp8_moe_weight_block_shape (vLLM 0.32.0)"
        ),
        what=(
            "block-quantized FP8 MoE whose expert shard is not whole blocks: the block scales are refined to "
            "gcd(block_n, block_k, shard, hidden) when that is at least 32 (Triton MoE kernels only), else refused"
        ),
    ),
    LayoutRule(
        name="wna16-group",
        since=(0, 0, 0),
        until=None,
        source=(
            "vllm/model_executor/kernels/linear/mixed_precision/marlin.py can_implement and "
            "vllm/model_executor/kernels/linear/__init__.py choose_mp_linear_kernel (vLLM 0.32.0)"
        ),
        what=(
            "4-bit group-quantized weights (AWQ, GPTQ, w4a16): each rank's input shard of a row-parallel layer is "
            "whole quantization groups (MoE experts fall back to the WNA16 MoE kernels instead of refusing)"
        ),
    ),
    LayoutRule(
        name="pipeline-layers",
        since=(0, 0, 0),
        until=None,
        source="vllm/distributed/utils.py get_pp_indices (vLLM 0.32.0)",
        what="every pipeline stage holds at least one layer",
    ),
    LayoutRule(
        name="expert-parallel-needs-moe",
        since=(0, 0, 0),
        until=None,
        source="vllm/config/model.py ModelConfig._verify_with_expert_parallelism (vLLM 0.32.0)",
        what="--enable-expert-parallel needs a model with experts",
    ),
    LayoutRule(
        name="data-parallel-attention",
        # Read in the source at commit 00193b82 of vllm-project/vllm; the pinned release is the oldest it is
        # applied to, so older pins are refused rather than sized by a rule not read for them.
        since=(0, 34, 0),
        until=None,
        source=(
            "vllm/config/parallel.py ParallelConfig data_parallel_size ('MoE layers will be sharded according to "
            "the product of the tensor, prefill-context, and data parallel sizes'), world_size (TP x PP per engine "
            "core) and use_all2all (data_parallel_size > 1), vllm-project/vllm at 00193b82"
        ),
        what=(
            "--data-parallel-size N starts N engine cores of tp x pp GPUs each, every one with its own KV cache and "
            "scheduler; with --enable-expert-parallel the experts spread over tp x N ranks, exchanged by all-to-all"
        ),
    ),
)

# vLLM's bitsandbytes loader turns every double-quantized absmax back into float32 at load, "at the cost of increased
# memory usage": vllm/model_executor/model_loader/bitsandbytes_loader.py dequantize_dq, called from load_weights on
# each parameter's quant states (vllm-project/vllm PR 19742). First in 0.9.2 (vllm 0.9.2 sdist, bitsandbytes_loader.py;
# 0.9.1's loader has no dequantize_dq: data/vllm_release_markers.json bnb-fp32-absmax). In-flight quantization
# (_unquantized_generator: quantize_4bit(..., compress_statistics=True, quant_type="nf4")) and double-quantized
# checkpoints then hold the same as a checkpoint without double quantization: 4-bit codes packed two to a uint8
# (BitsAndBytesLinearMethod.create_weights: one flat uint8 parameter of in x out / 2, no padding, nothing else per
# layer) and one fp32 absmax per 64 weights. Earlier releases kept the uint8 absmax and its nested fp32 scale per 256
# blocks (vllm 0.7.2: unsloth/meta-llama-3.1-8b-instruct-bnb-4bit printed 5.3541 GiB of weights; that storage gives
# 5.31, and the 0.03 GiB rope cache kvfleet leaves out, 5.34).
BNB_FP32_ABSMAX_SINCE = (0, 9, 2)

TRAITS = EngineTraits(
    # vllm/v1/worker/gpu_worker.py determine_available_memory: requested = total x gpu_memory_utilization, less the
    # weights, the profiled peak and what else is resident (see VLLM_PROFILES for what each release counts).
    memory_budget=MemoryBudget.SHARE_OF_TOTAL,
    # vllm/config/cache.py: BlockSize = Literal[1, 8, 16, 32, 64, 128] on CUDA (hybrid models may pick larger).
    block_sizes=frozenset({1, 8, 16, 32, 64, 128, 256}),
    block_size_power_of_two=False,
    block_size_option="block_size",
    # vllm/config/scheduler.py: max_num_batched_tokens must be at least max_num_seqs.
    max_num_batched_tokens_at_least_seqs=True,
    # --hf-overrides (vllm/engine/arg_utils.py): config.json changes, such as a RoPE scaling, applied at start-up.
    takes_config_overrides=True,
    # vllm/envs.py VLLM_ALLOW_LONG_MAX_MODEL_LEN, read by vllm/config/model.py _get_and_verify_max_len.
    max_len_override="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
    # vllm/model_executor/layers/rotary_embedding: one cos/sin cache over the model's positions on every rank
    # (kvfleet.sizing.memory.rope_cache_bytes).
    holds_rope_cache=True,
    # vLLM 0.32.0 gpu_model_runner.profile_run runs the vision encoder over a dummy batch (kvfleet.sizing.engines
    # encoder_profile).
    profiles_vision_encoder=True,
    separate_state_cache="",  # the state shares the hybrid KV-cache allocator (VLLM_PROFILES mamba_state_cache)
    context_profiling_requests=False,  # gpu_model_runner.py _dummy_sampler_run: max_num_seqs rows
    # config/vllm.py _set_max_num_scheduled_tokens: "not enough slots to schedule a token"
    refuses_batch_within_draft_slots=True,
    speculative_refusal="",  # every kvfleet method runs
    # config/vllm.py num_lookahead_tokens: eagle, eagle3, mtp and draft_model reserve num_speculative_tokens slots.
    lookahead_short_of_drafts=tuple(
        (m.value, 0) for m in (SpecMethod.EAGLE, SpecMethod.EAGLE3, SpecMethod.MTP, SpecMethod.DRAFT_MODEL)
    ),
    min_compute_capability=7.0,  # vLLM's GPU requirements: compute capability 7.0 or higher
    # FP8 checkpoints run weight-only (FP8 Marlin) on GPUs without FP8 tensor cores from Ampere on.
    fp8_weights_fallback_compute_capability=8.0,
    fp8_kv_needs_fp8_cores=False,
    # The FlashAttention backend takes an FP8 KV cache only with FlashAttention 3, i.e. on Hopper (sm90); elsewhere
    # vLLM logs "Cannot use FlashAttention backend for FP8 KV cache" and selects another backend (vllm-project/vllm
    # PR 24577, shown on an sm89 L40S).
    fp8_kv_flash_attention_compute_capability=9.0,
    bnb_fp32_absmax_since=BNB_FP32_ABSMAX_SINCE,
    # vllm/distributed/utils.py get_pp_indices (vLLM 0.32.0): the remainder one each to the stages before the last,
    # counting back from the second-to-last.
    pipeline_remainder_first=False,
)

CAPACITY = EngineCapacity(
    default_version=DEFAULT_VERSION,
    profiles=VLLM_PROFILES,
    traits=TRAITS,
    rope_rules=VLLM_ROPE_RULES,
    batch_defaults=VLLM_BATCH_DEFAULTS,
    layout_rules=LAYOUT_RULES,
    quantization=QUANTIZATION,
)
