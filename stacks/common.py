"""Pieces every deployment target shares: cdk-nag acknowledgments and the serving image."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Aws, CfnElement, CfnMapping, Fn, Stack, Validations
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from stacks.images import dlc_image, parse_ecr_uri
from stacks.resolve import ResolvedDeployment


def logical_id(c: Construct) -> str:
    """The CloudFormation logical id of ``c``'s resource, as cdk-nag names it in a finding."""
    child = c.node.default_child
    assert isinstance(child, CfnElement)
    stack = Stack.of(c)
    return str(stack.resolve(stack.get_logical_id(child)))


def condition_id(c: object) -> str:
    """The logical id of a CloudFormation condition (cdk-nag quotes it inside some findings)."""
    assert isinstance(c, CfnElement)
    stack = Stack.of(c)
    return str(stack.resolve(stack.get_logical_id(c)))


def acknowledge(scope: Construct, finding: str, reason: str) -> None:
    """Accept one cdk-nag finding on ``scope``, with the reason, next to what causes it."""
    Validations.of(scope).acknowledge(Acknowledgment(id=finding, reason=reason))


def serving_image(scope: Construct, r: ResolvedDeployment, policy: iam.Policy, region: str | None) -> str:
    """The serving image's URI, with pull access for ``policy`` on that repository only."""
    img = r.deployment.image
    pull = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
    if img.source == "kvfleet":
        repo = ecr.Repository.from_repository_name(scope, "ImageRepository", img.repository or f"kvfleet-{r.engine}")
        repo.grant_pull(policy)
        return repo.repository_uri_for_tag(img.tag or r.deployment.engine.version)
    if img.source == "uri":
        assert img.uri is not None
        e = parse_ecr_uri(img.uri)
        repo_arn = f"arn:{Aws.PARTITION}:ecr:{e.region}:{e.account}:repository/{e.repository}"
        uri = img.uri
    else:
        # The SDK picks the processor (GPU) from a SageMaker-style name.
        sm_type = r.instance_type if r.instance_type.startswith("ml.") else f"ml.{r.instance_type}"
        dlc = dlc_image(engine=r.engine, engine_version=r.deployment.engine.version, instance_type=sm_type)
        if region is not None:
            e = dlc.in_region(region)
            repo_arn = f"arn:{Aws.PARTITION}:ecr:{e.region}:{e.account}:repository/{e.repository}"
            uri = e.uri
        else:
            # Region unknown at synth: every region's URI goes into the template, the stack's region picks.
            table = CfnMapping(
                scope,
                "DlcImage",
                mapping={reg: {"uri": row.uri, "account": row.account} for reg, row in dlc.by_region},
            )
            uri = table.find_in_map(Aws.REGION, "uri")
            repo_name = dlc.by_region[0][1].repository  # the same in every region
            repo_arn = Fn.join(
                "",
                [
                    f"arn:{Aws.PARTITION}:ecr:{Aws.REGION}:",
                    table.find_in_map(Aws.REGION, "account"),
                    f":repository/{repo_name}",
                ],
            )
    policy.add_statements(
        iam.PolicyStatement(actions=pull, resources=[repo_arn]),
        iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
    )
    return uri


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


def grant_token_read(scope: Construct, policy: iam.Policy, secret_ref: str) -> None:
    """Read access to the Hugging Face token's secret (by name or ARN)."""
    secret = (
        secretsmanager.Secret.from_secret_complete_arn(scope, "HfToken", secret_ref)
        if secret_ref.startswith("arn:")
        else secretsmanager.Secret.from_secret_name_v2(scope, "HfToken", secret_ref)
    )
    secret.grant_read(policy)
