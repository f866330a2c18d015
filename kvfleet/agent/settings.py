"""The agent's settings, read once from the container environment the stacks set (stacks/resolve.py)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet import contract


class SettingsError(ValueError):
    """A bad container environment: one line naming the variable and what it must be."""


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    engine: str  # "vllm" or "trtllm"
    engine_version: str
    model: str  # a local directory or a Hugging Face id
    engine_args: Mapping[str, Any]  # vLLM flags without "--", or TensorRT-LLM LLM-API options
    deployment: str
    replica: str
    namespace: str = contract.NAMESPACE
    host: str = "0.0.0.0"
    port: int = 8080
    engine_port: int = 8081
    engine_python: str = "python3"  # the interpreter that has vLLM installed
    engine_command: tuple[str, ...] | None = None  # replaces the built-in engine command line
    drain_budget_s: float = 300.0
    token_budget: int | None = None  # KV tokens one replica holds (from the plan)
    admission: bool = True
    # Tokens admitted (queued + running) per token of KV cache: 1.0 admits what the cache holds; 2.0
    # also queues as much again, enough to keep batches full without TTFT growing without bound.
    admission_factor: float = 2.0
    retry_after_s: int = 2
    publish_interval_s: float = float(contract.PUBLISH_INTERVAL_S)
    put_metric_data: bool = False
    region: str | None = None
    tenant_header: str | None = None  # isolation on when set together with the secret
    tenant_secret: bytes | None = field(default=None, repr=False)
    hf_token_secret_arn: str | None = None
    engine_ready_timeout_s: float = 3600.0
    restart_backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def metrics_path(self) -> str:
        # trtllm-serve's /metrics is JSON iteration stats (and blocks under load); Prometheus text is here.
        return "/prometheus/metrics" if self.engine == "trtllm" else "/metrics"

    @property
    def tenant_isolation(self) -> bool:
        return self.tenant_header is not None and self.tenant_secret is not None

    @property
    def admitted_tokens(self) -> int | None:
        if not self.admission or self.token_budget is None:
            return None
        return int(self.token_budget * self.admission_factor)

    @property
    def max_model_len(self) -> int | None:
        v = self.engine_args.get("max-model-len", self.engine_args.get("max_seq_len"))
        return int(v) if v is not None else None


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}: must be an integer, got {raw!r}") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise SettingsError(f"{name}: must be a number, got {raw!r}") from None
    if v < 0:
        raise SettingsError(f"{name}: must not be negative, got {raw!r}")
    return v


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}: must be 1 or 0, got {raw!r}")


def from_env(env: Mapping[str, str] | None = None) -> AgentSettings:
    env = os.environ if env is None else env
    engine = env.get(contract.ENV_ENGINE, "vllm")
    if engine not in ("vllm", "trtllm"):
        raise SettingsError(f"{contract.ENV_ENGINE}: must be vllm or trtllm, got {engine!r}")
    model = env.get(contract.ENV_MODEL)
    if not model:
        raise SettingsError(f"{contract.ENV_MODEL}: required (a model directory or a Hugging Face id)")
    try:
        args = json.loads(env.get(contract.ENV_ENGINE_ARGS, "{}"))
    except json.JSONDecodeError as err:
        raise SettingsError(f"{contract.ENV_ENGINE_ARGS}: not JSON ({err.msg})") from None
    if not isinstance(args, dict):
        raise SettingsError(f"{contract.ENV_ENGINE_ARGS}: must be a JSON object of engine settings")
    command = None
    if env.get("KVFLEET_ENGINE_COMMAND"):
        try:
            cmd = json.loads(env["KVFLEET_ENGINE_COMMAND"])
        except json.JSONDecodeError:
            cmd = None
        if not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
            raise SettingsError("KVFLEET_ENGINE_COMMAND: must be a JSON list of strings")
        command = tuple(cmd)
    secret: bytes | None = None
    if env.get("KVFLEET_TENANT_SECRET_FILE"):
        path = Path(env["KVFLEET_TENANT_SECRET_FILE"])
        try:
            secret = path.read_bytes().strip()
        except OSError as err:
            raise SettingsError(f"KVFLEET_TENANT_SECRET_FILE: cannot read {path}: {err.strerror}") from None
    elif env.get("KVFLEET_TENANT_SECRET"):
        secret = env["KVFLEET_TENANT_SECRET"].encode()
    header = env.get("KVFLEET_TENANT_HEADER") or None
    if (header is None) != (secret is None):
        raise SettingsError(
            "KVFLEET_TENANT_HEADER and KVFLEET_TENANT_SECRET(_FILE): set both to isolate prefix caching per tenant"
        )
    port = _int(env, contract.ENV_PORT, 8080)
    engine_port = _int(env, "KVFLEET_ENGINE_PORT", 8081)
    assert port is not None and engine_port is not None
    if port == engine_port:
        raise SettingsError("KVFLEET_ENGINE_PORT: must differ from KVFLEET_PORT")
    return AgentSettings(
        engine=engine,
        engine_version=env.get(contract.ENV_ENGINE_VERSION, "0.0.0"),
        model=model,
        engine_args=args,
        deployment=env.get(contract.ENV_DEPLOYMENT, "local"),
        replica=env.get("KVFLEET_REPLICA") or socket.gethostname(),
        namespace=env.get(contract.ENV_NAMESPACE, contract.NAMESPACE),
        host=env.get("KVFLEET_HOST", "0.0.0.0"),
        port=port,
        engine_port=engine_port,
        engine_python=env.get("KVFLEET_ENGINE_PYTHON", "python3"),
        engine_command=command,
        drain_budget_s=_float(env, contract.ENV_DRAIN_BUDGET_S, 300.0),
        token_budget=_int(env, contract.ENV_TOKEN_BUDGET, None),
        admission=_bool(env, "KVFLEET_ADMISSION", True),
        admission_factor=_float(env, "KVFLEET_ADMISSION_FACTOR", 2.0),
        retry_after_s=_int(env, "KVFLEET_RETRY_AFTER_S", 2) or 1,
        publish_interval_s=_float(env, "KVFLEET_PUBLISH_INTERVAL_S", float(contract.PUBLISH_INTERVAL_S)) or 1.0,
        put_metric_data=_bool(env, contract.ENV_PUT_METRIC_DATA, False),
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        tenant_header=header,
        tenant_secret=secret,
        hf_token_secret_arn=env.get(contract.ENV_HF_TOKEN_SECRET_ARN) or None,
        engine_ready_timeout_s=_float(env, "KVFLEET_ENGINE_READY_TIMEOUT_S", 3600.0),
    )
