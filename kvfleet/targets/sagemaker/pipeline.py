"""What a release pipeline's live-check role may ask SageMaker (``kvfleet.targets.sagemaker.live``)."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import Stack
from aws_cdk import aws_iam as iam


def grant_live_check(stack: Stack, role: iam.Role, environment: str) -> list[tuple[str, str]]:
    """The endpoint's status and one streamed generation, on this environment's endpoints; the IAM5 wildcards
    that stand, each with its reason."""
    partition, region, account = cdk.Aws.PARTITION, stack.region, stack.account
    role.add_to_policy(
        iam.PolicyStatement(
            # InvokeEndpointWithResponseStream has no IAM action of its own: "your IAM permissions must
            # allow the sagemaker:InvokeEndpoint action" (SageMaker API Reference, the operation's page).
            actions=["sagemaker:DescribeEndpoint", "sagemaker:InvokeEndpoint"],
            resources=[f"arn:{partition}:sagemaker:{region}:{account}:endpoint/*"],
            conditions={"StringEquals": {"aws:ResourceTag/kvfleet:environment": environment}},
        )
    )
    return [
        (
            f"arn:<AWS::Partition>:sagemaker:{region}:{account}:endpoint/*",
            "endpoint names are generated: limited to those tagged with this environment",
        )
    ]
