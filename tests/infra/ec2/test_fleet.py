"""The EC2 fleet stack: load balancer, launch template, group, lifecycle hook, warm pool, scaling on the signals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.deployments import resolve_environment
from kvfleet.infra.app import build_app
from kvfleet.infra.ec2.fleet import LIFECYCLE_HOOK, OS_DISK_GIB, fleet_instance_types
from tests.infra.helpers import environment, make_app, only, props

EC2_ENV = """\
name: test
region: us-east-1
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
      s3_uri: s3://model-bucket/llama/8b/
    engine:
      name: vllm
      version: "0.30.0"
    workload:
      max_input_tokens: 4096
      max_output_tokens: 1024
      concurrency_per_replica: 16
    target:
      platform: ec2
      warm_pool:
        enabled: true
        min_size: 1
    scaling:
      min_replicas: 1
      max_replicas: 4
      drain_budget_s: 420
    sizing:
      families: [g6e]
"""


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
    template.resource_count_is("AWS::AutoScaling::LifecycleHook", 2)  # drain, and warm-up for the pool
    template.resource_count_is("AWS::SageMaker::Endpoint", 0)


def test_internal_load_balancer_with_a_drain_aware_target_group(template: Template) -> None:
    [lb] = props(template, "AWS::ElasticLoadBalancingV2::LoadBalancer")
    assert lb["Scheme"] == "internal"
    attrs = {a["Key"]: a["Value"] for a in lb["LoadBalancerAttributes"]}
    assert attrs["idle_timeout.timeout_seconds"] == "900"
    assert attrs["routing.http.drop_invalid_header_fields.enabled"] == "true"
    assert attrs["access_logs.s3.enabled"] == "true"
    [tg] = props(template, "AWS::ElasticLoadBalancingV2::TargetGroup")
    assert (tg["Port"], tg["Protocol"], tg["HealthCheckPath"]) == (8080, "HTTP", "/ping")
    tattrs = {a["Key"]: a["Value"] for a in tg["TargetGroupAttributes"]}
    assert tattrs["deregistration_delay.timeout_seconds"] == "420"  # the drain budget
    assert 30 <= int(tattrs["slow_start.duration_seconds"]) <= 900
    [listener] = props(template, "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (80, "HTTP")


def test_https_when_a_certificate_is_configured() -> None:
    arn = "arn:aws:acm:us-east-1:123456789012:certificate/0b1c2d3e-aaaa-bbbb-cccc-000000000000"
    text = EC2_ENV.replace(
        "      platform: ec2\n", f"      platform: ec2\n      load_balancer:\n        certificate_arn: {arn}\n"
    )
    [listener] = props(only(text), "AWS::ElasticLoadBalancingV2::Listener")
    assert (listener["Port"], listener["Protocol"]) == (443, "HTTPS")
    assert listener["Certificates"] == [{"CertificateArn": arn}]
    assert listener["SslPolicy"].startswith("ELBSecurityPolicy-TLS13")


def test_no_security_group_open_to_the_world(template: Template) -> None:
    ingress = [
        rule for sg in props(template, "AWS::EC2::SecurityGroup") for rule in sg.get("SecurityGroupIngress", [])
    ] + props(template, "AWS::EC2::SecurityGroupIngress")
    for rule in ingress:
        assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0"
    # The instances take traffic on the agent's port from the load balancer's group only.
    to_instances = [r for r in props(template, "AWS::EC2::SecurityGroupIngress") if r.get("FromPort") == 8080]
    assert to_instances and all("SourceSecurityGroupId" in r for r in to_instances)


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
    [r] = resolve_environment(environment(EC2_ENV))
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
    ud = launch_data(t)["UserData"]["Fn::Base64"]
    if isinstance(ud, str):
        return ud
    return "".join(p if isinstance(p, str) else json.dumps(p) for p in ud["Fn::Join"][1])


def test_user_data_runs_the_agent_with_gpus_shm_logs_and_the_model(template: Template) -> None:
    ud = user_data(template)
    assert "docker create --name kvfleet" in ud and "--gpus all" in ud and "--shm-size 16g" in ud
    assert "systemctl enable kvfleet.service" in ud
    # Going into the warm pool: image and weights on disk, engine not started; then the warm-up hook completes.
    assert 'case "$STATE" in Warmed:*) ;; *) systemctl start kvfleet.service ;; esac' in ud
    assert "--lifecycle-hook-name kvfleet-warm" in ud and ud.index("docker pull") < ud.index("kvfleet-warm")
    assert "--log-driver awslogs" in ud and "awslogs-group=" in ud
    assert "aws s3 sync --only-show-errors s3://model-bucket/llama/8b/ /opt/kvfleet/model" in ud
    assert "-v /opt/kvfleet/model:/opt/ml/model:ro" in ud
    assert f"KVFLEET_LIFECYCLE_HOOK={LIFECYCLE_HOOK}" in ud and "KVFLEET_ASG_NAME=$GROUP" in ud
    assert "tags/instance/aws:autoscaling:groupName" in ud
    assert f"{contract.ENV_DEPLOYMENT}=test-chat" in ud
    assert "--stop-timeout 450" in ud  # drain budget + margin
    assert "Instance Storage" not in ud  # stopped warm pool: no instance store


def test_without_a_stopped_warm_pool_the_weights_go_to_local_nvme() -> None:
    t = only(EC2_ENV.replace("        enabled: true\n", "        enabled: false\n"))
    [r] = resolve_environment(environment(EC2_ENV))
    assert r.candidate.instance.local_nvme_gb > 0
    ud = user_data(t)
    assert "Instance Storage" in ud and "mkfs.xfs" in ud and "kvfleet-warm" not in ud
    t.resource_count_is("AWS::AutoScaling::LifecycleHook", 1)
    t.resource_count_is("AWS::AutoScaling::WarmPool", 0)


def test_group_sizes_health_warmup_and_overrides(template: Template) -> None:
    [g] = props(template, "AWS::AutoScaling::AutoScalingGroup")
    [r] = resolve_environment(environment(EC2_ENV))
    assert (g["MinSize"], g["MaxSize"]) == ("1", "4")
    assert g["DesiredCapacity"] == str(r.initial_instance_count)
    assert g["HealthCheckType"] == "ELB"
    assert g["DefaultInstanceWarmup"] == g["HealthCheckGracePeriod"] == int(-(-r.startup.ready_s // 1))
    assert g["CapacityRebalance"] is True
    overrides = [o["InstanceType"] for o in g["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]]
    assert overrides[0] == r.candidate.instance.name and overrides == fleet_instance_types(r)
    for name in overrides:  # the same engine settings must run unchanged on every override
        c = next(x for x in (r.candidate, *r.alternatives) if x.instance.name == name)
        assert c.instance.accelerator_count == r.candidate.instance.accelerator_count
        assert c.tensor_parallel_size == r.candidate.tensor_parallel_size
    update = template.find_resources("AWS::AutoScaling::AutoScalingGroup")
    [(_, res)] = update.items()
    rolling = res["UpdatePolicy"]["AutoScalingRollingUpdate"]
    assert rolling["MinInstancesInService"] >= 1  # 90% of the minimum stays in service


def test_lifecycle_hook_covers_the_drain_budget(template: Template) -> None:
    [hook] = [h for h in props(template, "AWS::AutoScaling::LifecycleHook") if h["LifecycleHookName"] == LIFECYCLE_HOOK]
    assert hook["LifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["LifecycleHookName"] == LIFECYCLE_HOOK
    assert hook["DefaultResult"] == "CONTINUE"
    assert hook["HeartbeatTimeout"] >= 420


def test_instance_role_completes_lifecycle_actions_on_this_group_only(template: Template) -> None:
    stmts = [s for p in props(template, "AWS::IAM::Policy") for s in p["PolicyDocument"]["Statement"]]
    [life] = [s for s in stmts if "autoscaling:CompleteLifecycleAction" in s["Action"]]
    assert sorted(life["Action"]) == [
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:RecordLifecycleActionHeartbeat",
    ]
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


def test_two_target_tracking_policies_on_the_signals(template: Template) -> None:
    policies = props(template, "AWS::AutoScaling::ScalingPolicy")
    assert len(policies) == 2
    names = set()
    for p in policies:
        assert p["PolicyType"] == "TargetTrackingScaling"
        spec = p["TargetTrackingConfiguration"]["CustomizedMetricSpecification"]
        assert spec["Namespace"] == contract.NAMESPACE
        assert spec["Dimensions"] == [{"Name": "Deployment", "Value": "test-chat"}]
        assert spec["Statistic"] == "Average"
        names.add(spec["MetricName"])
    assert names == {"KvCacheUtilization", "RequestsWaiting"}


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
    from kvfleet.errors import ConfigError

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
    from kvfleet.errors import ConfigError

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
