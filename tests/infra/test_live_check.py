"""The live check's least privilege: the stage's live-check role trusts the pipeline's check step of its environment
only (by its role's path, aws:PrincipalArn), or in the GitHub flow the workflow's deploy role by its ARN alone, and
on EC2 it may send the fleet's own probe document, which reads /ping and /metrics and takes no parameters, never
AWS-RunShellScript. The document's lines run here by bash against the real agent (with the fake engine), as Run
Command runs them on an instance."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.errors import KvfleetError
from kvfleet.infra.app import add_environment
from kvfleet.infra.live_check import LiveCheckStack, check_step_role, check_step_trust, live_check_principal
from kvfleet.targets.ec2 import read_probe
from kvfleet.targets.ec2.infra.probe import PROBE_OUTPUT, probe_commands, probe_content
from tests.agent.harness import running, settings
from tests.infra.helpers import REPO, SAGEMAKER_ENV, environment, make_app

PIPELINE_ACCOUNT = "111111111111"


@pytest.fixture(scope="module")
def staging() -> tuple[LiveCheckStack, list[cdk.Stack]]:
    text = SAGEMAKER_ENV.replace("platform: sagemaker", "platform: ec2").replace("ml.g6e.xlarge", "g6e.xlarge")
    env = environment(text.replace("name: test", 'name: staging\naccount: "333333333333"', 1))
    app = make_app()
    stacks = add_environment(app, env)
    live = LiveCheckStack(
        app, "kvfleet-staging-live-check", environment=env, stacks=stacks, pipeline_account=PIPELINE_ACCOUNT
    )
    return live, stacks


def _statements(t: Template) -> list[dict[str, Any]]:
    return [
        s for p in t.find_resources("AWS::IAM::Policy").values() for s in p["Properties"]["PolicyDocument"]["Statement"]
    ]


def test_the_role_trusts_the_check_step_of_its_environment_only(
    staging: tuple[LiveCheckStack, list[cdk.Stack]],
) -> None:
    live, _ = staging
    [role] = Template.from_stack(live).find_resources("AWS::IAM::Role").values()
    [statement] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    condition = statement["Condition"]["ArnLike"]["aws:PrincipalArn"]
    pattern = "".join(p if isinstance(p, str) else "aws" for p in condition["Fn::Join"][1])
    # The step role's ARN as IAM writes it: path, then the generated name.
    scope = cdk.Stack(cdk.App(), "Pipeline", env=cdk.Environment(account=PIPELINE_ACCOUNT, region="us-east-1"))
    check_step_role(scope, "CheckRole", environment="staging")
    [step] = Template.from_stack(scope).find_resources("AWS::IAM::Role").values()
    path = step["Properties"]["Path"]
    assert step["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {
        "Service": "codebuild.amazonaws.com"
    }
    assert fnmatch.fnmatchcase(f"arn:aws:iam::{PIPELINE_ACCOUNT}:role{path}CheckRoleABC123", pattern)
    # Not the pipeline's other roles, nor another stage's check step.
    assert not fnmatch.fnmatchcase(f"arn:aws:iam::{PIPELINE_ACCOUNT}:role/kvfleet-pipeline-Role-1", pattern)
    assert not fnmatch.fnmatchcase(f"arn:aws:iam::{PIPELINE_ACCOUNT}:role/kvfleet-check-step/prod/X", pattern)
    assert check_step_trust("aws", PIPELINE_ACCOUNT, "prod")["ArnLike"]["aws:PrincipalArn"].endswith("/prod/*")


def test_run_command_is_the_fleets_probe_document_only(staging: tuple[LiveCheckStack, list[cdk.Stack]]) -> None:
    live, _ = staging
    text = json.dumps(Template.from_stack(live).to_json())
    assert "AWS-RunShellScript" not in text
    send = [s for s in _statements(Template.from_stack(live)) if s["Action"] == "ssm:SendCommand"]
    assert len(send) == 1
    assert send[0]["Condition"] == {"StringEquals": {"ssm:resourceTag/kvfleet:environment": "staging"}}
    resources = [json.dumps(r) for r in send[0]["Resource"]]
    assert any(":document/*" in r for r in resources) and any(":instance/*" in r for r in resources)


def test_the_fleet_stack_holds_the_probe_document_tagged_and_named_in_its_outputs(
    staging: tuple[LiveCheckStack, list[cdk.Stack]],
) -> None:
    _, stacks = staging
    [fleet] = [s for s in stacks if not s.stack_name.endswith("-alerts")]
    t = Template.from_stack(fleet)
    [(logical, doc)] = t.find_resources("AWS::SSM::Document").items()
    props = doc["Properties"]
    assert props["DocumentType"] == "Command" and "Name" not in props  # generated: no fixed physical name
    assert props["Content"] == probe_content()
    assert {"Key": "kvfleet:environment", "Value": "staging"} in props["Tags"]  # what the grant's condition reads
    assert t.find_outputs(PROBE_OUTPUT)[PROBE_OUTPUT]["Value"] == {"Ref": logical}


def test_the_document_takes_no_parameters_and_names_no_other_route() -> None:
    content = probe_content()
    assert content["parameters"] == {}
    text = json.dumps(content)
    assert "{{" not in text  # no parameter reference anywhere
    base = f"http://127.0.0.1:{contract.SERVING_PORT}"
    routes = [re.match(r"[/a-z]*", part)[0] for line in probe_commands() for part in line.split(base)[1:]]  # type: ignore[index]
    assert sorted(routes) == sorted([contract.HEALTH_ROUTE, contract.METRICS_ROUTE])
    assert "://" not in " ".join(line.replace(base, "") for line in probe_commands())  # no other address


def probe_output() -> str:
    """What the fleet's probe document prints on an instance: its lines run by bash against the agent and a fake
    engine (kvfleet check reads this back; tests/bench/test_live.py feeds it to the check)."""

    async def go() -> str:
        s = settings()
        async with running(s) as agent:
            for _ in range(100):  # a deployed agent has long read the engine's cache size; wait until this one has
                async with agent.http.get(f"{agent.url}/metrics") as resp:
                    if contract.PROM_ENGINE_KV_BLOCKS in await resp.text():
                        break
                await asyncio.sleep(0.1)
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", "\n".join(probe_commands(port=s.port)), stdout=asyncio.subprocess.PIPE
            )
            out, _ = await proc.communicate()
            assert proc.returncode == 0
            return out.decode()

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_the_documents_lines_read_the_agents_health_and_cache() -> None:
    out = probe_output()
    ping, metrics = read_probe(out)
    assert ping == 200
    assert "/v1/" not in "\n".join(probe_commands())  # nothing is generated
    assert contract.PROM_ENGINE_KV_BLOCKS in metrics and contract.PROM_ENGINE_KV_BLOCK_TOKENS in metrics


# ---- the GitHub workflow's live-check role -------------------------------------------------------------------------

DEPLOY_ROLE = "arn:aws:iam::333333333333:role/github/kvfleet-deploy"


def test_a_workflow_deploy_role_is_trusted_by_its_arn_alone(staging: tuple[LiveCheckStack, list[cdk.Stack]]) -> None:
    _, stacks = staging
    env = environment(
        SAGEMAKER_ENV.replace("platform: sagemaker", "platform: ec2")
        .replace("ml.g6e.xlarge", "g6e.xlarge")
        .replace("name: test", 'name: staging\naccount: "333333333333"', 1)
    )
    app = make_app()
    live = LiveCheckStack(
        app, "kvfleet-staging-live-check", environment=env, stacks=stacks, deploy_role_arn=DEPLOY_ROLE
    )
    [role] = Template.from_stack(live).find_resources("AWS::IAM::Role").values()
    [statement] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    # That role's sessions only: no account principal, so no other principal of the account may assume it.
    assert statement["Principal"] == {"AWS": DEPLOY_ROLE} and "Condition" not in statement
    assert role["Properties"]["Path"] == "/kvfleet-check/"  # where the deploy role's policy lets it assume roles
    assert Template.from_stack(live).find_outputs("RoleArn")  # what the workflow's check step reads


def test_the_trust_is_one_principal_and_a_role_arn() -> None:
    with pytest.raises(KvfleetError, match=r"^deploy_role_arn: 'arn:aws:iam::333333333333:user/me' is not an IAM role"):
        live_check_principal("dev", pipeline_account=None, deploy_role_arn="arn:aws:iam::333333333333:user/me")
    with pytest.raises(KvfleetError, match="one of them"):
        live_check_principal("dev", pipeline_account=None, deploy_role_arn=None)
    with pytest.raises(KvfleetError, match="one of them"):
        live_check_principal("dev", pipeline_account=PIPELINE_ACCOUNT, deploy_role_arn=DEPLOY_ROLE)


def test_the_workflows_app_deploys_the_environments_role_trusted_by_the_deploy_role(tmp_path: Path) -> None:
    # As `cdk deploy --app 'python -m kvfleet.infra.live_check' -c env=... -c deploy_role_arn=...` runs it.
    context = {"env": "environments/dev.yaml", "deploy_role_arn": DEPLOY_ROLE}
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet.infra.live_check"],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    body = json.loads((tmp_path / "kvfleet-dev-live-check.template.json").read_text(encoding="utf-8"))
    [role] = [r for r in body["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"AWS": DEPLOY_ROLE}
    # It may read the environment's own stacks, as the pipeline's does.
    assert "stack/kvfleet-dev-alerts/*" in json.dumps(body)
    bad = {**env, "CDK_CONTEXT_JSON": json.dumps({**context, "deploy_role_arn": "nope"})}
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet.infra.live_check"],
        check=False,
        cwd=REPO,
        env=bad,
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("kvfleet: deploy_role_arn: 'nope'")
    assert "Traceback" not in done.stderr
