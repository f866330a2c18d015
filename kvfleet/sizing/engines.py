"""Engine semantics: how vLLM and TensorRT-LLM turn GPU memory into a KV cache, keyed by version.

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
context request in TensorRT-LLM's profiling run (``trtllm_profiling_requests``). The estimate, per GPU,
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

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from kvfleet import versions
from kvfleet.errors import SizingError
from kvfleet.sizing.models import ModelSpec, RopeLengthRules
from kvfleet.sizing.units import GiB, MiB, cdiv
from kvfleet.versions import Version


class EngineName(StrEnum):
    VLLM = "vllm"
    TRTLLM = "trtllm"


def parse_version(text: str, *, field: str = "engine_version") -> Version:
    try:
        return versions.parse_version(text)
    except ValueError as err:
        raise SizingError(str(err), field=field) from None


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """What one engine release does with memory. Rows of ``VLLM_PROFILES`` / ``TRTLLM_PROFILES``."""

    engine: EngineName
    since: Version  # first release this row describes
    gpu_memory_utilization: float  # vLLM default; TRT-LLM: free_gpu_memory_fraction default
    block_size: int  # tokens per KV block
    counts_cuda_graphs: bool  # CUDA-graph memory is subtracted before sizing the cache
    hybrid_kv_cache: bool  # sliding-window layers only hold their window (hybrid allocator)
    hybrid_chunked_local: bool  # chunked local attention layers hold one chunk (else the full context)
    mamba_state_cache: bool  # V1 runs Mamba/hybrid state models by default, their state in the hybrid allocator
    hybrid_group_ratio: float  # kv_cache_utils grouping: use the largest type count below this ratio (1: never)
    hybrid_tokens_from_concurrency: bool  # hybrid models log max_concurrency x max_model_len tokens
    sort_sampler: bool  # the profiling run's top-k/top-p mask sorts the vocabulary (see the module docstring)
    # Batches a sliding-window layer reserves beyond its window at pipeline parallel size 1
    # (VllmConfig.max_in_flight_tokens: 2 with async scheduling, on by default from 0.26; 1 where a step's blocks
    # are freed before the next). With pipeline stages see ``in_flight_batches``.
    sliding_in_flight_batches: int
    # Which models Model Runner V2 runs by default (VllmConfig.use_v2_model_runner): "none"; "dense" (0.26-0.28
    # _is_default_v2_model_runner_model: a listed architecture, else a model that is neither MoE nor a hybrid
    # state model); "all" (0.29 on). Only what depends on it is modelled: in-flight batches under pipeline parallelism.
    v2_runner: str
    # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES (vllm/config/vllm.py) where ``v2_runner`` is "dense".
    v2_runner_architectures: frozenset[str] = frozenset()
    # Model Runner V2 estimates CUDA-graph memory before sizing the cache (gpu/model_runner.py
    # profile_cudagraph_memory; it returned 0 before 0.29, so graphs came out of the 1 - utilization headroom).
    v2_counts_cuda_graphs: bool = False
    # The budget subtracts everything resident after profiling (vllm/utils/mem_utils.py total_consumed, 0.27 on), so
    # buffers allocated between loading and profiling count: Model Runner V2's penalty state above all.
    persistent_buffers_counted: bool = False
    # Prefix caching on by default for hybrid attention/Mamba models, which puts their state layers in
    # mamba_cache_mode "align": two state pages per request instead of one (MambaSpec.max_memory_usage_bytes).
    mamba_align_by_default: bool
    note: str
    # Bytes per logit the profiling sampler holds beyond its runner's constant: Model Runner V2's profile run samples
    # with SamplingParams.for_sampler_warmup from 0.33 (top-k/top-p through FlashInfer). Measured in vLLM PR 57926
    # (Qwen2.5-0.5B-Instruct, L4, 256 sequences): 1,733,440 -> 1,710,928 KV tokens across the change, 22,512 tokens
    # x 12,288 B = 0.258 GiB over 256 x 151,936 logits = 7.1 B per logit.
    sampler_extra_bytes_per_logit: float = 0.0
    # A bfloat16/float16 kv_cache_dtype must equal the model's dtype, or the engine refuses to start
    # (vllm/config/vllm.py VllmConfig._reject_mismatched_float_kv_cache, from 0.33).
    kv_dtype_must_match_model: bool = False
    # The cache is sized after warm-up and CUDA-graph capture from measured free memory (vllm/v1/worker/
    # extensible_kv_cache.py measure_kv_cache_bytes, on by default on CUDA from 0.34); see ``extensible_kv_bytes``.
    extensible_kv_cache: bool = False
    # The server's scheduler defaults where they do not depend on the device (TensorRT-LLM's max_num_tokens and
    # max_batch_size). vLLM's depend on it: VLLM_BATCH_DEFAULTS (tiers by memory, A100s excluded by name).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None


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


def _releases(first: EngineProfile, *changes: tuple[Version, str, dict[str, Any]]) -> tuple[EngineProfile, ...]:
    """Rows from ``first`` on, each the previous one with what changed in its release."""
    rows = [first]
    for since, note, changed in changes:
        rows.append(replace(rows[-1], since=since, note=note, **changed))
    return tuple(rows)


# Sources: vllm/v1/worker/gpu_worker.py determine_available_memory (three generations), vllm/v1/core/
# kv_cache_utils.py (grouping, num_blocks, _report_kv_cache_config), vllm/engine/arg_utils.py (scheduler defaults),
# vllm/config/cache.py (gpu_memory_utilization, block_size). Each row's release is the first whose own files show
# the change, read from the release's sdist (wheel for 0.15.x) on PyPI by tools/vllm_release_markers.py; the
# marker named in each note is in data/vllm_release_markers.json with the line read and the release before it,
# and tests/sizing/test_release_markers.py holds the rows to it.
VLLM_PROFILES: tuple[EngineProfile, ...] = _releases(
    EngineProfile(
        engine=EngineName.VLLM,
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
    ),
    ((0, 8, 0), "V1 engine by default (vllm/envs.py VLLM_USE_V1; v1-engine-default)", {}),
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
        {"extensible_kv_cache": True, "gpu_memory_utilization": 1.0, "block_size": 64},
    ),
)

# vllm/config/cache.py DEFAULT_GPU_MEMORY_UTILIZATION (0.34.0): the default where the extensible cache is off
# (--kv-cache-memory-bytes given, or a driver without virtual memory management).
VLLM_ESTIMATED_SIZING_UTILIZATION = 0.92

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
#     one sampled row per request (trtllm_profiling_requests), since the model returns the logits of each context
#     request's last token only (model_engine.py _prepare_tp_inputs: gather_ids). configure_kv_cache_capacity resets
#     the peak statistics after warm-up, so the torch peak is the run's; what warm-up keeps (CUDA graphs, NCCL) is
#     the "used outside torch" part, cuda_graph_bytes + non_torch_bytes + cuda_context_bytes here. The activation
#     term charges those rows, not max_batch_size: NVIDIA/TensorRT-LLM#6294 (max_batch_size 4,096, 151 dummy
#     requests) used at most 13.58 GiB and is predicted at 12.07 GiB; 4,096 rows alone would have charged 13.3 GiB.
#   Defaults: free_gpu_memory_fraction None -> 0.9 (_get_free_gpu_memory_fraction; llm_args "Default is 90%"; the
#     serve command's --kv_cache_free_gpu_memory_fraction defaults to 0.9); --max_batch_size / --max_num_tokens default
#     to BuildConfig.max_batch_size 2048 / max_num_tokens 8192 (commands/serve.py, builder.py BuildConfig);
#     tokens_per_block 32.
TRTLLM_PROFILES: tuple[EngineProfile, ...] = (
    EngineProfile(
        engine=EngineName.TRTLLM,
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
        mamba_align_by_default=False,
        max_num_batched_tokens=8192,
        max_num_seqs=2048,
        note="free_gpu_memory_fraction of the memory free after profiling; max_batch_size 2048, "
        "max_num_tokens 8192, tokens_per_block 32",
    ),
)


def trtllm_profiling_requests(*, max_num_tokens: int, max_seq_len: int) -> int:
    """Dummy context requests TensorRT-LLM's KV-cache estimation runs (KvCacheCreator._create_dummy_context_requests:
    max_num_tokens split into requests of min(max_num_tokens, max_seq_len - 1) tokens); each samples one row."""
    per_request = max(1, min(max_num_tokens, max_seq_len - 1))
    return -(-max_num_tokens // per_request)


# The newest releases modelled; deployments pin their own.
DEFAULT_VERSIONS = {EngineName.VLLM: "0.34.0", EngineName.TRTLLM: "1.0.0"}
# 70 GiB: vLLM's threshold for its larger scheduler defaults (H100-class GPUs).
LARGE_GPU_BYTES = 70 * GiB


@dataclass(frozen=True, kw_only=True)
class RopeRules:
    """A row of ``VLLM_ROPE_RULES`` / ``TRTLLM_ROPE_RULES``: the length rules from release ``since`` on."""

    since: Version
    rules: RopeLengthRules


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


def rope_rules(engine: EngineName, version: str | None = None) -> RopeLengthRules:
    table = VLLM_ROPE_RULES if engine is EngineName.VLLM else TRTLLM_ROPE_RULES
    v = parse_version(version or DEFAULT_VERSIONS[engine])
    rows = [r for r in table if r.since <= v] or [table[0]]
    return rows[-1].rules


@dataclass(frozen=True, kw_only=True)
class BatchDefaults:
    """One tier of vLLM's scheduler defaults for the OpenAI server (``UsageContext.OPENAI_API_SERVER``)."""

    min_memory_bytes: int  # CUDA's total memory of one device, at least
    excluded_names: tuple[str, ...]  # device-name substrings (lower case) that never get this tier
    max_num_batched_tokens: int
    max_num_seqs: int
    required_names: tuple[str, ...] = ()  # device-name substrings of which one must be there (empty: any device)

    def admits(self, gpu_memory_bytes: int, name: str) -> bool:
        return (
            gpu_memory_bytes >= self.min_memory_bytes
            and not any(x in name for x in self.excluded_names)
            and (not self.required_names or any(x in name for x in self.required_names))
        )


