"""What a release pipeline's live-check role may ask EKS (``kvfleet.targets.eks.live``)."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import Stack
from aws_cdk import aws_iam as iam


def grant_live_check(stack: Stack, role: iam.Role, environment: str) -> list[tuple[str, str]]:
    """The cluster's and the node group's status; the IAM5 wildcards that stand, each with its reason."""
    del environment  # EKS's describe calls take no tag condition: nothing to limit by
    partition, region, account = cdk.Aws.PARTITION, stack.region, stack.account
    role.add_to_policy(
        iam.PolicyStatement(
            actions=["eks:DescribeCluster", "eks:DescribeNodegroup"],
            resources=[
                f"arn:{partition}:eks:{region}:{account}:cluster/*",
                f"arn:{partition}:eks:{region}:{account}:nodegroup/*",
            ],
        )
    )
    return [
        (
            f"arn:<AWS::Partition>:eks:{region}:{account}:{kind}/*",
            "describe only, on clusters and node groups whose names are generated or shared",
        )
        for kind in ("cluster", "nodegroup")
    ]
