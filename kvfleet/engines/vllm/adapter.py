"""vLLM: flags, server command, the AWS vLLM container's variables, and metric names per release."""

from __future__ import annotations

import json
import shlex
from typing import Any, ClassVar

from kvfleet import contract
from kvfleet.engines.base import AwsContainer, EngineAdapter, EngineArgs, SignalNames
from kvfleet.engines.capacity import EngineCapacity
from kvfleet.engines.vllm.profiles import CAPACITY
from kvfleet.engines.vllm.scheduler import VllmScheduler
from kvfleet.versions import Version, parse_version

# vLLM's --kv-cache-dtype names (vllm/config/cache.py CacheDType) for kvfleet's.
_KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# --quantization names where kvfleet's differ (vllm/model_executor/layers/quantization/__init__.py).
_QUANTIZATION = {"bnb-4bit": "bitsandbytes"}
_DTYPE_CASTS = {"bf16": "bfloat16", "fp16": "float16"}

_S = contract
# The API server's idle keep-alive: 5 s (uvicorn's default) until VLLM_HTTP_TIMEOUT_KEEP_ALIVE made it a setting
# (vllm-project/vllm#18472, merged for 0.9.2; vllm/envs.py). The agent sets it to its own client-side keep-alive,
# so a pause of a few seconds between bursts does not cost every request a new connection to the engine.
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
KEEP_ALIVE_SINCE = parse_version("0.9.2")
KEEP_ALIVE_S = 75
_V0_0: SignalNames = {
    _S.KV_CACHE_UTILIZATION.name: ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    _S.REQUESTS_WAITING.name: ("vllm:num_requests_waiting",),
    _S.REQUESTS_RUNNING.name: ("vllm:num_requests_running",),
    _S.TIME_TO_FIRST_TOKEN.name: ("vllm:time_to_first_token_seconds",),
    _S.INTER_TOKEN_LATENCY.name: ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    _S.OUTPUT_TOKENS.name: ("vllm:generation_tokens_total",),
    _S.PREEMPTIONS.name: ("vllm:num_preemptions_total", "vllm:num_preemptions"),
}
# 0.9 renamed the KV-cache gauge (the old name stayed, deprecated, for a few releases).
_V0_9: SignalNames = {**_V0_0, _S.KV_CACHE_UTILIZATION.name: ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}
# 0.11 renamed the per-token latency histogram; around it both are exported.
_V0_11: SignalNames = {
    **_V0_9,
    _S.INTER_TOKEN_LATENCY.name: ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}


def speculative_config(args: EngineArgs) -> dict[str, Any]:
    """--speculative-config (vllm/config/speculative.py SpeculativeConfig): method, model, num_speculative_tokens.
    mtp names no model (the target's own layers) and may leave the token count to the model's MTP layer count."""
    out: dict[str, Any] = {"method": args.speculative_method}
    if args.speculative_model is not None:
        out["model"] = args.speculative_model
    if args.num_speculative_tokens is not None:
        out["num_speculative_tokens"] = args.num_speculative_tokens
    return out