@dataclass(frozen=True, kw_only=True)
class BatchDefaultsRule:
    """vLLM's ``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py) from release ``since``: the first tier whose
    memory threshold and name tests the device passes; the last tier (threshold 0) is everyone else's."""

    since: Version
    tiers: tuple[BatchDefaults, ...]
    source: str


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
_HUGE = BatchDefaults(min_memory_bytes=160 * GiB, excluded_names=(), max_num_batched_tokens=16384, max_num_seqs=1024)
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


def vllm_batch_defaults(version: str | None, *, gpu_memory_bytes: int, accelerator_name: str) -> BatchDefaults:
    """The tier vLLM gives this device: by CUDA's total memory and its name (H100/H200 before 0.8.5, A100s after)."""
    v = parse_version(version or DEFAULT_VERSIONS[EngineName.VLLM])
    rows = [r for r in VLLM_BATCH_DEFAULTS if r.since <= v] or [VLLM_BATCH_DEFAULTS[0]]
    name = accelerator_name.lower()
    return next((t for t in rows[-1].tiers if t.admits(gpu_memory_bytes, name)), _SMALL)


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
    if profile.engine is EngineName.VLLM and runs_v2_runner(profile, model):
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


def engine_profile(engine: EngineName, version: str | None = None) -> EngineProfile:
    table = VLLM_PROFILES if engine is EngineName.VLLM else TRTLLM_PROFILES
    v = parse_version(version or DEFAULT_VERSIONS[engine])
    rows = [p for p in table if p.since <= v]
    if not rows:
        oldest = ".".join(map(str, table[0].since))
        raise SizingError(
            f"{engine} {version} is older than the oldest modelled release {oldest}", field="engine_version"
        )
    return rows[-1]


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
MM_ENCODER_TP_MODES = ("weights", "data")  # vllm/config/multimodal.py MMEncoderTPMode; default "weights"
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
