"""`kvfleet ci-template`: a GitHub Actions workflow for teams not on CodePipeline, from the same pipeline.yaml.

- On a pull request and on a push: `make test`, then for every environment its plan diff against the base branch
  (on a pull request) in the job summary, and `kvfleet synth` of it. Nothing deploys unless it passed.
- On a push to the release branch, after the tests: one job per stage, in the file's order, each in a GitHub
  environment of the same name, one run per environment at a time (``concurrency``). A stage with ``approval``
  gets a plan-diff job first (its summary is what the reviewer reads) and its environment is where GitHub's
  required reviewers hold the deployment (set in the repository's settings: the
  workflow cannot set them). Each job takes AWS credentials from the environment's OIDC role
  (``vars.AWS_DEPLOY_ROLE_ARN``, no stored keys), builds and pushes the serving images the stacks name where
  their tag is missing (`make image`, pushing as the account's CDK image-publishing role, which the repositories let
  push: the OIDC role only assumes it), deploys with `cdk deploy`, deploys the environment's live-check role trusted by
  the OIDC role (kvfleet/infra/live_check.py's app), and runs `kvfleet check` as that role, as the release pipeline's
  check step does. What the OIDC role itself must be allowed: ``python -m kvfleet.infra.github_role <environment>``.

Every action is pinned by the full commit of a release, its tag in a comment: a tag can be moved, a commit cannot,
and the deploy jobs hold an OIDC token (GitHub Docs, "Security hardening for GitHub Actions", "Using third-party
actions": pinning to a full-length commit SHA is the only immutable release).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from kvfleet.config.pipeline import LoadedPipeline


@dataclass(frozen=True, kw_only=True)
class PinnedAction:
    repository: str
    tag: str
    commit: str  # the tag's commit, read from the action's repository

    @property
    def uses(self) -> str:
        return f"{self.repository}@{self.commit}"


# Each the newest release of its action (its git tag's commit in github.com/<repository>, read 2026-12-07); all run
# on node24, and take the inputs used here (their action.yml at that commit).
CHECKOUT = PinnedAction(repository="actions/checkout", tag="v7.0.1", commit="3d3c42e5aac5ba805825da76410c181273ba90b1")
SETUP_PYTHON = PinnedAction(
    repository="actions/setup-python", tag="v7.0.0", commit="5fda3b95a4ea91299a34e894583c3862153e4b97"
)
SETUP_NODE = PinnedAction(
    repository="actions/setup-node", tag="v7.0.0", commit="820762786026740c76f36085b0efc47a31fe5020"
)
AWS_CREDENTIALS = PinnedAction(
    repository="aws-actions/configure-aws-credentials", tag="v6.2.3", commit="e6de054238d6b7531b4efff3b6587d9aade6a06c"
)
ACTIONS = (CHECKOUT, SETUP_PYTHON, SETUP_NODE, AWS_CREDENTIALS)
RUNNER = "ubuntu-24.04"
TEST_JOB = "test"


def _setup(*, full_history: bool = False) -> list[dict[str, Any]]:
    checkout: dict[str, Any] = {"uses": CHECKOUT.uses}
    if full_history:
        checkout["with"] = {"fetch-depth": 0}  # the base branch, for the plan diff
    return [
        checkout,
        {"uses": SETUP_PYTHON.uses, "with": {"python-version": "3.11"}},
        {"uses": SETUP_NODE.uses, "with": {"node-version": "20", "cache": "npm"}},
    ]


def _diff(env_file: str, name: str, base: str) -> dict[str, Any]:
    # The file at the base ref is written beside the current one, so its relative paths (traces) still resolve.
    old = f"environments/.base-{name}.yaml"
    return {
        "name": f"Plan diff: {name}",
        # The copy goes on exit, also when the diff refuses the change (a step's shell stops at the first failure).
        "run": (
            f"trap 'rm -f {old}' EXIT\n"
            f'if git show "{base}:{env_file}" > {old} 2>/dev/null; then\n'
            f'  .venv/bin/kvfleet diff {old} {env_file} --markdown >> "$GITHUB_STEP_SUMMARY"\n'
            "else\n"
            f"  echo '{name}: new in this change' >> \"$GITHUB_STEP_SUMMARY\"\n"
            "fi\n"
        ),
    }


def _test_job(stages: list[tuple[str, str]]) -> dict[str, Any]:
    """On a pull request and before any deployment: the tests, then (on a pull request) each environment's plan diff
    against the base branch, and its synth."""
    on_pr = "github.event_name == 'pull_request'"
    return {
        "runs-on": RUNNER,
        "timeout-minutes": 60,
        "steps": [
            *_setup(full_history=True),
            {"name": "Tests", "run": "make test"},
            *({**_diff(f, name, "origin/${{ github.base_ref }}"), "if": on_pr} for name, f in stages),
            *({"name": f"Synth: {name}", "run": f".venv/bin/kvfleet synth {f} -- --quiet"} for name, f in stages),
        ],
    }


def _plan_job(name: str, env_file: str, needs: list[str]) -> dict[str, Any]:
    """Before an approved stage: what this release changes in its plan, in the job summary the reviewer reads."""
    job: dict[str, Any] = {"if": "github.event_name == 'push'"}
    if needs:
        job["needs"] = needs
    return {
        **job,
        "runs-on": RUNNER,
        "timeout-minutes": 30,
        "steps": [
            *_setup(full_history=True),
            {"name": "Install", "run": "make venv"},
            # Against the commit the branch was at before this push: what this release changes.
            _diff(env_file, name, "${{ github.event.before }}"),
        ],
    }


# Where the live-check stack's outputs are written (cdk deploy --outputs-file: {stack: {output: value}}), and the output
# naming its role (kvfleet/infra/live_check.py's RoleArn).
LIVE_CHECK_OUT = "cdk.out/live-check"
LIVE_CHECK_ROLE_OUTPUT = "RoleArn"


def _live_check(env_file: str) -> list[dict[str, Any]]:
    """The environment's live-check role, trusted by this job's OIDC role, then `kvfleet check` as that role. The
    role ARN reaches the shell through the step's environment, not the script's text (GitHub Docs, "Security
    hardening for GitHub Actions": an intermediate environment variable, not an expression in the script)."""
    read_role = (
        f".venv/bin/python -c 'import json, sys; [o] = json.load(open(sys.argv[1])).values(); "
        f'print(o["{LIVE_CHECK_ROLE_OUTPUT}"])\' {LIVE_CHECK_OUT}/outputs.json'
    )
    return [
        {
            "name": "Live-check role",
            "env": {"DEPLOY_ROLE_ARN": "${{ vars.AWS_DEPLOY_ROLE_ARN }}"},
            "run": (
                "node_modules/.bin/cdk deploy --app '.venv/bin/python -m kvfleet.infra.live_check' "
                f'-c env={env_file} -c deploy_role_arn="$DEPLOY_ROLE_ARN" --output {LIVE_CHECK_OUT} '
                f"--outputs-file {LIVE_CHECK_OUT}/outputs.json --require-approval never --all"
            ),
        },
        {
            "name": "Live check",
            "run": f'.venv/bin/kvfleet check {env_file} --role-arn "$({read_role})"',
        },
    ]


def _deploy_job(name: str, env_file: str, region: str | None, needs: list[str]) -> dict[str, Any]:
    """One stage: synth, deploy with the environment's OIDC role, then the live check."""
    job: dict[str, Any] = {
        "if": "github.event_name == 'push'",
        "runs-on": RUNNER,
        "timeout-minutes": 120,
        "environment": name,
        # One deployment of an environment at a time; a newer push waits rather than cancelling one mid-way.
        "concurrency": {"group": f"deploy-{name}", "cancel-in-progress": False},
        "permissions": {"id-token": "write", "contents": "read"},
        "steps": [
            *_setup(),
            {"name": "Install", "run": "make venv && npm ci --no-audit --no-fund --loglevel=error"},
            {
                "name": "AWS credentials (OIDC)",
                "uses": AWS_CREDENTIALS.uses,
                "with": {"role-to-assume": "${{ vars.AWS_DEPLOY_ROLE_ARN }}", "aws-region": region},
            },
            # The images the stacks name, built and pushed where their tag is missing, before anything deploys; pushed
            # as the image-publishing role, the one the repositories' policy lets push.
            {"name": "Image", "run": f"make image ENV={name} ASSUME_PUBLISHING_ROLE=1"},
            {"name": "Synth", "run": f".venv/bin/kvfleet synth {env_file} -- --quiet"},
            {
                "name": "Deploy",
                "run": "node_modules/.bin/cdk deploy --app cdk.out --all --require-approval never",
            },
            *_live_check(env_file),
        ],
    }
    if needs:
        job["needs"] = needs
    return job


def workflow(loaded: LoadedPipeline) -> dict[str, Any]:
    p = loaded.pipeline
    branch = p.source.branch
    stages = list(zip(p.stages, loaded.environments, loaded.relative_paths, strict=True))
    jobs: dict[str, Any] = {TEST_JOB: _test_job([(s.environment, f) for s, _, f in stages])}
    previous = TEST_JOB  # nothing deploys before the tests pass
    for i, (stage, env, env_file) in enumerate(stages):
        name = stage.environment
        needs: list[str] = [previous]
        if p.approval_before(i):
            jobs[f"plan-{name}"] = _plan_job(name, env_file, needs)
            needs = [*needs, f"plan-{name}"]
        previous = f"deploy-{name}"
        jobs[previous] = _deploy_job(name, env_file, env.environment.region, needs)
    return {
        "name": f"kvfleet release {p.name}",
        "on": {"pull_request": {"branches": [branch]}, "push": {"branches": [branch]}},
        "permissions": {"contents": "read"},
        "jobs": jobs,
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(loaded: LoadedPipeline) -> str:
    header = (
        f"# Written by `kvfleet ci-template {loaded.source}`; regenerate it when the pipeline file changes.\n"
        "# Each stage's GitHub environment holds vars.AWS_DEPLOY_ROLE_ARN (the OIDC role of that account) and, where\n"
        "# the pipeline asks for an approval, its required reviewers (README: Release pipelines).\n"
    )
    # "on" stays a key: PyYAML would quote it, and GitHub reads the quoted form the same way.
    text = yaml.dump(workflow(loaded), Dumper=_Dumper, sort_keys=False, width=120)
    for action in ACTIONS:  # the release each commit is, beside it
        text = text.replace(f"uses: {action.uses}\n", f"uses: {action.uses} # {action.tag}\n")
    return header + text
