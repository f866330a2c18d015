"""The vLLM adapter: EngineArgs rendered as vLLM's flags, its server command, the AWS DLC's variables, metric names."""

from __future__ import annotations

import pytest

from kvfleet import contract
from kvfleet.engines import ENGINES, EngineArgs
from kvfleet.engines.vllm.adapter import Vllm

_REGISTERED = ENGINES["vllm"]
assert isinstance(_REGISTERED, Vllm)
VLLM = _REGISTERED  # the adapter the agent and the stacks use, with its vLLM-only flags()
PLAN = EngineArgs(
    tensor_parallel_size=2,
    max_model_len=8192,
    max_num_seqs=64,
    max_num_batched_tokens=8192,
    gpu_memory_utilization=0.9,
    kv_cache_dtype="fp8",
)


def test_registered() -> None:
    assert VLLM.name == "vllm" and VLLM.metrics_path == "/metrics" and VLLM.health_path == "/health"


def test_a_plans_settings_become_flags_in_order() -> None:
    assert VLLM.flags(PLAN) == [
        *("--tensor-parallel-size", "2", "--max-model-len", "8192", "--max-num-seqs", "64"),
        *("--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.9", "--kv-cache-dtype", "fp8"),
        "--enable-prefix-caching",
    ]


def test_unset_settings_leave_vllms_defaults() -> None:
    assert VLLM.flags(EngineArgs()) == ["--enable-prefix-caching"]
    assert VLLM.flags(EngineArgs(enable_prefix_caching=False)) == ["--no-enable-prefix-caching"]


def test_local_run_knobs() -> None:
    args = EngineArgs(enforce_eager=True, kv_cache_memory_bytes=4194304, served_model_name="tiny")
    assert VLLM.flags(args) == [
        "--enable-prefix-caching",
        "--enforce-eager",
        *("--kv-cache-memory-bytes", "4194304", "--served-model-name", "tiny"),
    ]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "flag"),
    [("auto", "auto"), ("bf16", "bfloat16"), ("fp16", "float16"), ("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_kv_cache_dtypes_in_vllms_names(kv_cache_dtype: str, flag: str) -> None:
    assert VLLM.settings(EngineArgs(kv_cache_dtype=kv_cache_dtype))["kv-cache-dtype"] == flag


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        ("bf16", {"dtype": "bfloat16"}),  # a cast, not a quantization method
        ("fp16", {"dtype": "float16"}),
        ("fp8", {"quantization": "fp8"}),
        ("bnb-4bit", {"quantization": "bitsandbytes"}),
        ("awq", {"quantization": "awq"}),
    ],
)
def test_weight_precision(quantization: str, expected: dict[str, str]) -> None:
    settings = VLLM.settings(EngineArgs(quantization=quantization))
    assert {k: v for k, v in settings.items() if k in ("dtype", "quantization")} == expected


def test_server_command_binds_loopback_on_the_given_port() -> None:
    cmd = VLLM.server_command(PLAN, model="/opt/ml/model", port=contract.ENGINE_PORT, python="py", options_file=None)
    assert cmd[:9] == [
        *("py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/opt/ml/model"),
        *("--host", "127.0.0.1", "--port", str(contract.ENGINE_PORT)),
    ]
    assert cmd[9:] == VLLM.flags(PLAN)
    assert VLLM.options_file(PLAN) is None  # everything is on the command line


def test_dlc_environment_is_the_same_settings_as_variables() -> None:
    env = VLLM.dlc_environment(PLAN, model="meta-llama/Llama-3.1-8B", max_input_tokens=4096, max_output_tokens=1024)
    assert env == {
        "SM_VLLM_MODEL": "meta-llama/Llama-3.1-8B",
        "SM_VLLM_TENSOR_PARALLEL_SIZE": "2",
        "SM_VLLM_MAX_MODEL_LEN": "8192",
        "SM_VLLM_MAX_NUM_SEQS": "64",
        "SM_VLLM_MAX_NUM_BATCHED_TOKENS": "8192",
        "SM_VLLM_GPU_MEMORY_UTILIZATION": "0.9",
        "SM_VLLM_KV_CACHE_DTYPE": "fp8",
        "SM_VLLM_ENABLE_PREFIX_CACHING": "",  # a bare flag
    }
    # One renderer: each variable is a flag of the command line.
    flags = {f"--{k[len('SM_VLLM_') :].lower().replace('_', '-')}" for k in env if k != "SM_VLLM_MODEL"}
    assert flags == {f for f in VLLM.flags(PLAN) if f.startswith("--")}


def test_describe_and_plan_json() -> None:
    assert VLLM.describe(EngineArgs(max_num_seqs=8)) == "vllm serve <model> --max-num-seqs 8 --enable-prefix-caching"
    shown = VLLM.settings_json(EngineArgs(max_num_seqs=8))
    assert shown["engine"] == "vllm" and shown["settings"] == {"max-num-seqs": 8, "enable-prefix-caching": True}


