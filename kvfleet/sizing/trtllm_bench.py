"""The engine settings ``trtllm-bench throughput`` picks when it is given none (TensorRT-LLM 1.0, PyTorch backend).

TensorRT-LLM's published throughput tables (docs/source/performance/perf-overview.md) were measured with
``trtllm-bench throughput --backend pytorch`` and no ``--max_batch_size`` / ``--max_num_tokens``, so the engine ran
with what trtllm-bench derived from the dataset, not with the LLM API's defaults (2,048 and 8,192). The rule, from
NVIDIA/TensorRT-LLM ``tensorrt_llm/bench/build/tuning.py`` (``calc_engine_setting``, ``finetune_setting``; read at
commit 04cba882) and ``tensorrt_llm/bench/benchmark/utils/general.py`` (``get_settings``; commit 0171265e), later
than 1.0; a 1.0 release candidate's log (NVIDIA/TensorRT-LLM#6294) shows settings this rule gives:

* memory: NVML's total per GPU x GPUs, less the checkpoint's parameter count x bytes per weight (1 for FP8, 2
  otherwise), times ``kv_cache_free_gpu_mem_fraction``; requests that fit: that / (KV bytes per token x (avg ISL
  + avg OSL)), KV heads raised to at least the TP degree;
* batch: min(requests, 4096) / PP, rounded up to 32 (at least 64) below 256, to 128 below 1,024, else to 256;
* tokens: min(batch x (1 + ISL / OSL), 32768), rounded up to 256 (at least 2,048) below 4,096, to 512 below 8,192,
  else to 1,024;
* chunked prefill is off unless asked for, so max_num_tokens is raised to at least max ISL + max batch size.

Pure arithmetic on numbers the caller takes from the catalog; nothing here reads a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.sizing.units import GiB

MAX_REQUESTS = 4096  # "Cap total batch size to avoid decoder buffer size becoming too large."
MAX_TOKENS = 32768  # "Cap num tokens to avoid TRT activation buffer becoming too large."
# tuning.py BYTES_PER_ELEM by quantization algorithm, for the weights and the KV cache alike; any other is 2 bytes.
BYTES_PER_ELEM = {"fp8": 1.0, "fp8_block_scales": 1.0, "nvfp4": 0.5}
# finetune_setting's bands: below each bound, round up to that step; past the last, the last step.
BATCH_BANDS = ((256, 32), (1024, 128), (math.inf, 256))
TOKEN_BANDS = ((4096, 256), (8192, 512), (math.inf, 1024))
BATCH_FLOOR = 64  # "Set min BS to be 64."
TOKEN_FLOOR = 2048  # "Set min to 2048 to ensure Ctx/Gen overlap efficiency"


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    max_batch_size: int
    max_num_tokens: int
    kv_cache_max_requests: float  # what trtllm-bench's own estimate says the cache holds


def bytes_per_elem(quant_algo: str | None) -> float:
    """What trtllm-bench assumes one weight or KV element takes under ``quant_algo`` (None: unquantized)."""
    return BYTES_PER_ELEM.get((quant_algo or "").lower(), 2.0)


def _banded(value: float, bands: tuple[tuple[float, int], ...], floor: int) -> int:
    step = next(step for bound, step in bands if value < bound)
    return max(floor, step * math.ceil(value / step))


def finetune(kv_cache_max_requests: float, input_len: float, output_len: float, pp: int = 1) -> tuple[int, int]:
    """``finetune_setting`` with optimistic tuning (every model that is not a Mamba hybrid): (batch, tokens). Only
    the smallest band has a floor in the source; the larger bands start above it, so one floor per rule is the same."""
    raw_bs = min(kv_cache_max_requests, MAX_REQUESTS) / pp
    raw_token = min(raw_bs * (1 + input_len / output_len), MAX_TOKENS)
    return _banded(raw_bs, BATCH_BANDS, BATCH_FLOOR), _banded(raw_token, TOKEN_BANDS, TOKEN_FLOOR)


def engine_settings(
    *,
    param_count: int,
    weight_bytes: float,
    kv_bytes_per_elem: float,
    attention_layers: int,
    num_kv_heads: int,
    head_dim: int,
    device_memory_bytes: int,
    avg_isl: float,
    avg_osl: float,
    max_isl: int,
    tp: int = 1,
    pp: int = 1,
    kv_cache_fraction: float = 0.9,
    chunked_prefill: bool = False,
) -> BenchSettings:
    """``get_settings`` for a dense model (``device_memory_bytes``: NVML's total of one GPU)."""
    kv_heads = max(tp, num_kv_heads)  # "Each GPU in TP group has at least 1 kv head"
    gib_per_token = 2 * attention_layers * kv_heads * head_dim * kv_bytes_per_elem / GiB
    engine_gib = param_count * weight_bytes / GiB
    available_gib = device_memory_bytes / GiB * tp * pp - engine_gib
    requests = available_gib * kv_cache_fraction / (gib_per_token * (avg_isl + avg_osl))
    max_bs, max_tokens = finetune(requests, avg_isl, avg_osl, pp)
    if not chunked_prefill:
        max_tokens = max(max_tokens, max_isl + max_bs)
    return BenchSettings(max_batch_size=max_bs, max_num_tokens=max_tokens, kv_cache_max_requests=requests)
