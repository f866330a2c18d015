"""What a release pipeline's live-check role may ask EC2 (``kvfleet.targets.ec2.live``)."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import Stack
from aws_cdk import aws_iam as iam


def grant_live_check(stack: Stack, role: iam.Role, environment: str) -> list[tuple[str, str]]:
    """The group's instances and a Run Command probe on this environment's instances; the IAM5 wildcards that
    stand, each with its reason."""
    partition, region, account = cdk.Aws.PARTITION, stack.region, stack.account
    role.add_to_policy(
        iam.PolicyStatement(
            actions=["ssm:SendCommand"],
            resources=[f"arn:{partition}:ec2:{region}:{account}:instance/*"],
            # Run Command's own tag key for managed instances (Systems Manager User Guide, "Restricting Run
            # Command access based on tags").
            conditions={"StringEquals": {"ssm:resourceTag/kvfleet:environment": environment}},
        )
    )
    role.add_to_policy(
        iam.PolicyStatement(
            actions=["ssm:SendCommand"],
            resources=[f"arn:{partition}:ssm:{region}::document/AWS-RunShellScript"],
        )
    )
    role.add_to_policy(
        iam.PolicyStatement(
            # Neither takes a resource (Service Authorization Reference: DescribeAutoScalingGroups,
            # GetCommandInvocation).
            actions=["autoscaling:DescribeAutoScalingGroups", "ssm:GetCommandInvocation"],
            resources=["*"],
        )
    )
    return [
        (
            f"arn:<AWS::Partition>:ec2:{region}:{account}:instance/*",
            "instances are launched by Auto Scaling: limited to those tagged with this environment",
        ),
        ("*", "DescribeAutoScalingGroups and GetCommandInvocation take no resource"),
    ]
