"""`kvfleet check` on EC2: the Auto Scaling group has instances InService and Healthy (its health checks include the
load balancer's ``/ping``), and on one of them, through Systems Manager Run Command (the instances run the SSM agent
and reach its endpoints), the agent answers ``/ping``, streams one generation and reports its KV cache on
``/metrics``: the plan drift gate. Run Command needs no route into the VPC, so an internal load balancer is checked
too."""

from __future__ import annotations

from kvfleet import contract
from kvfleet.bench.live import Check, Deployed, judge_probe, run_probe
from kvfleet.targets.ec2 import TARGET


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
    if not d.generation:
        return
    instance = serving[0]
    result = run_probe(d, instance)
    status = result.get("Status")
    if status != "Success":
        detail = (result.get("StandardErrorContent") or result.get("StatusDetails") or "").strip().splitlines()
        check.fail(f"Run Command on {instance} ended {status}" + (f": {detail[-1][:300]}" if detail else ""))
        return
    judge_probe(d, check, instance, result.get("StandardOutputContent", ""))
