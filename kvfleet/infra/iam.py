"""IAM statements every target's roles share: the model's S3 prefix, the token's secret, the kvfleet metrics."""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_iam as iam
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from kvfleet import contract
from kvfleet.infra.nag import acknowledge

ECR_PULL_ACTIONS = ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability")


def put_metric_data() -> iam.PolicyStatement:
    """PutMetricData into the kvfleet namespace only (the action has no resource-level permissions)."""
    return iam.PolicyStatement(
        actions=["cloudwatch:PutMetricData"],
        resources=["*"],
        conditions={"StringEquals": {"cloudwatch:namespace": contract.NAMESPACE}},
    )


def grant_model_read(policy: iam.Policy, s3_uri: str) -> str:
    """Read access to the model's S3 prefix and nothing else; returns the prefix as s3://bucket/prefix/."""
    bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    policy.add_statements(
        iam.PolicyStatement(actions=["s3:GetObject"], resources=[f"arn:{Aws.PARTITION}:s3:::{bucket}/{prefix}*"]),
        iam.PolicyStatement(
            actions=["s3:ListBucket"],
            resources=[f"arn:{Aws.PARTITION}:s3:::{bucket}"],
            conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}} if prefix else None,
        ),
    )
    acknowledge(
        policy,
        f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::{bucket}/{prefix}*]",
        "Read access to the model's own S3 prefix: its file names (shards, tokenizer) are the checkpoint's.",
    )
    return f"s3://{bucket}/{prefix}"


def grant_token_read(scope: Construct, policy: iam.Policy, secret_ref: str, *, id: str = "HfToken") -> None:
    """Read access to a secret the agent reads at start-up (by name or ARN): the Hugging Face token, the tenant
    salt key."""
    secret = (
        secretsmanager.Secret.from_secret_complete_arn(scope, id, secret_ref)
        if secret_ref.startswith("arn:")
        else secretsmanager.Secret.from_secret_name_v2(scope, id, secret_ref)
    )
    secret.grant_read(policy)
