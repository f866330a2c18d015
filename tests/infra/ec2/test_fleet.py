"""The EC2 fleet stack: load balancer, launch template, group, lifecycle hook, warm pool, scaling on the signals."""

from __future__ import annotations

import json
import re
import string
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aws_cdk import aws_elasticloadbalancingv2 as elbv2
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import LOAD_PADDING
from kvfleet.errors import ConfigError
from kvfleet.infra.app import build_app
from kvfleet.sizing.startup import DOWNLOAD_BYTES_PER_S
from kvfleet.sizing.units import GiB, MiB
from kvfleet.targets import TARGETS
from kvfleet.targets.ec2.infra import fleet, lifecycle
from kvfleet.targets.ec2.infra.fleet import (
    GROUP_ACTIONS_SOURCE,
    LIFECYCLE_HOOK,
    UPDATE_POLICY,
    UPDATE_POLICY_REPLACES,
    WARM_HOOK,
    WARM_POOL_EXCLUDES_MIXED_INSTANCES,
    fleet_instance_types,
    refresh_healthy_percentages,
)
from kvfleet.targets.ec2.infra.user_data import HOST_MODEL_DIR
from kvfleet.volumes import GP3, OS_DISK_GIB, ROOT_WRITE_BUDGET_S
from tests.infra.ec2.envs import EC2_ENV, HF_TOKEN_SECRET, MODEL_S3_URI, from_hugging_face, resolved, without_warm_pool
from tests.infra.helpers import environment, make_app, only, props


@pytest.fixture(scope="module")
def template() -> Template:
    return only(EC2_ENV)


def test_fleet_resources(template: Template) -> None:
    for kind in (
        "AWS::ElasticLoadBalancingV2::LoadBalancer",
        "AWS::ElasticLoadBalancingV2::Listener",
        "AWS::ElasticLoadBalancingV2::TargetGroup",
        "AWS::EC2::LaunchTemplate",
        "AWS::AutoScaling::AutoScalingGroup",
        "AWS::AutoScaling::WarmPool",
    ):
        template.resource_count_is(kind, 1)
    # The hooks are the group's own (drain, and launch for the pool), none a resource created after it.
    template.resource_count_is("AWS::AutoScaling::LifecycleHook", 0)
    assert len(group_hooks(template)) == 2
    template.resource_count_is("AWS::SageMaker::Endpoint", 0)


