"""TensorRT-LLM's capacity rules (PyTorch backend): what each release does with GPU memory, as kvfleet.sizing reads
them: the release rows (``TRTLLM_PROFILES``), the rules every release keeps (``TRAITS``), the RoPE length rules, the
scheduler defaults, the parallel layouts it refuses and the weight precisions it loads (quantization.py), each with
the file it was read from.
"""

from __future__ import annotations

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
)
from kvfleet.engines.trtllm.quantization import QUANTIZATION
from kvfleet.engines.vocabulary import SpecMethod

# The newest release modelled; environment files pin their own up to it.
DEFAULT_VERSION = "1.0.0"

# TensorRT-LLM PyTorch backend, 1.0 (tensorrt_llm/_torch/pyexecutor/_util.py KvCacheCreator; resource_manager.py
# KVCacheManager.calculate_max_num_blocks; llmapi/llm_args.py KvCacheConfig; commands/serve.py):
#   estimate_max_tokens: peak = torch peak + what is used outside torch after the run (CUDA context, NCCL, the CUDA
#     graphs captured at warm-up, the temporary cache); _cal_max_tokens: available = (total - peak + temporary
#     cache) x free_gpu_memory_fraction, max_tokens = available // kv bytes per token, then min(KvCacheConfig
#     .max_tokens) where the user set one. So what counts as used is everything but the KV cache.
#   calculate_max_num_blocks: primary blocks = ceil(max_tokens / tokens_per_block); the log's "Allocated X GiB for max
#     tokens in paged KV cache (N)" prints N = blocks x tokens_per_block.
#   The profiling run: _create_dummy_context_requests(net_max_seq_len - 1) fills max_num_tokens with context requests
#     of min(max_num_tokens, max_seq_len - 1) tokens each, max_tokens=1: one forward over max_num_tokens tokens and
#     one sampled row per request (kvfleet.sizing.engines.context_profiling_requests), since the model returns the
#     logits of each context request's last token only (model_engine.py _prepare_tp_inputs: gather_ids).
#     configure_kv_cache_capacity resets the peak statistics after warm-up, so the torch peak is the run's; what
#     warm-up keeps (CUDA graphs, NCCL) is the "used outside torch" part, cuda_graph_bytes + non_torch_bytes +
#     cuda_context_bytes here. The activation term charges those rows, not max_batch_size: NVIDIA/TensorRT-LLM#6294
#     (max_batch_size 4,096, 151 dummy requests) used at most 13.58 GiB and is predicted at 12.07 GiB; 4,096 rows
#     alone would have charged 13.3 GiB.
#   Defaults: free_gpu_memory_fraction None -> 0.9 (_get_free_gpu_memory_fraction; llm_args "Default is 90%"; the
#     serve command's --kv_cache_free_gpu_memory_fraction defaults to 0.9); --max_batch_size / --max_num_tokens default
#     to BuildConfig.max_batch_size 2048 / max_num_tokens 8192 (commands/serve.py, builder.py BuildConfig);
#     tokens_per_block 32.
TRTLLM_PROFILES: tuple[EngineProfile, ...] = (
    EngineProfile(
        engine="trtllm",
        since=(0, 17, 0),
        gpu_memory_utilization=0.90,
        block_size=32,
        counts_cuda_graphs=True,
        hybrid_kv_cache=False,
        hybrid_chunked_local=False,
        mamba_state_cache=False,
        hybrid_group_ratio=1.5,
        hybrid_tokens_from_concurrency=False,
        sort_sampler=False,
        sliding_in_flight_batches=1,
        v2_runner="none",
        # KvCacheConfig.enable_block_reuse defaults to on, for every model.
        mamba_align_by_default=True,
        note="free_gpu_memory_fraction of the memory free after profiling; max_batch_size 2048, "
        "max_num_tokens 8192, tokens_per_block 32",
    ),
)

# tensorrt_llm/_torch/models/modeling_utils.py DecoderModelForCausalLM.infer_max_seq_len ("Modified from
# tensorrt_llm/builder.py _init_max_seq_len"): factor x max_position_embeddings unless su/longrope/llama3/yarn;
# no Gemma 3 exception, no LongRoPE default.
TRTLLM_ROPE_RULES: tuple[RopeRules, ...] = (
    RopeRules(
        since=(0, 17, 0),
        rules=RopeLengthRules(
            no_factor_types=frozenset({"su", "longrope", "llama3", "yarn"}),
            yarn_from_original=False,
            gemma3_exempt=False,
            longrope_default_original=False,
            source="tensorrt_llm/_torch/models/modeling_utils.py infer_max_seq_len",
        ),
    ),
)


