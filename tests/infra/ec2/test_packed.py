"""Several engines per EC2 instance (`target.pack_engines`): two TP4 engines of a 70B model on one p5.48xlarge, each
on its own GPUs and port, each a target group behind one forward action, all drained before the hook completes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.app import build_app
from kvfleet.targets.ec2 import MAX_TARGET_GROUPS_PER_ACTION
from kvfleet.targets.ec2.infra import user_data as ud
from kvfleet.targets.ec2.infra.fleet import LIFECYCLE_HOOK
from tests.envs import FEATURE_FLAGS, environment
from tests.infra.ec2.envs import EC2_ENV, resolved
from tests.infra.ec2.test_user_data import Case, Instance, docker_create
from tests.infra.helpers import only, props
from tests.infra.test_cfn_lint import cfn_lint

PACKED_ENV = (
    EC2_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B")
    .replace("s3://model-bucket/llama/8b/", "s3://model-bucket/llama/70b/")
    .replace("      platform: ec2\n", "      platform: ec2\n      pack_engines: true\n")
    .replace("      min_replicas: 1\n      max_replicas: 4\n", "      min_replicas: 2\n      max_replicas: 5\n")
    .replace("      families: [g6e]\n", "      instance_type: p5.48xlarge\n")
)
CASE = Case(nvme=True, s3=True, warm=True)


@pytest.fixture(scope="module")
def packed() -> ResolvedDeployment:
    return resolved(PACKED_ENV)


@pytest.fixture(scope="module")
def template() -> Template:
    return only(PACKED_ENV)


def test_the_plan_puts_two_tp4_engines_on_one_p5(packed: ResolvedDeployment) -> None:
    c = packed.candidate
    assert (c.instance.name, c.tensor_parallel_size, c.engines_per_instance) == ("p5.48xlarge", 4, 2)
    # Two replicas at least (min_replicas), one instance for them.
    assert packed.initial_instance_count == 1


def test_without_packing_the_plan_keeps_one_engine_per_instance() -> None:
    r = resolved(PACKED_ENV.replace("      pack_engines: true\n", ""))
    assert r.candidate.engines_per_instance == 1 and r.candidate.gpus_per_replica == 8


def test_no_instance_holds_more_engines_than_a_forward_action_has_target_groups() -> None:
    # An 8B model fits one H100: eight TP1 engines would need eight target groups, so the planner packs fewer.
    r = resolved(PACKED_ENV.replace("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-8B"))
    assert r.candidate.engines_per_instance <= MAX_TARGET_GROUPS_PER_ACTION
    assert r.candidate.engines_per_instance * r.candidate.gpus_per_replica <= 8


def test_scale_to_zero_is_refused_with_packing() -> None:
    text = PACKED_ENV.replace("      min_replicas: 2\n", "      min_replicas: 0\n")
    with pytest.raises(Exception, match="pack_engines: scale to zero"):
        environment(text)


# ---- the stack ---------------------------------------------------------------------------------------------


def test_one_target_group_per_engine_on_its_own_port(template: Template) -> None:
    groups = template.find_resources("AWS::ElasticLoadBalancingV2::TargetGroup")
    ports = sorted(g["Properties"]["Port"] for g in groups.values())
    assert ports == [contract.SERVING_PORT, contract.SERVING_PORT + 1]
    for g in groups.values():
        p = g["Properties"]
        # Each checks its own engine: the traffic port, the agent's health route.
        assert p.get("HealthCheckPort", "traffic-port") == "traffic-port"
        assert p["HealthCheckPath"] == contract.HEALTH_ROUTE
    # The group registers every instance in both target groups.
    [group] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    assert sorted(ref["Ref"] for ref in group["TargetGroupARNs"]) == sorted(groups)


def test_the_listener_forwards_to_both_engines_by_equal_weight(template: Template) -> None:
    [listener] = props(template, "AWS::ElasticLoadBalancingV2::Listener")
    [action] = listener["DefaultActions"]
    assert action["Type"] == "forward"
    weights = {t["TargetGroupArn"]["Ref"]: t["Weight"] for t in action["ForwardConfig"]["TargetGroups"]}
    assert set(weights) == set(template.find_resources("AWS::ElasticLoadBalancingV2::TargetGroup"))
    assert set(weights.values()) == {1}


def test_the_load_balancer_may_reach_every_engine_port(template: Template) -> None:
    rules = props(template, "AWS::EC2::SecurityGroupIngress")
    ports = {(r["FromPort"], r["ToPort"]) for r in rules if r.get("SourceSecurityGroupId")}
    assert {(contract.SERVING_PORT, contract.SERVING_PORT), (contract.SERVING_PORT + 1,) * 2} <= ports


def test_the_group_counts_instances_of_two_engines(template: Template) -> None:
    [group] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    # min 2 replicas = 1 instance, max 5 replicas = 3 instances (a bound is never below the replicas asked for).
    assert (group["MinSize"], group["DesiredCapacity"], group["MaxSize"]) == ("1", "1", "3")


def test_the_packed_stack_lints_clean_with_cdk_nag(tmp_path: Path) -> None:
    env = environment(PACKED_ENV)
    app = build_app(env, app=cdk.App(context=FEATURE_FLAGS, outdir=str(tmp_path)), nag=True)
    app.synth()
    templates = sorted(tmp_path.glob("*.template.json"))
    assert templates
    result = cfn_lint(templates, "us-east-1")
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_the_instance_gets_a_packed_user_data(template: Template) -> None:
    [lt] = props(template, "AWS::EC2::LaunchTemplate")
    text = json.dumps(lt["LaunchTemplateData"]["UserData"])
    assert "ENGINES=2" in text and "GPUS_PER_ENGINE=4" in text


# ---- the instance ------------------------------------------------------------------------------------------


def creates(run: Any) -> list[list[str]]:
    return [shlex.split(c) for c in run.called("docker") if c.startswith("docker create")]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_two_containers_on_disjoint_gpus_and_ports(packed: ResolvedDeployment, tmp_path: Path) -> None:
    instance = Instance(CASE, tmp_path, packed)
    run = instance.boot(states=("Warmed:Stopped",))
    first, second = creates(run)
    assert (option(first, "--name"), option(second, "--name")) == ("kvfleet", "kvfleet-1")
    # docker's --gpus takes a device list quoted, or its CSV parser splits it at the commas.
    # (The stub logs its arguments as they came: the quotes are part of the argument.)
    raw = [c for c in run.called("docker") if c.startswith("docker create")]
    assert '--gpus "device=0,1,2,3" ' in raw[0] and '--gpus "device=4,5,6,7" ' in raw[1]
    port = contract.SERVING_PORT
    assert (option(first, "-p"), option(second, "-p")) == (f"{port}:{port}", f"{port + 1}:{port}")
    # Each engine logs to a stream of its own, and publishes as its own replica (its container's host name).
    streams = [a for args in (first, second) for a in args if a.startswith("awslogs-stream=")]
    assert len(set(streams)) == 2
    # Warming the pool starts both, waits for both health routes, stops both.
    assert run.called("systemctl")[:4] == [
        "systemctl start kvfleet.service",
        "systemctl start kvfleet-1.service",
        "systemctl stop kvfleet.service",
        "systemctl stop kvfleet-1.service",
    ]
    health = [c for c in run.called("curl") if contract.HEALTH_ROUTE in c]
    assert any(f":{port}{contract.HEALTH_ROUTE}" in c for c in health)
    assert any(f":{port + 1}{contract.HEALTH_ROUTE}" in c for c in health)
    assert "ExecStart=/usr/bin/docker start -a kvfleet-1\n" in (tmp_path / "kvfleet-1.service").read_text()
    # The agents are not given the hook: the drain step completes it once.
    assert contract.ENV_LIFECYCLE_HOOK not in run.env_file
    drain_unit = (tmp_path / ud.DRAIN_UNIT).read_text(encoding="utf-8")
    assert f"ExecStart={instance.boot_script} {ud.DRAIN_ARG}\n" in drain_unit


def test_one_engine_writes_no_drain_unit_and_gives_the_agent_the_hook(tmp_path: Path) -> None:
    run = Instance(CASE, tmp_path).boot(states=("Warmed:Stopped",))
    assert not (tmp_path / ud.DRAIN_UNIT).exists()
    assert run.env_file[contract.ENV_LIFECYCLE_HOOK] == LIFECYCLE_HOOK
    assert "--gpus all" in docker_create(run)


def test_in_service_both_engines_the_watchdog_and_the_drain_step_start(
    packed: ResolvedDeployment, tmp_path: Path
) -> None:
    instance = Instance(CASE, tmp_path, packed)
    instance.boot(states=("Warmed:Stopped",))
    step = instance.boot(ud.LIFECYCLE_ARG, states=("InService",), MOUNTED=instance.model)
    assert step.called("systemctl") == [
        "systemctl start kvfleet.service",
        "systemctl start kvfleet-1.service",
        f"systemctl start {ud.WATCHDOG_UNIT}",
        f"systemctl start {ud.DRAIN_UNIT}",
    ]


def test_the_hook_is_completed_once_after_every_engine_has_drained(packed: ResolvedDeployment, tmp_path: Path) -> None:
    instance = Instance(CASE, tmp_path, packed)
    instance.boot(states=("Warmed:Stopped",))
    # A stop takes as long as its agent's drain: here a moment, recorded when it ends.
    systemctl = tmp_path / "bin" / "systemctl"
    systemctl.write_text(
        '#!/bin/bash\nif [ "$1" = stop ]; then /bin/sleep 0.3; fi\n'
        'printf \'%s\\n\' "$(basename "$0") $*" >> "$CALLS"\n',
        encoding="utf-8",
    )
    run = instance.boot(ud.DRAIN_ARG, states=("InService", "InService", "Terminated"))
    stops = [i for i, c in enumerate(run.calls) if c.startswith("systemctl stop")]
    assert sorted(run.calls[i] for i in stops) == ["systemctl stop kvfleet-1.service", "systemctl stop kvfleet.service"]
    assert run.completions == [LIFECYCLE_HOOK]
    [done] = [i for i, c in enumerate(run.calls) if "complete-lifecycle-action" in c]
    assert done > max(stops)


def test_the_watchdog_polls_every_engine_and_replaces_the_instance_for_one(
    packed: ResolvedDeployment, tmp_path: Path
) -> None:
    instance = Instance(CASE, tmp_path, packed)
    instance.boot(states=("Warmed:Stopped",))
    # Engine 0 answers, engine 1 fails every poll: the instance is marked after WATCH_FAILURES polls.
    answers = ["200", "503"] * ud.WATCH_FAILURES
    (tmp_path / "answers").write_text("".join(f"{a}\n" for a in answers), encoding="utf-8")
    # It runs until the answers are used up (the stub then ends it).
    run = instance.run((ud.WATCHDOG_ARG,), states=("InService",), ok=False, tags=True, env={})
    assert (tmp_path / "answers").read_text(encoding="utf-8") == ""
    port = contract.SERVING_PORT
    live = [c for c in run.called("curl") if contract.LIVENESS_ROUTE in c]
    assert any(f":{port}{contract.LIVENESS_ROUTE}" in c for c in live)
    assert any(f":{port + 1}{contract.LIVENESS_ROUTE}" in c for c in live)
    assert len([c for c in run.called("aws") if "set-instance-health" in c]) == 1