def test_internal_load_balancer_with_a_drain_aware_target_group(template: Template) -> None:
    [lb] = props(template, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert lb["Scheme"] == "internal"
    attrs = {a["Key"]: a["Value"] for a in lb["LoadBalancerAttributes"]}
    assert attrs["idle_timeout.timeout_seconds"] == "900"
    assert attrs["routing.http.drop_invalid_header_fields.enabled"] == "true"
    assert attrs["access_logs.s3.enabled"] == "true"
    [tg] = props(template, "AWS::ElasticLoadBalancingV2::TargetGroup")
    assert (tg["Port"], tg["Protocol"], tg["HealthCheckPath"]) == (contract.SERVING_PORT, "HTTP", contract.HEALTH_ROUTE)
    tattrs = {a["Key"]: a["Value"] for a in tg["TargetGroupAttributes"]}
    assert tattrs["deregistration_delay.timeout_seconds"] == "420"  # the drain budget
    # Least outstanding requests, which TARGETS["ec2"] declares; slow start is off, as that algorithm requires.
    assert tattrs["load_balancing.algorithm.type"] == "least_outstanding_requests"
    assert tattrs["slow_start.duration_seconds"] == "0"
    [listener] = props(template, "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (80, "HTTP")


@pytest.mark.parametrize(
    ("algorithm", "slow_start"),
    [
        (elbv2.TargetGroupLoadBalancingAlgorithmType.ROUND_ROBIN, True),
        (elbv2.TargetGroupLoadBalancingAlgorithmType.WEIGHTED_RANDOM, False),
    ],
)
def test_slow_start_only_with_round_robin(
    algorithm: elbv2.TargetGroupLoadBalancingAlgorithmType, slow_start: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other algorithms a declaration could map to: slow start where the ELB allows it (round robin), none else.
    monkeypatch.setitem(fleet.ALGORITHMS, TARGETS["ec2"].hosting.routing, algorithm)
    [tg] = props(only(EC2_ENV), "AWS::ElasticLoadBalancingV2::TargetGroup")
    tattrs = {a["Key"]: a["Value"] for a in tg["TargetGroupAttributes"]}
    assert tattrs["load_balancing.algorithm.type"] == algorithm.value.lower()
    if slow_start:
        assert 30 <= int(tattrs["slow_start.duration_seconds"]) <= 900
    else:
        assert "slow_start.duration_seconds" not in tattrs


def test_https_when_a_certificate_is_configured() -> None:
    arn = "arn:aws:acm:us-east-1:123456789012:certificate/0b1c2d3e-aaaa-bbbb-cccc-000000000000"
    text = EC2_ENV.replace(
        "      platform: ec2\n", f"      platform: ec2\n      load_balancer:\n        certificate_arn: {arn}\n"
    )
    [listener] = props(only(text), "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (443, "HTTPS")
    assert listener["Certificates"] == [{"CertificateArn": arn}]
    assert listener["SslPolicy"].startswith("ELBSecurityPolicy-TLS13")


CERT = "arn:aws:acm:us-east-1:123456789012:certificate/0b1c2d3e-aaaa-bbbb-cccc-000000000000"


def load_balancer(text: str = EC2_ENV, **fields: object) -> str:
    """EC2_ENV with these load_balancer fields."""
    lines = "".join(f"        {k}: {v}\n" for k, v in fields.items())
    return text.replace("      platform: ec2\n", f"      platform: ec2\n      load_balancer:\n{lines}")


def test_an_internet_facing_listener_without_a_certificate_is_refused() -> None:
    text = load_balancer(internal="false", allowed_cidrs="[203.0.113.0/24]")
    with pytest.raises(ConfigError) as info:
        environment(text)
    [line] = info.value.lines
    assert "load_balancer.internal:" in line and "certificate_arn" in line and "internal: true" in line
    assert line.count("\n") == 0


def test_an_internet_facing_listener_serves_https_with_its_certificate() -> None:
    t = only(load_balancer(internal="false", allowed_cidrs="[203.0.113.0/24]", certificate_arn=CERT))
    [lb] = props(t, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert lb["Scheme"] == "internet-facing"
    [listener] = props(t, "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (443, "HTTPS")
    [sg] = [g for g in props(t, "AWS::EC2::SecurityGroup") if g["GroupDescription"] == "kvfleet load balancer"]
    assert {(r["CidrIp"], r["FromPort"]) for r in sg["SecurityGroupIngress"]} == {("203.0.113.0/24", 443)}


def listener_rules(t: Template) -> list[dict[str, Any]]:
    return sorted(props(t, "AWS::ElasticLoadBalancingV2::ListenerRule"), key=lambda r: int(r["Priority"]))


def path_matches(pattern: str, path: str) -> bool:
    """An ALB path-pattern: case-sensitive, * any run of characters, ? exactly one, over the whole path (the query
    string is not part of it). Source: AWS::ElasticLoadBalancingV2::ListenerRule PathPatternConfig."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, path, flags=re.DOTALL) is not None


def routed_to_replicas(t: Template, path: str) -> bool:
    """Whether the listener forwards ``path`` (the rules in priority order, then the default forward)."""
    for rule in listener_rules(t):
        [cond] = rule["Conditions"]
        if cond["Field"] == "path-pattern" and any(path_matches(p, path) for p in cond["PathPatternConfig"]["Values"]):
            [action] = rule["Actions"]
            return bool(action["Type"] == "forward")
    [listener] = props(t, "AWS::ElasticLoadBalancingV2::Listener")
    [default] = listener["DefaultActions"]
    return bool(default["Type"] == "forward")


def test_the_agents_internal_routes_never_pass_the_load_balancer(template: Template) -> None:
    [rule] = listener_rules(template)
    [action] = rule["Actions"]
    assert action["Type"] == "fixed-response"
    assert action["FixedResponseConfig"]["StatusCode"] == "404"
    assert json.loads(action["FixedResponseConfig"]["MessageBody"])["error"]["code"] == 404
    assert rule["ListenerArn"] == {"Ref": template_id(template, "AWS::ElasticLoadBalancingV2::Listener")}
    # ALB quotas: 5 condition values and 5 wildcards per rule; 128 characters a pattern.
    values = rule["Conditions"][0]["PathPatternConfig"]["Values"]
    assert len(values) <= 5 and sum(v.count("*") + v.count("?") for v in values) <= 5
    assert all(len(v) <= 128 for v in values)
    # Only the characters ELB takes in a path pattern ("%" is not one: the agent refuses escaped paths itself).
    documented = set(string.ascii_letters + string.digits + "_-.$/~\"'@:+&*?")
    assert all(set(v) <= documented for v in values), values
    for path in (
        contract.METRICS_ROUTE,
        contract.DRAIN_ROUTE,
        contract.LIVENESS_ROUTE,
        f"{contract.METRICS_ROUTE}/",
        f"{contract.DRAIN_ROUTE}/",
    ):
        assert not routed_to_replicas(template, path), path
    # Client routes and the health route still reach the agent.
    for path in ("/v1/chat/completions", "/v1/completions", "/invocations", "/v1/models", contract.HEALTH_ROUTE):
        assert routed_to_replicas(template, path), path


def template_id(t: Template, kind: str) -> str:
    [key] = t.find_resources(kind)
    return key


def test_instance_refresh_rolls_back_on_the_5xx_rate(template: Template) -> None:
    prefs = update_policy(template)["AutoScalingInstanceRefresh"]["Preferences"]
    [ref] = prefs["AlarmSpecification"]["Alarms"]
    assert ref["Ref"].startswith("MonitoringServerErrorRate")
    assert ref["Ref"] in template.find_resources("AWS::CloudWatch::Alarm")


def test_no_security_group_open_to_the_world(template: Template) -> None:
    ingress = [
        rule for sg in props(template, "AWS::EC2::SecurityGroup") for rule in sg.get("SecurityGroupIngress", [])
    ] + props(template, "AWS::EC2::SecurityGroupIngress")
    for rule in ingress:
        assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0"
    # The instances take traffic on the agent's port from the load balancer's group only.
    ingress_rules = props(template, "AWS::EC2::SecurityGroupIngress")
    to_instances = [r for r in ingress_rules if r.get("FromPort") == contract.SERVING_PORT]
    assert to_instances and all("SourceSecurityGroupId" in r for r in to_instances)
    # The replicas' group admits the agent's port from the load balancer's group and nothing else: not the VPC's
    # CIDR (nothing in the VPC scrapes /metrics here; the signals leave as EMF or PutMetricData).
    serving = template_id_where(template, "AWS::EC2::SecurityGroup", "kvfleet serving replicas")
    lb = template_id_where(template, "AWS::EC2::SecurityGroup", "kvfleet load balancer")
    into_serving = [r for r in ingress_rules if r["GroupId"] == {"Fn::GetAtt": [serving, "GroupId"]}]
    assert [(r["FromPort"], r["ToPort"], r["SourceSecurityGroupId"]) for r in into_serving] == [
        (contract.SERVING_PORT, contract.SERVING_PORT, {"Fn::GetAtt": [lb, "GroupId"]})
    ]
    assert "SecurityGroupIngress" not in template.find_resources("AWS::EC2::SecurityGroup")[serving]["Properties"]


def template_id_where(t: Template, kind: str, description: str) -> str:
    [key] = [k for k, r in t.find_resources(kind).items() if r["Properties"].get("GroupDescription") == description]
    return key


def group_hooks(t: Template) -> dict[str, dict[str, Any]]:
    """The group's own lifecycle hooks (LifecycleHookSpecificationList), by name."""
    [g] = props(t, "AWS::AutoScaling::AutoScalingGroup")
    return {h["LifecycleHookName"]: h for h in g.get("LifecycleHookSpecificationList", [])}


def test_the_hooks_exist_before_the_first_instance_launches(template: Template) -> None:
    # A hook resource names the group, so CloudFormation creates it after the group has launched its first
    # instances; the group's own specification list is applied before it launches any (CreateAutoScalingGroup).
    assert not props(template, "AWS::AutoScaling::LifecycleHook")
    assert set(group_hooks(template)) == {LIFECYCLE_HOOK, WARM_HOOK}
    # The names the instances are told are those the group holds.
    ud = user_data(template)
    assert setting(ud, "DRAIN_HOOK") == LIFECYCLE_HOOK and setting(ud, "WARM_HOOK") == WARM_HOOK


def launch_data(t: Template) -> dict[str, Any]:
    [lt] = props(t, "AWS::EC2::LaunchTemplate")
    return dict(lt["LaunchTemplateData"])


def test_launch_template_imdsv2_encrypted_gp3_and_the_gpu_ami(template: Template) -> None:
    data = launch_data(template)
    md = data["MetadataOptions"]
    assert md["HttpTokens"] == "required"
    assert md["HttpPutResponseHopLimit"] == 2  # the container is one hop further than the host
    assert md["InstanceMetadataTags"] == "enabled"
    [bd] = data["BlockDeviceMappings"]
    assert bd["Ebs"]["Encrypted"] is True and bd["Ebs"]["VolumeType"] == "gp3"
    r = resolved()
    # A stopped warm pool loses instance store: the weights live on the root volume.
    assert bd["Ebs"]["VolumeSize"] == OS_DISK_GIB + r.disk_gib
    assert data["InstanceType"] == r.candidate.instance.name
    image = json.dumps(data["ImageId"])
    assert "SsmParameterValue" in image  # resolved at deploy time, no lookup at synth
    params = template.to_json()["Parameters"]
    [p] = [v for k, v in params.items() if k.startswith("SsmParameterValue")]
    assert p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    assert "deeplearning" in p["Default"]


def user_data(t: Template) -> str:
    """The launch template's user data, CloudFormation functions (the image, the log group) as JSON text."""
    ud = launch_data(t)["UserData"]["Fn::Base64"]
    if isinstance(ud, str):
        return ud
    return "".join(p if isinstance(p, str) else json.dumps(p) for p in ud["Fn::Join"][1])


def setting(ud: str, name: str) -> str:
    """The value a rendered setting of the user data assigns (as written, quotes included)."""
    [value] = re.findall(rf"^{name}=(.*)$", ud, flags=re.MULTILINE)
    return str(value)


def test_user_data_is_the_rendered_template(template: Template, tmp_path: Path) -> None:
    ud = user_data(template)
    assert ud.startswith("#!/bin/bash\n") and "{{" not in ud
    path = tmp_path / "user-data.sh"
    path.write_text(ud, encoding="utf-8")  # with the deploy-time values still CloudFormation functions
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_user_data_runs_the_agent_with_the_model_from_s3_into_the_warm_pool(template: Template) -> None:
    ud = user_data(template)
    assert setting(ud, "MODEL_S3_URI") == MODEL_S3_URI
    assert setting(ud, "HOST_MODEL_DIR") == HOST_MODEL_DIR
    assert setting(ud, "CONTAINER_MODEL_DIR") == contract.MODEL_DIR
    assert setting(ud, "SERVE_ARG") == contract.SERVE_ARG
    assert setting(ud, "SERVING_PORT") == str(contract.SERVING_PORT)
    assert setting(ud, "AGENT_UID") == str(contract.AGENT_UID)
    assert setting(ud, "SHM_SIZE_GIB") == "16"
    assert setting(ud, "DRAIN_BUDGET_S") == "420"
    # The image's repository and the log group are known at deploy time only.
    assert "kvfleet-vllm:" in setting(ud, "IMAGE") and '"Ref": "FleetLogs' in setting(ud, "LOG_GROUP")
    # Going into the warm pool: image and weights on disk, engine not started; then the warm-up hook completes.
    assert setting(ud, "WARM_HOOK") == WARM_HOOK
    assert setting(ud, "LOCAL_NVME") == "0"  # a stopped warm pool loses instance store
    assert setting(ud, "ENV_ASG_NAME") == contract.ENV_ASG_NAME
    assert f"\n{contract.ENV_LIFECYCLE_HOOK}={LIFECYCLE_HOOK}\n" in ud
    assert f"\n{contract.ENV_DEPLOYMENT}=test-chat\n" in ud
    assert f"\n{contract.ENV_MODEL}={contract.MODEL_DIR}\n" in ud


def test_without_a_stopped_warm_pool_the_weights_go_to_local_nvme() -> None:
    t = only(without_warm_pool())
    assert resolved().candidate.instance.local_nvme_gb > 0
    ud = user_data(t)
    assert setting(ud, "LOCAL_NVME") == "1" and setting(ud, "WARM_HOOK") == "''"
    [bd] = launch_data(t)["BlockDeviceMappings"]
    assert bd["Ebs"]["VolumeSize"] < OS_DISK_GIB + resolved().disk_gib  # the weights are not on EBS
    assert list(group_hooks(t)) == [LIFECYCLE_HOOK]
    t.resource_count_is("AWS::AutoScaling::WarmPool", 0)


def test_a_hugging_face_model_is_downloaded_by_the_engine() -> None:
    text = without_warm_pool(from_hugging_face())
    ud = user_data(only(text))
    assert setting(ud, "MODEL_S3_URI") == "''"
    assert f"\n{contract.ENV_MODEL}={resolved(text).model_id}\n" in ud
    assert f"\n{contract.ENV_HF_TOKEN_SECRET_ARN}={HF_TOKEN_SECRET}\n" in ud


def test_group_sizes_health_warmup_and_overrides(template: Template) -> None:
    [g] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    r = resolved()
    assert (g["MinSize"], g["MaxSize"]) == ("1", "4")
    assert g["DesiredCapacity"] == str(r.initial_instance_count)
    # EC2's health check alone: the load balancer's (the agent's health route, 503 through an engine restart) takes a
    # restarting replica out of rotation but must not replace it; the host's watchdog marks a failed one.
    assert g["HealthCheckType"] == "EC2"
    # The padded start-up wait every target uses, not the bare estimate.
    assert g["DefaultInstanceWarmup"] == g["HealthCheckGracePeriod"] == r.ready_window_s
    assert r.ready_window_s >= LOAD_PADDING * r.startup.ready_s
    assert g["CapacityRebalance"] is True


def test_a_group_with_a_warm_pool_has_no_mixed_instances_policy(template: Template) -> None:
    # EC2 Auto Scaling refuses a warm pool on a group with a mixed instances policy (User Guide, Warm pools,
    # Limitations; PutWarmPool): the base environment keeps a warm pool, so its group launches the template alone.
    assert WARM_POOL_EXCLUDES_MIXED_INSTANCES
    [g] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    assert template.find_resources("AWS::AutoScaling::WarmPool")
    assert "MixedInstancesPolicy" not in g and "LaunchTemplate" in g
    [lt] = props(template, "AWS::EC2::LaunchTemplate")
    assert lt["LaunchTemplateData"]["InstanceType"] == resolved().candidate.instance.name


def test_without_a_warm_pool_the_group_tries_alternatives_in_the_plans_order() -> None:
    text = without_warm_pool()
    t = only(text)
    [g] = props(t, "AWS::AutoScaling::AutoScalingGroup")
    r = resolved(text)
    overrides = [o["InstanceType"] for o in g["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]]
    assert len(overrides) > 1, "the base plan has alternatives of the same accelerator"
    assert overrides[0] == r.candidate.instance.name and overrides == fleet_instance_types(r)
    for name in overrides:  # the same engine settings must run unchanged on every override
        c = next(x for x in (r.candidate, *r.alternatives) if x.instance.name == name)
        assert c.instance.accelerator_count == r.candidate.instance.accelerator_count
        assert c.tensor_parallel_size == r.candidate.tensor_parallel_size


def test_lifecycle_hook_covers_the_drain_budget(template: Template) -> None:
    hook = group_hooks(template)[LIFECYCLE_HOOK]
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["LifecycleHookName"] == LIFECYCLE_HOOK
    assert hook["DefaultResult"] == "CONTINUE"
    assert hook["HeartbeatTimeout"] >= 420


def test_instance_role_completes_lifecycle_actions_on_this_group_only(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [life] = [s for s in stmts if "autoscaling:CompleteLifecycleAction" in s["Action"]]
    # Each takes the autoScalingGroup resource type (Service Authorization Reference, EC2 Auto Scaling's Actions
    # table): the watchdog can mark unhealthy an instance of this group only, never another group's.
    assert sorted(life["Action"]) == [
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:RecordLifecycleActionHeartbeat",
        "autoscaling:SetInstanceHealth",
    ]
    assert GROUP_ACTIONS_SOURCE.startswith("https://docs.aws.amazon.com/service-authorization/")
    assert not [s for s in stmts if "autoscaling:SetInstanceHealth" in s["Action"] and s is not life]
    res = json.dumps(life["Resource"])
    assert "autoScalingGroupName/" in res and '"Ref": "FleetGroupASG' in res
    [get] = [s for s in stmts if s["Action"] == "s3:GetObject"]
    assert json.dumps(get["Resource"]).endswith(':s3:::model-bucket/llama/8b/*"]]}')
    roles = [
        r["Properties"]
        for k, r in template.find_resources("AWS::IAM::Role").items()
        if k.startswith("FleetInstanceRole")
    ]
    [role] = roles
    assert "AmazonSSMManagedInstanceCore" in json.dumps(role["ManagedPolicyArns"])


def test_target_tracking_scales_out_on_the_signals_and_never_in(template: Template) -> None:
    policies = props(template, "AWS::AutoScaling::ScalingPolicy")
    tracking = [p for p in policies if p["PolicyType"] == "TargetTrackingScaling"]
    assert len(tracking) == 2
    names = set()
    for p in tracking:
        config = p["TargetTrackingConfiguration"]
        assert config["DisableScaleIn"] is True  # the simple policy below scales in, after the wait
        spec = config["CustomizedMetricSpecification"]
        assert spec["Namespace"] == contract.NAMESPACE
        assert spec["Dimensions"] == [{"Name": contract.DEPLOYMENT_DIMENSION, "Value": "test-chat"}]
        assert spec["Statistic"] == "Average"
        names.add(spec["MetricName"])
    assert names == {s.name for s in contract.SCALING_SIGNALS}
    assert contract.REPLICA_SATURATION.name in names and contract.KV_CACHE_UTILIZATION.name not in names


def test_one_policy_scales_in_by_one_after_the_wait_and_then_waits_again(template: Template) -> None:
    policies = template.find_resources(
        "AWS::AutoScaling::ScalingPolicy", {"Properties": {"PolicyType": "SimpleScaling"}}
    )
    [(policy_id, policy)] = policies.items()
    simple = policy["Properties"]
    wait_s = resolved().deployment.scaling.scale_in_wait_s
    assert (simple["AdjustmentType"], simple["ScalingAdjustment"]) == ("ChangeInCapacity", -1)
    # Only simple scaling honours a cooldown: without it an alarm still in ALARM removes one instance a minute.
    assert simple["Cooldown"] == str(wait_s)
    assert not template.find_resources("AWS::AutoScaling::ScalingPolicy", {"Properties": {"PolicyType": "StepScaling"}})
    [alarm] = [a for a in props(template, "AWS::CloudWatch::Alarm") if a.get("AlarmActions") == [{"Ref": policy_id}]]
    assert alarm["EvaluationPeriods"] == wait_s // 60  # one-minute periods, all of the wait
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("LessThanThreshold", 1)
    assert alarm["TreatMissingData"] == "notBreaching"  # one instance: no "one fewer", nothing to scale in
    [expr] = [m for m in alarm["Metrics"] if "Expression" in m]
    stats = {m["Id"]: m["MetricStat"]["Metric"] for m in alarm["Metrics"] if "MetricStat" in m}
    assert {m["MetricName"] for m in stats.values()} == {
        *(s.name for s in contract.SCALING_SIGNALS),
        "GroupInServiceInstances",
    }
    # Every signal and the group's in-service count enter the expression.
    assert all(re.search(rf"\b{metric_id}\b", expr["Expression"]) for metric_id in stats)
    [group] = [m for m in stats.values() if m["MetricName"] == "GroupInServiceInstances"]
    assert group["Dimensions"][0]["Value"]["Ref"].startswith("FleetGroupASG")


def test_dashboard_counts_instances_from_the_group(template: Template) -> None:
    [dash] = props(template, "AWS::CloudWatch::Dashboard")
    body = json.dumps(dash["DashboardBody"])
    assert "GroupInServiceInstances" in body and "HTTPCode_Target_5XX_Count" in body


def test_existing_vpc_needs_client_cidrs() -> None:
    text = EC2_ENV.replace(
        "deployments:\n",
        "network:\n  vpc_id: vpc-0123456789abcdef0\n"
        "  private_subnet_ids: [subnet-0123456789abcdef0, subnet-0123456789abcdef1]\n"
        "  availability_zones: [us-east-1a, us-east-1b]\ndeployments:\n",
        1,
    )
    with pytest.raises(ConfigError) as info:
        environment(text)
    assert "allowed_cidrs" in info.value.lines[0]
    ok = text.replace(
        "      platform: ec2\n", "      platform: ec2\n      load_balancer:\n        allowed_cidrs: [10.20.0.0/16]\n"
    )
    t = only(ok)
    t.resource_count_is("AWS::EC2::VPC", 0)
    [g] = props(t, "AWS::AutoScaling::AutoScalingGroup")
    assert g["VPCZoneIdentifier"] == ["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"]


def test_world_open_client_cidr_is_refused() -> None:
    text = EC2_ENV.replace(
        "      platform: ec2\n", "      platform: ec2\n      load_balancer:\n        allowed_cidrs: [0.0.0.0/0]\n"
    )
    with pytest.raises(ConfigError, match="every address"):
        environment(text)


def test_cdk_nag_passes(tmp_path: Path) -> None:
    app = build_app(environment(EC2_ENV), app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []
    agnostic = build_app(
        environment(EC2_ENV.replace("region: us-east-1\n", "")), app=make_app(outdir=str(tmp_path / "b")), nag=True
    )
    agnostic.synth()


# ---- the fleet's shape: one engine per instance --------------------------------------------------------------

# The case: Llama-3.1-8B on p4d at 50 requests/s (19 replicas of 16 sequences).
P4D_50_RPS = (
    EC2_ENV.replace(
        "      concurrency_per_replica: 16\n", "      concurrency_per_replica: 16\n      peak_requests_per_s: 50\n"
    )
    .replace("      families: [g6e]\n", "      instance_type: p4d.24xlarge\n")
    .replace("      max_replicas: 4\n", "      max_replicas: 32\n")
)


def test_an_instance_runs_one_engine_on_all_its_gpus_and_the_group_counts_replicas() -> None:
    """The group's min/max/desired and its scaling steps count instances, and one container per instance takes
    --gpus all: a plan with several engines per instance would deploy a fraction of its replicas."""
    r = resolved(P4D_50_RPS)
    c = r.candidate
    assert c.instance.name == "p4d.24xlarge"
    assert c.engines_per_instance == 1 and c.replicas == c.instance_count > 1
    assert c.tensor_parallel_size == c.instance.accelerator_count  # the engine spans every GPU it is given
    [g] = props(only(P4D_50_RPS), "AWS::AutoScaling::AutoScalingGroup")
    assert g["DesiredCapacity"] == str(c.replicas)


# ---- start-up waits and the root volume ---------------------------------------------------------------------

BIG = EC2_ENV.replace("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B").replace(
    "      families: [g6e]\n", "      instance_type: p4d.24xlarge\n"
)


@pytest.mark.parametrize("text", [EC2_ENV, without_warm_pool(), BIG], ids=["stopped-pool", "nvme", "70b"])
def test_the_root_volume_writes_what_lands_on_it_in_bounded_time_within_gp3_limits(text: str) -> None:
    [bd] = launch_data(only(text))["BlockDeviceMappings"]
    ebs = bd["Ebs"]
    size, mib_s, iops = ebs["VolumeSize"], ebs["Throughput"], ebs["Iops"]
    # gp3's own rules (the EBS user guide): ranges, IOPS per GiB, throughput per IOPS.
    assert GP3.baseline_mib_s <= mib_s <= GP3.max_mib_s and GP3.baseline_iops <= iops <= GP3.max_iops
    assert iops <= GP3.max_iops_per_gib * size and mib_s <= GP3.max_mib_s_per_iops * iops
    assert GP3.sources[0].startswith("https://docs.aws.amazon.com/ebs/")
    # What it writes at boot (all but the AMI's own part), in the budget unless gp3 cannot go faster; never slower
    # than the download the start-up estimate assumes.
    written = (size - OS_DISK_GIB) * GiB
    assert written / (mib_s * MiB) <= ROOT_WRITE_BUDGET_S or mib_s == GP3.max_mib_s
    assert mib_s * MiB >= min(DOWNLOAD_BYTES_PER_S, GP3.max_mib_s * MiB)


def test_gp3_ranges_are_those_of_the_pinned_ec2_api_model() -> None:
    """The launch template's Ebs ranges as the EC2 API documents them in botocore's service model (the release the
    project pins): a raised or lowered AWS limit fails here, not at deploy time."""
    import botocore.loaders  # type: ignore[import-untyped]

    shapes = botocore.loaders.Loader().load_service_model("ec2", "service-2")["shapes"]
    members = shapes["LaunchTemplateEbsBlockDeviceRequest"]["members"]
    iops_doc = re.sub(r"<[^>]+>", "", members["Iops"]["documentation"])
    throughput_doc = re.sub(r"<[^>]+>", "", members["Throughput"]["documentation"])
    low, high = (int(x.replace(",", "")) for x in re.findall(r"gp3: ([0-9,]+) - ([0-9,]+) IOPS", iops_doc)[0])
    assert (low, high) == (GP3.baseline_iops, GP3.max_iops)
    [(t_low, t_high)] = re.findall(r"Minimum value of ([0-9,]+)\. Maximum value of ([0-9,]+)", throughput_doc)
    assert (int(t_low), int(t_high.replace(",", ""))) == (GP3.baseline_mib_s, GP3.max_mib_s)


def test_a_big_checkpoint_gets_more_than_the_baseline() -> None:
    [bd] = launch_data(only(BIG))["BlockDeviceMappings"]
    assert bd["Ebs"]["Throughput"] > 2 * GP3.baseline_mib_s


# ---- updates replace the warm pool too ------------------------------------------------------------------------


def update_policy(t: Template) -> dict[str, Any]:
    [(_, res)] = t.find_resources("AWS::AutoScaling::AutoScalingGroup").items()
    return dict(res["UpdatePolicy"])


def test_a_launch_template_change_replaces_the_warm_pools_instances_too(template: Template) -> None:
    policy = update_policy(template)
    # The policies that replace instances (AutoScalingScheduledAction only keeps scheduled sizes).
    [name] = [k for k in policy if k in ("AutoScalingRollingUpdate", "AutoScalingReplacingUpdate", UPDATE_POLICY)]
    assert name == UPDATE_POLICY and "Warmed" in UPDATE_POLICY_REPLACES[name]
    assert "Warmed" not in UPDATE_POLICY_REPLACES["AutoScalingRollingUpdate"]  # what it replaced: the defect
    refresh = policy[name]
    assert refresh["Strategy"] == "Rolling"
    prefs = refresh["Preferences"]
    assert prefs["MinHealthyPercentage"] == 90  # target.min_healthy_percent
    assert prefs["InstanceWarmup"] == resolved().ready_window_s
    assert prefs["SkipMatching"] is True


@pytest.mark.parametrize("healthy", [0, 1, 50, 89, 90, 99, 100])
def test_refresh_percentages_are_in_the_documented_ranges(healthy: int) -> None:
    """InstanceMaintenancePolicy: minimum 0-100, maximum 100-200, at most 100 apart; and room to replace one."""
    low, high = refresh_healthy_percentages(healthy)
    assert low == healthy and 0 <= low <= 100 <= high <= 200 and high - low <= 100
    assert high > 100 or low < 100


# ---- the warm pool's size and hooks ---------------------------------------------------------------------------


def test_the_warm_pool_holds_exactly_min_size(template: Template) -> None:
    """PutWarmPool: without MaxGroupPreparedCapacity the pool is max - desired; equal to MinSize, it is MinSize."""
    [pool] = props(template, "AWS::AutoScaling::WarmPool")
    assert pool["MinSize"] == pool["MaxGroupPreparedCapacity"] == 1
    assert pool["PoolState"] == "Stopped"
    # No reuse on scale-in: a terminating instance never pauses at Warmed:Pending:Wait (see lifecycle.TRANSITIONS).
    assert not pool.get("InstanceReusePolicy", {}).get("ReuseOnScaleIn", False)
    two = only(EC2_ENV.replace("        min_size: 1\n", "        min_size: 2\n"))
    [pool] = props(two, "AWS::AutoScaling::WarmPool")
    assert pool["MinSize"] == pool["MaxGroupPreparedCapacity"] == 2


def test_a_warm_pool_of_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="min_size") as info:
        environment(EC2_ENV.replace("        min_size: 1\n", "        min_size: 0\n"))
    assert "warm_pool" in info.value.lines[0]
    environment(without_warm_pool(EC2_ENV.replace("        min_size: 1\n", "        min_size: 0\n")))


def test_every_transitions_hook_exists_with_its_transition(template: Template) -> None:
    hooks = group_hooks(template)
    names = {lifecycle.LAUNCHING: WARM_HOOK, lifecycle.TERMINATING: LIFECYCLE_HOOK}
    for t in lifecycle.TRANSITIONS:
        assert hooks[names[t.hook]]["LifecycleTransition"] == t.hook, t.name
    launch = hooks[WARM_HOOK]
    # The launch hook waits the padded start-up (a warm phase may download and load the weights), then abandons.
    assert launch["HeartbeatTimeout"] == min(7200, resolved().ready_window_s)
    assert launch["DefaultResult"] == "ABANDON"


def test_the_amis_driver_runs_the_images_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default DLAMI's driver runs the vLLM DLC's CUDA 13; with an older driver synth fails with the fix.
    import dataclasses

    from kvfleet.errors import KvfleetError
    from kvfleet.infra import cuda
    from kvfleet.targets.ec2.infra.hosts import HOSTS

    [host] = [h for h in cuda.hosts(HOSTS) if h.setting.startswith("/aws/service/")]
    assert host.cuda >= (13, 0)
    old = dataclasses.replace(host, driver_branch=550, cuda=(12, 4))
    monkeypatch.setattr(cuda, "hosts", lambda rule: (old,) if rule == HOSTS else ())
    monkeypatch.setattr(fleet, "hosts", cuda.hosts)
    with pytest.raises(KvfleetError, match=r"CUDA 13\.0"):
        only(EC2_ENV)


def test_the_instance_role_pulls_only_its_own_repository(template: Template) -> None:
    # ecr:GetAuthorizationToken takes no resource (Service Authorization Reference, Amazon ECR: no resource type);
    # every other ECR action the instances are granted names the one repository they run, never "*".
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    ecr = [s for s in stmts if any(str(a).startswith("ecr:") for a in _actions(s))]
    token = [s for s in ecr if "ecr:GetAuthorizationToken" in _actions(s)]
    assert token and all(
        a == "ecr:GetAuthorizationToken" or not a.startswith("ecr:") for s in token for a in _actions(s)
    )
    pulls = [s for s in ecr if s not in token]
    assert pulls and {a for s in pulls for a in _actions(s)} >= {"ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"}
    for s in pulls:
        resources = s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
        assert len(resources) == 1 and resources[0] != "*"
        assert json.dumps(resources[0]).endswith(':repository/kvfleet-vllm"]]}')


def _actions(statement: dict[str, Any]) -> list[str]:
    a = statement["Action"]
    return [a] if isinstance(a, str) else list(a)
