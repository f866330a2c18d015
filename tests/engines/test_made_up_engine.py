"""An engine is one folder and one registry line: a made-up engine, written to a temporary folder, plans end to end.

``toyserve`` is a package outside kvfleet holding what an engine's folder holds (an adapter with its own renderer,
its capacity rules, a scheduler: vLLM's, reused), registered by one entry in ``ENGINE_MODULES``. The command line,
the environment file and the planner take it with nothing else changed, so the seams between the registry, the
sizing core and the edges stay real: a branch on an engine's name anywhere would refuse it or size it as another.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cli import main
from kvfleet.config.loader import load_environment
from kvfleet.engines import ENGINE_MODULES, ENGINES, EngineName, adapter, unknown_engine
from kvfleet.errors import ConfigError

NAME = "toyserve"

PACKAGE: dict[str, str] = {
    "__init__.py": """
        from toyserve.adapter import ToyServe

        ADAPTER = ToyServe()
    """,
    # The capacity rules: vLLM's newest release as toyserve 1.0, with scheduler defaults and block sizes of its own.
    "profiles.py": """
        from dataclasses import replace

        from kvfleet.engines.capacity import BatchDefaults, BatchDefaultsRule, EngineCapacity, RopeRules
        from kvfleet.engines.vllm.profiles import CAPACITY as VLLM

        TIER = BatchDefaults(min_memory_bytes=0, excluded_names=(), max_num_batched_tokens=4096, max_num_seqs=96)
        CAPACITY = EngineCapacity(
            default_version="1.0.0",
            profiles=(replace(VLLM.profiles[-1], engine="toyserve", since=(1, 0, 0), note="toyserve 1.0"),),
            traits=replace(VLLM.traits, block_sizes=frozenset({16, 32, 64})),
            rope_rules=(RopeRules(since=(1, 0, 0), rules=VLLM.rope_rules[-1].rules),),
            batch_defaults=(
                BatchDefaultsRule(since=(1, 0, 0), tiers=(TIER,), source="toyserve's own defaults"),
            ),
            layout_rules=VLLM.layout_rules,
            quantization=VLLM.quantization,
        )
    """,
    "adapter.py": """
        from typing import Any, ClassVar

        from kvfleet.engines.base import EngineAdapter, EngineArgs, SignalNames
        from kvfleet.engines.capacity import EngineCapacity
        from kvfleet.engines.vllm.scheduler import VllmScheduler
        from toyserve.profiles import CAPACITY


        class ToyServe(EngineAdapter):
            name: ClassVar[str] = "toyserve"
            title: ClassVar[str] = "ToyServe"
            metrics_path: ClassVar[str] = "/toy/metrics"
            default_base_image: ClassVar[str] = "example.com/toyserve:1.0.0"
            metric_rows: ClassVar[tuple[tuple[str, SignalNames], ...]] = (("0.0.0", {}),)
            capacity: ClassVar[EngineCapacity] = CAPACITY

            def settings(self, args: EngineArgs) -> dict[str, Any]:
                return {
                    "toy_gpus": args.tensor_parallel_size,
                    "toy_slots": args.max_num_seqs,
                    "toy_context": args.max_model_len,
                    "toy_share": args.gpu_memory_utilization,
                }

            def server_command(self, args, *, model, port, python, options_file):
                return ["toyserve", model, "--port", str(port)]

            def dlc_environment(self, args, *, model, max_input_tokens, max_output_tokens):
                raise ValueError("toyserve has no AWS container")

            def describe(self, args: EngineArgs) -> str:
                return "toyserve <model> " + " ".join(f"{k}={v}" for k, v in self.settings(args).items())

            def scheduler(self, args: EngineArgs) -> VllmScheduler:
                return VllmScheduler()
    """,
}

ENVIRONMENT = """
name: toy
account: "222222222222"
region: us-east-1
notifications: none
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
    engine:
      name: toyserve
      version: "1.0.0"
    workload:
      max_input_tokens: 2048
      max_output_tokens: 512
      peak_requests_per_s: 2
    target:
      platform: ec2
    scaling:
      min_replicas: 1
      max_replicas: 2
    serving:
      tenancy: single
"""


@pytest.fixture
def toyserve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The made-up engine's folder on the import path and its one registry line."""
    folder = tmp_path / "engines" / NAME
    folder.mkdir(parents=True)
    for file, text in PACKAGE.items():
        (folder / file).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder.parent))
    monkeypatch.setitem(ENGINE_MODULES, NAME, NAME)
    yield
    for module in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        del sys.modules[module]


