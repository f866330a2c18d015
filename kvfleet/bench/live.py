"""`kvfleet check`: what a release pipeline asks of each deployment after its stage deploys, before it promotes
the release further. Each check reads the deployed stack's outputs, then asks the platform that serves the
deployment what its target's live check asks (``run`` in ``kvfleet/targets/<name>/live.py``: SageMaker's endpoint
status and one streamed generation; EC2's group health, then a generation and the KV cache on one instance through
Run Command, with the probe here; EKS's cluster and node group status).

A pipeline's step runs it with ``--role-arn``: the role the stage's live-check stack makes in the target account,
which allows these calls on this environment's resources only (each target's ``pipeline`` module grants them).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvfleet import contract
from kvfleet.bench.aws import stack_outputs
from kvfleet.bench.client import PROMPT_TOKEN_IDS, BenchError, parse_capacity
from kvfleet.bench.client import kv_drift as _kv_drift
from kvfleet.deployments import ResolvedDeployment
from kvfleet.targets import TARGETS, part

CHECK_TENANT = "kvfleet-live-check"  # the tenant the check's generation is made as, where tenancy is on
CHECK_OUTPUT_TOKENS = 8
GENERATION_TIMEOUT_S = 120
# Run Command: how long the instance may take to pick the command up and run it.
RUN_COMMAND_TIMEOUT_S = 300
_PENDING = frozenset({"Pending", "InProgress", "Delayed"})  # GetCommandInvocation Status values still running
_MARK = "kvfleet-check"


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


def probe_script(r: ResolvedDeployment, *, port: int = contract.SERVING_PORT) -> list[str]:
    """What Run Command runs on one instance: the agent's /ping, one streamed generation, and the KV-cache lines
    of /metrics, each after a marker line the check reads back (the output comes back truncated at 24,000
    characters, so only the lines it needs are printed)."""
    base = f"http://127.0.0.1:{port}"
    headers = ["-H", "Content-Type: application/json"]
    if r.deployment.serving.tenant_header:
        headers += ["-H", f"{r.deployment.serving.tenant_header}: {CHECK_TENANT}"]
    body = json.dumps(
        {"prompt": list(PROMPT_TOKEN_IDS[:8]), "max_tokens": CHECK_OUTPUT_TOKENS, "stream": True}, separators=(",", ":")
    )
    names = "|".join((contract.PROM_ENGINE_KV_BLOCKS, contract.PROM_ENGINE_KV_BLOCK_TOKENS))
    curl = "curl -sS --max-time"
    return [
        f"echo {_MARK}-ping $({curl} 10 -o /dev/null -w '%{{http_code}}' {base}{contract.HEALTH_ROUTE})",
        f"{curl} {GENERATION_TIMEOUT_S} -N {' '.join(shlex.quote(h) for h in headers)} -d {shlex.quote(body)} "
        f"-o /tmp/{_MARK}.out -w '{_MARK}-generation %{{http_code}}\\n' {base}/v1/completions",
        f"echo {_MARK}-events $(grep -c '^data: {{' /tmp/{_MARK}.out)",
        f"echo {_MARK}-metrics",
        f"{curl} 10 {base}{contract.METRICS_ROUTE} | grep -E '^({names})' || true",
    ]


def read_probe(text: str) -> tuple[int | None, int | None, int, str]:
    """(ping status, generation status, events streamed, the /metrics lines) from the script's output."""
    ping = gen = None
    events = 0
    metrics: list[str] = []
    in_metrics = False
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if in_metrics:
            metrics.append(line)
        elif word == f"{_MARK}-ping":
            ping = int(rest) if rest.strip().isdigit() else None
        elif word == f"{_MARK}-generation":
            gen = int(rest) if rest.strip().isdigit() else None
        elif word == f"{_MARK}-events":
            events = int(rest) if rest.strip().isdigit() else 0
        elif word == f"{_MARK}-metrics":
            in_metrics = True
    return ping or None, gen or None, events, "\n".join(metrics)


def run_probe(d: Deployed, instance: str) -> dict[str, Any]:
    """The probe script run on an instance through Run Command, waited for: the invocation's last state."""
    r, sleep = d.resolved, d.sleep
    ssm = d.session.client("ssm")
    sent = ssm.send_command(
        InstanceIds=[instance],
        DocumentName="AWS-RunShellScript",
        Comment=f"kvfleet check {r.deployment_id}",
        Parameters={"commands": probe_script(r), "executionTimeout": [str(GENERATION_TIMEOUT_S + 60)]},
        TimeoutSeconds=RUN_COMMAND_TIMEOUT_S,
    )
    command_id = sent["Command"]["CommandId"]
    deadline = time.monotonic() + RUN_COMMAND_TIMEOUT_S + GENERATION_TIMEOUT_S
    result: dict[str, Any] = {"Status": "Pending"}
    while time.monotonic() < deadline:
        sleep(3)
        try:
            result = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") == "InvocationDoesNotExist":  # not registered yet
                continue
            raise
        if result.get("Status") not in _PENDING:
            break
    return result


def judge_probe(d: Deployed, check: Check, instance: str, output: str) -> None:
    """What the probe saw on the instance: the agent's health, one streamed generation, the engine's KV cache."""
    r, kv_tolerance = d.resolved, d.kv_tolerance
    ping, gen, events, metrics = read_probe(output)
    if ping == 200:
        check.ok(f"{instance}: {contract.HEALTH_ROUTE} answers 200")
    else:
        check.fail(f"{instance}: {contract.HEALTH_ROUTE} answers {ping or 'nothing'}")
    if gen == 200 and events > 0:
        check.ok(f"{instance}: one generation streamed {events} events")
    else:
        check.fail(f"{instance}: the generation answered {gen or 'nothing'} with {events} events")
    expected = r.candidate.capacity.kv_cache_tokens
    capacity = parse_capacity(metrics)
    if (drift := _kv_drift(capacity, expected, kv_tolerance)) is not None:
        check.fail(f"{instance}: {drift}")
    elif capacity is not None:
        check.ok(f"{instance}: the engine holds {capacity.tokens:,} KV tokens; the plan {expected:,}")
