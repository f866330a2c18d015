"""`kvfleet check`, the pipeline's live check: each AWS call made as the service model defines it (botocore's
Stubber validates every request's parameters against it), the Run Command script executed by bash against the
real agent (with the fake engine), and the SageMaker generation through a local stand-in for the runtime API."""

from __future__ import annotations

import datetime
import json
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from kvfleet.bench.live import check_deployment
from kvfleet.config.loader import load_environment
from kvfleet.deployments import ResolvedDeployment, resolve_environment
from kvfleet.targets.ec2 import read_probe
from tests.bench.test_bench import serving
from tests.bench.test_sagemaker import runtime
from tests.infra.helpers import REPO
from tests.infra.test_live_check import probe_output

NOW = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
DOC = "kvfleet-staging-chat-ProbeDocument-AbCdEf012345"  # CloudFormation names it
COMMAND_ID = "0f6e2b1c-3a4d-4e5f-8a9b-0c1d2e3f4a5b"  # SendCommand ids are UUIDs (36 characters)


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "t"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _deployment(name: str) -> ResolvedDeployment:
    [r] = resolve_environment(load_environment(REPO / "environments" / f"{name}.yaml"))
    return r


class Session:
    """A boto3 session whose clients are stubbed (or, for the SageMaker runtime, pointed at a local server)."""

    region_name = "us-east-1"

    def __init__(self, runtime_url: str | None = None) -> None:
        self.stubs: dict[str, Stubber] = {}
        self.clients: dict[str, Any] = {}
        self.runtime_url = runtime_url

    def stub(self, service: str) -> Stubber:
        client = boto3.client(service, region_name=self.region_name)  # type: ignore[call-overload]
        self.clients[service] = client
        self.stubs[service] = Stubber(client)
        self.stubs[service].activate()
        return self.stubs[service]

    def client(self, service: str, **kwargs: Any) -> Any:
        if service == "sagemaker-runtime":
            kwargs["endpoint_url"] = self.runtime_url
            return boto3.client(service, **kwargs)  # type: ignore[call-overload]
        return self.clients[service]


def _stack(session: Session, r: ResolvedDeployment, outputs: dict[str, str], status: str = "CREATE_COMPLETE") -> None:
    session.stub("cloudformation").add_response(
        "describe_stacks",
        {
            "Stacks": [
                {
                    "StackName": r.stack_name,
                    "CreationTime": NOW,
                    "StackStatus": status,
                    "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
                }
            ]
        },
        {"StackName": r.stack_name},
    )


def _ec2(session: Session, r: ResolvedDeployment, stdout: str, *, healthy: bool = True) -> None:
    outputs = {"LoadBalancerDns": "internal-x.elb.amazonaws.com", "AutoScalingGroupName": "asg-1", "ProbeDocument": DOC}
    _stack(session, r, outputs)
    instance = {
        "InstanceId": "i-0123456789abcdef0",
        "AvailabilityZone": "us-east-1a",
        "LifecycleState": "InService",
        "HealthStatus": "Healthy" if healthy else "Unhealthy",
        "ProtectedFromScaleIn": False,
    }
    session.stub("autoscaling").add_response(
        "describe_auto_scaling_groups",
        {
            "AutoScalingGroups": [
                {
                    "AutoScalingGroupName": "asg-1",
                    "MinSize": 1,
                    "MaxSize": 4,
                    "DesiredCapacity": 1,
                    "DefaultCooldown": 300,
                    "AvailabilityZones": ["us-east-1a"],
                    "HealthCheckType": "ELB",
                    "CreatedTime": NOW,
                    "Instances": [instance],
                }
            ]
        },
        {"AutoScalingGroupNames": ["asg-1"]},
    )
    if not healthy:
        return
    ssm = session.stub("ssm")
    ssm.add_response(
        "send_command",
        {"Command": {"CommandId": COMMAND_ID}},
        {
            "InstanceIds": ["i-0123456789abcdef0"],
            "DocumentName": DOC,  # the fleet stack's probe document: no parameters
            "Comment": f"kvfleet check {r.deployment_id}",
            "TimeoutSeconds": 300,
        },
    )
    # Right after SendCommand the invocation may not exist yet, then it runs, then it is done.
    ssm.add_client_error("get_command_invocation", "InvocationDoesNotExist")
    ssm.add_response("get_command_invocation", {"Status": "InProgress"})
    ssm.add_response(
        "get_command_invocation",
        {"Status": "Success", "StandardOutputContent": stdout},
        {"CommandId": COMMAND_ID, "InstanceId": "i-0123456789abcdef0"},
    )


