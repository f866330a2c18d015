"""`kvfleet bench --env FILE --deployment NAME` finds the endpoint in the deployment's stack outputs
(CloudFormation DescribeStacks, answered here by botocore's Stubber: the request is checked against the API model)."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kvfleet.bench import aws
from kvfleet.bench.client import BenchError
from kvfleet.targets import TARGETS
from tests.bench.test_bench import one_line


def stubbed(monkeypatch: pytest.MonkeyPatch, response: dict[str, Any] | None, error: str | None = None) -> Stubber:
    client = boto3.client("cloudformation", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    stub = Stubber(client)
    if error is None:
        stub.add_response("describe_stacks", response, {"StackName": "kvfleet-prod-chat-70b"})
    else:
        stub.add_client_error("describe_stacks", service_error_code="ValidationError", service_message=error)
    stub.activate()
    real = aws.stack_outputs
    monkeypatch.setattr(aws, "stack_outputs", lambda name, region: real(name, region, client=client))
    return stub


def stack(status: str, outputs: dict[str, str]) -> dict[str, Any]:
    return {
        "Stacks": [
            {
                "StackName": "kvfleet-prod-chat-70b",
                "CreationTime": "2026-12-01T00:00:00Z",
                "StackStatus": status,
                "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
            }
        ]
    }


def test_the_sagemaker_endpoint_comes_from_the_stack(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """prod's chat-70b is a SageMaker endpoint: bench reads its name from the stack and calls the runtime API in the
    file's region (here the runtime is unreachable, which is the one line that follows)."""
    key = TARGETS["sagemaker"].address_output
    assert key is not None
    stub = stubbed(monkeypatch, stack("UPDATE_COMPLETE", {key: "kvfleet-prod-chat-70b-ep", "Dashboard": "d"}))
    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}.items():
        monkeypatch.setenv(k, v)
    code, _, err = one_line(
        capsys, "--env", "prod", "--deployment", "chat-70b", "--endpoint-url", "http://127.0.0.1:9", "--requests", "1"
    )
    stub.assert_no_pending_responses()
    assert code == 2
    [line] = err.strip().splitlines()
    assert "cannot reach SageMaker" in line or "SageMaker refused 'kvfleet-prod-chat-70b-ep'" in line, line


def test_a_stack_not_deployed_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    stubbed(monkeypatch, None, error="Stack with id kvfleet-prod-chat-70b does not exist")
    code, _, err = one_line(capsys, "--env", "prod", "--deployment", "chat-70b")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "stack kvfleet-prod-chat-70b is not deployed in us-east-1; deploy it (cdk deploy" in line


def test_a_stack_in_progress_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    client = boto3.client("cloudformation", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    with Stubber(client) as stub:
        stub.add_response("describe_stacks", stack("CREATE_IN_PROGRESS", {}), {"StackName": "s"})
        with pytest.raises(BenchError, match="stack s is CREATE_IN_PROGRESS; wait until it is deployed"):
            aws.stack_outputs("s", "us-east-1", client=client)


def test_eks_has_no_address_outside_the_cluster(capsys: Any) -> None:
    code, _, err = one_line(capsys, "--env", "platform")
    assert code == 2
    assert "ClusterIP Service" in err and "kubectl port-forward" in err


def test_the_stacks_publish_the_outputs_bench_reads() -> None:
    """The construct's output key is the registry's: what synth writes is what bench looks for."""
    from tests.infra.helpers import SAGEMAKER_ENV, only

    t = only(SAGEMAKER_ENV)
    key = TARGETS["sagemaker"].address_output
    assert key in t.to_json()["Outputs"]
