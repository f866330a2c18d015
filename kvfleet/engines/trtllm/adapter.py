"""TensorRT-LLM (trtllm-serve, PyTorch backend): LLM-API options, server command, DJL's variables, metric names."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from kvfleet import contract
from kvfleet.engines.base import AwsContainer, EngineAdapter, EngineArgs, SignalNames
from kvfleet.engines.capacity import EngineCapacity
from kvfleet.engines.trtllm.profiles import CAPACITY
from kvfleet.engines.trtllm.scheduler import TrtllmScheduler

_S = contract
# trtllm-serve exports no preemption or generated-token counter: those signals stay absent for it.
# Its Prometheus names moved: the endpoint's first collector (NVIDIA/TensorRT-LLM#5785, July 2025, in 1.0) exports
# only request histograms, unprefixed (time_to_first_token_seconds, time_per_output_token_seconds); later releases
# prefix them trtllm_ and add KV-cache use (trtllm_kv_cache_utilization), then queue gauges from the iteration stats
# (#12545, March 2026). Both spellings are listed; where the release has no KV or queue gauge at all, the agent reads
# them from the iteration stats (ITERATION_STATS_PATH).
_V0_0: SignalNames = {
    _S.KV_CACHE_UTILIZATION.name: ("trtllm_kv_cache_utilization",),
    _S.REQUESTS_WAITING.name: ("trtllm_num_requests_waiting", "num_requests_waiting"),
    _S.REQUESTS_RUNNING.name: ("trtllm_num_requests_running", "num_requests_running"),
    _S.TIME_TO_FIRST_TOKEN.name: ("trtllm_time_to_first_token_seconds", "time_to_first_token_seconds"),
    _S.INTER_TOKEN_LATENCY.name: ("trtllm_time_per_output_token_seconds", "time_per_output_token_seconds"),
}
# What the agent needs trtllm-serve to record, in the LLM-API options: the Prometheus collector exists only with
# return_perf_metrics (tensorrt_llm/serve/openai_server.py: `if ...args.return_perf_metrics: ... MetricsCollector`),
# and iteration statistics (the KV cache and the queue, on /metrics and, in later releases, as gauges) only with
# enable_iter_perf_stats (MetricsCollector.log_iteration_stats: "Needs enable_iter_perf_stats: true"; the 1.0
# trtllm-serve documentation, NVIDIA/TensorRT-LLM#7056).
OBSERVABILITY_OPTIONS: dict[str, Any] = {"return_perf_metrics": True, "enable_iter_perf_stats": True}


# speculative_config's decoding_type per method (tensorrt_llm/llmapi/llm_args.py: EagleDecodingConfig,
# MTPDecodingConfig, NGramDecodingConfig, DraftTargetDecodingConfig; docs/source/features/speculative-decoding.md:
# "decoding_type: Eagle" and "speculative_model_dir", the 1.0 spellings later releases keep as aliases). The
# PyTorch backend runs EAGLE-3 heads only, in the target's model ("eagle3_one_model").
_DECODING_TYPES = {"eagle3": "Eagle", "mtp": "MTP", "ngram": "NGram", "draft_model": "DraftTarget"}


def speculative_config(args: EngineArgs) -> dict[str, Any]:
    """The LLM-API speculative_config for these settings; ValueError for a method the PyTorch backend lacks."""
    method = args.speculative_method
    if method not in _DECODING_TYPES:
        raise ValueError(f"speculative_method: TensorRT-LLM's PyTorch backend has no {method}; use eagle3 or vllm")
    out: dict[str, Any] = {"decoding_type": _DECODING_TYPES[method]}
    drafts = args.num_speculative_tokens or 1  # only mtp may leave it unset: DeepSeek-V3/R1 ship one MTP layer
    out["max_draft_len"] = drafts
    if method == "mtp":
        # "num_nextn_predict_layers: Number of MTP modules to use. Currently must match max_draft_len."
        out["num_nextn_predict_layers"] = drafts
    elif method == "ngram":
        out["max_matching_ngram_size"] = 4  # the documented example's; vLLM's prompt_lookup_max defaults to 5
    if args.speculative_model is not None:
        out["speculative_model_dir"] = args.speculative_model
    if method == "eagle3":
        out["eagle3_one_model"] = True  # drafter layers in the target's engine and KV cache, as sized
    return out


class TensorRtLlm(EngineAdapter):
    name: ClassVar[str] = "trtllm"
    title: ClassVar[str] = "TensorRT-LLM"
    # trtllm-serve's /metrics is JSON iteration stats (and blocks under load); Prometheus text is here.
    metrics_path: ClassVar[str] = "/prometheus/metrics"
    # The iteration stats since the last read, newest last: kvCacheStats (maxNumBlocks, usedNumBlocks,
    # tokensPerBlock), numQueuedRequests, numActiveRequests. The KV cache the engine allocated comes from here.
    iteration_stats_path: ClassVar[str | None] = "/metrics"
    default_base_image: ClassVar[str] = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"
    metric_rows: ClassVar[tuple[tuple[str, SignalNames], ...]] = (("0.0.0", _V0_0),)
    # TensorRT-LLM comes in DJL's image, whose tag names the TensorRT-LLM it bundles (0.33.0-tensorrtllm0.21.0-cu128);
    # the kvfleet image is built on NVIDIA's (default_base_image).
    dlc: ClassVar[AwsContainer | None] = AwsContainer(
        framework="djl-tensorrtllm", bundled_by="DJL", bundle_tag="tensorrtllm"
    )
    capacity: ClassVar[EngineCapacity] = CAPACITY
    speculative_methods: ClassVar[frozenset[str]] = frozenset(_DECODING_TYPES)
    refused_settings: ClassVar[frozenset[str]] = frozenset(
        {
            *("enforce_eager", "kv_cache_memory_bytes", "served_model_name", "hf_overrides"),
            *("limit_mm_per_prompt", "mm_encoder_tp_mode", "mm_max_pixels"),
            *("mamba_cache_dtype", "mamba_ssm_cache_dtype"),
            "data_parallel_size",
        }
    )

    def settings(self, args: EngineArgs) -> dict[str, Any]:
        """LLM-API options (tensorrt_llm/llmapi/llm_args.py): what --extra_llm_api_options reads."""
        if (
            args.enforce_eager
            or args.kv_cache_memory_bytes is not None
            or args.served_model_name is not None
            or args.hf_overrides is not None
        ):
            raise ValueError(
                "enforce_eager, kv_cache_memory_bytes, served_model_name and hf_overrides are vLLM settings"
            )
        if args.data_parallel_size not in (None, 1):
            # TensorRT-LLM's attention data parallelism (enable_attention_dp) is another layout, not sized here.
            raise ValueError("data_parallel_size is a vLLM setting: kvfleet sizes data-parallel attention on vLLM only")
        if args.limit_mm_per_prompt or args.mm_encoder_tp_mode is not None or args.mm_max_pixels is not None:
            raise ValueError("limit_mm_per_prompt, mm_encoder_tp_mode and mm_max_pixels are vLLM settings")
        if args.mamba_cache_dtype is not None or args.mamba_ssm_cache_dtype is not None:
            # Later LLM APIs have KvCacheConfig.mamba_ssm_cache_dtype, but kvfleet does not size TensorRT-LLM's Mamba
            # state pool (kvfleet.sizing.capacity refuses hybrid models on it), so no plan could follow it.
            raise ValueError(
                "mamba_cache_dtype and mamba_ssm_cache_dtype are vLLM settings: kvfleet sizes hybrid Mamba models on "
                "vLLM only"
            )
        kv: dict[str, Any] = {}
        if args.gpu_memory_utilization is not None:
            kv["free_gpu_memory_fraction"] = args.gpu_memory_utilization
        kv["enable_block_reuse"] = args.enable_prefix_caching
        if args.kv_cache_dtype not in (None, "auto"):
            kv["dtype"] = "fp8" if args.kv_cache_dtype.startswith("fp8") else args.kv_cache_dtype
        out: dict[str, Any] = {}
        for key, value in (
            ("tensor_parallel_size", args.tensor_parallel_size),
            ("pipeline_parallel_size", args.pipeline_parallel_size),
            # Experts whole over the tensor-parallel ranks: moe_expert_parallel_size x moe_tensor_parallel_size
            # must equal tensor_parallel_size (tensorrt_llm/llmapi/llm_args.py, TensorRT-LLM 1.0.0).
            ("moe_expert_parallel_size", (args.tensor_parallel_size or 1) if args.enable_expert_parallel else None),
            ("moe_tensor_parallel_size", 1 if args.enable_expert_parallel else None),
            ("max_batch_size", args.max_num_seqs),
            ("max_num_tokens", args.max_num_batched_tokens),
            ("max_seq_len", args.max_model_len),
        ):
            if value is not None:
                out[key] = value
        out["kv_cache_config"] = kv
        if args.speculative_method is not None:
            out["speculative_config"] = speculative_config(args)
        return out

    def server_command(
        self, args: EngineArgs, *, model: str, port: int, python: str, options_file: str | None
    ) -> list[str]:
        cmd = ["trtllm-serve", model, "--host", "127.0.0.1", "--port", str(port)]
        if options_file:
            cmd += ["--extra_llm_api_options", options_file]
        return cmd

    def options_file(self, args: EngineArgs) -> str | None:
        return json.dumps({**self.settings(args), **OBSERVABILITY_OPTIONS})  # JSON is YAML

    def dlc_environment(
        self, args: EngineArgs, *, model: str, max_input_tokens: int, max_output_tokens: int
    ) -> dict[str, str]:
        # DJL LMI's TensorRT-LLM options (option.<name>, given as OPTION_<NAME>); unset settings stay DJL's default.
        opts = self.settings(args)
        kv = opts["kv_cache_config"]
        env = {"HF_MODEL_ID": model, "OPTION_ROLLING_BATCH": "trtllm"}
        for name, value in (
            ("OPTION_TENSOR_PARALLEL_DEGREE", opts.get("tensor_parallel_size")),
            # option.pipeline_parallel_degree (deepjavalibrary/djl-serving: world size = tp x pp degrees)
            ("OPTION_PIPELINE_PARALLEL_DEGREE", opts.get("pipeline_parallel_size")),
            ("OPTION_MAX_ROLLING_BATCH_SIZE", opts.get("max_batch_size")),
            ("OPTION_MAX_NUM_TOKENS", opts.get("max_num_tokens")),
            ("OPTION_MAX_INPUT_LEN", max_input_tokens),
            ("OPTION_MAX_OUTPUT_LEN", max_output_tokens),
            ("OPTION_KV_CACHE_FREE_GPU_MEM_FRACTION", kv.get("free_gpu_memory_fraction")),
        ):
            if value is not None:
                env[name] = str(value)
        if "speculative_config" in opts:
            raise ValueError(
                "speculative_method: DJL's TensorRT-LLM container takes no speculative_config; use the kvfleet image"
            )
        env["OPTION_ENABLE_KV_CACHE_REUSE"] = str(bool(kv["enable_block_reuse"])).lower()
        if args.quantization:
            env["OPTION_QUANTIZE"] = args.quantization
        return env

    def describe(self, args: EngineArgs) -> str:
        options = json.dumps({**self.settings(args), **OBSERVABILITY_OPTIONS})
        return f"trtllm-serve <model> --extra_llm_api_options <file with: {options}>"

    def scheduler(self, args: EngineArgs) -> TrtllmScheduler:
        # The options a plan writes leave the scheduler's policy and chunked prefill at their defaults.
        return TrtllmScheduler()