def _json(capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(capsys.readouterr().out)


@pytest.mark.usefixtures("toyserve")
def test_the_registry_loads_the_engine_from_its_folder() -> None:
    assert NAME in ENGINES and adapter(NAME).title == "ToyServe"
    assert EngineName(NAME) == NAME
    assert type(ENGINES[NAME]).__module__ == "toyserve.adapter"


@pytest.mark.usefixtures("toyserve")
def test_capacity_sizes_it_by_its_own_rules(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--engine", NAME, "--json"]
    assert main([*argv, "--max-model-len", "8192"]) == 0
    cap = _json(capsys)
    assert (cap["engine"], cap["engine_version"]) == (NAME, "1.0.0")
    # Its scheduler defaults and the profile row's note are toyserve's, not vLLM's (1,024 sequences, 8,192 tokens).
    assert (cap["max_num_seqs"], cap["max_num_batched_tokens"]) == (96, 4096)
    assert cap["notes"][0] == "toyserve 1.0"
    # The block sizes it accepts are its own: 128 is vLLM's, not toyserve's.
    assert main([*argv, "--block-size", "128"]) == 2
    assert "block_size: ToyServe accepts block sizes 16, 32, 64; got 128" in capsys.readouterr().err


@pytest.mark.usefixtures("toyserve")
def test_plan_from_flags_renders_its_settings(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--engine", NAME, "--model", "meta-llama/Llama-3.1-8B", "--platform", "ec2"]
    assert main([*argv, "--max-input-tokens", "2048", "--max-output-tokens", "512", "--json"]) == 0
    best = _json(capsys)[0]["candidates"][0]
    assert best["memory"]["engine"] == NAME
    engine = best["engine_settings"]
    assert engine["engine"] == NAME
    assert set(engine["settings"]) == {"toy_gpus", "toy_slots", "toy_context", "toy_share"}
    assert engine["command"].startswith("toyserve <model> toy_gpus=")


@pytest.mark.usefixtures("toyserve")
def test_an_environment_file_names_it_and_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text(ENVIRONMENT, encoding="utf-8")
    assert load_environment(path).deployments[0].engine.name == NAME
    assert main(["plan", str(path), "--json"]) == 0
    (deployment,) = _json(capsys)
    best = deployment["candidates"][0]
    assert best["memory"]["engine"] == NAME and best["memory"]["max_num_seqs"] <= 96
    assert set(best["engine_settings"]["settings"]) == {"toy_gpus", "toy_slots", "toy_context", "toy_share"}
    # Its releases are its own: vLLM's 0.34.0 is not a toyserve release.
    path.write_text(ENVIRONMENT.replace('"1.0.0"', '"0.34.0"'), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"engine\.version: kvfleet models toyserve releases 1\.0\.0 to 1\.0\.x"):
        load_environment(path)


def test_an_unregistered_engine_is_one_line_naming_the_registered_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as err:
        EngineName(NAME)
    assert str(err.value) == unknown_engine(NAME) == f"unknown engine {NAME!r}; known: vllm, trtllm"
    with pytest.raises(ValueError, match="known: vllm, trtllm"):
        adapter(NAME)
    path = tmp_path / "toy.yaml"
    path.write_text(ENVIRONMENT, encoding="utf-8")
    with pytest.raises(ConfigError) as config_err:
        load_environment(path)
    message = str(config_err.value)
    assert "\n" not in message and "engine.name" in message and "'vllm' or 'trtllm'" in message, message
    with pytest.raises(SystemExit) as exit_:
        main(["capacity", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--engine", NAME])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "invalid choice: 'toyserve' (choose from 'vllm', 'trtllm')" in line


@pytest.mark.usefixtures("toyserve")
def test_an_environment_file_naming_it_synthesizes(tmp_path: Path) -> None:
    """The stacks take the made-up engine from the resolved deployment alone: its image is named for it and its
    release, and the agent on the instance is told to run it with the settings its own renderer wrote."""
    import aws_cdk as cdk

    from kvfleet import contract
    from kvfleet.infra.app import build_app
    from tests.infra.helpers import make_app

    path = tmp_path / "toy.yaml"
    path.write_text(ENVIRONMENT, encoding="utf-8")
    app = build_app(load_environment(path), app=make_app())
    [stack] = [s for s in app.node.children if isinstance(s, cdk.Stack) and not s.stack_name.endswith("-alerts")]
    text = json.dumps(app.synth().get_stack_artifact(stack.artifact_id).template)
    assert f"kvfleet-{NAME}:{contract.image_tag('1.0.0')}" in text, "the image is toyserve's, at its release"
    assert contract.ENV_ENGINE in text and f"{contract.ENV_ENGINE}={NAME}" in text.replace('\\"', "")
