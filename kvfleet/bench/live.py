"""`kvfleet check`: what a release pipeline asks of each deployment after its stage deploys, before it promotes
the release further. Each check reads the deployed stack's outputs, then asks the platform that serves the
deployment:

- SageMaker: the endpoint is InService (DescribeEndpoint), and streams one generation through
  InvokeEndpointWithResponseStream, the path its clients use. SageMaker's runtime reaches the container's
  ``/invocations`` only, so the KV cache the engine allocated is not readable from outside.
- EC2: the Auto Scaling group has instances InService and Healthy (its health checks include the load balancer's
  ``/ping``), and on one of them, through Systems Manager Run Command (the instances run the SSM agent and reach
  its endpoints), the agent answers ``/ping``, streams one generation and reports its KV cache on ``/metrics``:
  the plan drift gate. Run Command needs no route into the VPC, so an internal load balancer is checked too.
- EKS: the cluster and the node group are ACTIVE with no health issues. The Service is ClusterIP, so a
  generation needs access inside the cluster (``kubectl port-forward`` and ``kvfleet bench``); that is said, not
  claimed.

A pipeline's step runs it with ``--role-arn``: the role the stage's live-check stack makes in the target account,
which allows these calls on this environment's resources only.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvfleet import contract
from kvfleet.bench.aws import stack_outputs
from kvfleet.bench.client import PROMPT_TOKEN_IDS, BenchError, parse_capacity
from kvfleet.bench.client import kv_drift as _kv_drift
from kvfleet.bench.sagemaker import SageMakerTarget, SageMakerTransport
from kvfleet.deployments import ResolvedDeployment
from kvfleet.targets import TARGETS

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
    platform = r.deployment.target.platform
    spec = TARGETS[platform]
    wanted = [k for k in (spec.address_output, spec.group_output) if k is not None]
    if missing := [k for k in wanted if k not in outputs]:
        check.fail(f"stack {r.stack_name} has no output {', '.join(missing)}; deploy it with this kvfleet")
        return check
    try:
        if platform == "sagemaker":
            _sagemaker(r, check, session, outputs[spec.address_output or ""], generation)
        elif platform == "ec2":
            _ec2(
                r,
                check,
                session,
                outputs[spec.group_output or ""],
                generation=generation,
                kv_tolerance=kv_tolerance,
                sleep=sleep,
            )
        else:
            _eks(check, session, outputs["ClusterName"], outputs[spec.group_output or ""])
    except ClientError as err:
        error = err.response.get("Error", {})
        check.fail(f"{err.operation_name}: {error.get('Code', 'error')}: {error.get('Message', err)}")
    except BotoCoreError as err:
        check.fail(f"cannot reach AWS: {err}")
    return check


def _sagemaker(r: ResolvedDeployment, check: Check, session: Any, name: str, generation: bool) -> None:
    desc = session.client("sagemaker").describe_endpoint(EndpointName=name)
    status = desc.get("EndpointStatus")
    if status != "InService":
        reason = f": {desc['FailureReason']}" if desc.get("FailureReason") else ""
        check.fail(f"endpoint {name} is {status}{reason}")
        return
    variants = desc.get("ProductionVariants", [])
    count = sum(int(v.get("CurrentInstanceCount", 0)) for v in variants)
    check.ok(f"endpoint {name} is InService with {count} instance(s)")
    if not generation:
        return
    transport = SageMakerTransport(
        SageMakerTarget(endpoint_name=name, region=session.region_name),
        workers=1,
        timeout_s=GENERATION_TIMEOUT_S,
        session=session,
    )
    try:
        res = transport.invoke(None, list(PROMPT_TOKEN_IDS[:8]), CHECK_OUTPUT_TOKENS)
    finally:
        transport.close()
    if res.ok and res.output_tokens > 0:
        check.ok(f"one generation streamed {res.output_tokens} tokens, first after {res.ttft_s or 0:.2f} s")
    else:
        check.fail(f"the generation failed: {res.error or 'no token came back'}")
    check.note(
        "the KV cache is not read on SageMaker (its runtime reaches /invocations only); kvfleet bench against a "
        "replica's agent checks it"
    )


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


def _ec2(
    r: ResolvedDeployment,
    check: Check,
    session: Any,
    group_name: str,
    *,
    generation: bool,
    kv_tolerance: float,
    sleep: Callable[[float], None],
) -> None:
    groups = session.client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
    if not groups["AutoScalingGroups"]:
        check.fail(f"Auto Scaling group {group_name} does not exist")
        return
    group = groups["AutoScalingGroups"][0]
    serving = [
        i["InstanceId"]
        for i in group.get("Instances", [])
        if i.get("LifecycleState") == "InService" and i.get("HealthStatus") == "Healthy"
    ]
    desired = int(group.get("DesiredCapacity", 0))
    if not serving:
        if desired == 0 and r.scaling.min_replicas == 0:
            check.note(f"group {group_name} is scaled to zero; the first request wakes it, so nothing is checked live")
            return
        check.fail(
            f"no instance of {group_name} is InService and Healthy (its health checks include the load balancer's "
            f"{contract.HEALTH_ROUTE}); {desired} desired"
        )
        return
    check.ok(f"{len(serving)} of {desired} desired instance(s) InService and Healthy behind the load balancer")
    if not generation:
        return
    instance = serving[0]
    result = _run_probe(r, session, instance, sleep)
    status = result.get("Status")
    if status != "Success":
        detail = (result.get("StandardErrorContent") or result.get("StatusDetails") or "").strip().splitlines()
        check.fail(f"Run Command on {instance} ended {status}" + (f": {detail[-1][:300]}" if detail else ""))
        return
    _judge_probe(r, check, instance, result.get("StandardOutputContent", ""), kv_tolerance)


def _run_probe(r: ResolvedDeployment, session: Any, instance: str, sleep: Callable[[float], None]) -> dict[str, Any]:
    """The probe script run on the instance through Run Command, waited for: the invocation's last state."""
    ssm = session.client("ssm")
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


def _judge_probe(r: ResolvedDeployment, check: Check, instance: str, output: str, kv_tolerance: float) -> None:
    """What the probe saw on the instance: the agent's health, one streamed generation, the engine's KV cache."""
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


def _eks(check: Check, session: Any, cluster: str, nodegroup: str) -> None:
    eks = session.client("eks")
    status = eks.describe_cluster(name=cluster)["cluster"].get("status")
    if status != "ACTIVE":
        check.fail(f"cluster {cluster} is {status}")
        return
    group = eks.describe_nodegroup(clusterName=cluster, nodegroupName=nodegroup)["nodegroup"]
    issues = group.get("health", {}).get("issues", [])
    if group.get("status") != "ACTIVE" or issues:
        said = "; ".join(f"{i.get('code')}: {i.get('message')}" for i in issues[:3])
        check.fail(f"node group {nodegroup} is {group.get('status')}" + (f" ({said})" if said else ""))
        return
    size = group.get("scalingConfig", {}).get("desiredSize")
    check.ok(f"cluster {cluster} and node group {nodegroup} are ACTIVE ({size} node(s) desired)")
    check.note(
        "no generation is sent: the Service is ClusterIP; kubectl port-forward to it and run kvfleet bench there"
    )
