"""What a release pipeline's live-check role may ask EC2 (``kvfleet.targets.ec2.live``)."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import Stack
from aws_cdk import aws_iam as iam

# Run Command's own tag key for managed instances and documents (Systems Manager User Guide, "Restricting Run
# Command access based on tags"; Service Authorization Reference, Systems Manager: SendCommand's document and
# instance resources take ssm:resourceTag/${TagKey}).
TAG_CONDITION = "ssm:resourceTag/kvfleet:environment"


def grant_live_check(stack: Stack, role: iam.Role, environment: str) -> list[tuple[str, str]]:
    """The group's instances and the fleet's probe document on this environment's instances; the IAM5 wildcards
    that stand, each with its reason. No AWS-owned document (AWS-RunShellScript runs any command): only documents
    tagged with this environment, which the fleet stacks create with no parameters (infra/probe.py)."""
    partition, region, account = cdk.Aws.PARTITION, stack.region, stack.account
    role.add_to_policy(
        iam.PolicyStatement(
            actions=["ssm:SendCommand"],
            resources=[
                f"arn:{partition}:ec2:{region}:{account}:instance/*",
                f"arn:{partition}:ssm:{region}:{account}:document/*",
            ],
            conditions={"StringEquals": {TAG_CONDITION: environment}},
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
        (
            f"arn:<AWS::Partition>:ssm:{region}:{account}:document/*",
            "the probe documents' names are generated: limited to those tagged with this environment, which the "
            "fleet stacks create with no parameters",
        ),
        ("*", "DescribeAutoScalingGroups and GetCommandInvocation take no resource"),
    ]
