"""The role a release pipeline's live check assumes in a stage's account (``kvfleet check``), and what it may ask:
each target's folder adds its own part (``kvfleet.targets.<name>.pipeline.grant_live_check``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import aws_cdk as cdk
from aws_cdk import Duration, Stack, Tags
from aws_cdk import aws_iam as iam
from constructs import Construct

from kvfleet.config.pipeline import CHECK_ROLE_PATH
from kvfleet.config.schema import Environment
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


# A cdk-nag IAM5 finding's resource and the reason the wildcard stands.
_Wildcard = tuple[str, str]


class LiveCheckStack(Stack):
    """The role the pipeline's check step assumes in a stage's account: it reads this environment's stacks and
    asks its endpoints, instances and node groups what `kvfleet check` asks, and nothing else."""

    def __init__(
        self, scope: Construct, id: str, *, environment: Environment, stacks: Sequence[Stack], pipeline_account: str
    ) -> None:
        super().__init__(
            scope,
            id,
            env=cdk.Environment(account=environment.account, region=environment.region),
            stack_name=id,
            description=f"kvfleet {environment.name}: the role a release pipeline's live checks assume",
        )
        Tags.of(self).add("kvfleet:environment", environment.name)
        self.role = iam.Role(
            self,
            "Role",
            # The pipeline account's check step of this environment only (check_step_role), by its role's path.
            assumed_by=iam.AccountPrincipal(pipeline_account).with_conditions(
                check_step_trust(cdk.Aws.PARTITION, pipeline_account, environment.name)
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
