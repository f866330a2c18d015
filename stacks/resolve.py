"""From an environment file to what each stack builds: the plan, decided once, as typed objects.

Pure Python (no aws_cdk): the CDK app, the tests and the manifests of every target read the same
ResolvedDeployment, so the instance type, the engine flags and the timeouts cannot drift apart.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from sizing.catalog import resolve_model
from sizing.errors import KvfleetError
from sizing.memory import weight_bytes
from sizing.planner import Candidate, plan
from sizing.settings import engine_settings
from sizing.startup import StartupEstimate, startup_estimate
from sizing.units import GiB
from stacks import signals
from stacks.config import Deployment, Environment, SageMakerTarget, plan_requests

SAGEMAKER_MODEL_DIR = "/opt/ml/model"  # where SageMaker puts ModelDataSource files
SERVING_PORT = 8080  # SageMaker's container contract; the agent listens here on every target
IMAGE_DISK_GIB = 30  # engine image layers on the instance's disk
_TIMEOUT_SAFETY = 2.0  # timeouts are twice the estimate: too short kills a replica that would have come up


@dataclass(frozen=True, kw_only=True)
class ResolvedDeployment:
    environment: Environment
    deployment: Deployment
    candidate: Candidate  # the plan's choice
    alternatives: tuple[Candidate, ...]  # the next feasible instance types, best first
    model_id: str  # Hugging Face id (catalog id)
    checkpoint_bytes: int  # the checkpoint as stored (what is downloaded and read from disk)
    startup: StartupEstimate

    @property
    def deployment_id(self) -> str:
        return signals.deployment_id(self.environment.name, self.deployment.name)

    @property
    def stack_name(self) -> str:
        return f"kvfleet-{self.deployment_id}"

    @property
    def engine(self) -> str:
        return self.deployment.engine.name

    @property
    def instance_type(self) -> str:
        c = self.candidate
        return c.instance.sagemaker_name if c.platform.value == "sagemaker" and c.instance.sagemaker_name else c.name

    @property
    def initial_instance_count(self) -> int:
        s = self.deployment.scaling
        return min(max(self.candidate.instance_count, s.min_replicas, 1), s.max_replicas)

    @property
    def kv_cache_tokens(self) -> int:
        return self.candidate.capacity.kv_cache_tokens

    @property
    def model_location(self) -> str:
        """What the engine loads: the local copy of the S3 prefix, or the Hugging Face id."""
        return SAGEMAKER_MODEL_DIR if self.deployment.model.s3_uri else self.model_id

    @property
    def engine_settings(self) -> dict[str, object]:
        return engine_settings(self.candidate, enable_prefix_caching=True)

    @property
    def disk_gib(self) -> int:
        """Disk for the image plus the weights, with room for a second copy during a download retry."""
        return IMAGE_DISK_GIB + math.ceil(1.2 * self.checkpoint_bytes / GiB)

    @property
    def download_timeout_s(self) -> int:
        return _clamp(_TIMEOUT_SAFETY * (self.startup.download_s + self.startup.image_pull_s))

    @property
    def startup_timeout_s(self) -> int:
        # An engine that downloads from Hugging Face itself does so inside the health-check window.
        s = self.startup.container_start_s + (0 if self.deployment.model.s3_uri else self.startup.download_s)
        return _clamp(_TIMEOUT_SAFETY * s)

    def container_environment(self, *, isolated: bool = False) -> dict[str, str]:
        """Environment of the serving container. DLC images take their engine's own variables."""
        if self.deployment.image.source == "dlc":
            return self._dlc_environment()
        env = {
            signals.ENV_ENGINE: self.engine,
            signals.ENV_ENGINE_VERSION: self.deployment.engine.version,
            signals.ENV_MODEL: self.model_location,
            signals.ENV_ENGINE_ARGS: json.dumps(_engine_args(self.engine_settings), sort_keys=True),
            signals.ENV_PORT: str(SERVING_PORT),
            signals.ENV_DEPLOYMENT: self.deployment_id,
            signals.ENV_NAMESPACE: signals.NAMESPACE,
            signals.ENV_DRAIN_BUDGET_S: str(self.deployment.scaling.drain_budget_s),
            signals.ENV_TOKEN_BUDGET: str(self.kv_cache_tokens),
            # EMF lines on stdout become metrics through the container's log stream, which also works with
            # no network; PutMetricData on top would count every data point twice.
            signals.ENV_PUT_METRIC_DATA: "0",
        }
        if self.deployment.model.hf_token_secret and not isolated:
            env[signals.ENV_HF_TOKEN_SECRET_ARN] = self.deployment.model.hf_token_secret
        return env

    def _dlc_environment(self) -> dict[str, str]:
        settings = self.engine_settings
        if self.engine == "vllm":
            # The vLLM DLC's entrypoint turns SM_VLLM_<NAME>=<value> into --<name> <value> (empty: a bare flag).
            env = {"SM_VLLM_MODEL": self.model_location}
            for k, v in _engine_args(settings).items():
                env["SM_VLLM_" + k.upper().replace("-", "_")] = "" if v is True else str(v)
            return env
        opts = _engine_args(settings)
        kv = opts["kv_cache_config"]
        assert isinstance(kv, dict)
        w = self.deployment.workload
        # DJL LMI's TensorRT-LLM options (option.<name>, given as OPTION_<NAME>).
        env = {
            "HF_MODEL_ID": self.model_location,
            "OPTION_ROLLING_BATCH": "trtllm",
            "OPTION_TENSOR_PARALLEL_DEGREE": str(opts["tensor_parallel_size"]),
            "OPTION_MAX_ROLLING_BATCH_SIZE": str(opts["max_batch_size"]),
            "OPTION_MAX_NUM_TOKENS": str(opts["max_num_tokens"]),
            "OPTION_MAX_INPUT_LEN": str(w.max_input_tokens),
            "OPTION_MAX_OUTPUT_LEN": str(w.max_output_tokens),
            "OPTION_KV_CACHE_FREE_GPU_MEM_FRACTION": str(kv["free_gpu_memory_fraction"]),
            "OPTION_ENABLE_KV_CACHE_REUSE": str(bool(kv["enable_block_reuse"])).lower(),
        }
        if self.candidate.online_quantization:
            env["OPTION_QUANTIZE"] = self.candidate.online_quantization
        return env