@pytest.mark.parametrize(
    ("version", "since", "kv_first", "itl_first"),
    [
        ("0.6.3", (0, 0, 0), "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.8.5", (0, 0, 0), "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.9.0", (0, 9, 0), "vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.10.2", (0, 9, 0), "vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.11.0rc1", (0, 11, 0), "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
        ("0.30.0", (0, 11, 0), "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
        ("v0.32", (0, 11, 0), "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
    ],
)
def test_metric_names_per_release(version: str, since: tuple[int, int, int], kv_first: str, itl_first: str) -> None:
    row, names = VLLM.metric_names(version)
    assert row == since
    kv = names[contract.KV_CACHE_UTILIZATION.name]
    itl = names[contract.INTER_TOKEN_LATENCY.name]
    assert (kv[0], itl[0]) == (kv_first, itl_first)
    # A stale version string still finds the other release's name.
    assert set(kv) == {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"}
    assert set(itl) == {"vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"}
    assert names[contract.PREEMPTIONS.name] == ("vllm:num_preemptions_total", "vllm:num_preemptions")
    assert names[contract.OUTPUT_TOKENS.name] == ("vllm:generation_tokens_total",)


def test_the_api_servers_keep_alive_is_raised_where_the_release_reads_the_variable() -> None:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE from 0.9.2 (vllm-project/vllm#18472); before it uvicorn's 5 s stands, and the
    agent's pool must not count on more."""
    from kvfleet.engines.vllm import adapter as vllm

    assert VLLM.server_environment((0, 9, 2)) == {vllm.KEEP_ALIVE_ENV: str(vllm.KEEP_ALIVE_S)}
    assert VLLM.keep_alive_s((0, 32, 0)) == vllm.KEEP_ALIVE_S
    assert VLLM.server_environment((0, 9, 1)) == {} and VLLM.keep_alive_s((0, 9, 1)) == 5.0
    trtllm = ENGINES["trtllm"]
    assert trtllm.server_environment((1, 0, 0)) == {} and trtllm.keep_alive_s((1, 0, 0)) == 5.0


def test_config_overrides_reach_the_engine_as_one_argument() -> None:
    # vllm/engine/arg_utils.py (0.32.0): --hf-overrides takes a JSON object; the agent passes argv, no shell.
    overrides = '{"max_position_embeddings": 131072, "rope_scaling": {"factor": 4.0, "rope_type": "yarn"}}'
    args = EngineArgs(max_model_len=131072, hf_overrides=overrides)
    flags = VLLM.flags(args)
    assert flags[flags.index("--hf-overrides") + 1] == overrides
    env = VLLM.dlc_environment(args, model="Qwen/Qwen2.5-72B-Instruct", max_input_tokens=1, max_output_tokens=1)
    assert env["SM_VLLM_HF_OVERRIDES"] == overrides


@pytest.mark.parametrize("text", ["{", "[]", "{}", '"yarn"'])
def test_config_overrides_must_be_a_json_object(text: str) -> None:
    with pytest.raises(ValueError, match="hf_overrides"):
        EngineArgs(hf_overrides=text)


def test_pipeline_and_expert_parallel_flags() -> None:
    # vllm/engine/arg_utils.py (vLLM 0.32.0): --pipeline-parallel-size, --enable-expert-parallel (a bare flag).
    args = EngineArgs(tensor_parallel_size=4, pipeline_parallel_size=2, enable_expert_parallel=True)
    flags = VLLM.flags(args)
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "2"
    assert "--enable-expert-parallel" in flags
    assert args.gpus == 8
    env = VLLM.dlc_environment(args, model="m", max_input_tokens=1, max_output_tokens=1)
    assert env["SM_VLLM_PIPELINE_PARALLEL_SIZE"] == "2" and env["SM_VLLM_ENABLE_EXPERT_PARALLEL"] == ""
    assert "--enable-expert-parallel" not in VLLM.flags(EngineArgs(tensor_parallel_size=4))


def test_state_dtypes_of_hybrid_models() -> None:
    # vllm/engine/arg_utils.py (vLLM 0.32.0): --mamba-cache-dtype and --mamba-ssm-cache-dtype, choices
    # vllm/config/cache.py MambaDType ("auto", "float32", "float16", "bfloat16").
    flags = VLLM.flags(EngineArgs(mamba_cache_dtype="bfloat16", mamba_ssm_cache_dtype="float32"))
    assert flags[flags.index("--mamba-cache-dtype") + 1] == "bfloat16"
    assert flags[flags.index("--mamba-ssm-cache-dtype") + 1] == "float32"
    assert not any(f.startswith("--mamba") for f in VLLM.flags(EngineArgs()))
    env = VLLM.dlc_environment(
        EngineArgs(mamba_ssm_cache_dtype="float32"), model="m", max_input_tokens=1, max_output_tokens=1
    )
    assert env["SM_VLLM_MAMBA_SSM_CACHE_DTYPE"] == "float32"
