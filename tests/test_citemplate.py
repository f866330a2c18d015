"""`kvfleet ci-template`: the GitHub Actions workflow it writes validates against GitHub's workflow schema
(SchemaStore's, as check-jsonschema vendors it, offline), keeps the pipeline file's order and approvals, takes
credentials only through OIDC, and its plan-diff step, run by bash in a git checkout, writes the diff's table; each
deploy job pushes as the image-publishing role and checks as the live-check role it deploys, trusted by its OIDC
role, and its live-check step, run by bash, passes that role to `kvfleet check`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvfleet.citemplate import ACTIONS, render, workflow
from kvfleet.config.pipeline import load_pipeline
from tests.infra.helpers import REPO


def _schema() -> dict[str, Any]:
    path = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "github-workflows.json"
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _validate(doc: Any) -> None:
    jsonschema.validate(doc, _schema(), cls=jsonschema.Draft7Validator)


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    text = render(load_pipeline(REPO / "pipeline.yaml"))
    return yaml.safe_load(text)  # type: ignore[no-any-return]


def test_the_workflow_is_valid_for_github(rendered: dict[str, Any]) -> None:
    _validate(rendered)


def test_the_schema_check_can_fail(rendered: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(rendered))
    broken["jobs"]["deploy-dev"]["environment"] = ["dev"]  # a list is neither a name nor {name, url}
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)
    del broken["jobs"]["deploy-dev"]["environment"]
    del broken["jobs"]["deploy-dev"]["runs-on"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


def test_deploys_follow_the_pipeline_order_and_approvals(rendered: dict[str, Any]) -> None:
    jobs = rendered["jobs"]
    assert jobs["deploy-dev"]["needs"] == ["test"]  # nothing deploys before the tests pass
    assert jobs["deploy-staging"]["needs"] == ["deploy-dev"]
    # Production: its plan diff after staging, then GitHub's environment (its required reviewers) holds it.
    assert jobs["plan-prod"]["needs"] == ["deploy-staging"]
    assert jobs["deploy-prod"]["needs"] == ["deploy-staging", "plan-prod"]
    assert [j["environment"] for n, j in jobs.items() if n.startswith("deploy-")] == ["dev", "staging", "prod"]
    assert not any(n.startswith("plan-") for n in jobs if n not in ("plan-prod",))


def test_credentials_come_from_oidc_only(rendered: dict[str, Any]) -> None:
    text = json.dumps(rendered)
    assert "aws-access-key-id" not in text and "secrets." not in text
    assert rendered["permissions"] == {"contents": "read"}
    for name, job in rendered["jobs"].items():
        uses = [s for s in job["steps"] if s.get("uses", "").startswith("aws-actions/configure-aws-credentials")]
        if name.startswith("deploy-"):
            assert job["permissions"]["id-token"] == "write"
            assert uses[0]["with"]["role-to-assume"] == "${{ vars.AWS_DEPLOY_ROLE_ARN }}"
            assert job["steps"][-1]["run"].startswith(".venv/bin/kvfleet check environments/")
            assert " --role-arn " in job["steps"][-1]["run"]  # as the live-check role, not the OIDC role
        else:
            assert not uses and "permissions" not in job


def test_every_stage_with_approval_gets_its_diff(tmp_path: Path) -> None:
    (tmp_path / "environments").mkdir()
    for name in ("dev", "staging", "prod"):
        shutil.copy(REPO / "environments" / f"{name}.yaml", tmp_path / "environments")
    shutil.copytree(REPO / "traces", tmp_path / "traces")
    text = (
        (REPO / "pipeline.yaml")
        .read_text()
        .replace("  - environment: dev\n", "  - environment: dev\n    approval: true\n")
    )
    (tmp_path / "pipeline.yaml").write_text(text)
    jobs = workflow(load_pipeline(tmp_path / "pipeline.yaml"))["jobs"]
    assert jobs["plan-dev"]["needs"] == ["test"] and jobs["deploy-dev"]["needs"] == ["test", "plan-dev"]
    _validate(json.loads(json.dumps(workflow(load_pipeline(tmp_path / "pipeline.yaml")))))


def _plan_diff_step(tmp_path: Path, rendered: dict[str, Any], peak: str, most: str = "2") -> tuple[int, str, Path]:
    """The PR's plan-diff step for dev, run by bash in a checkout whose change sets the peak rate to ``peak`` and
    max_replicas to ``most``: its exit status, its stderr and where its table went."""
    [step] = [s for s in rendered["jobs"]["test"]["steps"] if s.get("name") == "Plan diff: dev"]
    repo = tmp_path / "repo"
    (repo / "environments").mkdir(parents=True)
    shutil.copy(REPO / "environments" / "dev.yaml", repo / "environments")
    (repo / ".venv").symlink_to(REPO / ".venv")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=repo, check=True)
    subprocess.run([*git, "add", "environments"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], cwd=repo, check=True)
    dev = repo / "environments" / "dev.yaml"
    text = dev.read_text()
    assert "peak_requests_per_s: 2\n" in text and "max_replicas: 2\n" in text
    text = text.replace("peak_requests_per_s: 2\n", f"peak_requests_per_s: {peak}\n")
    dev.write_text(text.replace("max_replicas: 2\n", f"max_replicas: {most}\n"), encoding="utf-8")
    summary = tmp_path / "summary.md"
    script = step["run"].replace("origin/${{ github.base_ref }}", "main")
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert not (repo / "environments" / ".base-dev.yaml").exists()
    return done.returncode, done.stderr, summary


def test_the_plan_diff_step_runs_in_a_checkout(tmp_path: Path, rendered: dict[str, Any]) -> None:
    code, err, summary = _plan_diff_step(tmp_path, rendered, "6", most="8")
    assert code == 0, err
    table = summary.read_text()
    assert table.startswith("### Plan changes: `environments/.base-dev.yaml` -> `environments/dev.yaml`"), table
    assert "| instances | 2 | 4 |" in table  # 2 -> 6 requests/s at peak, room to 8: more replicas of the same type


def test_the_plan_diff_step_fails_a_change_sagemaker_cannot_deploy_in_one_update(
    tmp_path: Path, rendered: dict[str, Any]
) -> None:
    # 4 requests/s does not fit 2 replicas of dev's type (SageMaker, 1-2 replicas, autoscaled), so the plan moves to
    # another instance type: the step shows the table and fails with the two-deploy procedure, before anyone merges
    # a release that would fail to deploy.
    code, err, summary = _plan_diff_step(tmp_path, rendered, "4")
    assert code == 2
    assert "instance type ml.g6e.xlarge ->" in err and "deploy first with sizing.instance_type" in err
    assert "| instance type |" in summary.read_text()


def test_the_json_form_is_the_same_workflow(capsys: pytest.CaptureFixture[str], rendered: dict[str, Any]) -> None:
    from kvfleet.cli import main

    assert main(["ci-template", str(REPO / "pipeline.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == rendered


def test_the_tests_run_on_a_push_and_every_deploy_waits_for_them(rendered: dict[str, Any]) -> None:
    jobs = rendered["jobs"]
    assert "if" not in jobs["test"]  # on a pull request and on a push
    assert any(s.get("run") == "make test" for s in jobs["test"]["steps"])

    def upstream(name: str) -> set[str]:
        needs = set(jobs[name].get("needs", []))
        return needs.union(*(upstream(n) for n in needs)) if needs else set()

    for name in jobs:
        if name.startswith("deploy-"):
            assert "test" in upstream(name), name
            assert jobs[name]["concurrency"] == {"group": name, "cancel-in-progress": False}


def test_each_deploy_pushes_its_images_before_it_deploys(rendered: dict[str, Any]) -> None:
    for name, job in rendered["jobs"].items():
        if name.startswith("deploy-"):
            runs = [s.get("run", "") for s in job["steps"]]
            # Pushed as the image-publishing role, which the repositories let push; the OIDC role only assumes it.
            image = runs.index(f"make image ENV={job['environment']} ASSUME_PUBLISHING_ROLE=1")
            assert image < next(i for i, r in enumerate(runs) if "cdk deploy" in r)
            uses = [s.get("uses", "") for s in job["steps"]]
            assert image > next(i for i, u in enumerate(uses) if "configure-aws-credentials" in u)  # OIDC first


def test_every_action_is_pinned_by_a_full_commit_with_its_tag_beside_it() -> None:
    text = render(load_pipeline(REPO / "pipeline.yaml"))
    uses = re.findall(r"uses: (\S+)(.*)", text)
    assert uses
    by_repo = {a.repository: a for a in ACTIONS}
    for ref, comment in uses:
        repo, _, commit = ref.partition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", commit), ref  # a tag or branch can be moved; a commit cannot
        assert comment == f" # {by_repo[repo].tag}" and by_repo[repo].commit == commit
        assert re.fullmatch(r"v\d+\.\d+\.\d+", by_repo[repo].tag)  # a release, not a moving major tag
    assert yaml.safe_load(text) == workflow(load_pipeline(REPO / "pipeline.yaml"))  # the comments change nothing


def test_each_deploy_checks_as_the_live_check_role_it_deploys(tmp_path: Path, rendered: dict[str, Any]) -> None:
    job = rendered["jobs"]["deploy-staging"]
    names = [s.get("name") for s in job["steps"]]
    assert names.index("Deploy") < names.index("Live-check role") < names.index("Live check") == len(names) - 1
    role, check = job["steps"][-2:]
    # The role ARN reaches the shell by the step's environment, never spliced into the script.
    assert role["env"] == {"DEPLOY_ROLE_ARN": "${{ vars.AWS_DEPLOY_ROLE_ARN }}"} and "${{" not in role["run"]
    assert "--app '.venv/bin/python -m kvfleet.infra.live_check' -c env=environments/staging.yaml" in role["run"]
    assert '-c deploy_role_arn="$DEPLOY_ROLE_ARN"' in role["run"] and "--outputs-file " in role["run"]
    # The check step, run by bash beside the outputs file cdk deploy writes and a stand-in for kvfleet.
    out = tmp_path / "cdk.out" / "live-check"
    out.mkdir(parents=True)
    arn = "arn:aws:iam::333333333333:role/kvfleet-check/kvfleet-staging-live-check-Role-ABC"
    (out / "outputs.json").write_text(json.dumps({"kvfleet-staging-live-check": {"RoleArn": arn}}))
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    log = tmp_path / "args"
    (bin_ / "kvfleet").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n')
    (bin_ / "kvfleet").chmod(0o755)
    subprocess.run(["bash", "-euo", "pipefail", "-c", check["run"]], cwd=tmp_path, check=True, timeout=60)
    assert log.read_text().splitlines() == ["check", "environments/staging.yaml", "--role-arn", arn]
