"""SageMaker's inference-component shape (target.shape inference_components): the planner may pack several engines on
a multi-GPU instance, and the template holds a model-less variant with managed instance scaling, one inference
component whose copies and accelerators are the plan's, and target tracking on its copy count."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Template

from kvfleet import contract
from kvfleet.bench.sagemaker import SageMakerTransport
from kvfleet.cli import main
from kvfleet.cli.endpoint import bench_target
from kvfleet.deployments import resolve_environment
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.infra.app import build_app
from kvfleet.scaling import ScaleToZero
from kvfleet.targets.sagemaker import COMPONENT_HOSTING, COMPONENT_SEPARATOR, COMPONENTS, TARGET
from kvfleet.targets.sagemaker.config import SageMakerTarget
from kvfleet.targets.sagemaker.infra.components import HOST_MEMORY_SHARE, Copies
from kvfleet.tuning import sim_scaling
from tests.envs import SAGEMAKER_ENV, environment
from tests.infra.helpers import make_app, only, props
from tests.infra.test_cfn_lint import cfn_lint

SHAPE = "platform: sagemaker\n      shape: inference_components"
COMPONENTS_ENV = SAGEMAKER_ENV.replace("platform: sagemaker", SHAPE)

# Llama-3.1-8B at 20 requests/s, the planner free to choose the instance (the case).
AT_RATE = (
    SAGEMAKER_ENV.replace("      concurrency_per_replica: 16\n", "      peak_requests_per_s: 20\n")
    .replace("    sizing:\n      instance_type: ml.g6e.xlarge\n", "")
    .replace("max_replicas: 4", "max_replicas: 16")
)


def at_rate(shape: str) -> str:
    return AT_RATE.replace("platform: sagemaker", f"platform: sagemaker\n      shape: {shape}")


@pytest.fixture(scope="module")
def packed_text() -> str:
    return at_rate("inference_components")


@pytest.fixture(scope="module")
def packed(packed_text: str) -> Template:
    return only(packed_text)


def one(t: Template, kind: str) -> dict[str, Any]:
    [p] = props(t, kind)
    return p


# ---- the shape and what the planner may do -------------------------------------------------------------------


def test_the_default_shape_is_the_variant_with_one_engine_per_instance() -> None:
    d = environment().deployments[0]
    assert isinstance(d.target, SageMakerTarget)
    assert d.target.hosting is TARGET.hosting
    assert d.target.hosting.one_engine_per_instance
    assert d.target.chosen_shape(d)[0] == "variant"


def test_by_default_min_replicas_0_chooses_inference_components_one_copy_per_instance() -> None:
    d = environment(SAGEMAKER_ENV.replace("min_replicas: 1", "min_replicas: 0")).deployments[0]
    assert isinstance(d.target, SageMakerTarget)
    assert d.target.chosen_shape(d) == (
        "inference_components",
        "scaling.min_replicas 0: only inference components scale to zero",
    )
    # Packing is the file's choice (the planner's hosting is read before the plan).
    assert d.target.hosting.one_engine_per_instance


def test_the_plan_says_the_shape_and_why(packed_text: str) -> None:
    [r] = resolve_environment(environment(packed_text))
    d, c = r.deployment, r.candidate
    assert d.target.hosting_note(d, c) == (
        f"endpoint: inference components, copies of {c.gpus_per_replica} GPU(s), {c.engines_per_instance} per "
        f"{c.name} (target.shape)"
    )
    plain = environment().deployments[0]
    note = plain.target.hosting_note(plain, None)
    assert note is not None and note.startswith("endpoint: one production variant, one engine per instance")


def test_network_isolation_is_the_endpoint_configs_for_components() -> None:
    text = COMPONENTS_ENV.replace(SHAPE, SHAPE + "\n      network_isolation: true").replace(
        "      hf_token_secret: kvfleet/hf-token\n", "      s3_uri: s3://models/llama/\n"
    )
    assert one(only(text), "AWS::SageMaker::EndpointConfig")["EnableNetworkIsolation"] is True


def test_inference_components_let_the_planner_pack() -> None:
    target = environment(COMPONENTS_ENV).deployments[0].target
    assert target.hosting is COMPONENT_HOSTING
    assert not target.hosting.one_engine_per_instance
    # Everything else is the variant's shape.
    assert target.hosting.routing is TARGET.hosting.routing
    assert target.hosting.max_volume_gib == TARGET.hosting.max_volume_gib


def test_at_20_requests_per_s_the_plan_packs_copies_on_a_multi_gpu_instance_when_cheaper() -> None:
    [variant] = resolve_environment(environment(at_rate("variant")))
    [packed] = resolve_environment(environment(at_rate("inference_components")))
    c = packed.candidate
    assert c.instance.accelerator_count > 1
    assert c.engines_per_instance == c.instance.accelerator_count // c.gpus_per_replica > 1
    assert c.fleet_usd_per_hour <= variant.candidate.fleet_usd_per_hour
    assert variant.candidate.engines_per_instance == 1


def test_a_canary_is_refused_for_inference_components() -> None:
    text = COMPONENTS_ENV.replace(SHAPE, SHAPE + "\n      canary_percent: 10")
    with pytest.raises(ConfigError, match=r"test\.yaml:\d+: .*canary_percent applies to shape variant only"):
        environment(text)


def test_an_unknown_shape_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"test\.yaml:\d+: .*shape"):
        environment(SAGEMAKER_ENV.replace("platform: sagemaker", "platform: sagemaker\n      shape: packed"))


# ---- the template ---------------------------------------------------------------------------------------------


def test_the_variant_names_no_model_and_lets_sagemaker_manage_the_instances(packed_text: str, packed: Template) -> None:
    [r] = resolve_environment(environment(packed_text))
    config = one(packed, "AWS::SageMaker::EndpointConfig")
    [variant] = config["ProductionVariants"]
    assert "ModelName" not in variant
    assert "ModelDataDownloadTimeoutInSeconds" not in variant
    assert "ContainerStartupHealthCheckTimeoutInSeconds" not in variant
    assert variant["InstanceType"] == r.instance_type
    per = r.candidate.engines_per_instance
    assert variant["ManagedInstanceScaling"] == {
        "Status": COMPONENTS.managed_scaling_status,
        "MinInstanceCount": math.ceil(r.scaling.min_replicas / per),
        # Room for one rolling batch's new copies over the most copies.
        "MaxInstanceCount": math.ceil(
            (r.scaling.max_replicas + _batch(r.scaling.min_replicas, r.scaling.max_replicas)) / per
        ),
        "ScaleInPolicy": {"Strategy": "IDLE_RELEASE"},
    }
    assert variant["InitialInstanceCount"] == math.ceil(
        one(packed, "AWS::SageMaker::InferenceComponent")["RuntimeConfig"]["CopyCount"] / per
    )
    # The copies run as the execution role, in the VPC, named at the endpoint config.
    assert config["ExecutionRoleArn"]["Fn::GetAtt"][0].startswith("EndpointExecutionRole")
    assert set(config["VpcConfig"]) == {"SecurityGroupIds", "Subnets"}


def test_the_component_holds_the_plan(packed_text: str, packed: Template) -> None:
    [r] = resolve_environment(environment(packed_text))
    c = one(packed, "AWS::SageMaker::InferenceComponent")
    spec = c["Specification"]
    assert spec["ModelName"]["Fn::GetAtt"][0].startswith("EndpointModel")
    ram_gib = r.candidate.instance.ram_gib
    assert ram_gib is not None
    per = r.candidate.engines_per_instance
    need = spec["ComputeResourceRequirements"]
    assert need == {
        "NumberOfAcceleratorDevicesRequired": r.candidate.gpus_per_replica,
        "MinMemoryRequiredInMb": int(ram_gib * 1024 * HOST_MEMORY_SHARE / per),
    }
    # Copies on one instance never ask for more accelerators or memory than it has.
    assert need["NumberOfAcceleratorDevicesRequired"] * per <= r.candidate.instance.accelerator_count
    assert need["MinMemoryRequiredInMb"] * per <= ram_gib * 1024
    assert spec["StartupParameters"] == {
        "ModelDataDownloadTimeoutInSeconds": r.download_timeout_s,
        "ContainerStartupHealthCheckTimeoutInSeconds": r.startup_timeout_s,
    }
    assert c["RuntimeConfig"] == {
        "CopyCount": min(max(r.candidate.replicas, r.scaling.min_replicas), r.scaling.max_replicas)
    }
    assert c["VariantName"] == "AllTraffic"
    assert c["EndpointName"]["Fn::GetAtt"][1] == "EndpointName"


def test_the_component_keeps_the_containers_environment(packed: Template) -> None:
    # The model (image, environment, VPC) is the variant shape's; the component runs it.
    [model] = props(packed, "AWS::SageMaker::Model")
    assert model["PrimaryContainer"]["Environment"]
    assert "VpcConfig" in model


def test_an_update_replaces_one_copy_at_a_time_with_the_drain_budget_and_rolls_back_on_alarms(packed: Template) -> None:
    c = one(packed, "AWS::SageMaker::InferenceComponent")
    policy = c["DeploymentConfig"]["RollingUpdatePolicy"]
    assert policy["MaximumBatchSize"] == {"Type": "COPY_COUNT", "Value": 1}  # 1 to 16 copies: 5% of 16 is under 1
    assert policy["WaitIntervalInSeconds"] == 420
    assert 600 <= policy["MaximumExecutionTimeoutInSeconds"] <= 14400
    assert c["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    # The endpoint's own blue/green does not apply: the variant carries no model.
    endpoint = one(packed, "AWS::SageMaker::Endpoint")
    assert "DeploymentConfig" not in endpoint
    assert endpoint["RetainAllVariantProperties"] is False


def test_copies_scale_on_the_same_target_tracking_as_the_variant(packed_text: str, packed: Template) -> None:
    [r] = resolve_environment(environment(packed_text))
    target = one(packed, "AWS::ApplicationAutoScaling::ScalableTarget")
    assert target["ScalableDimension"] == "sagemaker:inference-component:DesiredCopyCount"
    assert target["ServiceNamespace"] == "sagemaker"
    prefix, name = target["ResourceId"]["Fn::Join"][1]
    assert prefix == "inference-component/"
    assert name["Fn::Select"][1]["Fn::Split"][1]["Fn::GetAtt"][1] == "InferenceComponentArn"
    assert (target["MinCapacity"], target["MaxCapacity"]) == (r.scaling.min_replicas, r.scaling.max_replicas)
    # The same policies as the variant's: one per tracked signal, on the deployment's signals.
    variant = only()
    assert len(props(packed, "AWS::ApplicationAutoScaling::ScalingPolicy")) == len(
        props(variant, "AWS::ApplicationAutoScaling::ScalingPolicy")
    )
    for p in props(packed, "AWS::ApplicationAutoScaling::ScalingPolicy"):
        spec = p["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
        assert {"Name": contract.DEPLOYMENT_DIMENSION, "Value": r.deployment_id} in spec["Dimensions"]


def test_a_fixed_size_has_no_copy_scaling_and_room_for_one_new_copy() -> None:
    t = only(COMPONENTS_ENV.replace("max_replicas: 4", "max_replicas: 1"))
    assert not props(t, "AWS::ApplicationAutoScaling::ScalableTarget")
    [variant] = one(t, "AWS::SageMaker::EndpointConfig")["ProductionVariants"]
    scaling = variant["ManagedInstanceScaling"]
    assert (scaling["MinInstanceCount"], scaling["MaxInstanceCount"]) == (1, 2)
    # One copy: no whole batch is within 5% to 50% of it, so no rolling policy (and so no deployment config).
    assert "DeploymentConfig" not in one(t, "AWS::SageMaker::InferenceComponent")


def _batch(low: int, high: int) -> int:
    c = Copies(initial=max(low, 1), low=low, high=high, per_instance=1)
    batch = c.batch()
    assert batch is not None
    return batch


@pytest.mark.parametrize(
    ("low", "high"), [(0, 2), (1, 2), (2, 3), (1, 16), (2, 20), (2, 21), (4, 40), (10, 100), (0, 1)]
)
def test_a_rolling_batch_is_within_5_to_50_percent_of_the_copy_count(low: int, high: int) -> None:
    lowest, highest = COMPONENTS.batch_share
    batch = Copies(initial=max(low, 1), low=low, high=high, per_instance=1).batch()
    if high < 2:
        assert batch is None
        return
    assert batch is not None and batch >= 1
    # Within range at two copies or the fewest, whichever is more (a whole copy is over 50% of one).
    assert batch <= highest * max(low, 2)
    # And at the most copies, wherever one batch can be both (else the 50% bound wins: 2 to 21 copies).
    if math.ceil(lowest * high) <= highest * max(low, 2):
        assert batch >= lowest * high


def test_a_large_fleet_updates_in_batches_of_its_share() -> None:
    t = only(
        COMPONENTS_ENV.replace("min_replicas: 1", "min_replicas: 10").replace("max_replicas: 4", "max_replicas: 40")
    )
    policy = one(t, "AWS::SageMaker::InferenceComponent")["DeploymentConfig"]["RollingUpdatePolicy"]
    assert policy["MaximumBatchSize"] == {"Type": "COPY_COUNT", "Value": 2}  # 5% of 40
    [variant] = one(t, "AWS::SageMaker::EndpointConfig")["ProductionVariants"]
    assert variant["ManagedInstanceScaling"]["MaxInstanceCount"] == 42


def _log_resources(t: Template) -> list[str]:
    out = []
    for p in props(t, "AWS::IAM::Policy"):
        for st in p["PolicyDocument"]["Statement"]:
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            if "logs:PutLogEvents" in actions:
                out += [
                    json.dumps(r) for r in (st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]])
                ]
    return out


def test_the_copies_may_write_their_component_log_group(packed: Template) -> None:
    logs = _log_resources(packed)
    assert any(COMPONENTS.log_group_prefix + "*" in r for r in logs)
    assert any(COMPONENTS.log_group_prefix + "*:log-stream:*" in r for r in logs)
    assert any("/aws/sagemaker/Endpoints/*" in r for r in logs)
    assert not any(COMPONENTS.log_group_prefix in r for r in _log_resources(only()))


def _alarm_metric(t: Template, metric: str) -> dict[str, Any]:
    """The one alarm's metric named ``metric``: the Platform5xx alarm's."""
    [found] = [
        m["MetricStat"]["Metric"]
        for a in props(t, "AWS::CloudWatch::Alarm")
        for m in a.get("Metrics", [])
        if m.get("MetricStat", {}).get("Metric", {}).get("MetricName") == metric
    ]
    return found  # type: ignore[no-any-return]


def test_the_platform_5xx_alarm_and_dashboard_read_the_components_metric(packed: Template) -> None:
    alarm = _alarm_metric(packed, "Invocation5XXErrors")
    assert alarm["Namespace"] == "AWS/SageMaker"
    [dimension] = alarm["Dimensions"]
    assert dimension["Name"] == COMPONENTS.metric_dimension
    assert dimension["Value"]["Fn::Select"][1]["Fn::Split"][1]["Fn::GetAtt"][1] == "InferenceComponentArn"
    [board] = props(packed, "AWS::CloudWatch::Dashboard")
    body = json.dumps(board["DashboardBody"])
    assert "Invocation5XXErrors" in body and COMPONENTS.metric_dimension in body
    assert '\\"VariantName\\"' not in body and '"VariantName"' not in body
    # The variant shape keeps the variant's.
    variant = _alarm_metric(only(), "Invocation5XXErrors")
    assert {d["Name"] for d in variant["Dimensions"]} == {"EndpointName", "VariantName"}


def test_the_variant_shape_has_no_component() -> None:
    t = only()
    assert not props(t, "AWS::SageMaker::InferenceComponent")
    [variant] = one(t, "AWS::SageMaker::EndpointConfig")["ProductionVariants"]
    assert "ManagedInstanceScaling" not in variant
    assert "ModelName" in variant


def test_cdk_nag_and_cfn_lint_pass(packed_text: str, tmp_path: Path) -> None:
    env = environment(packed_text)
    app = build_app(env, app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    report = json.loads((tmp_path / "validation-report.json").read_text())
    assert report["pluginReports"] == []
    templates = sorted(tmp_path.glob("*.template.json"))
    result = cfn_lint(templates, env.region or "us-east-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


# ---- scale to zero --------------------------------------------------------------------------------------------

TO_ZERO = COMPONENTS_ENV.replace("min_replicas: 1", "min_replicas: 0")


@pytest.fixture(scope="module")
def to_zero() -> Template:
    return only(TO_ZERO)


def test_the_variant_shape_still_refuses_scale_to_zero() -> None:
    text = SAGEMAKER_ENV.replace("platform: sagemaker", "platform: sagemaker\n      shape: variant")
    with pytest.raises(ConfigError, match=r"sagemaker cannot scale to zero .*set inference_components"):
        environment(text.replace("min_replicas: 1", "min_replicas: 0"))


def test_by_default_min_replicas_0_synthesizes_inference_components() -> None:
    t = only(SAGEMAKER_ENV.replace("min_replicas: 1", "min_replicas: 0"))
    assert (
        one(t, "AWS::SageMaker::InferenceComponent")["Specification"]["ComputeResourceRequirements"][
            "NumberOfAcceleratorDevicesRequired"
        ]
        == 1
    )
    assert one(t, "AWS::ApplicationAutoScaling::ScalableTarget")["MinCapacity"] == 0


def test_scale_to_zero_lets_copies_and_instances_reach_zero(to_zero: Template) -> None:
    [variant] = one(to_zero, "AWS::SageMaker::EndpointConfig")["ProductionVariants"]
    assert variant["ManagedInstanceScaling"]["MinInstanceCount"] == 0
    assert one(to_zero, "AWS::ApplicationAutoScaling::ScalableTarget")["MinCapacity"] == 0
    # It deploys serving: one copy first, whatever the minimum.
    assert one(to_zero, "AWS::SageMaker::InferenceComponent")["RuntimeConfig"]["CopyCount"] >= 1


def test_a_request_refused_at_zero_wakes_one_copy(to_zero: Template) -> None:
    policies = props(to_zero, "AWS::ApplicationAutoScaling::ScalingPolicy")
    [step] = [p for p in policies if p["PolicyType"] == "StepScaling"]
    assert step["StepScalingPolicyConfiguration"] == {
        "AdjustmentType": "ExactCapacity",
        "Cooldown": ScaleToZero.WAKE_COOLDOWN_S,
        "MetricAggregationType": "Maximum",
        "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}],
    }
    # The way down is the target tracking on the signals, as above zero.
    assert sum(p["PolicyType"] == "TargetTrackingScaling" for p in policies) == 2
    [wake] = [a for a in props(to_zero, "AWS::CloudWatch::Alarm") if COMPONENTS.refused_metric in json.dumps(a)]
    [m] = wake["Metrics"]
    metric = m["MetricStat"]["Metric"]
    assert metric["Namespace"] == "AWS/SageMaker"
    [dimension] = metric["Dimensions"]
    assert dimension["Name"] == "InferenceComponentName"
    assert dimension["Value"]["Fn::Select"][1]["Fn::Split"][1]["Fn::GetAtt"][1] == "InferenceComponentArn"
    assert (m["MetricStat"]["Stat"], m["MetricStat"]["Period"]) == ("Sum", 60)
    assert wake["Threshold"] == ScaleToZero.WAKE_THRESHOLD
    assert wake["ComparisonOperator"] == ScaleToZero.WAKE_COMPARISON
    assert wake["EvaluationPeriods"] == ScaleToZero.WAKE_PERIODS
    assert wake["TreatMissingData"] == ScaleToZero.WAKE_MISSING_DATA
    [action] = wake["AlarmActions"]
    assert action["Ref"].startswith("EndpointWake")


def test_no_wake_above_zero(packed: Template) -> None:
    policies = props(packed, "AWS::ApplicationAutoScaling::ScalingPolicy")
    assert all(p["PolicyType"] == "TargetTrackingScaling" for p in policies)


def test_the_simulator_replays_the_zero() -> None:
    [r] = resolve_environment(environment(TO_ZERO))
    assert sim_scaling(r).min_replicas == 0
    [variant] = resolve_environment(environment())
    assert sim_scaling(variant).min_replicas == 1


def test_scale_to_zero_passes_cdk_nag_and_cfn_lint(tmp_path: Path) -> None:
    env = environment(TO_ZERO)
    app = build_app(env, app=make_app(outdir=str(tmp_path)), nag=True)
    app.synth()
    assert json.loads((tmp_path / "validation-report.json").read_text())["pluginReports"] == []
    result = cfn_lint(sorted(tmp_path.glob("*.template.json")), env.region or "us-east-1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_kvfleet_plan_prints_the_shape(packed_text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "packed.yaml"
    f.write_text(packed_text, encoding="utf-8")
    assert main(["plan", str(f)]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("chat: endpoint:")]
    shape = r"chat: endpoint: inference components, copies of \d GPU\(s\), \d+ per ml\.\S+ \(target\.shape\)"
    assert re.fullmatch(shape, line)
    assert main(["plan", str(f), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["choices"]["hosting"] == line.removeprefix("chat: ")


# ---- where clients send -----------------------------------------------------------------------------------------


def test_the_address_names_the_endpoint_and_its_component(packed: Template) -> None:
    outputs = packed.to_json()["Outputs"]
    [address] = [v["Value"] for k, v in outputs.items() if k.startswith(TARGET.address_output or "")]
    separator, (endpoint, component) = address["Fn::Join"]
    assert separator == COMPONENT_SEPARATOR
    assert endpoint["Fn::GetAtt"][1] == "EndpointName"
    assert component["Fn::Select"][1]["Fn::Split"][1]["Fn::GetAtt"][1] == "InferenceComponentArn"
    # A variant's endpoint is its name alone.
    [plain] = [v["Value"] for k, v in only().to_json()["Outputs"].items() if k.startswith(TARGET.address_output or "")]
    assert plain["Fn::GetAtt"][1] == "EndpointName"


class _Client:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def invoke_endpoint_with_response_stream(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        return {"Body": [{"PayloadPart": {"Bytes": b'data: {"choices": [{"text": "t"}]}\n\ndata: [DONE]\n\n'}}]}


@pytest.mark.parametrize(("url", "component"), [("sagemaker:chat/chat-ic", "chat-ic"), ("sagemaker:chat", None)])
def test_a_request_names_the_component_where_the_address_has_one(url: str, component: str | None) -> None:
    args = argparse.Namespace(url=url, region="us-east-1", endpoint_url=None, model=None, header=[], api_key=None)
    _, target = bench_target(args, None)
    assert target is not None and target.endpoint_name == "chat" and target.inference_component == component
    transport = SageMakerTransport(target, workers=1, timeout_s=5)
    fake = _Client()
    transport.client = fake
    try:
        transport.invoke(None, [1, 2], 1)
    finally:
        transport.close()
    [call] = fake.calls
    assert call["EndpointName"] == "chat"
    assert call.get("InferenceComponentName") == component


def test_a_bad_component_name_is_one_line() -> None:
    args = argparse.Namespace(url="sagemaker:chat/bad_ic!", region="us-east-1", endpoint_url=None)
    with pytest.raises(KvfleetError, match="'bad_ic!' is not a SageMaker endpoint or inference component name"):
        bench_target(args, None)