def _engine_args(settings: dict[str, object]) -> dict[str, object]:
    out = settings.get("args") or settings.get("llm_api_options")
    assert isinstance(out, dict)
    return out


def _clamp(seconds: float) -> int:
    # SageMaker accepts 60..3600 s for both health-check timeouts.
    return int(min(3600, max(600, math.ceil(seconds / 60) * 60)))


def resolve_environment(env: Environment) -> tuple[ResolvedDeployment, ...]:
    """Plan every deployment. A deployment that cannot be planned is the user's error (one line)."""
    out = []
    for (name, req), d in zip(plan_requests(env), env.deployments, strict=True):
        try:
            result = plan(req)
        except KvfleetError as err:
            raise KvfleetError(str(err), field=f"deployments.{name}") from None
        best = result.best
        seen = {best.instance.name}
        alternatives = []
        for c in result.candidates[1:]:
            if c.instance.name not in seen:
                seen.add(c.instance.name)
                alternatives.append(c)
        model = resolve_model(d.model.id)
        if "/" not in model.model_id and d.model.s3_uri is None:
            raise KvfleetError(
                f"{d.model.id!r} is not a Hugging Face id, so the engine cannot download it: set model.s3_uri",
                field=f"deployments.{name}.model",
            )
        ckpt = weight_bytes(model, tp=1, scheme=model.native_scheme).weights_bytes_per_gpu
        out.append(
            ResolvedDeployment(
                environment=env,
                deployment=d,
                candidate=best,
                alternatives=tuple(alternatives),
                model_id=model.model_id,
                checkpoint_bytes=ckpt,
                startup=startup_estimate(checkpoint_bytes=ckpt),
            )
        )
        _check_target(out[-1])
    return tuple(out)


def _check_target(r: ResolvedDeployment) -> None:
    t = r.deployment.target
    if isinstance(t, SageMakerTarget):
        nvme = r.candidate.instance.local_nvme_gb
        need_gb = math.ceil(r.disk_gib * GiB / 1e9)
        if nvme and nvme < need_gb:
            raise KvfleetError(
                f"{r.instance_type} has {nvme} GB of instance storage, the image and weights need {need_gb} GB; "
                "pin a larger sizing.instance_type or a smaller weight precision",
                field=f"deployments.{r.deployment.name}.sizing",
            )
        if r.disk_gib > 512 and not nvme:
            raise KvfleetError(
                f"the weights need a {r.disk_gib} GiB volume, SageMaker allows 512: choose an instance type with "
                "local NVMe storage (sizing.families)",
                field=f"deployments.{r.deployment.name}.sizing",
            )
