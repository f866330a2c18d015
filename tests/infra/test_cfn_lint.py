"""cfn-lint on every synthesized template of every example environment (synthesized as `make synth` does, with
CDK's CloudFormation validation and cdk-nag on): 0 errors, 0 warnings.

The only ignored check is listed, with its reason, in .cfnlintrc.yaml at the repository root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
import pytest

from kvfleet.config.loader import load_environment
from kvfleet.infra.app import build_app
from tests.envs import FEATURE_FLAGS
from tests.infra.helpers import REPO, make_app

ENV_FILES = sorted(p for p in (REPO / "environments").glob("*.yaml"))


def cfn_lint(templates: list[Path], region: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), "--regions", region, "--", *map(str, templates)],
        cwd=REPO,  # picks up .cfnlintrc.yaml
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("env_file", ENV_FILES, ids=[p.stem for p in ENV_FILES])
def test_example_environment_lints_clean(env_file: Path, tmp_path: Path) -> None:
    env = load_environment(env_file)
    # CloudFormation validation on, as `make synth` runs it.
    app = build_app(env, app=cdk.App(context=FEATURE_FLAGS, outdir=str(tmp_path)), nag=True)
    app.synth()
    templates = sorted(tmp_path.glob("*.template.json"))
    # One per deployment, and the environment's alerts stack unless the file names its own topic.
    assert len(templates) == len(env.deployments) + (env.notifications.topic_arn is None)
    result = cfn_lint(templates, env.region or "us-east-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_cfn_lint_catches_an_instance_type_sagemaker_does_not_have(tmp_path: Path) -> None:
    # The gate can fail: the same template with an instance type SageMaker does not offer.
    env = load_environment(REPO / "environments" / "dev.yaml")
    app = build_app(env, app=make_app(outdir=str(tmp_path / "out")), nag=False)
    app.synth()
    [path] = (tmp_path / "out").glob("kvfleet-dev-chat.template.json")
    t = json.loads(path.read_text())
    for r in t["Resources"].values():
        if r["Type"] == "AWS::SageMaker::EndpointConfig":
            r["Properties"]["ProductionVariants"][0]["InstanceType"] = "ml.g6e.huge"
    bad = tmp_path / "bad.template.json"
    bad.write_text(json.dumps(t))
    result = cfn_lint([bad], "us-east-1")
    assert result.returncode != 0
    assert "E3030" in result.stdout


def test_ignored_checks_are_justified_in_one_place() -> None:
    text = (REPO / ".cfnlintrc.yaml").read_text(encoding="utf-8")
    ignored = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")]
    assert ignored == ["W3005"]
    before = text.split("- W3005")[0]
    assert "W3005" in before.split("ignore_checks:")[1]  # its reason sits above it
