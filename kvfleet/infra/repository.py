"""The ECR repositories the kvfleet images go to: one stack per account and region, ``kvfleet-images``, holding
``kvfleet-<engine>`` for every registered engine (image.repository's default), with scan on push and immutable tags.

Owned by the account and region, not by an environment: its template depends on nothing but the engine registry, so
two environments (or a pipeline and a person) deploying it into one account and region update one stack to the same
template, and no second stack ever tries to create a repository that exists. It is not in an environment's app, so
``cdk destroy --all`` of one environment leaves the images the others run; the repositories are retained.

The pushes come from ``make image`` (the person's own credentials, or with ``ASSUME_PUBLISHING_ROLE=1`` the role
below), from the GitHub workflow's deploy job (``make image ASSUME_PUBLISHING_ROLE=1``: its OIDC role may assume the
account's ``cdk-*`` roles and has no ECR rights on the repositories), or from the release pipeline's image step in
another account; the last two assume the account's CDK image-publishing role (bootstrapped with ``--trust <pipeline
account>``, as every stage already is), and each repository's policy lets that role push to it.

Run as a CDK app for ``make image``: ``cdk deploy --app 'python -m kvfleet.infra.repository' -c env=<name>``
deploys the stack into the environment file's account and region; ``python -m kvfleet.infra.repository --script
<name> [--assume-publishing-role]`` prints the shell that builds and pushes that environment's images
(kvfleet/infra/image_build.py), pushing as the caller or as the image-publishing role.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import aws_cdk as cdk
from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from constructs import Construct

from kvfleet.config.loader import environment_path, load_located
from kvfleet.config.schema import Environment
from kvfleet.deployments import resolve_environment
from kvfleet.engines import ENGINES
from kvfleet.errors import KvfleetError, exit_on_user_error
from kvfleet.infra.image_build import ImageBuild, kvfleet_build, push_script, repository_name

REPOSITORIES_STACK = "kvfleet-images"
# The CDK bootstrap's image-publishing role (aws-cdk 2.1148.1, lib/api/bootstrap/bootstrap-template.yaml,
# ImagePublishingRole: RoleName cdk-${Qualifier}-image-publishing-role-${AWS::AccountId}-${AWS::Region}; trusted by
# the accounts given to `cdk bootstrap --trust`; its own policy grants ecr:GetAuthorizationToken on *). Within one
# account an ECR repository policy alone grants a role access (Amazon ECR User Guide, "Private repository policies").
BOOTSTRAP_QUALIFIER = cdk.DefaultStackSynthesizer.DEFAULT_QUALIFIER
PUBLISHING_ROLE = "cdk-{qualifier}-image-publishing-role-{account}-{region}"
# What a push needs on the repository (Amazon ECR User Guide, "Pushing a Docker image": the layer upload actions and
# PutImage), and what the image step's existence check and build cache read.
PUSH_ACTIONS = (
    "ecr:BatchCheckLayerAvailability",
    "ecr:InitiateLayerUpload",
    "ecr:UploadLayerPart",
    "ecr:CompleteLayerUpload",
    "ecr:PutImage",
    "ecr:DescribeImages",
    "ecr:BatchGetImage",
    "ecr:GetDownloadUrlForLayer",
)
# Untagged manifests only: every tag names a build some stack may still run, and an EC2 or EKS node pulls it again
# when it replaces a replica, so no tagged image is expired.
UNTAGGED_DAYS = 30


# The partition of a region's ARNs (AWS General Reference, "Amazon Resource Names": aws, aws-cn for the China regions,
# aws-us-gov for GovCloud).
_PARTITIONS = (("cn-", "aws-cn"), ("us-gov-", "aws-us-gov"))
ASSUME_FLAG = "--assume-publishing-role"


def partition_of(region: str) -> str:
    return next((p for prefix, p in _PARTITIONS if region.startswith(prefix)), "aws")


def publishing_role_arn(account: str, region: str, partition: str = "aws") -> str:
    name = PUBLISHING_ROLE.format(qualifier=BOOTSTRAP_QUALIFIER, account=account, region=region)
    return f"arn:{partition}:iam::{account}:role/{name}"


class ImageRepositoriesStack(Stack):
    """``kvfleet-<engine>`` for each registered engine, in the stack's account and region."""

    def __init__(self, scope: Construct, id: str, *, env: cdk.Environment | None = None) -> None:
        super().__init__(
            scope,
            id,
            env=env,
            stack_name=REPOSITORIES_STACK,
            description="kvfleet serving image repositories (scan on push, immutable tags), one per engine",
        )
        self.repositories: dict[str, ecr.Repository] = {}
        pusher = iam.ArnPrincipal(publishing_role_arn(self.account, self.region, self.partition))
        for engine in sorted(ENGINES):
            repo = ecr.Repository(
                self,
                f"Repository-{engine}",
                # A fixed name is the point: every stack of every environment in the account pulls it by name.
                repository_name=repository_name(engine),
                image_scan_on_push=True,
                image_tag_mutability=ecr.TagMutability.IMMUTABLE,
                lifecycle_rules=[
                    ecr.LifecycleRule(tag_status=ecr.TagStatus.UNTAGGED, max_image_age=Duration.days(UNTAGGED_DAYS))
                ],
                removal_policy=RemovalPolicy.RETAIN,
            )
            repo.add_to_resource_policy(iam.PolicyStatement(principals=[pusher], actions=list(PUSH_ACTIONS)))
            self.repositories[engine] = repo


