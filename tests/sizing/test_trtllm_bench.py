"""trtllm-bench's own batch and token limits (kvfleet.sizing.trtllm_bench), rule by rule from TensorRT-LLM's
tensorrt_llm/bench/build/tuning.py and bench/benchmark/utils/general.py, and the published throughput cases that
ran under them."""

from __future__ import annotations

import pytest

from kvfleet.sizing import step
from kvfleet.sizing.catalog import catalog_model
from kvfleet.sizing.trtllm_bench import bytes_per_elem, engine_settings, finetune
from tests.sizing.conftest import load_tool

H100_NVML_BYTES = 81559 * 1024 * 1024  # nvidia-smi's total for an H100 80GB HBM3


def test_bytes_per_element_follow_the_quantization_algorithm() -> None:
    assert bytes_per_elem("fp8") == bytes_per_elem("FP8_BLOCK_SCALES") == 1.0
    assert bytes_per_elem("nvfp4") == 0.5
    assert bytes_per_elem(None) == bytes_per_elem("bf16") == bytes_per_elem("w4a16") == 2.0  # not in its table


def test_batch_rounding_by_band() -> None:
    assert finetune(10, 128, 128)[0] == 64  # at least 64
    assert finetune(100, 128, 128)[0] == 128  # to 32 below 256
    assert finetune(557, 128, 128)[0] == 640  # to 128 below 1,024
    assert finetune(1500, 128, 128)[0] == 1536  # to 256 above
    assert finetune(9000, 128, 128)[0] == 4096  # the decoder-buffer cap
    assert finetune(9000, 128, 128, pp=2)[0] == 2048  # per pipeline stage


def test_token_rounding_by_band() -> None:
    assert finetune(557, 1000, 1000)[1] == 2048  # 1,114 -> the 2,048 floor
    assert finetune(1500, 1000, 1000)[1] == 3072  # 3,000 -> to 256
    assert finetune(2000, 1000, 1000)[1] == 4096  # 4,000 -> to 256
    assert finetune(3000, 1000, 1000)[1] == 6144  # 6,000 -> to 512
    assert finetune(512, 2048, 128)[1] == 9216  # 8,704 -> to 1,024
    assert finetune(4096, 5000, 500)[1] == 32768  # the activation cap


def test_a_logged_run_is_consistent_with_the_rule() -> None:
    # NVIDIA/TensorRT-LLM#6294 (trtllm-bench, PyTorch backend, Llama 3.1 8B FP8 on one H100, fraction 0.8) logged
    # max_batch_size 4096 and max_num_tokens 23552 with max_seq_len 157. Its dataset is not printed: the cap gives
    # the batch, and 23,552 needs an ISL/OSL ratio in (4.5, 4.75], as 129 / 28 (157 tokens) is.
    m = catalog_model("meta-llama/Llama-3.1-8B")
    s = engine_settings(
        param_count=m.total_params,
        weight_bytes=1.0,
        kv_bytes_per_elem=1.0,
        attention_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        device_memory_bytes=H100_NVML_BYTES,
        avg_isl=129,
        avg_osl=28,
        max_isl=129,
        kv_cache_fraction=0.8,
    )
    assert (s.max_batch_size, s.max_num_tokens) == (4096, 23552)
    assert finetune(s.kv_cache_max_requests, 128, 28)[1] == 23552  # 4.57, the same band
    assert finetune(s.kv_cache_max_requests, 128, 32)[1] == 20480  # 4.0: another band


def test_without_chunked_prefill_a_whole_prompt_and_batch_fit_the_token_budget() -> None:
    m = catalog_model("meta-llama/Llama-3.1-8B")
    common = {
        "param_count": m.total_params,
        "weight_bytes": 1.0,
        "kv_bytes_per_elem": 1.0,
        "attention_layers": m.num_layers,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "device_memory_bytes": H100_NVML_BYTES,
        "avg_isl": 5000,
        "avg_osl": 500,
        "max_isl": 5000,
        "kv_cache_fraction": 0.95,
    }
    off = engine_settings(**common)  # type: ignore[arg-type]
    on = engine_settings(**common, chunked_prefill=True)  # type: ignore[arg-type]
    assert off.max_num_tokens == 5000 + off.max_batch_size > on.max_num_tokens


def test_kv_heads_are_raised_to_the_tensor_parallel_degree() -> None:
    common = {
        "param_count": 10**9,
        "weight_bytes": 2.0,
        "kv_bytes_per_elem": 2.0,
        "attention_layers": 16,
        "head_dim": 128,
        "device_memory_bytes": H100_NVML_BYTES,
        "avg_isl": 1000,
        "avg_osl": 1000,
        "max_isl": 1000,
    }
    one_head = engine_settings(num_kv_heads=1, tp=4, **common)  # type: ignore[arg-type]
    four_heads = engine_settings(num_kv_heads=4, tp=4, **common)  # type: ignore[arg-type]
    assert one_head.kv_cache_max_requests == pytest.approx(four_heads.kv_cache_max_requests)


def test_the_perf_overview_cases_run_under_trtllm_bench_settings() -> None:
    rows = [c for c in load_tool("fit_step").cases() if c.cid.startswith("trtllm-1.0-")]
    raw = {r["id"]: r for r in step.calibration()["cases"]}
    assert rows and all(raw[c.cid]["settings"] == "trtllm-bench" for c in rows)
    by_id = {c.cid: c for c in rows}
    # Llama 3.1 8B FP8 on one H100 at 1000/1000 and fraction 0.95: about 557 requests' worth of cache by
    # trtllm-bench's estimate, so a batch of 640 and the 2,048-token floor (the LLM API defaults are 2,048 / 8,192).
    c = by_id["trtllm-1.0-llama-3.1-8b-h100-tp1-1000-1000"]
    assert (c.max_batch_size, c.max_num_tokens) == (640, 2048)
    c = by_id["trtllm-1.0-llama-3.1-8b-h100-tp1-5000-500"]
    assert c.max_num_tokens == 5000 + c.max_batch_size  # chunked prefill off: a whole prompt fits beside the batch
