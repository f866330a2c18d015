"""The real CDK CLI (pinned in package-lock.json) synthesizes the app, with no warnings."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import get_args

import pytest

from kvfleet.config.loader import environment_path, load_environment
from tests.envs import REPO

CDK = REPO / "node_modules" / ".bin" / "cdk"

pytestmark = pytest.mark.skipif(not CDK.exists(), reason="the CDK CLI is installed by `make test` (npm ci)")


def cdk_synth(env: str, outdir: Path) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JSII_", "CDK_"))}
    environ["CDK_DISABLE_CLI_TELEMETRY"] = "true"
    return subprocess.run(
        [str(CDK), "synth", "-c", f"env={env}", "--quiet", "-o", str(outdir)],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_default_environment_synthesizes_without_warnings(tmp_path: Path) -> None:
    out = tmp_path / "cdk.out"
    result = cdk_synth("dev", out)
    assert result.returncode == 0, result.stderr
    # No Node banner, no deprecation or feature-flag warnings: with more than one stack the CLI only names them.
    # The CLI writes these lines to stderr, or to stdout when CI is set (as in a pipeline), so both are read.
    assert (result.stderr + result.stdout).splitlines() == [
        f"Successfully synthesized to {out}",
        "Supply a stack id (kvfleet-dev-alerts, kvfleet-dev-chat) to display its template.",
    ]
    assert (out / "kvfleet-dev-chat.template.json").is_file()
    assert (out / "kvfleet-dev-alerts.template.json").is_file()
    # cdk-nag ran as a validation plugin and found nothing unacknowledged.
    assert json.loads((out / "validation-report.json").read_text())["pluginReports"] == []


def test_malformed_environment_gets_one_line_per_problem_and_no_template(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text(
        "name: broken\n"
        "deployments:\n"
        "  - name: chat\n"
        "    model: {id: meta-llama/Llama-3.1-8B}\n"
        "    engine: {name: vllm, version: '0.30.0'}\n"
        "    workload: {max_input_tokens: 4096, max_output_tokens: 0}\n"
        "    target: {platform: sagemaker, colour: blue}\n",
        encoding="utf-8",
    )
    out = tmp_path / "cdk.out"
    result = cdk_synth(str(bad), out)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith(str(bad))]
    assert ours == [
        f"{bad}:6: deployments[0].workload.max_output_tokens: must be greater than 0",
        f"{bad}:7: deployments[0].target.colour: unknown key; remove it or check its spelling",
    ]
    assert not list(out.glob("*.template.json"))


def test_unknown_environment_name_lists_the_examples(tmp_path: Path) -> None:
    result = cdk_synth("qa", tmp_path / "cdk.out")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "no environment file at" in result.stderr
    found = ", ".join(sorted(p.stem for p in (REPO / "environments").glob("*.yaml")))
    assert "dev" in found and f"found: {found}" in result.stderr


def test_every_target_has_a_config_class_and_a_construct() -> None:
    # One registry of names (kvfleet.targets); each target's folder holds its section and its construct.
    from kvfleet.config.targets import target_sections
    from kvfleet.infra.context import TargetSpec, target_spec
    from kvfleet.targets import TARGETS

    config_names = [get_args(cls.model_fields["platform"].annotation)[0] for cls in target_sections()]
    assert config_names == list(TARGETS)
    assert all(isinstance(target_spec(name), TargetSpec) for name in TARGETS)


def test_environments_are_found_from_the_working_directory(tmp_path: Path) -> None:
    # An installed kvfleet synthesizes outside a checkout: environments/ is looked up where cdk runs.
    (tmp_path / "environments").mkdir()
    (tmp_path / "environments" / "solo.yaml").write_text(
        (REPO / "environments" / "dev.yaml").read_text(encoding="utf-8").replace("name: dev", "name: solo"),
        encoding="utf-8",
    )
    assert environment_path("solo") == Path("environments/solo.yaml")
    assert environment_path("solo", environments_dir=tmp_path / "environments") == tmp_path / "environments/solo.yaml"
    assert environment_path("x/y.yaml") == Path("x/y.yaml")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert load_environment(environment_path("solo")).name == "solo"
    finally:
        os.chdir(cwd)


# The CDK CLI exits 1 for every failure of its app (aws-cdk's cli.js: `process.exitCode = 1` in its catch), so
# `kvfleet synth` is the entry point whose exit status tells a bad file (2) from a broken toolchain.
HALF_BUILT = """\
name: half
region: us-east-1
deployments:
  - name: coder
    model: {id: Qwen/Qwen2.5-7B}
    engine: {name: vllm, version: "0.30.0"}
    workload: {max_input_tokens: 8192, max_output_tokens: 1024, concurrency_per_replica: 32}
    target: {platform: eks, kubernetes_version: "1.35", clients: cluster}
    sizing: {families: [g6e, g5]}
    serving: {tenancy: single}
  - name: chat
    model: {id: meta-llama/Llama-3.1-8B}
    engine: {name: vllm, version: "0.30.0"}
    workload: {max_input_tokens: 4096, max_output_tokens: 1024}
    target: {platform: sagemaker, inference_ami_version: al2-ami-sagemaker-inference-gpu-2}
    sizing: {instance_type: ml.g6e.xlarge}
    serving: {tenancy: single}
