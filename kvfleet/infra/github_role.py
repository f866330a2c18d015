"""What the GitHub workflow's deploy role (``vars.AWS_DEPLOY_ROLE_ARN``, the OIDC role of a stage's account) must be
allowed itself, as an IAM policy: ``python -m kvfleet.infra.github_role <environment>`` prints it.

Everything else the job does runs as a role it assumes: ``cdk deploy`` as the account's CDK bootstrap roles, the
image pushes as the CDK image-publishing role (``make image ASSUME_PUBLISHING_ROLE=1``), ``kvfleet check`` as the
environment's live-check role (kvfleet/infra/live_check.py, which trusts this role by its ARN). The base image is the
exception: it is pulled from AWS's account with the role's own credentials (image_build.base_repositories says why).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvfleet.config.loader import environment_path, load_located
from kvfleet.config.pipeline import CHECK_ROLE_PATH
from kvfleet.config.schema import Environment
from kvfleet.errors import KvfleetError, exit_on_user_error
from kvfleet.infra.iam import ECR_PULL_ACTIONS
from kvfleet.infra.image_build import base_repositories
from kvfleet.infra.repository import BOOTSTRAP_QUALIFIER, environment_builds, partition_of

# The CDK bootstrap roles' names (aws-cdk 2.1148.1, lib/api/bootstrap/bootstrap-template.yaml: cdk-${Qualifier}-
# {deploy,file-publishing,image-publishing,lookup}-role-${AWS::AccountId}-${AWS::Region}); their trust allows the
# account's principals sts:AssumeRole and sts:TagSession (the same template's AssumeRolePolicyDocument).
BOOTSTRAP_ROLES = "cdk-{qualifier}-*-role-{account}-{region}"
ASSUME_ACTIONS = ("sts:AssumeRole", "sts:TagSession")


def deploy_role_policy(env: Environment) -> dict[str, Any]:
    """The identity policy the workflow's deploy role needs in ``env``'s account and region."""
    if env.account is None or env.region is None:
        raise KvfleetError(
            f"{env.name}: the deploy role's policy names the file's account and region; set both in it", field="account"
        )
    partition = partition_of(env.region)
    bootstrap = BOOTSTRAP_ROLES.format(qualifier=BOOTSTRAP_QUALIFIER, account=env.account, region=env.region)
    statements: list[dict[str, Any]] = [
        {
            "Sid": "CdkBootstrapRoles",
            "Effect": "Allow",
            "Action": list(ASSUME_ACTIONS),
            "Resource": f"arn:{partition}:iam::{env.account}:role/{bootstrap}",
        },
        {
            "Sid": "LiveCheckRole",
            "Effect": "Allow",
            "Action": "sts:AssumeRole",
            "Resource": f"arn:{partition}:iam::{env.account}:role{CHECK_ROLE_PATH}*",
        },
    ]
    if pulls := base_repositories(environment_builds(env), partition):
        statements += [
            # Registry-wide: the action takes no resource (Service Authorization Reference, Amazon ECR).
            {"Sid": "BaseImageLogin", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"},
            {"Sid": "BaseImagePull", "Effect": "Allow", "Action": list(ECR_PULL_ACTIONS), "Resource": pulls},
        ]
    return {"Version": "2012-10-17", "Statement": statements}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m kvfleet.infra.github_role <environment>")
    with exit_on_user_error():
        env = load_located(environment_path(argv[0])).environment
        print(json.dumps(deploy_role_policy(env), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    main(sys.argv[1:])