def test_an_ec2_deployment_is_checked_on_an_instance_through_run_command() -> None:
    r = _deployment("staging")
    out = probe_output()
    # The fake engine's cache as the plan's: the drift gate passes.
    blocks_line = next(line for line in read_probe(out)[1].splitlines() if "kv_cache_blocks" in line)
    block_tokens = next(int(float(ln.split()[-1])) for ln in read_probe(out)[1].splitlines() if "block_tokens" in ln)
    planned_blocks = -(-r.candidate.capacity.kv_cache_tokens // block_tokens)
    out = out.replace(blocks_line, f"{blocks_line.split()[0]} {planned_blocks}")
    session = Session()
    _ec2(session, r, out)
    check = check_deployment(r, session=session, sleep=lambda s: None)
    assert check.passed, check.lines
    assert [line.split()[0] for line in check.lines] == ["ok"] * 3 + ["note"]  # no generation through Run Command
    for stub in session.stubs.values():
        stub.assert_no_pending_responses()


def test_an_engine_with_less_cache_than_planned_stops_the_promotion() -> None:
    r = _deployment("staging")
    out = probe_output()  # the fake engine's small cache, far below the plan's
    session = Session()
    _ec2(session, r, out)
    check = check_deployment(r, session=session, sleep=lambda s: None)
    assert not check.passed
    [fail] = [line for line in check.lines if line.startswith("FAIL")]
    assert "fewer than the plan's" in fail


def test_no_healthy_instance_fails_without_sending_a_command() -> None:
    r = _deployment("staging")
    session = Session()
    _ec2(session, r, "", healthy=False)
    check = check_deployment(r, session=session, sleep=lambda s: None)
    assert not check.passed
    assert "InService and Healthy" in check.lines[-1]


def test_a_sagemaker_deployment_streams_one_generation() -> None:
    r = _deployment("dev")
    seen: list[dict[str, Any]] = []
    with serving(runtime(seen)) as url:
        session = Session(runtime_url=url)
        _stack(session, r, {"EndpointName": "chat", "Dashboard": "d"})
        session.stub("sagemaker").add_response(
            "describe_endpoint",
            {
                "EndpointName": "chat",
                "EndpointArn": "arn:aws:sagemaker:us-east-1:222222222222:endpoint/chat",
                "EndpointConfigName": "cfg",
                "EndpointStatus": "InService",
                "CreationTime": NOW,
                "LastModifiedTime": NOW,
                "ProductionVariants": [{"VariantName": "main", "CurrentInstanceCount": 2}],
            },
            {"EndpointName": "chat"},
        )
        check = check_deployment(r, session=session)
    assert check.passed, check.lines
    assert check.lines[0] == "ok    endpoint chat is InService with 2 instance(s)"
    assert check.lines[1].startswith("ok    one generation streamed 8 tokens")
    assert seen[0]["body"]["max_tokens"] == 8


def test_an_endpoint_that_is_updating_or_a_stack_that_failed_is_a_fail_line() -> None:
    r = _deployment("dev")
    session = Session()
    _stack(session, r, {"EndpointName": "chat"}, status="UPDATE_ROLLBACK_FAILED")
    check = check_deployment(r, session=session)
    assert not check.passed and "UPDATE_ROLLBACK_FAILED" in check.lines[0]
    session = Session()
    _stack(session, r, {"EndpointName": "chat"})
    session.stub("sagemaker").add_response(
        "describe_endpoint",
        {
            "EndpointName": "chat",
            "EndpointArn": "arn:aws:sagemaker:us-east-1:222222222222:endpoint/chat",
            "EndpointConfigName": "cfg",
            "EndpointStatus": "Failed",
            "FailureReason": "the container did not pass its ping health check",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        },
    )
    check = check_deployment(r, session=session)
    assert check.lines == ["FAIL  endpoint chat is Failed: the container did not pass its ping health check"]


def test_a_stack_without_the_outputs_this_kvfleet_reads_says_to_redeploy() -> None:
    r = _deployment("staging")
    session = Session()
    _stack(session, r, {"LoadBalancerDns": "x"})
    check = check_deployment(r, session=session)
    assert check.lines == [
        f"FAIL  stack {r.stack_name} has no output AutoScalingGroupName; deploy it with this kvfleet"
    ]


def test_kvfleet_check_prints_each_deployment_and_exits_1_on_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfleet import cli
    from kvfleet.bench import live

    r = _deployment("staging")
    session = Session()
    _ec2(session, r, "", healthy=False)
    assumed: list[tuple[str | None, str]] = []

    def fake_session(role_arn: str | None, region: str) -> Session:
        assumed.append((role_arn, region))
        return session

    monkeypatch.setattr(live, "assumed_session", fake_session)
    role = "arn:aws:iam::333333333333:role/kvfleet-check/x"
    code = cli.main(["check", str(REPO / "environments" / "staging.yaml"), "--role-arn", role])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert assumed == [(role, "us-east-1")]
    assert out[0] == f"{r.deployment_id} (ec2, stack {r.stack_name}):"
    assert out[1].startswith("  FAIL  no instance of asg-1 is InService and Healthy")
    assert out[-1] == "0 of 1 deployment(s) passed; promotion stops"
    # The same checks for a machine: the verdict, and each deployment's lines.
    _ec2(session, r, "", healthy=False)
    code = cli.main(["check", str(REPO / "environments" / "staging.yaml"), "--role-arn", role, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and doc["passed"] is False
    [dep] = doc["deployments"]
    assert dep["deployment"] == r.deployment_id and dep["platform"] == "ec2" and dep["passed"] is False
    assert dep["checks"][0].startswith("FAIL  no instance of asg-1 is InService and Healthy")


def test_kvfleet_check_of_an_unknown_deployment_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet import cli

    code = cli.main(["check", str(REPO / "environments" / "staging.yaml"), "--deployment", "nope"])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "no deployment 'nope'" in line and "assistant" in line