notifications: none
"""
# The same file without the choices synth asks for: who hears the alarms, who shares each prefix cache.
UNDECIDED = HALF_BUILT.replace("    serving: {tenancy: single}\n", "").replace("notifications: none\n", "")


def kvfleet_synth(env: str, outdir: Path) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JSII_", "CDK_"))}
    environ["CDK_DISABLE_CLI_TELEMETRY"] = "true"
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "kvfleet"), "synth", env, "--", "--quiet", "-o", str(outdir)],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_kvfleet_synth_refuses_a_bad_file_with_exit_2_before_cdk_runs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndeployments: []\n", encoding="utf-8")
    result = kvfleet_synth(str(bad), tmp_path / "cdk.out")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"kvfleet: error: {bad}:2: deployments: give at least 1 entry"]
    assert not (tmp_path / "cdk.out").exists()  # cdk never ran


def test_kvfleet_synth_exits_2_on_a_stack_error_and_leaves_no_assets(tmp_path: Path) -> None:
    # The EKS stack stages its assets (kubectl handler, layers) into the output directory while it is built; the
    # second deployment then fails in its construct: the CUDA 13 image on a pinned driver-535 AMI.
    f = tmp_path / "half.yaml"
    f.write_text(HALF_BUILT, encoding="utf-8")
    out = tmp_path / "cdk.out"
    out.mkdir()
    (out / "kept.txt").write_text("from an earlier run", encoding="utf-8")
    result = kvfleet_synth(str(f), out)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith(str(f))]
    assert len(ours) == 1
    assert ours[0].startswith(f"{f}:15: deployments[1].target.inference_ami_version: the image (kvfleet image of ")
    assert sorted(p.name for p in out.iterdir()) == ["kept.txt"]


def test_kvfleet_synth_refuses_a_file_that_leaves_its_choices_open(tmp_path: Path) -> None:
    # `kvfleet plan` plans it; synth names each choice at its line, exits 2 and stages nothing.
    f = tmp_path / "open.yaml"
    f.write_text(UNDECIDED, encoding="utf-8")
    out = tmp_path / "cdk.out"
    result = kvfleet_synth(str(f), out)
    assert result.returncode == 2, result.stderr
    # Refused by kvfleet before the CDK CLI starts: the first line carries its "kvfleet: error: " prefix.
    ours = [line.removeprefix("kvfleet: error: ") for line in result.stderr.splitlines()]
    assert [line.split(": ", 2)[:2] for line in ours] == [
        [f"{f}:1", "notifications"],
        [f"{f}:4", "deployments[0].serving.tenancy"],
        [f"{f}:10", "deployments[1].serving.tenancy"],
    ]
    assert "Traceback" not in result.stderr and not list(out.glob("*.template.json"))


def _stub_cdk(tmp_path: Path) -> tuple[Path, Path]:
    """A CDK CLI that only records that it was started: a refusal must come before it."""
    started = tmp_path / "cdk-started"
    stub = tmp_path / "cdk"
    stub.write_text(f"#!/bin/sh\ntouch {started}\n", encoding="utf-8")
    stub.chmod(0o755)
    return stub, started


def _each_line_at_a_file(stderr: str, files: list[Path]) -> list[str]:
    """stderr's lines, each required to start (after the CLI's one prefix) with one of ``files``'s path and a line."""
    lines = stderr.splitlines()
    assert lines and lines[0].startswith("kvfleet: error: "), stderr
    bare = [lines[0].removeprefix("kvfleet: error: "), *lines[1:]]
    for line in bare:
        assert any(line.startswith(f"{f}:") and line[len(f"{f}:") :].split(":")[0].isdigit() for f in files), line
    return bare


