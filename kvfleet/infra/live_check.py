"""The role a release's live check assumes in a stage's account (``kvfleet check --role-arn``), and what it may ask:
each target's folder adds its own part (``kvfleet.targets.<name>.pipeline.grant_live_check``).

The release pipeline deploys it in each stage, trusted by that stage's check step. The GitHub workflow deploys it
with this module as a CDK app, trusted by the job's OIDC role (``vars.AWS_DEPLOY_ROLE_ARN``), which then checks
through it as the pipeline does, so that role needs no read rights of its own:
``cdk deploy --app 'python -m kvfleet.infra.live_check' -c env=<name> -c deploy_role_arn=<arn>``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Sequence

import aws_cdk as cdk
from aws_cdk import Duration, Stack, Tags
from aws_cdk import aws_iam as iam
from constructs import Construct

from kvfleet.config.pipeline import CHECK_ROLE_PATH
from kvfleet.config.schema import Environment
from kvfleet.errors import KvfleetError, exit_on_user_error
from kvfleet.infra.nag import acknowledge
from kvfleet.targets import TARGET_MODULES, part


def live_check_stack_name(environment: str) -> str:
    return f"kvfleet-{environment}-live-check"


# The path of the pipeline's check-step roles (in the pipeline's account); a stage's live-check role trusts the roles
# under its environment's path only, so no other principal of the pipeline account (its deploy, build and
# self-mutation roles included) can assume it.
CHECK_STEP_ROLE_PATH = "/kvfleet-check-step/"


def check_step_role_path(environment: str) -> str:
    """The path of the role the check step of ``environment`` runs as (an IAM path: '/' and printable ASCII)."""
    return f"{CHECK_STEP_ROLE_PATH}{environment}/"


def check_step_trust(partition: str, pipeline_account: str, environment: str) -> dict[str, dict[str, str]]:
    """The condition the live-check role's trust puts on the pipeline account: the caller's role is under this
    environment's check-step path. aws:PrincipalArn is the calling role's ARN, path included, not its session's
    (IAM User Guide, "AWS global condition context keys": aws:PrincipalArn)."""
    arn = f"arn:{partition}:iam::{pipeline_account}:role{check_step_role_path(environment)}*"
    return {"ArnLike": {"aws:PrincipalArn": arn}}


def check_step_role(scope: Construct, id: str, *, environment: str) -> iam.Role:
    """The role the pipeline's check step for ``environment`` runs as: CodeBuild's, under the path the stage's
    live-check role trusts. The pipeline gives it to that step (``CodeBuildStep(role=...)``); its name is generated."""
    return iam.Role(
        scope,
        id,
        assumed_by=iam.ServicePrincipal("codebuild.amazonaws.com"),
        path=check_step_role_path(environment),
        description=f"kvfleet release pipeline: the live check of environment {environment}",
    )


# An IAM role's ARN (IAM User Guide, "IAM identifiers": arn:<partition>:iam::<account>:role/<path><name>).
ROLE_ARN = re.compile(r"arn:aws(-[a-z-]+)?:iam::\d{12}:role/[\w+=,.@/-]+")
DEPLOY_ROLE_CONTEXT = "deploy_role_arn"


def live_check_principal(
    environment: str, *, pipeline_account: str | None, deploy_role_arn: str | None
) -> iam.IPrincipal:
    """Who may assume the live-check role: the pipeline account's check step of this environment only (by its role's
    path), or, where a GitHub workflow deploys the environment, that workflow's deploy role by its ARN (a role ARN
    as principal matches that role's sessions: IAM User Guide, "AWS JSON policy elements: Principal", role
    principals). One of the two."""
    if (pipeline_account is None) == (deploy_role_arn is None):
        raise KvfleetError("the live-check role is trusted by a pipeline account or a deploy role ARN, one of them")
    if deploy_role_arn is not None:
        if not ROLE_ARN.fullmatch(deploy_role_arn):
            raise KvfleetError(
                f"{deploy_role_arn!r} is not an IAM role ARN; set it to the workflow's role "
                "(arn:aws:iam::<account>:role/<name>, vars.AWS_DEPLOY_ROLE_ARN)",
                field=DEPLOY_ROLE_CONTEXT,
            )
        return iam.ArnPrincipal(deploy_role_arn)
    assert pipeline_account is not None
    return iam.AccountPrincipal(pipeline_account).with_conditions(
        check_step_trust(cdk.Aws.PARTITION, pipeline_account, environment)
    )


# A cdk-nag IAM5 finding's resource and the reason the wildcard stands.
_Wildcard = tuple[str, str]


class LiveCheckStack(Stack):
    """The role the pipeline's check step assumes in a stage's account: it reads this environment's stacks and
    asks its endpoints, instances and node groups what `kvfleet check` asks, and nothing else."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        environment: Environment,
        stacks: Sequence[Stack],
        pipeline_account: str | None = None,
        deploy_role_arn: str | None = None,
    ) -> None:
        super().__init__(
            scope,
            id,
            env=cdk.Environment(account=environment.account, region=environment.region),
            stack_name=id,
            description=f"kvfleet {environment.name}: the role a release's live checks assume",
        )
        Tags.of(self).add("kvfleet:environment", environment.name)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=live_check_principal(
                environment.name, pipeline_account=pipeline_account, deploy_role_arn=deploy_role_arn
            ),
            path=CHECK_ROLE_PATH,
            max_session_duration=Duration.hours(1),
            description=f"kvfleet check of environment {environment.name}",
        )
        wildcards = self._allow_stacks(stacks)
        # What each target's live check asks (its folder's pipeline module), in registry order.
        platforms = {d.target.platform for d in environment.deployments}
        for name in [t for t in TARGET_MODULES if t in platforms]:
            grant: Callable[[Stack, iam.Role, str], list[_Wildcard]] = part(name, "pipeline").grant_live_check
            wildcards += grant(self, self.role, environment.name)
        for finding, reason in wildcards:
            acknowledge(self.role, f"AwsSolutions-IAM5[Resource::{finding}]", reason)
        self.role_arn = cdk.CfnOutput(self, "RoleArn", value=self.role.role_arn)

    def _allow_stacks(self, stacks: Sequence[Stack]) -> list[_Wildcard]:
        region, account = self.region, self.account
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudformation:DescribeStacks"],
                resources=[
                    f"arn:{cdk.Aws.PARTITION}:cloudformation:{region}:{account}:stack/{s.stack_name}/*" for s in stacks
                ],
            )
        )
        # A stack's ARN ends in its id, which CloudFormation makes at creation.
        return [
            (f"arn:<AWS::Partition>:cloudformation:{region}:{account}:stack/{s.stack_name}/*", "a stack's id")
            for s in stacks
        ]


def main() -> None:
    """The CDK app of the GitHub workflow's live-check stack: ``-c env=<name> -c deploy_role_arn=<arn>``."""
    from kvfleet.config.loader import environment_path, load_located
    from kvfleet.infra.app import add_environment

    app = cdk.App()
    with exit_on_user_error():
        loaded = load_located(environment_path(str(app.node.try_get_context("env") or "dev")))
        env = loaded.environment
        if env.account is None or env.region is None:
            raise KvfleetError(
                f"{env.name}: the live-check stack deploys into the file's account; set account and region in it",
                field="account",
            )
        with tempfile.TemporaryDirectory() as scratch:
            # The environment's stacks, for the names the role may read; built apart, never synthesized.
            stacks = add_environment(cdk.App(outdir=scratch), env, traces=loaded.traces, host_images=loaded.host_images)
            role = app.node.try_get_context(DEPLOY_ROLE_CONTEXT)
            LiveCheckStack(
                app,
                live_check_stack_name(env.name),
                environment=env,
                stacks=stacks,
                deploy_role_arn=str(role) if role is not None else "",
            )
    app.synth()


if __name__ == "__main__":
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    main()