class Vllm(EngineAdapter):
    name: ClassVar[str] = "vllm"
    title: ClassVar[str] = "vLLM"
    metrics_path: ClassVar[str] = "/metrics"
    # vllm/v1/metrics/loggers.py (log_metrics_info("cache_config", ...)): an info gauge whose labels are the
    # CacheConfig's fields, num_gpu_blocks among them once the engine has profiled memory. With data-parallel
    # attention it is one series per engine core (engine=<index>), each the front end's config, whose
    # num_gpu_blocks is the sum over the cores (vllm/v1/engine/utils.py wait_for_engine_startup): the replica's.
    capacity_metric: ClassVar[tuple[str, str, str] | None] = ("vllm:cache_config_info", "num_gpu_blocks", "block_size")
    default_base_image: ClassVar[str] = (
        "763104351884.dkr.ecr.us-east-1.amazonaws.com/vllm:0.30.0-gpu-py312-cu130-ubuntu24.04-sagemaker"
    )
    metric_rows: ClassVar[tuple[tuple[str, SignalNames], ...]] = (
        ("0.0.0", _V0_0),
        ("0.9.0", _V0_9),
        ("0.11.0", _V0_11),
    )
    # The vLLM DLC, released per vLLM version; the kvfleet image is built on it (default_base_image).
    dlc: ClassVar[AwsContainer | None] = AwsContainer(framework="vllm", kvfleet_image_base=True)
    capacity: ClassVar[EngineCapacity] = CAPACITY

    def settings(self, args: EngineArgs) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for flag, value in (
            ("tensor-parallel-size", args.tensor_parallel_size),
            ("pipeline-parallel-size", args.pipeline_parallel_size),
            # One server, data_parallel_size engine cores on this node (vllm/engine/arg_utils.py
            # --data-parallel-size; --data-parallel-size-local defaults to it on a single node).
            ("data-parallel-size", args.data_parallel_size),
            ("max-model-len", args.max_model_len),
            ("max-num-seqs", args.max_num_seqs),
            ("max-num-batched-tokens", args.max_num_batched_tokens),
            ("gpu-memory-utilization", args.gpu_memory_utilization),
            (
                "kv-cache-dtype",
                None if args.kv_cache_dtype is None else _KV_DTYPES.get(args.kv_cache_dtype, args.kv_cache_dtype),
            ),
        ):
            if value is not None:
                out[flag] = value
        q = args.quantization
        if q in _DTYPE_CASTS:
            out["dtype"] = _DTYPE_CASTS[q]
        elif q is not None:
            out["quantization"] = _QUANTIZATION.get(q, q)
        out["enable-prefix-caching" if args.enable_prefix_caching else "no-enable-prefix-caching"] = True
        out.update(_switches(args))
        return out

    def server_environment(self, version: Version) -> dict[str, str]:
        return {KEEP_ALIVE_ENV: str(KEEP_ALIVE_S)} if version >= KEEP_ALIVE_SINCE else {}

    def keep_alive_s(self, version: Version) -> float:
        return float(KEEP_ALIVE_S) if version >= KEEP_ALIVE_SINCE else super().keep_alive_s(version)

    def flags(self, args: EngineArgs) -> list[str]:
        out: list[str] = []
        for k, v in self.settings(args).items():
            out.append(f"--{k}")
            if v is not True:
                out.append(str(v))
        return out

    def server_command(
        self, args: EngineArgs, *, model: str, port: int, python: str, options_file: str | None
    ) -> list[str]:
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.flags(args),
        ]

    def dlc_environment(
        self, args: EngineArgs, *, model: str, max_input_tokens: int, max_output_tokens: int
    ) -> dict[str, str]:
        # The vLLM DLC's entrypoint turns SM_VLLM_<NAME>=<value> into --<name> <value> (empty: a bare flag).
        env = {"SM_VLLM_MODEL": model}
        for k, v in self.settings(args).items():
            env["SM_VLLM_" + k.upper().replace("-", "_")] = "" if v is True else str(v)
        return env

    def describe(self, args: EngineArgs) -> str:
        return "vllm serve <model> " + shlex.join(self.flags(args))  # pasteable: --hf-overrides is JSON

    def scheduler(self, args: EngineArgs) -> VllmScheduler:
        # A plan sets no long_prefill_token_threshold, so vLLM's default (off) is what runs.
        return VllmScheduler()


def _switches(args: EngineArgs) -> dict[str, Any]:
    """The flags set only when their setting is: expert parallelism, eager mode, a fixed cache, the served name,
    multimodal limits, Mamba state dtypes, speculative decoding and config overrides."""
    out: dict[str, Any] = {}
    if args.enable_expert_parallel:
        out["enable-expert-parallel"] = True  # vllm/engine/arg_utils.py (vLLM 0.32.0)
    if args.enforce_eager:
        out["enforce-eager"] = True
    if args.kv_cache_memory_bytes is not None:
        out["kv-cache-memory-bytes"] = args.kv_cache_memory_bytes
    if args.served_model_name is not None:
        out["served-model-name"] = args.served_model_name
    if args.limit_mm_per_prompt:
        # vllm/engine/arg_utils.py: --limit-mm-per-prompt takes a JSON object, e.g. {"image": 0, "video": 0}.
        out["limit-mm-per-prompt"] = json.dumps(dict(args.limit_mm_per_prompt), sort_keys=True)
    if args.mm_encoder_tp_mode is not None:
        out["mm-encoder-tp-mode"] = args.mm_encoder_tp_mode
    if args.mm_max_pixels is not None:
        out["mm-processor-kwargs"] = json.dumps({"max_pixels": args.mm_max_pixels})
    # vllm/engine/arg_utils.py --mamba-cache-dtype, --mamba-ssm-cache-dtype (vLLM 0.32.0)
    if args.mamba_cache_dtype is not None:
        out["mamba-cache-dtype"] = args.mamba_cache_dtype
    if args.mamba_ssm_cache_dtype is not None:
        out["mamba-ssm-cache-dtype"] = args.mamba_ssm_cache_dtype
    if args.speculative_method is not None:
        out["speculative-config"] = json.dumps(speculative_config(args), separators=(",", ":"))
    if args.hf_overrides is not None:
        out["hf-overrides"] = args.hf_overrides
    return out
