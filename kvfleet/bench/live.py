"""`kvfleet check`: what a release pipeline asks of each deployment after its stage deploys, before it promotes
the release further. Each check reads the deployed stack's outputs, then asks the platform that serves the
deployment what its target's live check asks (``run`` in ``kvfleet/targets/<name>/live.py``: SageMaker's endpoint
status and one streamed generation; EC2's group health, then a generation and the KV cache on one instance through
Run Command, with the probe here; EKS's cluster and node group status).

A pipeline's step runs it with ``--role-arn``: the role the stage's live-check stack makes in the target account,
which allows these calls on this environment's resources only (each target's ``pipeline`` module grants them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvfleet import contract
from kvfleet.bench.aws import stack_outputs
from kvfleet.bench.client import BenchError
from kvfleet.deployments import ResolvedDeployment
from kvfleet.targets import TARGETS, part

CHECK_OUTPUT_TOKENS = 8
GENERATION_TIMEOUT_S = 120
# Run Command: how long the instance may take to pick the command up and run it.
RUN_COMMAND_TIMEOUT_S = 300


@dataclass(kw_only=True)
class Check:
    deployment: str
    passed: bool = True
    lines: list[str] = field(default_factory=list)

    def ok(self, line: str) -> None:
        self.lines.append(f"ok    {line}")

    def fail(self, line: str) -> None:
        self.passed = False
        self.lines.append(f"FAIL  {line}")

    def note(self, line: str) -> None:
        self.lines.append(f"note  {line}")


@dataclass(frozen=True, kw_only=True)
class Deployed:
    """What a target's live check asks its platform about: the deployment as planned and its stack's outputs, the
    session to ask with, and what the check is to do."""

    resolved: ResolvedDeployment
    session: Any
    outputs: Mapping[str, str]
    generation: bool  # stream one generation where the target can
    kv_tolerance: float  # the shortfall of KV tokens against the plan that still passes
    sleep: Callable[[float], None]


def assumed_session(role_arn: str | None, region: str) -> Any:
    """A boto3 session in ``region``: the usual credentials, or ``role_arn`` assumed with them."""
    if role_arn is None:
        return boto3.Session(region_name=region)
    try:
        creds = boto3.client("sts", region_name=region).assume_role(
            RoleArn=role_arn, RoleSessionName="kvfleet-check", DurationSeconds=3600
        )["Credentials"]
    except NoCredentialsError:
        raise BenchError(
            "no AWS credentials to assume the check role with; set AWS_PROFILE or the usual variables", field="role-arn"
        ) from None
    except (ClientError, BotoCoreError) as err:
        raise BenchError(f"cannot assume {role_arn}: {err}", field="role-arn") from None
    return boto3.Session(
        aws_access_key_id=creds["AccessKeyId"],
        aws_secret_access_key=creds["SecretAccessKey"],
        aws_session_token=creds["SessionToken"],
        region_name=region,
    )


def check_deployment(
    r: ResolvedDeployment,
    *,
    session: Any,
    generation: bool = True,
    kv_tolerance: float = contract.KV_SHORTFALL_TOLERANCE,
    sleep: Callable[[float], None] = time.sleep,
) -> Check:
    """The live checks of one deployed deployment; every problem is a FAIL line, never an exception."""
    check = Check(deployment=r.deployment.name)
    region = r.environment.region or session.region_name
    try:
        outputs = stack_outputs(r.stack_name, region, client=session.client("cloudformation", region_name=region))
    except BenchError as err:
        check.fail(err.message)
        return check
    spec = TARGETS[r.deployment.target.platform]
    wanted = [k for k in (spec.address_output, spec.group_output) if k is not None]
    if missing := [k for k in wanted if k not in outputs]:
        check.fail(f"stack {r.stack_name} has no output {', '.join(missing)}; deploy it with this kvfleet")
        return check
    live: Callable[[Deployed, Check], None] = part(spec.name, "live").run
    deployed = Deployed(
        resolved=r, session=session, outputs=outputs, generation=generation, kv_tolerance=kv_tolerance, sleep=sleep
    )
    try:
        live(deployed, check)
    except ClientError as err:
        error = err.response.get("Error", {})
        check.fail(f"{err.operation_name}: {error.get('Code', 'error')}: {error.get('Message', err)}")
    except BotoCoreError as err:
        check.fail(f"cannot reach AWS: {err}")
    return check
