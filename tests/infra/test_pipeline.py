"""The release pipeline of pipeline.yaml, synthesized once with cdk-nag on: its stages in order, the approval and
the plan diff before production, the live check after every stage and the role it assumes, cross-account
deployment with each account's bootstrap roles, encrypted artifacts, and the same deployment stacks as
`make synth ENV=<name>`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.config.loader import load_located
from kvfleet.config.pipeline import CHECK_ROLE_PATH, load_pipeline
from kvfleet.errors import KvfleetError
from kvfleet.infra.app import build_app
from kvfleet.infra.live_check import check_step_role_path
from kvfleet.infra.pipeline import PipelineStack, build_pipeline, locked_version, stage_stacks
from tests.envs import FEATURE_FLAGS
from tests.infra.helpers import REPO, make_app
from tests.infra.test_cfn_lint import cfn_lint
from tests.infra.test_stage import _without_stage

BOOTSTRAP = "hnb659fds"  # the CDK bootstrap's default qualifier


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineStack, Path]:
    out = tmp_path_factory.mktemp("pipeline")
    # CloudFormation validation on, as `kvfleet synth --pipeline` runs it (the pipeline's own Synth step).
    app = cdk.App(context=FEATURE_FLAGS, outdir=str(out))
    from cdk_nag import AwsSolutionsChecks

    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app, verbose=True))
    stack = build_pipeline(load_pipeline(REPO / "pipeline.yaml"), app=app)
    app.synth()  # fails on any unacknowledged cdk-nag finding, in the pipeline's stack or a stage's
    return stack, out


def _pipeline(stack: PipelineStack) -> dict[str, Any]:
    [resource] = Template.from_stack(stack).find_resources("AWS::CodePipeline::Pipeline").values()
    return dict(resource)


def _actions(stage: dict[str, Any]) -> list[tuple[int, str, str]]:
    return sorted((a["RunOrder"], a["Name"], a["ActionTypeId"]["Provider"]) for a in stage["Actions"])


def test_stages_run_in_the_files_order(synthesized: tuple[PipelineStack, Path]) -> None:
    stages = [s["Name"] for s in _pipeline(synthesized[0])["Properties"]["Stages"]]
    assert stages[:3] == ["Source", "Build", "UpdatePipeline"]  # self-mutation before anything is deployed
    assert [s for s in stages if s.startswith("Deploy-")] == ["Deploy-dev", "Deploy-staging", "Deploy-prod"]


def test_production_is_approved_after_its_plan_diff_and_before_any_deployment(
    synthesized: tuple[PipelineStack, Path],
) -> None:
    by_name = {s["Name"]: s for s in _pipeline(synthesized[0])["Properties"]["Stages"]}
    manual = {n for n, s in by_name.items() for a in s["Actions"] if a["ActionTypeId"]["Provider"] == "Manual"}
    assert manual == {"Deploy-prod"}  # the default: the last of several stages, and only it
    prod = _actions(by_name["Deploy-prod"])
    diff = next(o for o, n, _ in prod if n == "PlanDiff-prod")
    approve = next(o for o, n, p in prod if p == "Manual")
    first_deploy = min(o for o, _, p in prod if p == "CloudFormation")
    assert diff < approve < first_deploy


def test_every_stage_ends_with_its_live_check_reading_the_stages_role(synthesized: tuple[PipelineStack, Path]) -> None:
    stack, _ = synthesized
    projects = Template.from_stack(stack).find_resources("AWS::CodeBuild::Project")
    for stage in _pipeline(stack)["Properties"]["Stages"]:
        if not stage["Name"].startswith("Deploy-"):
            continue
        env = stage["Name"].removeprefix("Deploy-")
        actions = _actions(stage)
        last_order, last_name, provider = actions[-1]
        assert (last_name, provider) == (f"Check-{env}", "CodeBuild")
        assert all(o < last_order for o, n, _ in actions[:-1])  # after every stack's deployment
        [check] = [a for a in stage["Actions"] if a["Name"] == f"Check-{env}"]
        variables = json.loads(check["Configuration"]["EnvironmentVariables"])
        # The role's ARN is the live-check stack's output, read by the pipeline from that deployment.
        assert variables[0]["name"] == "KVFLEET_CHECK_ROLE_ARN"
        assert variables[0]["value"].startswith("#{") and "livecheck" in variables[0]["value"]
        spec = json.loads(projects[check["Configuration"]["ProjectName"]["Ref"]]["Properties"]["Source"]["BuildSpec"])
        commands = spec["phases"]["build"]["commands"]
        assert commands[0].startswith(f".venv/bin/kvfleet check environments/{env}.yaml --role-arn")
        assert f"deployed/{env}.json" in commands[-1]  # kept only when the check passed (commands stop at a failure)
        # The project runs as the role under the path only the stage's live-check role trusts.
        project = projects[check["Configuration"]["ProjectName"]["Ref"]]["Properties"]
        role = Template.from_stack(stack).find_resources("AWS::IAM::Role")[project["ServiceRole"]["Fn::GetAtt"][0]]
        assert role["Properties"]["Path"] == check_step_role_path(env)


def test_the_synth_step_runs_the_tests_before_it_synthesizes(synthesized: tuple[PipelineStack, Path]) -> None:
    stack, _ = synthesized
    [build] = [s for s in _pipeline(stack)["Properties"]["Stages"] if s["Name"] == "Build"]
    ref = build["Actions"][0]["Configuration"]["ProjectName"]["Ref"]
    project = Template.from_stack(stack).find_resources("AWS::CodeBuild::Project")[ref]["Properties"]
    spec = json.loads(project["Source"]["BuildSpec"])
    commands = spec["phases"]["build"]["commands"]
    assert commands[0] == "make test"
    assert commands[-1] == ".venv/bin/kvfleet synth --pipeline pipeline.yaml -- --quiet"
    assert spec["phases"]["install"]["runtime-versions"] == {"python": "3.11", "nodejs": "20"}
    assert project["Environment"]["Image"] == "aws/codebuild/standard:7.0"


def test_each_stage_deploys_with_its_accounts_bootstrap_roles(synthesized: tuple[PipelineStack, Path]) -> None:
    stack, _ = synthesized
    loaded = load_pipeline(REPO / "pipeline.yaml")
    accounts = {e.environment.name: (e.environment.account, e.environment.region) for e in loaded.environments}
    assert len({a for a, _ in accounts.values()} | {loaded.pipeline.account}) == 4  # every stage cross-account
    for stage in _pipeline(stack)["Properties"]["Stages"]:
        if not stage["Name"].startswith("Deploy-"):
            continue
        account, region = accounts[stage["Name"].removeprefix("Deploy-")]
        for action in stage["Actions"]:
            if action["ActionTypeId"]["Provider"] != "CloudFormation":
                continue
            text = json.dumps(action)
            # The action runs as the target account's deploy role; the change set it prepares runs as that
            # account's CloudFormation execution role.
            assert f":iam::{account}:role/cdk-{BOOTSTRAP}-deploy-role-{account}-{region}" in text
            if action["Name"].endswith(".Prepare"):
                assert f":iam::{account}:role/cdk-{BOOTSTRAP}-cfn-exec-role-{account}-{region}" in text


def test_artifacts_are_encrypted_with_a_rotated_key(synthesized: tuple[PipelineStack, Path]) -> None:
    t = Template.from_stack(synthesized[0])
    store = _pipeline(synthesized[0])["Properties"]["ArtifactStore"]
    assert store["EncryptionKey"]["Type"] == "KMS"
    [key] = t.find_resources("AWS::KMS::Key").values()
    assert key["Properties"]["EnableKeyRotation"] is True
    for bucket in t.find_resources("AWS::S3::Bucket").values():
        assert bucket["Properties"]["PublicAccessBlockConfiguration"]["BlockPublicPolicy"] is True
        assert "BucketEncryption" in bucket["Properties"]


def test_the_live_check_role_is_assumable_from_the_pipeline_account_only_and_reads_its_environment(
    synthesized: tuple[PipelineStack, Path],
) -> None:
    stages = stage_stacks(synthesized[0])
    for env, stacks in stages.items():
        [live] = [s for s in stacks if s.stack_name == f"kvfleet-{env}-live-check"]
        t = Template.from_stack(live)
        [role] = t.find_resources("AWS::IAM::Role").values()
        assert role["Properties"]["Path"] == CHECK_ROLE_PATH
        [statement] = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert "111111111111" in json.dumps(statement["Principal"])
        [policy] = t.find_resources("AWS::IAM::Policy").values()
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        actions = {a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
        assert actions <= {
            "cloudformation:DescribeStacks",
            "sagemaker:DescribeEndpoint",
            "sagemaker:InvokeEndpoint",  # what InvokeEndpointWithResponseStream is authorized as
            "ssm:SendCommand",
            "ssm:GetCommandInvocation",
            "autoscaling:DescribeAutoScalingGroups",
        }
        others = {s.stack_name for s in stacks} - {live.stack_name}
        described = next(s for s in statements if s["Action"] == "cloudformation:DescribeStacks")
        resources = [json.dumps(r) for r in described["Resource"]]  # Fn::Join of the partition and the rest
        assert {r.split("stack/")[1].split("/")[0] for r in resources} == others
        tagged = 0
        for s in statements:
            # Endpoints and instances only where they carry this environment's tag.
            text = json.dumps(s["Resource"])
            if "endpoint/" in text or "instance/" in text:
                assert f'/kvfleet:environment": "{env}"' in json.dumps(s["Condition"]), s
                tagged += 1
        assert tagged == 1  # dev and prod: SageMaker endpoints; staging: EC2 instances


@pytest.mark.parametrize("name", ["dev", "staging", "prod"])
def test_a_stage_deploys_the_stacks_make_synth_builds(name: str, synthesized: tuple[PipelineStack, Path]) -> None:
    loaded = load_located(REPO / "environments" / f"{name}.yaml")
    app = build_app(loaded.environment, app=make_app(), nag=False, traces=loaded.traces)
    direct = {s.stack_name: Template.from_stack(s).to_json() for s in app.node.children if isinstance(s, cdk.Stack)}
    staged = {
        s.stack_name: Template.from_stack(s).to_json()
        for s in stage_stacks(synthesized[0])[name]
        if not s.stack_name.endswith("-live-check")
    }
    assert set(staged) == set(direct)
    for stack_name, template in direct.items():
        mine: dict[str, Any] = template["Resources"]
        theirs: dict[str, Any] = staged[stack_name]["Resources"]
        assert sorted(r["Type"] for r in theirs.values()) == sorted(r["Type"] for r in mine.values()), stack_name
        common = set(mine) & set(theirs)
        assert len(common) >= len(mine) - 4, sorted(set(mine) - common)
        for lid in common:
            assert _without_stage(theirs[lid], f"Deploy-{name}") == _without_stage(mine[lid], ""), (stack_name, lid)
        assert staged[stack_name].get("Outputs") == template.get("Outputs")


def test_every_template_of_the_pipeline_lints_clean(synthesized: tuple[PipelineStack, Path]) -> None:
    _, out = synthesized
    templates = sorted(out.rglob("*.template.json"))
    # The pipeline; each stage's alerts, deployment and live-check stacks; each stage account's image repositories.
    assert len(templates) == 1 + 3 * 3 + 3
    result = cfn_lint(templates, "us-east-1")
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_is_looked_up_in_an_account_at_synth(synthesized: tuple[PipelineStack, Path]) -> None:
    # Concrete accounts would otherwise make ec2.Vpc look up their AZs (an AWS call through the lookup role).
    _, out = synthesized
    for manifest in out.rglob("manifest.json"):
        assert json.loads(manifest.read_text()).get("missing") is None, manifest


def test_what_the_check_role_may_touch_carries_the_tag_its_condition_reads(
    synthesized: tuple[PipelineStack, Path],
) -> None:
    # The role's SageMaker and Run Command grants hold only where kvfleet:environment is the stage's: the endpoint
    # has the tag, and the Auto Scaling group gives it to every instance it launches.
    seen = 0
    for env, stacks in stage_stacks(synthesized[0]).items():
        for stack in stacks:
            t = Template.from_stack(stack)
            for kind in ("AWS::SageMaker::Endpoint", "AWS::AutoScaling::AutoScalingGroup"):
                for resource in t.find_resources(kind).values():
                    tags = {x["Key"]: x for x in resource["Properties"]["Tags"]}
                    assert tags["kvfleet:environment"]["Value"] == env
                    if kind == "AWS::AutoScaling::AutoScalingGroup":
                        assert tags["kvfleet:environment"]["PropagateAtLaunch"] is True
                    seen += 1
    assert seen == 3


def _stage(stack: PipelineStack, name: str) -> dict[str, Any]:
    [stage] = [s for s in _pipeline(stack)["Properties"]["Stages"] if s["Name"] == name]
    return stage  # type: ignore[no-any-return]


def _projects(stack: PipelineStack) -> list[dict[str, Any]]:
    return [dict(p) for p in Template.from_stack(stack).find_resources("AWS::CodeBuild::Project").values()]


def _buildspec(project: dict[str, Any]) -> dict[str, Any]:
    spec = project["Properties"]["Source"]["BuildSpec"]
    return json.loads(spec) if isinstance(spec, str) else spec  # type: ignore[no-any-return]


def test_the_images_are_pushed_after_self_mutation_and_before_any_stage_deploys(
    synthesized: tuple[PipelineStack, Path],
) -> None:
    stages = [s["Name"] for s in _pipeline(synthesized[0])["Properties"]["Stages"]]
    assert (
        stages.index("UpdatePipeline")
        < stages.index("Images")
        < min(i for i, s in enumerate(stages) if s.startswith("Deploy-"))
    )
    actions = _actions(_stage(synthesized[0], "Images"))
    # Per account the stages deploy into: its repositories, then the image step (which needs them).
    for account in ("222222222222", "333333333333", "444444444444"):
        place = f"Images-{account}-us-east-1"
        order = {name.removeprefix(place + "."): run for run, name, _ in actions if name.startswith(place)}
        assert order["kvfleet-images.Deploy"] < order[f"Image-{account}-us-east-1"], order


def test_the_image_step_builds_the_tag_each_stack_names(synthesized: tuple[PipelineStack, Path]) -> None:
    stack = synthesized[0]
    steps = [
        p for p in _projects(stack) if any("docker build" in c for c in _buildspec(p)["phases"]["build"]["commands"])
    ]
    assert len(steps) == 3 and all(p["Properties"]["Environment"]["PrivilegedMode"] is True for p in steps)
    commands = "\n".join(c for p in steps for c in _buildspec(p)["phases"]["build"]["commands"])
    seen = 0
    for env, stacks in stage_stacks(stack).items():
        for s in stacks:
            text = json.dumps(Template.from_stack(s).to_json())
            for tag in set(re.findall(r"kvfleet-vllm:([0-9][A-Za-z0-9_.-]*)", text)):
                assert f"--image-ids imageTag={tag} " in commands, (env, tag)  # skipped when pushed already
                assert f"/kvfleet-vllm:{tag} ." in commands, (env, tag)
                seen += 1
    assert seen >= 3  # every stage's deployment names a built tag
    assert f"--build-arg CONTRACT_VERSION={contract.CONTRACT_VERSION} " in commands


def test_the_pipeline_installs_the_cli_versions_the_lockfile_pins(synthesized: tuple[PipelineStack, Path]) -> None:
    lock = json.loads((REPO / "package-lock.json").read_text())["packages"]
    installs = {c for p in _projects(synthesized[0]) for c in _buildspec(p)["phases"]["install"].get("commands", [])}
    npm = {c for c in installs if c.startswith("npm install -g")}
    assert npm == {
        f"npm install -g aws-cdk@{lock['node_modules/aws-cdk']['version']}",
        f"npm install -g cdk-assets@{lock['node_modules/cdk-assets']['version']}",
    }


def test_one_execution_deploys_at_a_time(synthesized: tuple[PipelineStack, Path]) -> None:
    assert _pipeline(synthesized[0])["Properties"]["ExecutionMode"] == "QUEUED"


def test_a_lockfile_without_the_cli_says_what_to_pin(tmp_path: Path) -> None:
    (tmp_path / "package-lock.json").write_text(json.dumps({"packages": {"": {}}}))
    with pytest.raises(KvfleetError) as err:
        locked_version("cdk-assets", root=tmp_path)
    assert "pins no cdk-assets" in str(err.value) and "\n" not in str(err.value)
    assert locked_version("aws-cdk") == json.loads((REPO / "package.json").read_text())["devDependencies"]["aws-cdk"]


def test_the_source_may_use_the_connection_under_its_own_prefix(synthesized: tuple[PipelineStack, Path]) -> None:
    # A connection made since the rename is arn:...:codeconnections:...; the policy's action prefix must match the
    # resource's (Developer Tools console User Guide, "Connections rename - Summary of changes").
    arn = load_pipeline(REPO / "pipeline.yaml").pipeline.source.connection_arn
    assert arn.split(":")[2] == "codeconnections"
    policies = Template.from_stack(synthesized[0]).find_resources("AWS::IAM::Policy")
    granted = {
        action
        for p in policies.values()
        for s in p["Properties"]["PolicyDocument"]["Statement"]
        if s.get("Resource") == arn
        for action in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert "codeconnections:UseConnection" in granted
