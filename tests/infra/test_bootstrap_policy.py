"""The stage accounts' CloudFormation execution policies (docs/bootstrap/, written by tools/bootstrap_policy.py):
current with every example environment's synthesized stage stacks, covering each resource type's handler
permissions from its CloudFormation registry schema, naming every action (no global or service-wide wildcard),
and each under IAM's managed policy size limit."""

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
    assert by_type["AWS::SSM::Document"] == tool.schema_permissions("AWS::SSM::Document")
    assert "ssm:CreateDocument" in by_type["AWS::SSM::Document"]
    assert tool.uncovered(_documents(), by_type) == []


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