def test_kvfleet_synth_refuses_open_choices_before_the_cdk_cli_starts(tmp_path: Path) -> None:
    f = tmp_path / "open.yaml"
    f.write_text(UNDECIDED, encoding="utf-8")
    stub, started = _stub_cdk(tmp_path)
    result = subprocess.run(
        [str(REPO / ".venv" / "bin" / "kvfleet"), "synth", str(f), "--cdk", str(stub)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert not started.exists()
    lines = _each_line_at_a_file(result.stderr, [f])
    assert [line.split(": ", 2)[:2] for line in lines] == [
        [f"{f}:1", "notifications"],
        [f"{f}:4", "deployments[0].serving.tenancy"],
        [f"{f}:10", "deployments[1].serving.tenancy"],
    ]


PIPELINE = """\
name: open-choices
account: "111111111111"
region: us-east-1
source:
  connection_arn: arn:aws:codeconnections:us-east-1:111111111111:connection/3f1c0b2e-9a4d-4c6e-8b7f-2d5e6a7b8c9d
  repository: example-org/llm-platform
  branch: main
stages:
  - environment: first
  - environment: second
"""


def test_kvfleet_synth_pipeline_names_every_stages_open_choices_before_the_cdk_cli_starts(tmp_path: Path) -> None:
    # Every problem of every stage at its file and line (not the first of each stage, not without its line).
    envs = tmp_path / "environments"
    envs.mkdir()
    staged = UNDECIDED.replace("region: us-east-1\n", 'account: "222222222222"\nregion: us-east-1\n')
    first, second = envs / "first.yaml", envs / "second.yaml"
    first.write_text(staged.replace("name: half", "name: first"), encoding="utf-8")
    # The second decides who hears the alarms but leaves the coder's prefix cache open.
    second.write_text(
        staged.replace("name: half", "name: second").replace(
            "\n  - name: chat", "\n    serving: {tenancy: single}\n  - name: chat"
        )
        + "notifications: none\n",
        encoding="utf-8",
    )
    (tmp_path / "pipeline.yaml").write_text(PIPELINE, encoding="utf-8")
    stub, started = _stub_cdk(tmp_path)
    result = subprocess.run(
        [str(REPO / ".venv" / "bin" / "kvfleet"), "synth", "--pipeline", "pipeline.yaml", "--cdk", str(stub)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert not started.exists()
    files = [Path("environments") / "first.yaml", Path("environments") / "second.yaml"]
    lines = _each_line_at_a_file(result.stderr, files)
    assert [line.split(": ", 2)[:2] for line in lines] == [
        [f"{files[0]}:1", "notifications"],
        [f"{files[0]}:5", "deployments[0].serving.tenancy"],
        [f"{files[0]}:11", "deployments[1].serving.tenancy"],
        [f"{files[1]}:12", "deployments[1].serving.tenancy"],
    ]


def test_the_app_itself_still_refuses_open_choices_when_cdk_synth_runs_it_directly(tmp_path: Path) -> None:
    # The backstop behind `kvfleet synth`'s own check: `cdk synth -c env=...` runs the app with no kvfleet before it.
    f = tmp_path / "open.yaml"
    f.write_text(UNDECIDED, encoding="utf-8")
    out = tmp_path / "cdk.out"
    result = cdk_synth(str(f), out)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith(str(f))]
    assert [line.split(": ", 2)[:2] for line in ours] == [
        [f"{f}:1", "notifications"],
        [f"{f}:4", "deployments[0].serving.tenancy"],
        [f"{f}:10", "deployments[1].serving.tenancy"],
    ]
    assert "Traceback" not in result.stderr and not list(out.glob("*.template.json"))


def test_kvfleet_synth_refuses_a_release_no_base_image_runs_at_its_line(tmp_path: Path) -> None:
    # AWS publishes no vLLM container of 0.34.0: an image built on another base would run another release than its
    # tag names (kvfleet/infra/image_build.py), so the app refuses at engine.version and stages nothing.
    f = tmp_path / "newer.yaml"
    f.write_text(HALF_BUILT.replace('version: "0.30.0"', 'version: "0.34.0"', 1), encoding="utf-8")
    out = tmp_path / "cdk.out"
    result = kvfleet_synth(str(f), out)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith(str(f))]
    assert len(ours) == 1 and ours[0].startswith(f"{f}:6: deployments[0].engine.version: the kvfleet image "), ours
    assert "set image.tag" in ours[0] and "Traceback" not in result.stderr and not list(out.glob("*.template.json"))
