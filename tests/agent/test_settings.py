"""The agent reads exactly the container environment the stacks write (one contract, both sides)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet import contract
from kvfleet.agent import __main__ as agent_main
from kvfleet.agent.engine import command
from kvfleet.agent.settings import SettingsError, from_env
from kvfleet.deployments import resolve_environment
from kvfleet.engines import EngineArgs
from tests.envs import SAGEMAKER_ENV, environment

M = {contract.ENV_MODEL: "m"}


def test_agent_understands_the_stack_environment() -> None:
    [r] = resolve_environment(environment())
    s = from_env(r.container_environment())
    assert s.engine == "vllm" and s.engine_version == "0.30.0"
    assert s.model == "meta-llama/Llama-3.1-8B"
    assert s.engine_args == r.engine_args
    assert s.deployment == "test-chat"
    assert s.drain_budget_s == 420
    assert s.token_budget == r.kv_cache_tokens
    assert s.port == contract.SERVING_PORT and s.engine_port == contract.ENGINE_PORT
    assert s.hf_token_secret_arn == "kvfleet/hf-token"
    assert s.put_metric_data is False
    assert s.max_model_len == r.engine_args.max_model_len == 5120
    assert s.metrics_path == r.adapter.metrics_path
    cmd = command(s)
    # The adapter's own rendering, the same the plan shows: one renderer.
    assert cmd == r.adapter.server_command(
        r.engine_args, model=s.model, port=contract.ENGINE_PORT, python="python3", options_file=None
    )
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(r.candidate.concurrency_per_replica)
    assert "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == str(contract.ENGINE_PORT) and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_trtllm_gets_its_options_file() -> None:
    text = SAGEMAKER_ENV.replace("name: vllm", "name: trtllm").replace('version: "0.30.0"', 'version: "1.0.0"')
    [r] = resolve_environment(environment(text))
    s = from_env(r.container_environment())
    assert s.engine == "trtllm" and s.metrics_path == "/prometheus/metrics"
    assert s.engine_args == r.engine_args
    options = s.adapter.options_file(s.engine_args)
    assert options is not None
    assert json.loads(options)["max_batch_size"] == r.candidate.concurrency_per_replica
    cmd = command(s, options_file="/tmp/o.yaml")
    assert cmd[:2] == ["trtllm-serve", "meta-llama/Llama-3.1-8B"]
    assert cmd[-2:] == ["--extra_llm_api_options", "/tmp/o.yaml"]


def test_the_test_command_override_fills_port_and_model() -> None:
    s = from_env({**M, contract.ENV_ENGINE_COMMAND: json.dumps(["fake", "--port", "{port}", "{model}"])})
    assert command(s) == ["fake", "--port", str(contract.ENGINE_PORT), "m"]


def test_every_agent_variable_is_read_by_its_contract_name(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("k3y\n")
    env = {
        **M,
        contract.ENV_HOST: "127.0.0.1",
        contract.ENV_PORT: "9000",
        contract.ENV_ENGINE_PORT: "9001",
        contract.ENV_ENGINE_PYTHON: "/opt/venv/bin/python",
        contract.ENV_ENGINE_READY_TIMEOUT_S: "120",
        contract.ENV_ADMISSION: "0",
        contract.ENV_ADMISSION_FACTOR: "1.5",
        contract.ENV_RETRY_AFTER_S: "7",
        contract.ENV_PUBLISH_INTERVAL_S: "3",
        contract.ENV_TENANT_HEADER: "X-Tenant",
        contract.ENV_TENANT_SECRET_FILE: str(secret),
        contract.ENV_REPLICA: "r-9",
        contract.ENV_DEPLOYMENT: "d",
        contract.ENV_NAMESPACE: "Ns",
        contract.ENV_PUT_METRIC_DATA: "1",
    }
    s = from_env(env)
    assert (s.host, s.port, s.engine_port, s.engine_python) == ("127.0.0.1", 9000, 9001, "/opt/venv/bin/python")
    assert (s.engine_ready_timeout_s, s.admission, s.admission_factor) == (120.0, False, 1.5)
    assert (s.retry_after_s, s.publish_interval_s) == (7, 3.0)
    assert (s.tenant_header, s.tenant_secret, s.replica, s.deployment, s.namespace) == (
        "X-Tenant",
        b"k3y",
        "r-9",
        "d",
        "Ns",
    )
    assert s.put_metric_data is True
    assert from_env({**M, contract.ENV_TENANT_HEADER: "X-T", contract.ENV_TENANT_SECRET: "s"}).tenant_secret == b"s"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, f"{contract.ENV_MODEL}: required"),
        ({**M, contract.ENV_ENGINE: "sglang"}, f"{contract.ENV_ENGINE}: must be one of vllm, trtllm"),
        ({**M, contract.ENV_ENGINE_VERSION: "latest"}, f"{contract.ENV_ENGINE_VERSION}: expected a release"),
        ({**M, contract.ENV_ENGINE_ARGS: "{nope"}, f"{contract.ENV_ENGINE_ARGS}: not JSON"),
        ({**M, contract.ENV_ENGINE_ARGS: "[1]"}, f"{contract.ENV_ENGINE_ARGS}: must be a JSON object"),
        # The old flag-style keys are not settings any more: named, with what is known.
        ({**M, contract.ENV_ENGINE_ARGS: '{"max-model-len": 1024}'}, "unknown setting 'max-model-len'; known: "),
        ({**M, contract.ENV_ENGINE_ARGS: '{"max_model_len": "1024"}'}, "max_model_len: must be a positive integer"),
        ({**M, contract.ENV_ENGINE_ARGS: '{"enforce_eager": 1}'}, "enforce_eager: must be true or false"),
        # A vLLM-only setting on TensorRT-LLM fails at start, not when the engine is spawned.
        (
            {**M, contract.ENV_ENGINE: "trtllm", contract.ENV_ENGINE_ARGS: '{"enforce_eager": true}'},
            f"{contract.ENV_ENGINE_ARGS}: enforce_eager, kv_cache_memory_bytes, served_model_name and hf_overrides "
            "are vLLM",
        ),
        ({**M, contract.ENV_ENGINE_COMMAND: '["a", 1]'}, f"{contract.ENV_ENGINE_COMMAND}: must be a JSON list"),
        ({**M, contract.ENV_DRAIN_BUDGET_S: "soon"}, f"{contract.ENV_DRAIN_BUDGET_S}: must be a number"),
        ({**M, contract.ENV_DRAIN_BUDGET_S: "nan"}, f"{contract.ENV_DRAIN_BUDGET_S}: must be a finite number"),
        ({**M, contract.ENV_TOKEN_BUDGET: "1.5"}, f"{contract.ENV_TOKEN_BUDGET}: must be an integer"),
        ({**M, contract.ENV_TOKEN_BUDGET: "-1"}, f"{contract.ENV_TOKEN_BUDGET}: must not be negative"),
        ({**M, contract.ENV_ADMISSION: "maybe"}, f"{contract.ENV_ADMISSION}: must be 1 or 0"),
        ({**M, contract.ENV_TENANT_HEADER: "X-T"}, "set both"),
        ({**M, contract.ENV_TENANT_SECRET: "s"}, "set both"),
        ({**M, contract.ENV_TENANT_HEADER: "X-T", contract.ENV_TENANT_SECRET_FILE: "/nonexistent"}, "cannot read"),
        ({**M, contract.ENV_PORT: str(contract.ENGINE_PORT)}, f"{contract.ENV_ENGINE_PORT}: must differ"),
        ({**M, contract.ENV_PORT: "70000"}, f"{contract.ENV_PORT}: must be at most 65535"),
        (
            {**M, contract.ENV_CONTRACT_VERSION: str(contract.CONTRACT_VERSION + 1)},
            f"{contract.ENV_CONTRACT_VERSION}: the stack speaks contract '{contract.CONTRACT_VERSION + 1}'",
        ),
    ],
)
def test_bad_environment_is_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_contract_version_of_the_stack_is_checked_only_when_set() -> None:
    assert from_env(M).engine == "vllm"  # a local run: no stack, no version
    assert from_env({**M, contract.ENV_CONTRACT_VERSION: str(contract.CONTRACT_VERSION)}).engine == "vllm"


def test_engine_args_round_trip_through_the_environment() -> None:
    args = EngineArgs(max_model_len=1024, max_num_seqs=32, enforce_eager=True, kv_cache_memory_bytes=4 << 20)
    s = from_env({**M, contract.ENV_ENGINE_ARGS: args.to_json()})
    assert s.engine_args == args and s.max_model_len == 1024
    assert from_env(M).engine_args == EngineArgs() and from_env(M).max_model_len is None


def test_admission_budget() -> None:
    s = from_env({**M, contract.ENV_TOKEN_BUDGET: "1000", contract.ENV_ADMISSION_FACTOR: "1.5"})
    assert s.admitted_tokens == 1500
    off = from_env({**M, contract.ENV_TOKEN_BUDGET: "1000", contract.ENV_ADMISSION: "0"})
    assert off.admitted_tokens is None


# --- the command ----------------------------------------------------------------------------------


def _main(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str]) -> tuple[int, list[str]]:
    """``main`` in-process, under exactly ``env`` (of the contract's variables), with serving stubbed out."""
    for name in [n for n in vars(contract) if n.startswith("ENV_")]:
        monkeypatch.delenv(getattr(contract, name), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    served: list[object] = []

    async def serve(settings: object) -> int:
        served.append(settings)
        return 0

    monkeypatch.setattr(agent_main, "serve", serve)
    return agent_main.main(argv), [type(s).__name__ for s in served]


def test_main_refuses_another_contract_with_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = str(contract.CONTRACT_VERSION + 1)
    code, served = _main(monkeypatch, {**M, contract.ENV_CONTRACT_VERSION: other}, [contract.SERVE_ARG])
    assert code == 2 and served == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{contract.AGENT_COMMAND}: {contract.ENV_CONTRACT_VERSION}: ")


def test_main_logs_the_contract_version_and_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvfleet.agent")
    code, served = _main(monkeypatch, {**M, contract.ENV_CONTRACT_VERSION: str(contract.CONTRACT_VERSION)}, [])
    assert code == 0 and served == ["AgentSettings"]
    assert any(r.getMessage().startswith(f"contract {contract.CONTRACT_VERSION};") for r in caplog.records)


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        (M, ["bogus"], "unknown command 'bogus'"),
        ({**M, contract.ENV_LOG_LEVEL: "chatty"}, [], f"{contract.ENV_LOG_LEVEL}: not a log level"),
    ],
)
def test_main_usage_errors_exit_2(
    env: dict[str, str],
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, served = _main(monkeypatch, env, argv)
    assert code == 2 and served == [] and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [[str(Path(sys.executable).parent / contract.AGENT_COMMAND)], [sys.executable, "-m", "kvfleet.agent"]],
    ids=["console-script", "module"],
)
def test_the_command_and_the_module_run_the_same_main(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    done = subprocess.run(
        [*argv, contract.SERVE_ARG],
        env={**env, contract.ENV_MODEL: "m", contract.ENV_CONTRACT_VERSION: "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"{contract.AGENT_COMMAND}: {contract.ENV_CONTRACT_VERSION}: the stack speaks contract '0', this image "
        f"contract {contract.CONTRACT_VERSION}; deploy an image built for contract 0 (tag *-kvfleet0)"
    ]


def test_the_tenant_key_may_come_from_secrets_manager_at_start_up() -> None:
    base = {contract.ENV_MODEL: "m", contract.ENV_TENANT_HEADER: "X-Tenant"}
    s = from_env({**base, contract.ENV_TENANT_SECRET_ARN: "kvfleet/tenant-salt"})
    assert s.tenant_secret_arn == "kvfleet/tenant-salt" and s.tenant_secret is None and not s.tenant_isolation
    given = from_env({**base, contract.ENV_TENANT_SECRET: "k", contract.ENV_TENANT_SECRET_ARN: "kvfleet/t"})
    assert given.tenant_secret == b"k" and given.tenant_secret_arn is None  # a key given directly wins
    with pytest.raises(SettingsError, match="KVFLEET_TENANT_SECRET_ARN"):
        from_env({contract.ENV_MODEL: "m", contract.ENV_TENANT_SECRET_ARN: "kvfleet/t"})  # no header


def test_the_agent_reads_the_tenant_key_or_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving without isolation would let one tenant probe another's prefix cache: a key that cannot be read
    stops the agent (exit 2) before the engine starts."""
    import asyncio

    import boto3
    from botocore.stub import Stubber  # type: ignore[import-untyped]

    from kvfleet.agent import aws

    sm = boto3.client("secretsmanager", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(sm)
    arn = "kvfleet/tenant-salt"
    stub.add_response("get_secret_value", {"SecretString": "s3cret\n", "Name": arn}, {"SecretId": arn})
    stub.add_client_error("get_secret_value", "ResourceNotFoundException", http_status_code=400)
    monkeypatch.setattr(aws, "client", lambda service, region: sm)
    env = {contract.ENV_MODEL: "m", contract.ENV_TENANT_HEADER: "X-Tenant", contract.ENV_TENANT_SECRET_ARN: arn}
    settings = from_env(env)
    with stub:
        read = asyncio.run(agent_main._tenant_secret(settings))
        assert read is not None and read.tenant_secret == b"s3cret" and read.tenant_isolation
        assert asyncio.run(agent_main.serve(settings)) == 2  # not found: no serving, no engine
    assert asyncio.run(agent_main._tenant_secret(from_env({contract.ENV_MODEL: "m"}))) is not None  # none asked


def test_admission_budget_is_the_smaller_of_the_plans_cache_and_the_engines() -> None:
    s = from_env({**M, contract.ENV_TOKEN_BUDGET: "1000", contract.ENV_ADMISSION_FACTOR: "1.5"})
    assert s.admitted_tokens_for(800) == 1200  # the engine allocated less than planned
    assert s.admitted_tokens_for(5000) == 1500  # more than planned: the plan's budget holds
    assert s.admitted_tokens_for(None) == s.admitted_tokens == 1500
    off = from_env({**M, contract.ENV_TOKEN_BUDGET: "1000", contract.ENV_ADMISSION: "0"})
    assert off.admitted_tokens_for(800) is None
