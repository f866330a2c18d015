"""The stage accounts' CloudFormation execution policies (docs/bootstrap/, written by tools/bootstrap_policy.py):
current with every example environment's synthesized stage stacks and the account's kvfleet-images stack, covering
each resource type's handler permissions from its CloudFormation registry schema and what each intrinsic function
CloudFormation resolves with the stack's role needs (Fn::GetStackOutput: cloudformation:DescribeStacks on the alerts
stacks), naming every action (no global or service-wide wildcard), and each under IAM's managed policy size limit."""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import pytest

from tests.infra.helpers import REPO

spec = importlib.util.spec_from_file_location("bootstrap_policy", REPO / "tools" / "bootstrap_policy.py")
assert spec is not None and spec.loader is not None
tool = importlib.util.module_from_spec(spec)
sys.modules["bootstrap_policy"] = tool
spec.loader.exec_module(tool)

OUT = REPO / "docs" / "bootstrap"


def _documents() -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(OUT.glob("execution-policy-*.json"))]


def _by_type() -> dict[str, list[str]]:
    return json.loads((OUT / "resource-types.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def test_the_checked_in_policies_are_those_the_example_stacks_need() -> None:
    # Synthesizes every example environment with its live-check stack: a new resource type fails here until the
    # tool is run again.
    assert tool.main(["--check"]) == 0, "run .venv/bin/python tools/bootstrap_policy.py"


def test_every_resource_types_handler_permissions_are_allowed() -> None:
    by_type = _by_type()
    assert {"AWS::SageMaker::Endpoint", "AWS::EKS::Cluster", "AWS::AutoScaling::AutoScalingGroup"} <= set(by_type)
    # The account's kvfleet-images stack is deployed with the same role (the pipeline's Images wave, make image).
    assert "ecr:CreateRepository" in by_type["AWS::ECR::Repository"]
    assert by_type["AWS::SSM::Document"] == tool.schema_permissions("AWS::SSM::Document")
    assert "ssm:CreateDocument" in by_type["AWS::SSM::Document"]
    assert tool.uncovered(_documents(), by_type) == []


# The inference component's handlers (its registry schema): a stage with that shape is refused without them.
COMPONENT_ACTIONS = {
    "sagemaker:CreateInferenceComponent",
    "sagemaker:DescribeInferenceComponent",
    "sagemaker:UpdateInferenceComponent",
    "sagemaker:UpdateInferenceComponentRuntimeConfig",
    "sagemaker:DeleteInferenceComponent",
}


def test_the_inference_component_shapes_handler_permissions_are_allowed() -> None:
    by_type = _by_type()
    component = "AWS::SageMaker::InferenceComponent"
    assert set(by_type[component]) >= COMPONENT_ACTIONS
    assert by_type[component] == tool.schema_permissions(component)
    assert tool.uncovered(_documents(), {component: by_type[component]}) == []
    # Without UpdateInferenceComponentRuntimeConfig (a copy-count change) the check finds it missing.
    documents = _documents()
    for doc in documents:
        for statement in doc["Statement"]:
            statement["Action"] = [
                a for a in statement["Action"] if a != "sagemaker:UpdateInferenceComponentRuntimeConfig"
            ]
    assert tool.uncovered(documents, by_type) == [f"{component}: sagemaker:UpdateInferenceComponentRuntimeConfig"]


def _types_by_file() -> dict[str, list[dict[str, Any]]]:
    """Each synthesized environment file's resources (its type and properties), all stacks together."""
    out: dict[str, list[dict[str, Any]]] = {}
    for where, text in tool.example_templates():
        name = where.split(":")[0]
        out.setdefault(name, []).extend(json.loads(text).get("Resources", {}).values())
    return out


def test_the_shape_fixtures_synthesize_every_shape_kvfleet_deploys() -> None:
    assert [p.name for p in tool.environment_files() if p.parent == tool.SHAPES] == [
        "ec2-packed.yaml",
        "sagemaker-components.yaml",
        "sagemaker-to-zero.yaml",
    ]
    files = _types_by_file()

    def of(name: str, kind: str) -> list[dict[str, Any]]:
        return [r.get("Properties", {}) for r in files[name] if r["Type"] == kind]

    assert of("sagemaker-components.yaml", "AWS::SageMaker::InferenceComponent")
    # Scale to zero: the copies' scalable target reaches 0, and a step policy wakes one.
    [target] = of("sagemaker-to-zero.yaml", "AWS::ApplicationAutoScaling::ScalableTarget")
    assert target["MinCapacity"] == 0
    assert target["ScalableDimension"] == "sagemaker:inference-component:DesiredCopyCount"
    assert any(
        p["PolicyType"] == "StepScaling"
        for p in of("sagemaker-to-zero.yaml", "AWS::ApplicationAutoScaling::ScalingPolicy")
    )
    # Packed engines: one target group per engine slot.
    assert len(of("ec2-packed.yaml", "AWS::ElasticLoadBalancingV2::TargetGroup")) >= 2
    # Each fixture's resource types are covered like the examples'.
    kinds = {r["Type"] for name in files for r in files[name]} - tool.NOT_PROVISIONED
    assert kinds <= set(_by_type())


def test_a_missing_action_is_found() -> None:
    documents = _documents()
    for doc in documents:
        for statement in doc["Statement"]:
            statement["Action"] = [a for a in statement["Action"] if a != "iam:CreateRole"]
    assert "AWS::IAM::Role: iam:CreateRole" in tool.uncovered(documents, _by_type())


def test_no_action_is_a_global_or_service_wide_wildcard() -> None:
    for doc in _documents():
        for statement in doc["Statement"]:
            assert statement["Effect"] == "Allow" and "NotAction" not in statement
            for action in statement["Action"]:
                assert tool.IAM_ACTION.fullmatch(action), action  # 'ec2:Describe*' at most
                assert not action.endswith(":*"), action
    assert "iam:*" not in json.dumps(_documents()) and '"*:*"' not in json.dumps(_documents())


def test_each_policy_fits_an_iam_managed_policy() -> None:
    docs = _documents()
    assert 1 <= len(docs) <= 10  # IAM's default quota of managed policies attached to one role
    for doc in docs:
        assert len(json.dumps(doc, separators=(",", ":"))) <= tool.MAX_POLICY_CHARS


def test_a_type_with_no_schema_is_refused() -> None:
    with pytest.raises(SystemExit, match="AWS::Nope::Thing: no CloudFormation registry schema"):
        tool.schema_permissions("AWS::Nope::Thing")


def test_custom_resources_need_only_to_invoke_their_provider() -> None:
    assert tool.required_actions(["Custom::AWSCDK-EKS-HelmChart", "AWS::CDK::Metadata"]) == {
        "Custom::AWSCDK-EKS-HelmChart": ["lambda:InvokeFunction"]
    }


def _functions() -> dict[str, list[str]]:
    return json.loads((OUT / "intrinsic-functions.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _stack_arn(region: str, name: str) -> str:
    # As CloudFormation names a stack: its id, a UUID made at creation, last.
    return f"arn:aws:cloudformation:{region}:{tool.PIPELINE_ACCOUNT}:stack/{name}/0f1e2d3c-aaaa-bbbb-cccc-000000000000"


def test_every_intrinsic_function_of_every_example_template_is_covered() -> None:
    functions = _functions()
    read: list[str] = []
    for where, text in tool.example_templates():
        body = json.loads(text)
        for fn, arg in tool.template_functions(body, where):
            assert fn in tool.NO_CALL_FUNCTIONS or fn in functions, f"{where}: {fn}"
            if fn != "Fn::GetStackOutput":
                continue
            # The role that resolves it is the stack's execution role (no RoleArn): DescribeStacks on that stack.
            assert "RoleArn" not in arg, where
            arn = _stack_arn(arg["Region"], arg["StackName"])
            assert tool.uncovered(_documents(), {fn: functions[fn]}, {fn: arn}) == [], f"{where}: {arn}"
            read.append(arg["StackName"])
    # Every example's deployment stacks send their alarms to the alerts stack's topic by a weak reference.
    assert {n.removeprefix("kvfleet-").removesuffix("-alerts") for n in read} >= {"dev", "staging", "prod"}
    assert functions["Fn::GetStackOutput"] == ["cloudformation:DescribeStacks"]
    assert tool.uncovered(_documents(), {f: a for f, a in functions.items() if f != "Fn::GetStackOutput"}) == []


def test_describe_stacks_is_allowed_on_the_alerts_stacks_only() -> None:
    fn = {"Fn::GetStackOutput": ["cloudformation:DescribeStacks"]}
    alerts = {"Fn::GetStackOutput": _stack_arn("eu-west-1", "kvfleet-prod-alerts")}
    other = {"Fn::GetStackOutput": _stack_arn("eu-west-1", "kvfleet-prod-chat")}
    assert tool.uncovered(_documents(), fn, alerts) == []
    assert tool.uncovered(_documents(), fn, other) == ["Fn::GetStackOutput: cloudformation:DescribeStacks"]
    # Without the statement the deployment stacks could not be created: the check finds it missing.
    documents = _documents()
    for doc in documents:
        doc["Statement"] = [st for st in doc["Statement"] if "cloudformation:DescribeStacks" not in st["Action"]]
    assert tool.uncovered(documents, fn, alerts) == ["Fn::GetStackOutput: cloudformation:DescribeStacks"]


def test_a_function_or_reference_without_a_rule_stops_the_tool() -> None:
    with pytest.raises(SystemExit, match="Fn::Transform: no rule"):
        tool.function_actions(["Fn::Sub", "Fn::Transform"])
    secret = {
        "Resources": {"K": {"Type": "AWS::X::Y", "Properties": {"P": "{{resolve:secretsmanager:db:SecretString}}"}}}
    }
    with pytest.raises(SystemExit, match=r"t\.json: dynamic reference \{\{resolve:secretsmanager:"):
        list(tool.template_functions(secret, "t.json"))
    with pytest.raises(SystemExit, match="Transform"):
        list(tool.template_functions({"Transform": "AWS::Serverless-2016-10-31", "Resources": {}}, "t.json"))
    elsewhere = {"Outputs": {"O": {"Value": {"Fn::GetStackOutput": {"StackName": "shared-vpc", "OutputName": "Id"}}}}}
    with pytest.raises(SystemExit, match="alerts"):
        tool.referenced_stacks(elsewhere, "t.json")
    assert tool.function_actions(["Ref", "Fn::GetAZs"]) == {"Fn::GetAZs": list(tool.FUNCTION_ACTIONS["Fn::GetAZs"])}