def environment_builds(env: Environment) -> list[ImageBuild]:
    """The kvfleet images the environment's deployments run where its file names no tag (those the stacks tag by
    their inputs), each once."""
    found: dict[tuple[str, str], ImageBuild] = {}
    for r in resolve_environment(env):
        img = r.deployment.image
        if img.source != "kvfleet" or img.tag is not None:
            continue  # an image the file names is pushed by whoever names it; AWS's own need no build
        b = kvfleet_build(
            engine=r.engine,
            engine_version=r.deployment.engine.version,
            region=env.region,
            instance_type=r.instance_type,
        )
        if img.repository is not None:
            b = ImageBuild(
                engine=b.engine,
                engine_version=b.engine_version,
                base_image=b.base_image,
                repository=img.repository,
                tag=b.tag,
            )
        found[(b.repository, b.tag)] = b
    return list(found.values())


def builds_by_place(envs: Iterable[Environment]) -> dict[tuple[str, str], list[ImageBuild]]:
    """(account, region) -> the images to push there, for environments that name both."""
    out: dict[tuple[str, str], list[ImageBuild]] = {}
    for env in envs:
        if env.account is None or env.region is None:
            continue
        place = out.setdefault((env.account, env.region), [])
        place.extend(b for b in environment_builds(env) if b not in place)
    return {k: v for k, v in out.items() if v}


def _load(name: str) -> Environment:
    loaded = load_located(environment_path(name))
    if loaded.environment.account is None or loaded.environment.region is None:
        raise KvfleetError(
            f"{name}: make image pushes into the account and region the environment file names; set account and "
            "region in it",
            field="account",
        )
    return loaded.environment


def _script(args: list[str]) -> list[str]:
    """``--script <name> [--assume-publishing-role]``: the push script of the environment's images."""
    if len(args) not in (1, 2) or args[1:] not in ([], [ASSUME_FLAG]):
        raise KvfleetError(f"usage: python -m kvfleet.infra.repository --script <environment> [{ASSUME_FLAG}]")
    env = _load(args[0])
    assert env.account is not None and env.region is not None
    role = publishing_role_arn(env.account, env.region, partition_of(env.region)) if args[1:] else None
    return push_script(environment_builds(env), account=env.account, region=env.region, role_arn=role)


def main(argv: list[str]) -> None:
    with exit_on_user_error():
        if argv[:1] == ["--script"]:
            print("\n".join(_script(argv[1:])))
            return
        app = cdk.App()
        env = _load(str(app.node.try_get_context("env") or "dev"))
        ImageRepositoriesStack(app, REPOSITORIES_STACK, env=cdk.Environment(account=env.account, region=env.region))
        app.synth()


if __name__ == "__main__":
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    main(sys.argv[1:])
