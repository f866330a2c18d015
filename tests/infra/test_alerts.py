"""Alarm notifications: one encrypted topic per environment that CloudWatch can publish to, on every alarm."""

from __future__ import annotations

import pytest

from kvfleet.errors import ConfigError
from kvfleet.infra.alerts import CLOUDWATCH
from tests.envs import SAGEMAKER_ENV, environment
from tests.infra.helpers import props, synth_all

TOPIC = "arn:aws:sns:us-east-1:123456789012:platform-alerts"


def with_notifications(block: str) -> str:
    return SAGEMAKER_ENV + f"notifications:\n{block}"


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
