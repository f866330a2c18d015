"""The TensorRT-LLM adapter: EngineArgs as LLM-API options (the options file), trtllm-serve, DJL's variables."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvfleet import contract
from kvfleet.engines import ENGINES, EngineArgs
from kvfleet.engines.trtllm.adapter import TensorRtLlm

TRT = ENGINES["trtllm"]
PLAN = EngineArgs(
    tensor_parallel_size=2,
    max_model_len=8192,
    max_num_seqs=64,
    max_num_batched_tokens=8192,
    gpu_memory_utilization=0.9,
    kv_cache_dtype="fp8_e4m3",
)


def test_registered() -> None:
    assert isinstance(TRT, TensorRtLlm)
    # trtllm-serve's /metrics is JSON iteration stats; Prometheus text is on its own path.
    assert TRT.metrics_path == "/prometheus/metrics"


def test_a_plans_settings_become_llm_api_options() -> None:
    assert TRT.settings(PLAN) == {
        "tensor_parallel_size": 2,
        "max_batch_size": 64,
        "max_num_tokens": 8192,
        "max_seq_len": 8192,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.9, "enable_block_reuse": True, "dtype": "fp8"},
    }


def test_unset_settings_leave_the_engines_defaults() -> None:
    assert TRT.settings(EngineArgs()) == {"kv_cache_config": {"enable_block_reuse": True}}
    assert TRT.settings(EngineArgs(enable_prefix_caching=False, kv_cache_dtype="auto")) == {
        "kv_cache_config": {"enable_block_reuse": False}
    }


@pytest.mark.parametrize(
    "args",
    [
        EngineArgs(enforce_eager=True),
        EngineArgs(kv_cache_memory_bytes=1 << 20),
        EngineArgs(served_model_name="x"),
        EngineArgs(hf_overrides='{"max_position_embeddings": 131072}'),
        EngineArgs(limit_mm_per_prompt=(("image", 1),)),
        EngineArgs(mamba_ssm_cache_dtype="float32"),
        EngineArgs(mamba_cache_dtype="bfloat16"),
    ],
)
def test_vllm_only_settings_are_refused(args: EngineArgs) -> None:
    with pytest.raises(ValueError, match="vLLM settings"):
        TRT.settings(args)
    with pytest.raises(ValueError, match="vLLM settings"):
        TRT.options_file(args)


def test_the_options_file_is_the_options() -> None:
    text = TRT.options_file(PLAN)
    assert text is not None and "\n" not in text
    # JSON is YAML: what --extra_llm_api_options reads. Beside the plan's settings, what the agent's signals need:
    # the Prometheus collector (return_perf_metrics) and the iteration statistics (enable_iter_perf_stats).
    assert json.loads(text) == {**TRT.settings(PLAN), "return_perf_metrics": True, "enable_iter_perf_stats": True}
    assert '"enable_iter_perf_stats": true' in TRT.describe(PLAN)


def test_server_command_reads_the_options_file() -> None:
    cmd = TRT.server_command(PLAN, model="m", port=contract.ENGINE_PORT, python="py", options_file="/tmp/o.yaml")
    assert cmd == [
        *("trtllm-serve", "m", "--host", "127.0.0.1", "--port", str(contract.ENGINE_PORT)),
        *("--extra_llm_api_options", "/tmp/o.yaml"),
    ]
    assert "--extra_llm_api_options" not in TRT.server_command(PLAN, model="m", port=1, python="py", options_file=None)


def test_dlc_environment_is_djls_options() -> None:
    env = TRT.dlc_environment(
        dataclasses.replace(PLAN, quantization="fp8"), model="m", max_input_tokens=4096, max_output_tokens=1024
    )
    assert env == {
        "HF_MODEL_ID": "m",
        "OPTION_ROLLING_BATCH": "trtllm",
        "OPTION_TENSOR_PARALLEL_DEGREE": "2",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "64",
        "OPTION_MAX_NUM_TOKENS": "8192",
        "OPTION_MAX_INPUT_LEN": "4096",
        "OPTION_MAX_OUTPUT_LEN": "1024",
        "OPTION_KV_CACHE_FREE_GPU_MEM_FRACTION": "0.9",
        "OPTION_ENABLE_KV_CACHE_REUSE": "true",
        "OPTION_QUANTIZE": "fp8",
    }


def test_dlc_environment_without_a_plan_sets_only_what_is_known() -> None:
    env = TRT.dlc_environment(EngineArgs(), model="m", max_input_tokens=10, max_output_tokens=5)
    assert env == {
        "HF_MODEL_ID": "m",
        "OPTION_ROLLING_BATCH": "trtllm",
        "OPTION_MAX_INPUT_LEN": "10",
        "OPTION_MAX_OUTPUT_LEN": "5",
        "OPTION_ENABLE_KV_CACHE_REUSE": "true",
    }


def test_describe() -> None:
    assert TRT.describe(EngineArgs(max_num_seqs=8)).startswith("trtllm-serve <model> --extra_llm_api_options <file")
    assert '"max_batch_size": 8' in TRT.describe(EngineArgs(max_num_seqs=8))


@pytest.mark.parametrize("version", ["0.20.0", "1.0.0", "1.1.0rc2"])
def test_metric_names(version: str) -> None:
    since, names = TRT.metric_names(version)
    assert since == (0, 0, 0)
    assert names[contract.KV_CACHE_UTILIZATION.name] == ("trtllm_kv_cache_utilization",)
    # Both spellings: 1.0's collector exported unprefixed request histograms (NVIDIA/TensorRT-LLM#5785).
    assert names[contract.REQUESTS_WAITING.name] == ("trtllm_num_requests_waiting", "num_requests_waiting")
    assert names[contract.INTER_TOKEN_LATENCY.name] == (
        "trtllm_time_per_output_token_seconds",
        "time_per_output_token_seconds",
    )
    assert TRT.iteration_stats_path == "/metrics"  # the KV cache and the queue where the text has neither
    # trtllm-serve exports no preemption or generated-token counter: those signals stay absent.
    assert contract.PREEMPTIONS.name not in names and contract.OUTPUT_TOKENS.name not in names


def test_pipeline_and_expert_parallel_options() -> None:
    # LLM-API options: pipeline_parallel_size; experts whole over the TP ranks is moe_expert_parallel_size = tp
    # with moe_tensor_parallel_size 1 (tensorrt_llm/mapping.py requires tp = moe_tp x moe_ep).
    opts = TRT.settings(dataclasses.replace(PLAN, pipeline_parallel_size=2, enable_expert_parallel=True))
    assert opts["pipeline_parallel_size"] == 2
    assert opts["moe_expert_parallel_size"] * opts["moe_tensor_parallel_size"] == opts["tensor_parallel_size"] == 2
    assert "moe_expert_parallel_size" not in TRT.settings(PLAN)
    env = TRT.dlc_environment(
        dataclasses.replace(PLAN, pipeline_parallel_size=2), model="m", max_input_tokens=1, max_output_tokens=1
    )
    assert env["OPTION_PIPELINE_PARALLEL_DEGREE"] == "2"
