"""`kvfleet check` on EC2: the Auto Scaling group has instances InService and Healthy (its health checks include the
load balancer's ``/ping``), and on one of them, through Systems Manager Run Command (the instances run the SSM agent
and reach its endpoints), the agent answers ``/ping`` and reports its KV cache on ``/metrics``: the plan drift gate.
Run Command needs no route into the VPC, so an internal load balancer is checked too.

The command is the fleet stack's own document (``infra/probe.py``, named by the stack's ``ProbeDocument`` output),
which reads those two routes and takes no parameters: the check runs nothing else on a host that holds the model's
token and the tenant secret, so it sends no generation there (`kvfleet bench --env` sends them through the load
balancer)."""

from __future__ import annotations

import time
from typing import Any

from botocore.exceptions import ClientError

from kvfleet import contract
from kvfleet.bench.client import kv_drift, parse_capacity
from kvfleet.bench.live import RUN_COMMAND_TIMEOUT_S, Check, Deployed
from kvfleet.targets.ec2 import PROBE_OUTPUT, TARGET, read_probe

_PENDING = frozenset({"Pending", "InProgress", "Delayed"})  # GetCommandInvocation Status values still running


def run(d: Deployed, check: Check) -> None:
    group_name = d.outputs[TARGET.group_output or ""]
    groups = d.session.client("autoscaling").describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
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
        if desired == 0 and d.resolved.scaling.min_replicas == 0:
            check.note(f"group {group_name} is scaled to zero; the first request wakes it, so nothing is checked live")
            return
        check.fail(
            f"no instance of {group_name} is InService and Healthy (its health checks include the load balancer's "
            f"{contract.HEALTH_ROUTE}); {desired} desired"
        )
        return
    check.ok(f"{len(serving)} of {desired} desired instance(s) InService and Healthy behind the load balancer")
    document = d.outputs.get(PROBE_OUTPUT)
    if document is None:
        check.fail(f"the stack has no output {PROBE_OUTPUT} (the probe document); deploy it with this kvfleet")
        return
    instance = serving[0]
    result = send_probe(d, document, instance)
    status = result.get("Status")
    if status != "Success":
        detail = (result.get("StandardErrorContent") or result.get("StatusDetails") or "").strip().splitlines()
        check.fail(f"Run Command on {instance} ended {status}" + (f": {detail[-1][:300]}" if detail else ""))
        return
    judge(d, check, instance, result.get("StandardOutputContent", ""))


def send_probe(d: Deployed, document: str, instance: str) -> dict[str, Any]:
    """The probe document run on an instance, waited for: the invocation's last state."""
    ssm = d.session.client("ssm")
    sent = ssm.send_command(
        InstanceIds=[instance],
        DocumentName=document,
        Comment=f"kvfleet check {d.resolved.deployment_id}",
        TimeoutSeconds=RUN_COMMAND_TIMEOUT_S,
    )
    command_id = sent["Command"]["CommandId"]
    deadline = time.monotonic() + 2 * RUN_COMMAND_TIMEOUT_S
    result: dict[str, Any] = {"Status": "Pending"}
    while time.monotonic() < deadline:
        d.sleep(3)
        try:
            result = ssm.get_command_invocation(CommandId=command_id, InstanceId=instance)
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") == "InvocationDoesNotExist":  # not registered yet
                continue
            raise
        if result.get("Status") not in _PENDING:
            break
    return result


def judge(d: Deployed, check: Check, instance: str, output: str) -> None:
    """What the probe saw on the instance: the agent's health and the engine's KV cache against the plan."""
    ping, metrics = read_probe(output)
    if ping == 200:
        check.ok(f"{instance}: {contract.HEALTH_ROUTE} answers 200")
    else:
        check.fail(f"{instance}: {contract.HEALTH_ROUTE} answers {ping or 'nothing'}")
    expected = d.resolved.candidate.capacity.kv_cache_tokens
    capacity = parse_capacity(metrics)
    if (drift := kv_drift(capacity, expected, d.kv_tolerance)) is not None:
        check.fail(f"{instance}: {drift}")
    elif capacity is not None:
        check.ok(f"{instance}: the engine holds {capacity.tokens:,} KV tokens; the plan {expected:,}")
    if d.generation:
        check.note(
            f"no generation is sent on {instance}: the probe document reads {contract.HEALTH_ROUTE} and "
            f"{contract.METRICS_ROUTE} only; kvfleet bench --env sends one through the load balancer"
        )