# tensorrt_llm/commands/serve.py (1.0): --max_batch_size / --max_num_tokens default to BuildConfig.max_batch_size 2048
# / max_num_tokens 8192 (builder.py BuildConfig), on every device.
TRTLLM_BATCH_DEFAULTS: tuple[BatchDefaultsRule, ...] = (
    BatchDefaultsRule(
        since=(0, 17, 0),
        tiers=(BatchDefaults(min_memory_bytes=0, excluded_names=(), max_num_batched_tokens=8192, max_num_seqs=2048),),
        source="tensorrt_llm/commands/serve.py --max_batch_size, --max_num_tokens (builder.py BuildConfig)",
    ),
)

# Each rule as TensorRT-LLM's source states it, at the commit read.
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    LayoutRule(
        name="pipeline-layers",
        since=(0, 0, 0),
        until=None,
        source="tensorrt_llm/mapping.py Mapping.pp_layers (NVIDIA/TensorRT-LLM commit 05ebebb2)",
        what="pipeline stages at most the hidden layers; the first num_layers % pp stages hold one layer more",
    ),
    LayoutRule(
        name="expert-parallel-even",
        since=(0, 0, 0),
        until=None,
        source=(
            "tensorrt_llm/mapping.py Mapping.ep_experts and Mapping.__init__ (tp_size = moe_tp_size x moe_ep_size) "
            "(NVIDIA/TensorRT-LLM commit 05ebebb2)"
        ),
        what="expert parallelism gives every rank num_experts // ep experts: the experts divide over the ranks",
    ),
)

TRAITS = EngineTraits(
    # See TRTLLM_PROFILES: free_gpu_memory_fraction of what the profiling run leaves free, in whole blocks.
    memory_budget=MemoryBudget.SHARE_OF_FREE,
    block_sizes=frozenset(),
    block_size_power_of_two=True,  # KvCacheConfig tokens_per_block (no source file was recorded for this check)
    block_size_option="tokens_per_block",
    max_num_batched_tokens_at_least_seqs=False,
    takes_config_overrides=False,  # trtllm-serve reads config.json as the checkpoint ships it
    max_len_override="",
    holds_rope_cache=False,
    profiles_vision_encoder=False,  # its vision encoder's memory beyond the weights is not modelled
    separate_state_cache="Mamba state cache (a separate pool per max_batch_size)",
    context_profiling_requests=True,  # KvCacheCreator._create_dummy_context_requests (see TRTLLM_PROFILES)
    refuses_batch_within_draft_slots=False,
    # The PyTorch backend's speculative_config has no EAGLE-1 (tensorrt_llm/llmapi/llm_args.py; the adapter's
    # speculative_methods).
    speculative_refusal="TensorRT-LLM's PyTorch backend runs EAGLE-3 heads, not EAGLE-1; use eagle3 or the vllm engine",
    # One-model EAGLE-3 and MTP reserve num_extra_kv_tokens = max_draft_len - 1 per sequence (TensorRT-LLM
    # tests/unittest/_torch/speculative/test_eagle3.py, test_kv_lens_runtime_with_eagle3_one_model; a later
    # release than 1.0.0, not checked there); two-model drafters keep their own cache.
    lookahead_short_of_drafts=((SpecMethod.EAGLE3.value, 1), (SpecMethod.MTP.value, 1)),
    min_compute_capability=None,
    fp8_weights_fallback_compute_capability=None,  # FP8 weights need FP8 tensor cores
    fp8_kv_needs_fp8_cores=True,
    fp8_kv_flash_attention_compute_capability=None,
    bnb_fp32_absmax_since=None,
    # tensorrt_llm/mapping.py Mapping.pp_layers: torch.tensor_split, the first stages one layer more (LAYOUT_RULES).
    pipeline_remainder_first=True,
)

CAPACITY = EngineCapacity(
    default_version=DEFAULT_VERSION,
    profiles=TRTLLM_PROFILES,
    traits=TRAITS,
    rope_rules=TRTLLM_ROPE_RULES,
    batch_defaults=TRTLLM_BATCH_DEFAULTS,
    layout_rules=LAYOUT_RULES,
    quantization=QUANTIZATION,
)
