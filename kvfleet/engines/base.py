"""What every engine adapter provides, and the engine settings a plan decides (``EngineArgs``).

Standard library only: the serving image carries this package with the contract. Settings travel from
the stacks to the agent as ``EngineArgs`` JSON in ``contract.ENV_ENGINE_ARGS``; each adapter renders
them in its engine's terms (vLLM flags, TensorRT-LLM LLM-API options, the AWS images' variables), so
there is one renderer per engine and nobody re-parses a flag list.
"""

from __future__ import annotations

import dataclasses
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvfleet.engines.capacity import EngineCapacity
from kvfleet.engines.scheduling import Scheduler
from kvfleet.engines.vocabulary import DRAFTS_FROM_CHECKPOINT, MM_ENCODER_TP_MODES, KvDtype, SpecMethod
from kvfleet.versions import Version, parse_version

KV_CACHE_DTYPES = tuple(d.value for d in KvDtype)
# The methods that draft with a checkpoint of their own first (an EAGLE head, a smaller model), then mtp (the
# target's own MTP layers) and ngram: the order the settings' messages list them in.
SPECULATIVE_WITH_MODEL = tuple(m.value for m in DRAFTS_FROM_CHECKPOINT)
SPECULATIVE_METHODS = SPECULATIVE_WITH_MODEL + tuple(m.value for m in SpecMethod if m not in DRAFTS_FROM_CHECKPOINT)
# vLLM's state dtypes for linear-attention / Mamba layers (vllm/config/cache.py MambaDType, vLLM 0.32.0).
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")

