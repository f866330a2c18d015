"""What an engine does with GPU memory, as data: the rules kvfleet.sizing asks an engine's adapter for.

Each engine's folder holds its own (``profiles.py``: ``EngineCapacity``, reached as ``adapter.capacity``): release
rows (``EngineProfile``), the rules that hold for every release (``EngineTraits``), the RoPE length rules, the
scheduler defaults, the parallel layouts the engine refuses and the weight precisions it loads. The sizing core
turns them into capacity; it never tests an engine's name. Standard library only: the serving image carries it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvfleet.versions import Version


class MemoryBudget(StrEnum):
    """How the engine takes the memory its KV cache is cut from."""

    # A share of the GPU's total memory, less everything that is not cache (vLLM's gpu_memory_utilization).
    SHARE_OF_TOTAL = "share_of_total"
    # A share of what is free after the profiling run, in whole blocks (TensorRT-LLM's free_gpu_memory_fraction).
    SHARE_OF_FREE = "share_of_free"


@dataclass(frozen=True, kw_only=True)
class EngineTraits:
    """The capacity rules that hold for every release of one engine (each with the engine file it was read from,
    in the engine's ``profiles.py``)."""

    memory_budget: MemoryBudget
    block_sizes: frozenset[int]  # the block sizes it accepts; empty: any ``block_size_power_of_two`` allows
    block_size_power_of_two: bool  # a block size that is not a power of two is refused
    block_size_option: str  # the engine's name for the block size, as its refusal names it
    max_num_batched_tokens_at_least_seqs: bool  # a token budget below max_num_seqs is refused
    takes_config_overrides: bool  # config.json changes at start-up (a RoPE scaling that extends the context)
    max_len_override: str  # the engine's own switch to start past the model's length limit; empty: none
    holds_rope_cache: bool  # a RoPE cos/sin cache over every position on every rank, beside the weights
    profiles_vision_encoder: bool  # the start-up profile runs the vision encoder (its memory is sized)
    # A hybrid model's state cache the engine keeps in a pool of its own, which kvfleet does not size; empty: the
    # state shares the KV-cache pool (from the release rows with ``mamba_state_cache``).
    separate_state_cache: str
    # The profiling run fills the token budget with dummy context requests, each sampling one row; else its dummy
    # sampler run samples max_num_seqs rows.
    context_profiling_requests: bool
    refuses_batch_within_draft_slots: bool  # a token budget at or below the draft model's new slots is refused
    speculative_refusal: str  # why a method outside the adapter's ``speculative_methods`` is refused
    # Per speculative method, how many fewer lookahead slots than drafted tokens a decoding request reserves past
    # its drafts (lookahead = K - this); a method not listed reserves none.
    lookahead_short_of_drafts: tuple[tuple[str, int], ...]
    min_compute_capability: float | None  # the oldest GPUs it runs on; None: not checked
    # FP8 weights on GPUs without FP8 tensor cores from this compute capability on (a weight-only kernel); None: never.
    fp8_weights_fallback_compute_capability: float | None
    fp8_kv_needs_fp8_cores: bool  # an FP8 KV cache needs FP8 tensor cores
    # The one compute capability whose FlashAttention backend takes an FP8 KV cache (elsewhere another attention
    # backend runs it, at another speed); None: no such note.
    fp8_kv_flash_attention_compute_capability: float | None
    # From this release bitsandbytes 4-bit weights hold their double-quantized absmax as fp32; None: never.
    bnb_fp32_absmax_since: Version | None
    # Pipeline stages: the first num_layers % pp stages hold one layer more; else the stages before the last do.
    pipeline_remainder_first: bool

    def lookahead_slots(self, method: str, drafts: int) -> int:
        """Slots a decoding request reserves past its ``drafts`` drafted tokens under ``method``."""
        short = dict(self.lookahead_short_of_drafts)
        return drafts - short[method] if method in short else 0


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """What one engine release does with memory: a row of its engine's ``EngineCapacity.profiles``."""

    engine: str  # the engine's registered name
    since: Version  # first release this row describes
    gpu_memory_utilization: float  # vLLM default; TRT-LLM: free_gpu_memory_fraction default
    block_size: int  # tokens per KV block
    counts_cuda_graphs: bool  # CUDA-graph memory is subtracted before sizing the cache
    hybrid_kv_cache: bool  # sliding-window layers only hold their window (hybrid allocator)
    hybrid_chunked_local: bool  # chunked local attention layers hold one chunk (else the full context)
    mamba_state_cache: bool  # V1 runs Mamba/hybrid state models by default, their state in the hybrid allocator
    hybrid_group_ratio: float  # kv_cache_utils grouping: use the largest type count below this ratio (1: never)
    hybrid_tokens_from_concurrency: bool  # hybrid models log max_concurrency x max_model_len tokens
    sort_sampler: bool  # the profiling run's top-k/top-p mask sorts the vocabulary (kvfleet.sizing.engines)
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
    # Prefix caching on by default for hybrid attention/Mamba models; in vLLM that puts their state layers in
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
    # With the extensible cache on by default, the utilization an unset gpu_memory_utilization resolves to where a
    # fixed cache size (--kv-cache-memory-bytes) turns it off.
    fixed_cache_gpu_memory_utilization: float | None = None
    # Without chunked prefill a step schedules a whole prompt: the token budget defaults to max_model_len (at least
    # 2,048) up to 32k tokens, else 2,048.
    schedules_whole_prompts: bool = False
    # What a start-up compiles and caches, where a boot without that cache starts with a smaller KV cache (a note
    # for the plan; empty: nothing).
    compile_cache_note: str = ""


def releases(first: EngineProfile, *changes: tuple[Version, str, dict[str, Any]]) -> tuple[EngineProfile, ...]:
    """Rows from ``first`` on, each the previous one with what changed in its release."""
    rows = [first]
    for since, note, changed in changes:
        rows.append(replace(rows[-1], since=since, note=note, **changed))
    return tuple(rows)


@dataclass(frozen=True, kw_only=True)
class RopeLengthRules:
    """How one engine release derives its longest context from a config's length and RoPE scaling."""

    no_factor_types: frozenset[str]  # scaling types whose factor never lengthens the context
    yarn_from_original: bool  # YaRN: original_max_position_embeddings x factor (else max_position_embeddings as is)
    gemma3_exempt: bool  # Gemma 3's max_position_embeddings is already scaled
    longrope_default_original: bool  # with no max_model_len given, LongRoPE models start at the original length
    source: str


@dataclass(frozen=True, kw_only=True)
class RopeRules:
    """A row of an engine's ``EngineCapacity.rope_rules``: the length rules from release ``since`` on."""

    since: Version
    rules: RopeLengthRules


@dataclass(frozen=True, kw_only=True)
class BatchDefaults:
    """One tier of an engine's scheduler defaults (max_num_seqs, max_num_batched_tokens) by device."""

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
    """The scheduler defaults from release ``since``: the first tier whose memory threshold and name tests the device
    passes; the last tier (threshold 0) is everyone else's."""

    since: Version
    tiers: tuple[BatchDefaults, ...]
    source: str


@dataclass(frozen=True, kw_only=True)
class LayoutRule:
    """One shape check that makes the engine refuse to start, where it was read (kvfleet.sizing.parallel applies
    the rules whose names it knows)."""

    name: str
    since: Version  # first release the rule is known to hold for, as read
    until: Version | None  # first release where it no longer holds; None: still holds in the newest read
    source: str
    what: str


@dataclass(frozen=True, kw_only=True)
class EngineCapacity:
    """One engine's capacity rules: what kvfleet.sizing asks its adapter (``EngineAdapter.capacity``)."""

    default_version: str  # the newest release modelled; environment files pin their own up to it
    profiles: tuple[EngineProfile, ...]  # oldest first; a release uses the last row at or below it
    traits: EngineTraits
    rope_rules: tuple[RopeRules, ...]  # oldest first
    batch_defaults: tuple[BatchDefaultsRule, ...]  # oldest first
    layout_rules: tuple[LayoutRule, ...]
    # Which weight precisions each release loads: {"schemes", "schemes_source", "releases"} (kvfleet.sizing
    # .quantization reads it; the engine's quantization.py holds it with its sources).
    quantization: Mapping[str, Any] = field(compare=False)
