"""The GitHub workflow's deploy role: the policy `python -m kvfleet.infra.github_role <environment>` prints lets it
assume the roles the job works through (the CDK bootstrap roles, the image-publishing role among them, and the
environment's live-check role) and pull the base images from AWS's account, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from fnmatch import fnmatchcase
from typing import Any

import pytest

from kvfleet.config.loader import load_located
from kvfleet.errors import KvfleetError
from kvfleet.infra.github_role import deploy_role_policy
from kvfleet.infra.repository import environment_builds, publishing_role_arn
from tests.infra.helpers import REPO


def _allows(policy: dict[str, Any], action: str, resource: str) -> bool:
    def listed(v: str | list[str]) -> list[str]:
        return [v] if isinstance(v, str) else v

    return any(
        st["Effect"] == "Allow"
        and action in listed(st["Action"])
        and any(fnmatchcase(resource, r) for r in listed(st["Resource"]))
        for st in policy["Statement"]
    )


def test_the_deploy_role_may_assume_what_the_job_runs_as_and_pull_the_bases() -> None:
    env = load_located(REPO / "environments" / "dev.yaml").environment
    policy = deploy_role_policy(env)
    account, region = "222222222222", "us-east-1"
    assert _allows(policy, "sts:AssumeRole", publishing_role_arn(account, region))  # make image's pushes
    for role in ("deploy", "file-publishing", "lookup"):  # cdk deploy's
        assert _allows(
            policy, "sts:AssumeRole", f"arn:aws:iam::{account}:role/cdk-hnb659fds-{role}-role-{account}-{region}"
        )
    live_check = f"arn:aws:iam::{account}:role/kvfleet-check/kvfleet-dev-live-check-RoleABC-123"
    assert _allows(policy, "sts:AssumeRole", live_check)  # kvfleet check --role-arn
    for b in environment_builds(env):
        repo = b.base_image.split("/", 1)[1].split(":")[0]
        arn = f"arn:aws:ecr:{region}:763104351884:repository/{repo}"
        assert _allows(policy, "ecr:BatchGetImage", arn) and _allows(policy, "ecr:GetDownloadUrlForLayer", arn)
    assert _allows(policy, "ecr:GetAuthorizationToken", "*")
    # Nothing else: no other account's roles, no push, no read of the stacks (the live-check role reads them).
    assert not _allows(policy, "sts:AssumeRole", f"arn:aws:iam::{account}:role/Admin")
    assert not _allows(policy, "sts:AssumeRole", "arn:aws:iam::999999999999:role/kvfleet-check/x")
    assert not _allows(policy, "ecr:PutImage", f"arn:aws:ecr:{region}:{account}:repository/kvfleet-vllm")
    assert all(not a.startswith("cloudformation:") for st in policy["Statement"] for a in st["Action"])


def test_a_file_without_an_account_is_refused_in_one_line() -> None:
    env = load_located(REPO / "environments" / "dev.yaml").environment.model_copy(update={"account": None})
    with pytest.raises(KvfleetError, match=r"^account: dev: .*set both in it$"):
        deploy_role_policy(env)


def test_the_command_prints_the_policy() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet.infra.github_role", "environments/dev.yaml"],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    env = load_located(REPO / "environments" / "dev.yaml").environment
    assert json.loads(done.stdout) == deploy_role_policy(env)
