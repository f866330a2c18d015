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
        f"{bad}:6: deployments[0].workload.max_output_tokens: Input should be greater than 0",
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
    # One registry of names (kvfleet.targets); the config union and the construct table must name the same ones.
    from kvfleet.config.targets import TARGET_CLASSES
    from kvfleet.infra.stack import TARGET_CONSTRUCTS
    from kvfleet.targets import TARGETS

    config_names = [get_args(cls.model_fields["platform"].annotation)[0] for cls in TARGET_CLASSES]
    assert sorted(config_names) == sorted(TARGETS) == sorted(TARGET_CONSTRUCTS)


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