SignalNames = Mapping[str, tuple[str, ...]]  # contract signal name -> engine metric names, preferred first


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The settings of one engine start, engine-neutral. ``None`` leaves the engine's own default."""

    tensor_parallel_size: int | None = None
    # GPUs of one engine start = tensor x pipeline parallelism; expert parallelism keeps MoE experts whole and
    # spreads them over the tensor-parallel ranks (None / False: the engine's default, off).
    pipeline_parallel_size: int | None = None
    enable_expert_parallel: bool = False
    # Data-parallel attention (vLLM --data-parallel-size): this many engine cores of tensor x pipeline GPUs each
    # behind one server; with expert parallelism the experts spread over all of their ranks. None: one.
    data_parallel_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # concurrent sequences (TensorRT-LLM: max_batch_size)
    max_num_batched_tokens: int | None = None  # tokens per step (TensorRT-LLM: max_num_tokens)
    gpu_memory_utilization: float | None = None  # TensorRT-LLM: free_gpu_memory_fraction
    kv_cache_dtype: str | None = None  # one of KV_CACHE_DTYPES
    # Weight precision applied at load: a quantization method (fp8, bnb-4bit, ...) or a dtype cast (bf16, fp16).
    # None: the checkpoint's own precision (a quantized checkpoint names its method in config.json).
    quantization: str | None = None
    enable_prefix_caching: bool = True
    # vLLM knobs a plan does not set, for local runs and tests.
    enforce_eager: bool = False  # no CUDA graphs
    kv_cache_memory_bytes: int | None = None  # vLLM: a fixed cache size, skipping the memory profile
    served_model_name: str | None = None
    # vLLM --limit-mm-per-prompt for vision-language models: (modality, items per prompt) pairs; image=0,video=0
    # serves text only (no vision tower loaded, no encoder profiled). Empty: vLLM's default.
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()
    mm_encoder_tp_mode: str | None = None  # vLLM --mm-encoder-tp-mode: weights (sharded) or data (replicated)
    mm_max_pixels: int | None = None  # vLLM --mm-processor-kwargs {"max_pixels": N} (Qwen-VL's largest image)
    # vLLM --mamba-cache-dtype (conv and SSM state) and --mamba-ssm-cache-dtype (SSM state only) of hybrid
    # linear-attention / Mamba models: one of MAMBA_DTYPES; None: vLLM's default, auto.
    mamba_cache_dtype: str | None = None
    mamba_ssm_cache_dtype: str | None = None
    # Speculative decoding: a method of SPECULATIVE_METHODS, the drafter's checkpoint (an EAGLE head or a draft
    # model; none for mtp and ngram) and the tokens drafted per step (mtp: the model's MTP layer count if unset).
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    # vLLM --hf-overrides: a JSON object of config.json changes the plan sized the model with (a RoPE scaling
    # that extends the context, and the length it extends to).
    hf_overrides: str | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_words()
        self._check_multimodal()
        self._check_speculative()

    def _check_numbers(self) -> None:
        for f in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "mm_max_pixels",
            "num_speculative_tokens",
        ):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, int | float) or not (0 < u <= 1)):
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {u!r}")
        for f in ("enable_prefix_caching", "enforce_eager", "enable_expert_parallel"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f}: must be true or false, got {getattr(self, f)!r}")

    def _check_words(self) -> None:
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        for f in ("quantization", "served_model_name", "speculative_model", "hf_overrides"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{f}: must be a non-empty string, got {v!r}")
        if self.hf_overrides is not None:
            try:
                overrides = json.loads(self.hf_overrides)
            except (json.JSONDecodeError, RecursionError):
                overrides = None
            if not isinstance(overrides, dict) or not overrides:
                raise ValueError(f"hf_overrides: must be a JSON object of config.json keys, got {self.hf_overrides!r}")
        for f in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, f) not in (None, *MAMBA_DTYPES):
                raise ValueError(f"{f}: must be one of {', '.join(MAMBA_DTYPES)}, got {getattr(self, f)!r}")

    def _check_multimodal(self) -> None:
        for pair in self.limit_mm_per_prompt:
            ok = isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            if not ok or isinstance(pair[1], bool) or not isinstance(pair[1], int) or pair[1] < 0:
                raise ValueError(f"limit_mm_per_prompt: expected modality: count (count >= 0), got {pair!r}")
        if self.mm_encoder_tp_mode not in (None, *MM_ENCODER_TP_MODES):
            modes = " or ".join(MM_ENCODER_TP_MODES)
            raise ValueError(f"mm_encoder_tp_mode: must be {modes}, got {self.mm_encoder_tp_mode!r}")

    def _check_speculative(self) -> None:
        method = self.speculative_method
        if method is None:
            if self.speculative_model is not None or self.num_speculative_tokens is not None:
                raise ValueError("speculative_method: must be set with speculative_model or num_speculative_tokens")
            return
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if (method in SPECULATIVE_WITH_MODEL) != (self.speculative_model is not None):
            need = "needs a" if method in SPECULATIVE_WITH_MODEL else "takes no"
            raise ValueError(f"speculative_model: {method} {need} draft checkpoint")
        if method != "mtp" and self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens: {method} needs it")

    @property
    def gpus(self) -> int:
        """GPUs one engine start takes: every data-parallel rank's tensor x pipeline GPUs."""
        return (self.tensor_parallel_size or 1) * (self.pipeline_parallel_size or 1) * (self.data_parallel_size or 1)

    def to_json(self) -> str:
        """Compact JSON without the defaults: what the stacks put in ``contract.ENV_ENGINE_ARGS``."""
        defaults = EngineArgs()
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }
        if "limit_mm_per_prompt" in out:
            out["limit_mm_per_prompt"] = dict(self.limit_mm_per_prompt)
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        """The inverse of ``to_json``. ValueError names the key at fault (unknown keys are errors)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise ValueError(f"not JSON ({getattr(err, 'msg', 'nested too deeply')})") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object of engine settings")
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        value = data.get("gpu_memory_utilization")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("gpu_memory_utilization: must be a finite number")
        limits = data.get("limit_mm_per_prompt")
        if limits is not None:
            if not isinstance(limits, Mapping):
                raise ValueError(f"limit_mm_per_prompt: must map modality to count, got {limits!r}")
            data = {**data, "limit_mm_per_prompt": tuple(sorted((str(k), v) for k, v in limits.items()))}
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class AwsContainer:
    """The AWS Deep Learning Container that runs the engine without the kvfleet agent (image.source dlc)."""

    framework: str  # the SageMaker SDK's framework name for it (sagemaker.core.image_uris)
    # A container that bundles the engine under releases of its own (DJL's LMI): its name for people, and the word
    # its tags put before the engine release they bundle ("0.33.0-tensorrtllm0.21.0-cu128"). None: the container is
    # released per engine release, under the engine's own version.
    bundled_by: str | None = None
    bundle_tag: str = ""
    # containers/Dockerfile builds the kvfleet image on this container by default (``default_base_image``), so a
    # kvfleet image of the same engine release carries its CUDA.
    kvfleet_image_base: bool = False


class EngineAdapter(ABC):
    """One serving engine: how kvfleet starts it, configures it and reads its metrics."""

    name: ClassVar[str]
    title: ClassVar[str]  # for people
    # The engine's Prometheus endpoint (on its own port, behind the agent).
    metrics_path: ClassVar[str]
    # The metric whose labels give the KV cache the engine allocated: (name, blocks label, block size label).
    capacity_metric: ClassVar[tuple[str, str, str] | None] = None
    # A JSON endpoint of iteration statistics (TensorRT-LLM): the KV cache and the queue where the Prometheus text
    # lacks them, and the allocated cache (kvfleet.agent.metrics.iteration_gauges reads it).
    iteration_stats_path: ClassVar[str | None] = None
    health_path: ClassVar[str] = "/health"
    # The image the kvfleet serving image is built on by default (containers/Dockerfile, --build-arg BASE_IMAGE).
    default_base_image: ClassVar[str]
    # (first release, contract signal -> engine metric names), oldest first: a release uses the last row at or
    # below it. Each row lists the release's own name first and other releases' after it, so a wrong or stale
    # version string still finds the metric; the version only decides which name wins when both exist.
    metric_rows: ClassVar[tuple[tuple[str, SignalNames], ...]]
    # The AWS container that runs the engine alone; None: AWS publishes none (image.source kvfleet only).
    dlc: ClassVar[AwsContainer | None] = None
    # What the engine does with GPU memory, for kvfleet.sizing (kvfleet.engines.capacity; the engine's profiles.py).
    capacity: ClassVar[EngineCapacity]
    # The speculative-decoding methods it runs (kvfleet.engines.vocabulary.SpecMethod values).
    speculative_methods: ClassVar[frozenset[str]] = frozenset(SPECULATIVE_METHODS)
    # EngineArgs fields the engine has no option for, or whose effect kvfleet does not size on it: ``settings``
    # refuses them set, and an environment file naming one is refused at load.
    refused_settings: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def settings(self, args: EngineArgs) -> dict[str, Any]:
        """The settings in the engine's own terms (vLLM flags without "--", TensorRT-LLM LLM-API options)."""

    @abstractmethod
    def server_command(
        self, args: EngineArgs, *, model: str, port: int, python: str, options_file: str | None
    ) -> list[str]:
        """The engine's OpenAI-compatible server on 127.0.0.1:``port``."""

    def options_file(self, args: EngineArgs) -> str | None:
        """Text of an options file the server command reads (``options_file``), or None for none."""
        return None

    def server_environment(self, version: Version) -> dict[str, str]:
        """Variables for the engine's server process as the agent starts it (on top of the agent's own)."""
        return {}

    def keep_alive_s(self, version: Version) -> float:
        """How long the engine's HTTP server keeps an idle connection open when started by the agent, which
        reuses a pooled connection only well inside it. Both engines serve through uvicorn, whose default is 5 s."""
        return 5.0

    @abstractmethod
    def dlc_environment(
        self, args: EngineArgs, *, model: str, max_input_tokens: int, max_output_tokens: int
    ) -> dict[str, str]:
        """The variables AWS's own image for this engine reads, for deployments that run it without the agent."""

    @abstractmethod
    def describe(self, args: EngineArgs) -> str:
        """One line for people: how to start the engine with these settings."""

    @abstractmethod
    def scheduler(self, args: EngineArgs) -> Scheduler:
        """The engine's scheduling rules as these settings start it (kvfleet.engines.scheduling): the one model of
        them that the plan, the simulator, the derived scaling and a calibration's replay run."""

    def settings_json(self, args: EngineArgs) -> dict[str, Any]:
        """What ``kvfleet plan --json`` shows of the settings."""
        return {"engine": self.name, "settings": self.settings(args), "command": self.describe(args)}

    def metric_names(self, version: str) -> tuple[Version, SignalNames]:
        """(the row's first release, its name table) for ``version``; ValueError for a malformed version."""
        parsed = parse_version(version)
        rows = [(parse_version(since), names) for since, names in self.metric_rows]
        chosen = rows[0]
        for row in rows:
            if row[0] <= parsed:
                chosen = row
        return chosen
