"""Engine settings that follow from a plan: vLLM flags and TensorRT-LLM LLM-API options.

They admit exactly what the plan sized: ``max-num-seqs`` is the concurrency that fits (not the
engine default), ``max-model-len`` the workload's longest sequence.
"""

from __future__ import annotations

from typing import Any

from sizing.engines import EngineName
from sizing.planner import Candidate
from sizing.precision import KvDtype


def vllm_args(c: Candidate, *, enable_prefix_caching: bool = True) -> dict[str, Any]:
    cap = c.capacity
    args: dict[str, Any] = {
        "tensor-parallel-size": c.tensor_parallel_size,
        "max-model-len": cap.max_model_len,
        "max-num-seqs": c.concurrency_per_replica,
        "max-num-batched-tokens": cap.max_num_batched_tokens,
        "gpu-memory-utilization": cap.gpu_memory_utilization,
        "kv-cache-dtype": c.kv_cache_dtype.vllm_name,
    }
    if c.online_quantization and c.online_quantization not in ("bf16", "fp16"):
        # vLLM reads a quantized checkpoint's method from its config; only on-the-fly needs the flag.
        args["quantization"] = {"bnb-4bit": "bitsandbytes"}.get(c.online_quantization, c.online_quantization)
    elif c.online_quantization in ("bf16", "fp16"):
        args["dtype"] = {"bf16": "bfloat16", "fp16": "float16"}[c.online_quantization]
    if enable_prefix_caching:
        args["enable-prefix-caching"] = True
    else:
        args["no-enable-prefix-caching"] = True
    return args


def vllm_cli(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in args.items():
        out.append(f"--{k}")
        if v is not True:
            out.append(str(v))
    return out


def trtllm_options(c: Candidate, *, enable_prefix_caching: bool = True) -> dict[str, Any]:
    cap = c.capacity
    kv: dict[str, Any] = {
        "free_gpu_memory_fraction": cap.gpu_memory_utilization,
        "enable_block_reuse": enable_prefix_caching,
    }
    if c.kv_cache_dtype is not KvDtype.AUTO:
        kv["dtype"] = "fp8" if c.kv_cache_dtype.is_fp8 else c.kv_cache_dtype.vllm_name
    return {
        "tensor_parallel_size": c.tensor_parallel_size,
        "max_batch_size": c.concurrency_per_replica,
        "max_num_tokens": cap.max_num_batched_tokens,
        "max_seq_len": cap.max_model_len,
        "kv_cache_config": kv,
    }


def engine_settings(c: Candidate, *, enable_prefix_caching: bool = True) -> dict[str, Any]:
    if c.capacity.engine is EngineName.TRTLLM:
        return {
            "engine": "trtllm",
            "llm_api_options": trtllm_options(c, enable_prefix_caching=enable_prefix_caching),
        }
    args = vllm_args(c, enable_prefix_caching=enable_prefix_caching)
    return {"engine": "vllm", "args": args, "cli": vllm_cli(args)}
