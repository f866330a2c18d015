"""TensorRT-LLM's (PyTorch backend) KV-cache sizing against its own logs and its source's arithmetic.

The records are the TensorRT-LLM rows of tests/sizing/data/engine_logs.json (tools/fit_engine_logs.py reports their
errors beside vLLM's). No constant is fitted for TensorRT-LLM: the one FIT record logs its weights only.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.engines.trtllm.profiles import TRTLLM_PROFILES
from kvfleet.sizing.capacity import capacity
from kvfleet.sizing.engines import (
    ACTIVATIONS,
    EngineName,
    activation_peak_bytes,
    batch_defaults,
    context_profiling_requests,
)
from kvfleet.sizing.units import GiB
from tests.sizing.test_engine_log_calibration import TOOL as tool  # the fit script, loaded once

TRT = [r for r in tool.load() if r["engine"] == EngineName.TRTLLM]


def _rec(rid: str) -> dict[str, Any]:
    return next(r for r in TRT if r["id"] == rid)


def test_trtllm_records_are_split_and_sourced() -> None:
    assert {r["split"] for r in TRT} == {"fit", "check"}
    for rec in TRT:
        assert rec["source"].startswith("https://github.com/NVIDIA/TensorRT-LLM/"), rec["id"]


def test_capped_cache_is_rounded_up_to_whole_blocks() -> None:
    # NVIDIA/TensorRT-LLM#6294: max_tokens 860308; the engine printed "Allocated 52.51 GiB for max tokens in paged
    # KV cache (860320)": ceil(860308 / 32) blocks of 32 tokens (resource_manager.py calculate_max_num_blocks).
    # Sized here on a GPU large enough that the cap binds whatever the activation term (see the next test).
    rec = _rec("trtllm-6294-llama31-8b-fp8-h100-bench")
    cap = capacity(tool.model_of(rec), gpu_memory_bytes=141 * GiB, settings=tool.settings_of(rec))
    assert cap.kv_cache_tokens == rec["logged"]["kv_cache_tokens"] == 860320
    assert cap.kv_cache_tokens != 860308 // 32 * 32  # flooring to blocks would lose the last 32 tokens
    assert abs(cap.kv_cache_bytes_per_gpu / GiB - rec["logged"]["allocated_kv_cache_gib"]) < 0.006


def test_cap_binds_on_the_logged_gpu() -> None:
    # NVIDIA/TensorRT-LLM#6294 on its own H100 (79.22 GiB) at fraction 0.8: the estimate reached the 860308-token cap,
    # so (79.22 GiB - used) x 0.8 >= 52.51 GiB, i.e. weights + activations + runtime <= 13.58 GiB. The profiling run
    # samples one row per dummy request (151 here, not max_batch_size 4,096), so its peak is the forward pass's.
    rec = _rec("trtllm-6294-llama31-8b-fp8-h100-bench")
    errs = tool.errors(rec, ACTIVATIONS)
    assert errs["kv_cache_tokens"] == 0


def test_profiling_run_samples_one_row_per_dummy_request() -> None:
    rec = _rec("trtllm-6294-llama31-8b-fp8-h100-bench")
    model = tool.model_of(rec)
    cap = capacity(model, gpu_memory_bytes=141 * GiB, settings=tool.settings_of(rec))
    rows = context_profiling_requests(max_num_tokens=23552, max_seq_len=157)
    assert cap.activation_peak_bytes == activation_peak_bytes(
        model, tp=1, max_num_batched_tokens=23552, max_num_seqs=rows
    )
    assert cap.activation_peak_bytes < activation_peak_bytes(
        model, tp=1, max_num_batched_tokens=23552, max_num_seqs=4096
    )


def test_weights_of_the_fit_record() -> None:
    # NVIDIA/TensorRT-LLM#5872: Qwen3-235B-A22B-FP8 at TP8/EP8 on H200; the executor's report shows 28.85 GiB per
    # rank taken by the model (free 139.55 -> 110.70 GiB). This model counts 27.65 GiB of weights: loading holds
    # about 1.2 GiB more than the checkpoint's tensors, which the fraction path counts as used after profiling.
    err = tool.errors(_rec("trtllm-5872-qwen3-235b-fp8-tp8-ep8-h200"), ACTIVATIONS)["weights_gib"]
    assert -1.25 <= err <= 0


@pytest.mark.parametrize(
    ("max_num_tokens", "max_seq_len", "requests"),
    [
        (8192, 131072, 1),  # the serve defaults with a long context: one 8,192-token request
        (8192, 8193, 1),  # max_seq_len - 1 = 8192 tokens per request
        (8192, 4097, 2),  # 4,096 tokens per request
        (23552, 157, 151),  # NVIDIA/TensorRT-LLM#6294's bench settings: 156 tokens per request
    ],
)
def test_profiling_run_requests(max_num_tokens: int, max_seq_len: int, requests: int) -> None:
    # KvCacheCreator._create_dummy_context_requests(net_max_seq_len - 1): max_num_tokens in requests of
    # min(max_num_tokens, max_seq_len - 1) tokens; each returns one token, so the sampler sees one row per request.
    assert context_profiling_requests(max_num_tokens=max_num_tokens, max_seq_len=max_seq_len) == requests


def test_serve_defaults() -> None:
    # tensorrt_llm/commands/serve.py (1.0): --max_batch_size BuildConfig.max_batch_size (2048), --max_num_tokens
    # BuildConfig.max_num_tokens (8192), --kv_cache_free_gpu_memory_fraction 0.9; KvCacheConfig tokens_per_block 32.
    p = TRTLLM_PROFILES[-1]
    for device, memory in (("H100", 80 * GiB), ("T4", 16 * GiB)):  # the same on every device
        tier = batch_defaults(EngineName.TRTLLM, None, gpu_memory_bytes=memory, accelerator_name=device)
        assert (tier.max_num_seqs, tier.max_num_batched_tokens) == (2048, 8192)
    assert (p.gpu_memory_utilization, p.block_size) == (0.9, 32)
