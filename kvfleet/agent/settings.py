"""The agent's settings, read once from the container environment the stacks set (``kvfleet.deployments``).

Every variable is named in ``kvfleet.contract``; a bad value is one ``SettingsError`` line naming it.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet import contract
from kvfleet.engines import ENGINES, EngineAdapter, EngineArgs
from kvfleet.versions import Version, parse_version


class SettingsError(ValueError):
    """A bad container environment: one line naming the variable and what it must be."""


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    engine: str  # a kvfleet.engines name
    engine_version: str
    model: str  # a local directory or a Hugging Face id
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    deployment: str
    replica: str
    namespace: str = contract.NAMESPACE
    host: str = "0.0.0.0"
    port: int = contract.SERVING_PORT
    engine_port: int = contract.ENGINE_PORT
    engine_python: str = "python3"  # the interpreter that has the engine installed
    engine_command: tuple[str, ...] | None = None  # replaces the adapter's command line ({port}, {model})
    drain_budget_s: float = 300.0
    token_budget: int | None = None  # KV tokens one replica holds (from the plan)
    admission: bool = True
    # Tokens admitted (queued + running) per token of KV cache: 1.0 admits what the cache holds; 2.0
    # also queues as much again, enough to keep batches full without TTFT growing without bound.
    admission_factor: float = contract.ADMISSION_FACTOR
    retry_after_s: int = 2
    publish_interval_s: float = float(contract.PUBLISH_INTERVAL_S)
    put_metric_data: bool = False
    request_log: bool = True  # one line per generation request on stdout (contract.REQUEST_LOG_FIELDS)
    region: str | None = None
    tenant_header: str | None = None  # isolation on when set together with the secret
    tenant_secret: bytes | None = field(default=None, repr=False)
    hf_token_secret_arn: str | None = None
    # Where the tenant salt key is read from at start-up (Secrets Manager), when it is not given directly.
    tenant_secret_arn: str | None = None
    engine_ready_timeout_s: float = 3600.0
    restart_backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
    engine_kill_grace_s: float = 10.0  # what an engine left behind gets between SIGTERM and SIGKILL
    # Before a restart on a GPU host: how long to wait for the old engine's device memory to be free
    # (a new engine started while it is still held fails its own allocation); 0 does not wait.
    gpu_release_timeout_s: float = 120.0
    # How long the engine may be down (since it last served, or since the agent started) before the liveness route
    # says the replica failed; the supervisor adds its own restart overhead. The stacks that poll the route set it.
    restart_budget_s: float = 3600.0

    @property
    def adapter(self) -> EngineAdapter:
        return ENGINES[self.engine]

    @property
    def engine_release(self) -> Version:
        return parse_version(self.engine_version)

    @property
    def engine_environment(self) -> dict[str, str]:
        """What the engine's server process gets on top of the agent's environment (its HTTP keep-alive)."""
        return self.adapter.server_environment(self.engine_release)

    @property
    def engine_keep_alive_s(self) -> float:
        return self.adapter.keep_alive_s(self.engine_release)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def metrics_path(self) -> str:
        return self.adapter.metrics_path

    @property
    def health_path(self) -> str:
        return self.adapter.health_path

    @property
    def tenant_isolation(self) -> bool:
        return self.tenant_header is not None and self.tenant_secret is not None

    @property
    def admitted_tokens(self) -> int | None:
        return self.admitted_tokens_for(None)

    def admitted_tokens_for(self, engine_kv_tokens: int | None) -> int | None:
        """The admission budget: the plan's KV tokens, or the cache the engine reports allocating where that is
        smaller (a cold first boot, another driver or release: the engine sizes its cache at start-up, whatever the
        plan said), times the admission factor. None: admission off."""
        if not self.admission or self.token_budget is None:
            return None
        tokens = self.token_budget if engine_kv_tokens is None else min(self.token_budget, engine_kv_tokens)
        return int(tokens * self.admission_factor)

    @property
    def max_model_len(self) -> int | None:
        return self.engine_args.max_model_len


def _int(env: Mapping[str, str], name: str, default: int, *, maximum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise SettingsError(f"{name}: must be an integer, got {raw!r}") from None
    if v < 0:
        raise SettingsError(f"{name}: must not be negative, got {raw!r}")
    if maximum is not None and v > maximum:
        raise SettingsError(f"{name}: must be at most {maximum}, got {raw!r}")
    return v


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name, 0) if env.get(name) else None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise SettingsError(f"{name}: must be a number, got {raw!r}") from None
    if not math.isfinite(v) or v < 0:
        raise SettingsError(f"{name}: must be a finite number, not negative, got {raw!r}")
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


def check_contract_version(env: Mapping[str, str]) -> None:
    """The stack and the image must speak the same contract; unset (a local run) passes."""
    raw = env.get(contract.ENV_CONTRACT_VERSION)
    if raw is None or raw.strip() == str(contract.CONTRACT_VERSION):
        return
    raise SettingsError(
        f"{contract.ENV_CONTRACT_VERSION}: the stack speaks contract {raw!r}, this image contract "
        f"{contract.CONTRACT_VERSION}; deploy an image built for contract {raw} (tag *-kvfleet{raw})"
    )


def _engine_args(env: Mapping[str, str], engine: EngineAdapter) -> EngineArgs:
    name = contract.ENV_ENGINE_ARGS
    try:
        args = EngineArgs.from_json(env.get(name) or "{}")
        engine.settings(args)  # settings the engine has no knob for fail here, not at the engine's start
    except ValueError as err:
        raise SettingsError(f"{name}: {err}") from None
    return args


def _engine_command(env: Mapping[str, str]) -> tuple[str, ...] | None:
    name = contract.ENV_ENGINE_COMMAND
    if not env.get(name):
        return None
    try:
        cmd = json.loads(env[name])
    except (json.JSONDecodeError, RecursionError):
        cmd = None
    if not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
        raise SettingsError(f"{name}: must be a JSON list of strings")
    return tuple(cmd)


def _tenant(env: Mapping[str, str]) -> tuple[str | None, bytes | None]:
    secret: bytes | None = None
    if env.get(contract.ENV_TENANT_SECRET_FILE):
        path = Path(env[contract.ENV_TENANT_SECRET_FILE])
        try:
            secret = path.read_bytes().strip()
        except OSError as err:
            raise SettingsError(f"{contract.ENV_TENANT_SECRET_FILE}: cannot read {path}: {err.strerror}") from None
    elif env.get(contract.ENV_TENANT_SECRET):
        secret = env[contract.ENV_TENANT_SECRET].encode()
    header = env.get(contract.ENV_TENANT_HEADER) or None
    from_secrets_manager = bool(env.get(contract.ENV_TENANT_SECRET_ARN))
    if (header is None) != (not secret and not from_secrets_manager):
        raise SettingsError(
            f"{contract.ENV_TENANT_HEADER} and {contract.ENV_TENANT_SECRET} (or {contract.ENV_TENANT_SECRET_FILE}, or "
            f"{contract.ENV_TENANT_SECRET_ARN}): set both to isolate prefix caching per tenant"
        )
    return header, secret or None


def from_env(env: Mapping[str, str] | None = None) -> AgentSettings:
    env = os.environ if env is None else env
    check_contract_version(env)
    engine = env.get(contract.ENV_ENGINE) or "vllm"
    if engine not in ENGINES:
        raise SettingsError(f"{contract.ENV_ENGINE}: must be one of {', '.join(ENGINES)}, got {engine!r}")
    adapter = ENGINES[engine]
    version = env.get(contract.ENV_ENGINE_VERSION) or "0.0.0"
    try:
        adapter.metric_names(version)
    except ValueError as err:
        raise SettingsError(f"{contract.ENV_ENGINE_VERSION}: {err}") from None
    model = env.get(contract.ENV_MODEL)
    if not model:
        raise SettingsError(f"{contract.ENV_MODEL}: required (a model directory or a Hugging Face id)")
    args = _engine_args(env, adapter)
    header, secret = _tenant(env)
    port = _int(env, contract.ENV_PORT, contract.SERVING_PORT, maximum=65535)
    engine_port = _int(env, contract.ENV_ENGINE_PORT, contract.ENGINE_PORT, maximum=65535)
    if port == engine_port:
        raise SettingsError(f"{contract.ENV_ENGINE_PORT}: must differ from {contract.ENV_PORT} ({port})")
    return AgentSettings(
        engine=engine,
        engine_version=version,
        model=model,
        engine_args=args,
        deployment=env.get(contract.ENV_DEPLOYMENT) or "local",
        replica=env.get(contract.ENV_REPLICA) or socket.gethostname(),
        namespace=env.get(contract.ENV_NAMESPACE) or contract.NAMESPACE,
        host=env.get(contract.ENV_HOST) or "0.0.0.0",
        port=port,
        engine_port=engine_port,
        engine_python=env.get(contract.ENV_ENGINE_PYTHON) or "python3",
        engine_command=_engine_command(env),
        drain_budget_s=_float(env, contract.ENV_DRAIN_BUDGET_S, 300.0),
        token_budget=_optional_int(env, contract.ENV_TOKEN_BUDGET),
        admission=_bool(env, contract.ENV_ADMISSION, True),
        admission_factor=_float(env, contract.ENV_ADMISSION_FACTOR, contract.ADMISSION_FACTOR),
        retry_after_s=_int(env, contract.ENV_RETRY_AFTER_S, 2) or 1,
        publish_interval_s=_float(env, contract.ENV_PUBLISH_INTERVAL_S, float(contract.PUBLISH_INTERVAL_S)) or 1.0,
        put_metric_data=_bool(env, contract.ENV_PUT_METRIC_DATA, False),
        request_log=_bool(env, contract.ENV_REQUEST_LOG, True),
        region=env.get(contract.REGION_VARIABLE) or env.get("AWS_DEFAULT_REGION"),
        tenant_header=header,
        tenant_secret=secret,
        hf_token_secret_arn=env.get(contract.ENV_HF_TOKEN_SECRET_ARN) or None,
        tenant_secret_arn=None if secret else env.get(contract.ENV_TENANT_SECRET_ARN) or None,
        engine_ready_timeout_s=_float(env, contract.ENV_ENGINE_READY_TIMEOUT_S, 3600.0),
        gpu_release_timeout_s=_float(env, contract.ENV_GPU_RELEASE_TIMEOUT_S, 120.0),
        restart_budget_s=_float(env, contract.ENV_RESTART_BUDGET_S, 3600.0),
    )
