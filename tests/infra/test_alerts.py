"""Alarm notifications: one encrypted topic per environment that CloudWatch can publish to, on every alarm."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.config.choices import UndecidedError, undecided
from kvfleet.config.loader import parse_located
from kvfleet.errors import ConfigError
from kvfleet.infra.alerts import CLOUDWATCH, KEY_ACTIONS, SERVICE_GRANTS
from kvfleet.infra.app import build_app
from tests.envs import SAGEMAKER_ENV, environment
from tests.infra.helpers import make_app, props, synth_all

TOPIC = "arn:aws:sns:us-east-1:123456789012:platform-alerts"


def with_notifications(block: str) -> str:
    """The base environment with its notifications section replaced by ``block`` (lines indented two spaces)."""
    assert "notifications: none\n" in SAGEMAKER_ENV
    return SAGEMAKER_ENV.replace("notifications: none\n", f"notifications:\n{block}")


def test_every_alarm_notifies_the_environments_topic() -> None:
    stacks = synth_all(with_notifications("  emails: [oncall@example.com]\n"))
    assert sorted(stacks) == ["kvfleet-test-alerts", "kvfleet-test-chat"]
    alerts, chat = stacks["kvfleet-test-alerts"], stacks["kvfleet-test-chat"]
    [topic_id] = alerts.find_resources("AWS::SNS::Topic")
    [sub] = props(alerts, "AWS::SNS::Subscription")
    assert (sub["Protocol"], sub["Endpoint"]) == ("email", "oncall@example.com")
    alarms = props(chat, "AWS::CloudWatch::Alarm")
    assert len(alarms) >= 5
    for alarm in alarms:
        [action] = alarm["AlarmActions"]
        assert alarm["OKActions"] == [action]
        # The alerts stack's topic, by cross-stack reference (an export, or the newer weak stack-output read).
        ref = action.get("Fn::ImportValue") or action.get("Fn::GetStackOutput")
        assert ref is not None, action
        assert topic_id in str(ref) or ref.get("StackName") == "kvfleet-test-alerts"


def test_the_topic_key_lets_cloudwatch_publish() -> None:
    # The AWS managed key alias/aws/sns cannot grant the CloudWatch service principal, so alarms could not publish.
    alerts = synth_all()["kvfleet-test-alerts"]
    [topic] = props(alerts, "AWS::SNS::Topic")
    assert "KmsMasterKeyId" in topic and "alias/aws/sns" not in str(topic["KmsMasterKeyId"])
    [key] = props(alerts, "AWS::KMS::Key")
    assert key["EnableKeyRotation"] is True
    grants = [
        s
        for s in key["KeyPolicy"]["Statement"]
        if s.get("Principal", {}).get("Service") == CLOUDWATCH and s["Effect"] == "Allow"
    ]
    actions = {a for s in grants for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert {"kms:Decrypt", "kms:GenerateDataKey*"} <= actions
    [policy] = props(alerts, "AWS::SNS::TopicPolicy")
    denies = [s for s in policy["PolicyDocument"]["Statement"] if s["Effect"] == "Deny"]
    assert any(s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} for s in denies)


def test_an_existing_topic_is_notified_directly() -> None:
    stacks = synth_all(with_notifications(f"  topic_arn: {TOPIC}\n"))
    assert sorted(stacks) == ["kvfleet-test-chat"]
    for alarm in props(stacks["kvfleet-test-chat"], "AWS::CloudWatch::Alarm"):
        assert alarm["AlarmActions"] == [TOPIC]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (f"  topic_arn: {TOPIC}\n  emails: [a@example.com]\n", "notifications.emails: kvfleet subscribes addresses"),
        ("  emails: [not-an-address]\n", "not an email address: not-an-address"),
        ("  topic_arn: arn:aws:sqs:us-east-1:123456789012:q\n", "notifications.topic_arn: expected an SNS topic ARN"),
    ],
)
def test_bad_notification_settings_point_at_their_line(block: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        environment(with_notifications(block))
    [line] = info.value.lines
    text = with_notifications(block)
    named = message.startswith("notifications.")
    field = message.split(":", maxsplit=1)[0].rsplit(".", maxsplit=1)[-1] if named else "emails"
    lineno = next(n for n, row in enumerate(text.splitlines(), 1) if row.strip().startswith(f"{field}:"))
    assert message in line and line.startswith(f"test.yaml:{lineno}: notifications.")


def test_cdk_nag_and_the_alerts_stack() -> None:
    stacks = synth_all(nag=True)  # raises on an unacknowledged finding
    assert "kvfleet-test-alerts" in stacks


def _service_statements(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in document["Statement"] if "Service" in s.get("Principal", {}) and s["Effect"] == "Allow"]


def test_every_service_grant_names_this_accounts_alarms() -> None:
    # IAM User Guide, cross-service confused deputy prevention: a service principal's grant says for whom, by
    # aws:SourceAccount and aws:SourceArn; without them any account's alarm could use this key and topic.
    alerts = synth_all(with_notifications("  emails: [oncall@example.com]\n"))["kvfleet-test-alerts"]
    [key] = props(alerts, "AWS::KMS::Key")
    [policy] = props(alerts, "AWS::SNS::TopicPolicy")
    statements = _service_statements(key["KeyPolicy"]) + _service_statements(policy["PolicyDocument"])
    assert {s["Principal"]["Service"] for s in statements} == set(SERVICE_GRANTS) == {CLOUDWATCH}
    publish = [s for s in statements if s["Action"] == "sns:Publish"]
    assert len(publish) == 1 and len(statements) == 2
    for s in statements:
        condition = s["Condition"]
        assert condition["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}, s
        arn = json.dumps(condition["ArnLike"]["aws:SourceArn"])
        for part in ("arn:aws:cloudwatch:us-east-1:", "AWS::AccountId", ":alarm:*"):
            assert part in arn, (part, arn)


def test_the_key_grant_keeps_what_cloudwatch_needs() -> None:
    alerts = synth_all()["kvfleet-test-alerts"]
    [key] = props(alerts, "AWS::KMS::Key")
    [grant] = [s for s in _service_statements(key["KeyPolicy"]) if s["Principal"]["Service"] == CLOUDWATCH]
    assert sorted(grant["Action"]) == sorted(KEY_ACTIONS) and grant["Resource"] == "*"


def test_the_stack_says_addresses_must_confirm() -> None:
    # SNS mails each address a confirmation link; `cdk deploy` prints this output when it has created them.
    alerts = synth_all(with_notifications("  emails: [a@example.com, b@example.com]\n"))["kvfleet-test-alerts"]
    [output] = alerts.find_outputs("AlarmEmails").values()
    assert output["Value"] == "a@example.com, b@example.com" and "confirmation link" in output["Description"]
    quiet = synth_all()["kvfleet-test-alerts"]  # notifications: none
    assert quiet.find_outputs("AlarmEmails") == {} and props(quiet, "AWS::SNS::Subscription") == []


UNDECIDED = SAGEMAKER_ENV.replace("notifications: none\n", "").replace("    serving:\n      tenancy: single\n", "")


def test_synth_refuses_a_file_that_leaves_the_choices_open() -> None:
    loaded = parse_located(UNDECIDED, source="test.yaml")
    with pytest.raises(UndecidedError) as info:
        build_app(loaded.environment, app=make_app(), nag=False)
    lines = loaded.problem(info.value).lines
    assert len(lines) == 2
    assert lines[0].startswith("test.yaml:1: notifications: nobody is told when an alarm fires")
    assert "notifications: {emails: [" in lines[0] and "{topic_arn: " in lines[0] and "or none" in lines[0]
    assert lines[1].startswith("test.yaml:4: deployments[0].serving.tenancy: prefix caching is on")
    assert "serving.tenancy: single" in lines[1] and "serving.tenant_header and serving.tenant_secret" in lines[1]


@pytest.mark.parametrize(
    "choice",
    [
        "    serving:\n      tenant_header: X-Tenant\n      tenant_secret: kvfleet/tenant-salt\n",
        "    serving:\n      tenancy: isolated\n      tenant_header: X-Tenant\n      tenant_secret: kvfleet/t\n",
        '    engine:\n      name: vllm\n      version: "0.30.0"\n      enable_prefix_caching: false\n',
    ],
)
def test_tenants_or_no_prefix_cache_is_a_choice_too(choice: str) -> None:
    text = "notifications: none\n" + UNDECIDED + choice
    if "engine:" in choice:
        text = "notifications: none\n" + UNDECIDED.replace(
            '    engine:\n      name: vllm\n      version: "0.30.0"\n', choice
        )
    assert "kvfleet-test-chat" in synth_all(text)


def test_an_aws_container_is_told_it_cannot_isolate_tenants() -> None:
    dlc = (
        UNDECIDED.replace("      max_replicas: 4\n", "      max_replicas: 1\n").replace(
            "hf_token_secret: kvfleet/hf-token", "s3_uri: s3://models-bucket/llama"
        )
        + "    image:\n      source: dlc\n"
    )
    env = environment("notifications: none\n" + dlc)
    [problem] = undecided(env, [True])
    assert problem.field == "deployments[0].serving.tenancy"
    assert "tenant_header" not in problem.message and "image.source dlc has no agent" in problem.message
    assert undecided(env, [False]) == ()
