"""The release pipeline (``pipeline.yaml``): CDK Pipelines promoting a release through the environments in order.

    Source (CodeConnections) -> Synth (make test, then kvfleet synth --pipeline) -> UpdatePipeline (self-mutation)
    -> Images: per account and region, its image repositories, then the serving images built and pushed
    -> one stage per environment: [plan diff -> manual approval] -> deploy its stacks -> live check

The images are pushed before any stage deploys, under the tag that digests their inputs (kvfleet/infra/
image_build.py), which the stacks name: a build already pushed is skipped, and a failed build deploys nothing.
The pipeline runs one execution at a time (QUEUED): two pushes never deploy one environment at once. The CDK CLI
its self-mutation installs and the cdk-assets its asset steps install are the versions package-lock.json pins.

Each stage is a ``cdk.Stage`` in the environment's account and region holding ``add_environment``'s stacks (the
stacks `make synth ENV=<name>` builds, under the same names), and a small live-check stack: the role the check
step assumes in that account. The check (``kvfleet check``) stops the promotion when a deployment is not healthy,
cannot stream a generation, or holds fewer KV tokens than planned; when it passes, the stage's plan is kept in the
pipeline's plans bucket, and the next release's approval step prints what it changes against that plan.

CDK Pipelines deploys a stage with the target account's bootstrap roles, so each account is bootstrapped once
with ``--trust <pipeline account>`` (the README gives the commands). Cross-account deployment needs the artifact
bucket encrypted with a KMS key the stages' roles may use: ``cross_account_keys`` makes one, rotated yearly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import Duration, RemovalPolicy, Stack, pipelines
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from kvfleet.config.loader import LoadedEnvironment
from kvfleet.config.pipeline import CHECK_ROLE_PATH, LoadedPipeline
from kvfleet.config.schema import Environment
from kvfleet.errors import KvfleetError
from kvfleet.infra.app import add_environment
from kvfleet.infra.iam import ECR_PULL_ACTIONS
from kvfleet.infra.image_build import SOURCE_ROOT, ImageBuild, base_repositories, push_script
from kvfleet.infra.live_check import LiveCheckStack, check_step_role, live_check_stack_name
from kvfleet.infra.nag import acknowledge, condition_id, logical_id
from kvfleet.infra.repository import REPOSITORIES_STACK, ImageRepositoriesStack, builds_by_place, publishing_role_arn

# CodeBuild's curated image for every step, and the runtimes its buildspec selects: standard:7.0 (Ubuntu 22.04)
# offers python 3.11 and nodejs 20 (AWS CodeBuild User Guide, "Available runtimes"), the versions this project is
# built and tested with.
BUILD_IMAGE = codebuild.LinuxBuildImage.STANDARD_7_0
RUNTIMES = {"python": "3.11", "nodejs": "20"}
# make test runs the real vLLM (CPU build) and the CDK synths: ~15 min on 2 cores; the large type has 8 vCPUs.
SYNTH_COMPUTE = codebuild.ComputeType.LARGE
SYNTH_TIMEOUT = Duration.minutes(90)
STEP_TIMEOUT = Duration.minutes(30)
PLANS_PREFIX = "deployed"  # s3://<plans bucket>/deployed/<environment>.json: the plan that passed its checks
# The plan diff needs the planner alone; the live check (`kvfleet check`) needs the bench extra (aiohttp, boto3).
INSTALL = [
    "python -m venv .venv",
    ".venv/bin/pip install --quiet --upgrade pip",
    ".venv/bin/pip install --quiet '.[bench]'",
]


# The image step runs docker (CodeBuild's privileged mode) and pulls the engine's base image: the vLLM DLC is over
# 10 GB; the large type has 128 GB of disk (AWS CodeBuild User Guide, "Build environment compute modes and types").
IMAGE_COMPUTE = codebuild.ComputeType.LARGE
IMAGE_TIMEOUT = Duration.minutes(60)
# CodePipeline V2's execution modes (CodePipeline User Guide, "Set or change the pipeline execution mode"): QUEUED
# runs executions one after another, in order; SUPERSEDED would let a newer one overtake an older one mid-way.
EXECUTION_MODE = codepipeline.ExecutionMode.QUEUED
LOCKFILE = "package-lock.json"


def stage_id(environment: str) -> str:
    return f"Deploy-{environment}"


def images_stage_id(account: str, region: str) -> str:
    return f"Images-{account}-{region}"


def locked_version(package: str, *, root: Path = SOURCE_ROOT) -> str:
    """The version of an npm package package-lock.json pins (npm's lockfileVersion 2 and 3: packages by path)."""
    path = root / LOCKFILE
    try:
        lock = json.loads(path.read_text(encoding="utf-8"))
        version = lock["packages"][f"node_modules/{package}"]["version"]
    except (OSError, ValueError, KeyError, TypeError):
        raise KvfleetError(
            f"{path} pins no {package}: the pipeline installs the versions the lockfile pins; run npm install "
            f"--save-dev --save-exact {package} and commit {LOCKFILE}",
            field="pipeline",
        ) from None
    return str(version)


class PipelineStack(Stack):
    """The pipeline, in its own account and region, and a stage per environment of ``pipeline.yaml``."""

    def __init__(self, scope: Construct, id: str, *, loaded: LoadedPipeline) -> None:
        p = loaded.pipeline
        self._loaded = loaded
        super().__init__(
            scope,
            id,
            env=cdk.Environment(account=p.account, region=p.region),
            stack_name=id,
            description=f"kvfleet release pipeline {p.name}: {' -> '.join(s.environment for s in p.stages)}",
        )
        self.plans = self._plans_bucket()
        source = pipelines.CodePipelineSource.connection(
            p.source.repository, p.source.branch, connection_arn=p.source.connection_arn
        )
        env_files = list(loaded.relative_paths)
        self.pipeline = self._code_pipeline(self._synth(source, env_files))
        self.stages: list[cdk.Stage] = []
        self.checks: dict[str, pipelines.CodeBuildStep] = {}
        self.diffs: dict[str, pipelines.CodeBuildStep] = {}
        self.approvals: dict[str, pipelines.ManualApprovalStep] = {}
        self.image_steps: dict[tuple[str, str], pipelines.CodeBuildStep] = {}
        self._add_images(source)
        for i, (env_loaded, env_file) in enumerate(zip(loaded.environments, env_files, strict=True)):
            self._add_stage(i, env_loaded, env_file, source)
        self.pipeline.build_pipeline()
        self._grant_connection_prefix(p.source.connection_arn)
        cfn = self.pipeline.pipeline.node.default_child
        assert isinstance(cfn, cdk.CfnResource)
        # cfn-lint's E3703 ("prefer Fn::Sub over Fn::Join with an empty delimiter") is a style rule; CDK Pipelines
        # writes the stages' role ARNs as such joins. Ignored on the pipeline resource only.
        cfn.add_metadata("cfn-lint", {"config": {"ignore_checks": ["E3703"]}})
        self._acknowledge()

    def _grant_connection_prefix(self, connection_arn: str) -> None:
        """CDK grants the source action codestar-connections:UseConnection whatever the connection's ARN; a connection
        created since the rename is arn:...:codeconnections:..., and "when specifying a resource in the IAM policy,
        the service prefix needs to match that of the resource" (Developer Tools console User Guide, "Connections
        rename - Summary of changes"). The action of the ARN's own prefix is granted too."""
        prefix = connection_arn.split(":")[2]
        roles = [
            c
            for c in self.pipeline.node.find_all()
            if isinstance(c, iam.Role) and "/Source/" in c.node.path and c.node.id == "CodePipelineActionRole"
        ]
        assert roles, "CDK Pipelines' source action role was not found"
        for role in roles:
            role.add_to_principal_policy(
                iam.PolicyStatement(actions=[f"{prefix}:UseConnection"], resources=[connection_arn])
            )

    def _plans_bucket(self) -> s3.Bucket:
        plans = s3.Bucket(
            self,
            "Plans",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,  # every plan that was deployed, for as long as the lifecycle keeps it
            lifecycle_rules=[s3.LifecycleRule(noncurrent_version_expiration=Duration.days(365))],
            removal_policy=RemovalPolicy.RETAIN,
        )
        acknowledge(
            plans,
            "AwsSolutions-S1",
            "holds the plan JSON of each deployed release, written and read only by this pipeline's steps; its "
            "versions are the history",
        )
        return plans

    def _synth(self, source: pipelines.CodePipelineSource, env_files: Sequence[str]) -> pipelines.CodeBuildStep:
        return pipelines.CodeBuildStep(
            "Synth",
            input=source,
            install_commands=["make venv", "npm ci --no-audit --no-fund --loglevel=error"],
            commands=[
                # The same gate as CI: lint, types and every test (the real vLLM on the CPU included).
                "make test",
                *(f".venv/bin/kvfleet plan {f}" for f in env_files),
                f".venv/bin/kvfleet synth --pipeline {self._loaded.relative_source} -- --quiet",
            ],
            primary_output_directory="cdk.out",
            build_environment=codebuild.BuildEnvironment(build_image=BUILD_IMAGE, compute_type=SYNTH_COMPUTE),
            timeout=SYNTH_TIMEOUT,
        )

    def _code_pipeline(self, synth: pipelines.CodeBuildStep) -> pipelines.CodePipeline:
        return pipelines.CodePipeline(
            self,
            "Pipeline",
            synth=synth,
            pipeline_type=codepipeline.PipelineType.V2,
            execution_mode=EXECUTION_MODE,
            cli_version=locked_version("aws-cdk"),
            cdk_assets_cli_version=locked_version("cdk-assets"),
            cross_account_keys=True,  # a KMS key for the artifacts, which every stage's account may decrypt
            enable_key_rotation=True,
            use_change_sets=True,
            code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(
                    build_image=BUILD_IMAGE, compute_type=codebuild.ComputeType.SMALL
                ),
                partial_build_spec=codebuild.BuildSpec.from_object(
                    {"phases": {"install": {"runtime-versions": dict(RUNTIMES)}}}
                ),
                timeout=STEP_TIMEOUT,
            ),
        )

    def _add_images(self, source: pipelines.CodePipelineSource) -> None:
        """Before every deploy stage: per account and region the stages deploy into, its repositories stack, then
        the images its environments run, built and pushed where their tag is missing."""
        places = builds_by_place(e.environment for e in self._loaded.environments)
        if not places:
            return
        app = self.node.scope
        assert isinstance(app, Construct)
        wave = self.pipeline.add_wave("Images")
        for (account, region), builds in sorted(places.items()):
            stage = cdk.Stage(
                app, images_stage_id(account, region), env=cdk.Environment(account=account, region=region)
            )
            ImageRepositoriesStack(stage, REPOSITORIES_STACK)
            step = self._image_step(source, account, region, builds)
            self.image_steps[(account, region)] = step
            wave.add_stage(stage, post=[step])

    def _image_step(
        self, source: pipelines.CodePipelineSource, account: str, region: str, builds: Sequence[ImageBuild]
    ) -> pipelines.CodeBuildStep:
        role = publishing_role_arn(account, region, self.partition)
        pulls = base_repositories(builds, self.partition)  # as the GitHub workflow's OIDC role is granted them
        statements = [
            iam.PolicyStatement(actions=["sts:AssumeRole"], resources=[role]),
            iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
        ]
        if pulls:
            statements.append(iam.PolicyStatement(actions=list(ECR_PULL_ACTIONS), resources=pulls))
        return pipelines.CodeBuildStep(
            f"Image-{account}-{region}",
            input=source,
            commands=push_script(builds, account=account, region=region, role_arn=role),
            build_environment=codebuild.BuildEnvironment(
                build_image=BUILD_IMAGE, compute_type=IMAGE_COMPUTE, privileged=True
            ),
            timeout=IMAGE_TIMEOUT,
            role_policy_statements=statements,
        )

    def _add_stage(
        self, index: int, env_loaded: LoadedEnvironment, env_file: str, source: pipelines.CodePipelineSource
    ) -> None:
        """One environment's Stage (its stacks and live-check role), with its approval before and check after."""
        p = self._loaded.pipeline
        env = env_loaded.environment
        app = self.node.scope
        assert isinstance(app, Construct)
        # Beside the pipeline's stack in the app, not inside it: the stage's construct paths (and the names CDK
        # derives from them) are then those of a Stage of its own (tests/infra/test_stage.py).
        stage = cdk.Stage(app, stage_id(env.name), env=cdk.Environment(account=env.account, region=env.region))
        stacks = add_environment(stage, env, traces=env_loaded.traces, host_images=env_loaded.host_images)
        live = LiveCheckStack(
            stage, live_check_stack_name(env.name), environment=env, stacks=stacks, pipeline_account=p.account
        )
        pre = self._approval(source, env.name, env_file) if p.approval_before(index) else []
        check = self._live_check(
            source, env, env_file, live, generation=p.checks.generation, kv_tolerance=p.checks.kv_tolerance
        )
        self.checks[env.name] = check
        self.pipeline.add_stage(stage, pre=pre, post=[check])
        self.stages.append(stage)

    def _approval(self, source: pipelines.CodePipelineSource, name: str, env_file: str) -> list[pipelines.Step]:
        """The plan diff, then the manual approval that waits for a person to read it."""
        diff = self._plan_diff(source, name, env_file)
        approval = pipelines.ManualApprovalStep(
            f"Approve-{name}",
            comment=f"Promote this release to {name}? Step PlanDiff-{name} shows what it changes in "
            "the plan (instance type, count, engine flags, KV tokens, $/h); the deploy actions' change sets "
            "show what it changes in CloudFormation.",
        )
        approval.add_step_dependency(diff)
        self.diffs[name], self.approvals[name] = diff, approval
        return [diff, approval]

    def _plan_diff(self, source: pipelines.CodePipelineSource, name: str, env_file: str) -> pipelines.CodeBuildStep:
        key = f"{PLANS_PREFIX}/{name}.json"
        return pipelines.CodeBuildStep(
            f"PlanDiff-{name}",
            input=source,
            install_commands=INSTALL,
            commands=[
                f'if aws s3 cp --quiet "s3://$PLANS_BUCKET/{key}" deployed.json; then '
                f".venv/bin/kvfleet diff deployed.json {env_file}; "
                f"else echo 'no plan of {name} has passed its live checks yet: all of it is new'; "
                f".venv/bin/kvfleet plan {env_file}; fi",
            ],
            env={"PLANS_BUCKET": self.plans.bucket_name},
            role_policy_statements=[
                iam.PolicyStatement(actions=["s3:GetObject"], resources=[self.plans.arn_for_objects(key)]),
                iam.PolicyStatement(actions=["s3:ListBucket"], resources=[self.plans.bucket_arn]),  # 404, not 403
            ],
        )

    def _live_check(
        self,
        source: pipelines.CodePipelineSource,
        env: Environment,
        env_file: str,
        live: LiveCheckStack,
        *,
        generation: bool,
        kv_tolerance: float,
    ) -> pipelines.CodeBuildStep:
        key = f"{PLANS_PREFIX}/{env.name}.json"
        flags = "" if generation else " --no-generation"
        return pipelines.CodeBuildStep(
            f"Check-{env.name}",
            input=source,
            install_commands=INSTALL,
            commands=[
                f'.venv/bin/kvfleet check {env_file} --role-arn "$KVFLEET_CHECK_ROLE_ARN" '
                f"--kv-tolerance {kv_tolerance}{flags}",
                f".venv/bin/kvfleet plan {env_file} --json > plan.json",
                f'aws s3 cp --quiet plan.json "s3://$PLANS_BUCKET/{key}"',
            ],
            env={"PLANS_BUCKET": self.plans.bucket_name},
            env_from_cfn_outputs={"KVFLEET_CHECK_ROLE_ARN": live.role_arn},
            # Under the path the stage's live-check role trusts, so no other job of this account can assume it.
            role=check_step_role(self.pipeline, f"CheckRole-{env.name}", environment=env.name),
            role_policy_statements=[
                iam.PolicyStatement(
                    actions=["sts:AssumeRole"],
                    resources=[f"arn:{cdk.Aws.PARTITION}:iam::{env.account}:role{CHECK_ROLE_PATH}*"],
                ),
                iam.PolicyStatement(actions=["s3:PutObject"], resources=[self.plans.arn_for_objects(key)]),
            ],
        )

    def _acknowledge(self) -> None:
        """What cdk-nag finds in the roles CDK Pipelines generates, each with the reason it stands. They are
        acknowledged on the pipeline construct only, so nothing here covers a finding in a stage's stacks."""
        artifacts = self.pipeline.pipeline.artifact_bucket
        assert isinstance(artifacts, Construct)
        acknowledge(
            artifacts,
            "AwsSolutions-S1",
            "the pipeline's artifact bucket: CDK Pipelines writes and reads it, encrypted with the pipeline's KMS key",
        )
        # CDK writes the CodeBuild grants with the stack's partition: a literal where the region names it
        # (@aws-cdk/core:enablePartitionLiterals), else the pseudo parameter, as cdk-nag then quotes it.
        part = "<AWS::Partition>" if cdk.Token.is_unresolved(self.partition) else self.partition
        for finding, reason in self._generated_grants(logical_id(artifacts), part):
            acknowledge(self.pipeline, f"AwsSolutions-IAM5[{finding}]", reason)
        self._acknowledge_projects(part)
        # CDK's built-in CloudFormation validation reads the check projects' ServiceRole (Fn::GetAtt Role.Arn) as a
        # Ref to a role with a path (E3050, which cfn-lint raises only for a Ref: a Ref gives the name, without the
        # path); CloudFormation takes the ARN.
        acknowledge(
            self.pipeline,
            "CloudFormation-Validate::E3050",
            "the check projects name their role by Fn::GetAtt Arn, path included; the rule is for a Ref",
        )
        for account in sorted({e.environment.account or "" for e in self._loaded.environments}):
            acknowledge(
                self.pipeline,
                f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:iam::{account}:role{CHECK_ROLE_PATH}*]",
                "the check step assumes the live-check role of its stage, whose name is generated, under its path",
            )

    def _generated_grants(self, bucket: str, part: str) -> list[tuple[str, str]]:
        """The wildcards of the grants CDK Pipelines writes for its artifacts, self-mutation and asset steps."""
        return [
            (
                "Action::s3:GetObject*",
                "CDK Pipelines' grants on its own artifact bucket (read, write, delete of artifacts)",
            ),
            ("Action::s3:GetBucket*", "the same grants"),
            ("Action::s3:List*", "the same grants"),
            ("Action::s3:DeleteObject*", "the same grants"),
            ("Action::s3:Abort*", "the same grants"),
            (f"Resource::<{bucket}.Arn>/*", "artifact names are per execution"),
            ("Action::kms:ReEncrypt*", "the pipeline's own artifact key, granted to its actions and stages"),
            ("Action::kms:GenerateDataKey*", "the same key"),
            (
                "Resource::*",
                "the self-mutation step reads the deployed pipeline's stacks and the asset step's ECR login; CDK "
                "Pipelines generates both",
            ),
            (
                f"Resource::arn:*:iam::{self.account}:role/*",
                "self-mutation assumes the pipeline account's bootstrap roles (cdk-*-deploy-role-*), whose names "
                "carry the bootstrap qualifier",
            ),
            (
                f"Resource::arn:{part}:logs:{self.region}:{self.account}:log-group:/aws/codebuild/*",
                "the asset step's CodeBuild projects are created by CDK Pipelines per asset",
            ),
            (
                f"Resource::arn:{part}:codebuild:{self.region}:{self.account}:report-group/*",
                "the same projects' report groups",
            ),
        ]

    def _acknowledge_projects(self, part: str) -> None:
        """Each CodeBuild project's grants on its own log streams and report groups."""
        for project in self.pipeline.node.find_all():
            if isinstance(project, codebuild.CfnProject):
                name = condition_id(project)
                acknowledge(
                    self.pipeline,
                    f"AwsSolutions-IAM5[Resource::arn:{part}:logs:{self.region}:{self.account}:log-group:"
                    f"/aws/codebuild/<{name}>:*]",
                    "a CodeBuild project's own log streams",
                )
                acknowledge(
                    self.pipeline,
                    f"AwsSolutions-IAM5[Resource::arn:{part}:codebuild:{self.region}:{self.account}:"
                    f"report-group/<{name}>-*]",
                    "a CodeBuild project's own report groups",
                )


def build_pipeline(loaded: LoadedPipeline, *, app: cdk.App) -> PipelineStack:
    return PipelineStack(app, loaded.pipeline.stack_name, loaded=loaded)


def stage_stacks(stack: PipelineStack) -> Mapping[str, list[Stack]]:
    """Each stage's stacks by environment name (the tests compare them with `make synth`'s)."""
    return {
        s.node.id.removeprefix("Deploy-"): [c for c in s.node.children if isinstance(c, Stack)] for s in stack.stages
    }
