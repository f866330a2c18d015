"""The agent reads exactly the container environment the stacks write (one contract, both sides)."""

from __future__ import annotations

import pytest

from kvfleet.agent.engine import engine_command
from kvfleet.agent.settings import SettingsError, from_env
from kvfleet.deployments import resolve_environment
from tests.envs import SAGEMAKER_ENV, environment


def test_agent_understands_the_stack_environment() -> None:
    [r] = resolve_environment(environment())
    s = from_env(r.container_environment())
    assert s.engine == "vllm" and s.engine_version == "0.30.0"
    assert s.model == "meta-llama/Llama-3.1-8B"
    assert dict(s.engine_args) == r.engine_settings["args"]
    assert s.deployment == "test-chat"
    assert s.drain_budget_s == 420
    assert s.token_budget == r.kv_cache_tokens
    assert s.port == 8080
    assert s.hf_token_secret_arn == "kvfleet/hf-token"
    assert s.put_metric_data is False
    assert s.max_model_len == 5120
    cmd = engine_command(s)
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(r.candidate.concurrency_per_replica)
    assert "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8081" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_trtllm_gets_its_options_file() -> None:
    text = SAGEMAKER_ENV.replace("name: vllm", "name: trtllm").replace('version: "0.30.0"', 'version: "1.0.0"')
    [r] = resolve_environment(environment(text))
    s = from_env(r.container_environment())
    assert s.engine == "trtllm" and s.metrics_path == "/prometheus/metrics"
    assert s.engine_args["max_batch_size"] == r.candidate.concurrency_per_replica
    cmd = engine_command(s, options_file="/tmp/o.yaml")
    assert cmd[:2] == ["trtllm-serve", "meta-llama/Llama-3.1-8B"]
    assert cmd[-2:] == ["--extra_llm_api_options", "/tmp/o.yaml"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "KVFLEET_MODEL: required"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_ENGINE": "sglang"}, "KVFLEET_ENGINE: must be vllm or trtllm"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_ENGINE_ARGS": "{nope"}, "KVFLEET_ENGINE_ARGS: not JSON"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_ENGINE_ARGS": "[1]"}, "KVFLEET_ENGINE_ARGS: must be a JSON object"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_DRAIN_BUDGET_S": "soon"}, "KVFLEET_DRAIN_BUDGET_S: must be a number"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_TOKEN_BUDGET": "1.5"}, "KVFLEET_TOKEN_BUDGET: must be an integer"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_ADMISSION": "maybe"}, "KVFLEET_ADMISSION: must be 1 or 0"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_TENANT_HEADER": "X-T"}, "set both"),
        ({"KVFLEET_MODEL": "m", "KVFLEET_PORT": "8081"}, "must differ"),
    ],
)
def test_bad_environment_is_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        from_env(env)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_admission_budget() -> None:
    s = from_env({"KVFLEET_MODEL": "m", "KVFLEET_TOKEN_BUDGET": "1000", "KVFLEET_ADMISSION_FACTOR": "1.5"})
    assert s.admitted_tokens == 1500
    off = from_env({"KVFLEET_MODEL": "m", "KVFLEET_TOKEN_BUDGET": "1000", "KVFLEET_ADMISSION": "0"})
    assert off.admitted_tokens is None


def test_tenant_secret_from_a_file(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "secret"
    p.write_text("k3y\n")
    s = from_env({"KVFLEET_MODEL": "m", "KVFLEET_TENANT_HEADER": "X-Tenant", "KVFLEET_TENANT_SECRET_FILE": str(p)})
    assert s.tenant_isolation and s.tenant_secret == b"k3y"
