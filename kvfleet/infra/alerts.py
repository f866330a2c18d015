"""Where alarms go: one SNS topic per environment (or the config's own), every deployment's alarms notify it.

CloudWatch cannot publish to a topic encrypted with the AWS managed key ``alias/aws/sns``: that key's policy
cannot be changed to let the CloudWatch service principal use it (CloudWatch User Guide, "Using Amazon
CloudWatch alarms": encrypted SNS topics need a customer managed key that grants cloudwatch.amazonaws.com
kms:Decrypt and kms:GenerateDataKey*; SNS Developer Guide, "Managing Amazon SNS encryption keys", "Enable
compatibility between event sources from AWS services and encrypted topics"). So the topic gets its own key, with
that grant.

A grant to a service principal is a grant to that service acting for anyone, unless it says for whom (IAM User
Guide, "The confused deputy problem", cross-service confused deputy prevention: use the aws:SourceArn and
aws:SourceAccount global condition keys in resource policies, with the same account in both). Every grant here
to a service principal (``SERVICE_GRANTS``) carries both: this account, and CloudWatch alarms of this account
and region (CloudWatch names the alarm as the source, arn:aws:cloudwatch:<region>:<account>:alarm:<name>: AWS
re:Post Knowledge Center, "Why didn't I receive an SNS notification for my CloudWatch alarm trigger?", the
aws:SourceArn condition on sns:Publish; "How do I configure a CloudWatch alarm with an encrypted SNS topic?",
the key policy's optional Condition). The topic's own policy allows CloudWatch alarms the same way, since a
topic policy replaces SNS's default one (which allowed the account's own principals).
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from kvfleet.config.schema import Environment

CLOUDWATCH = "cloudwatch.amazonaws.com"
# The service principals granted the topic or its key, with what each may do: every such statement is conditioned
# on aws:SourceAccount and aws:SourceArn (tests/infra/test_alerts.py holds the template to it).
KEY_ACTIONS = ("kms:Decrypt", "kms:GenerateDataKey*")
SERVICE_GRANTS: dict[str, tuple[str, ...]] = {CLOUDWATCH: KEY_ACTIONS}


def alerts_stack_name(environment: str) -> str:
    return f"kvfleet-{environment}-alerts"


class AlertsStack(Stack):
    """The environment's alarm topic: encrypted with a key CloudWatch may use, TLS-only, email subscriptions."""

    def __init__(self, scope: Construct, id: str, *, environment: Environment) -> None:
        explicit = environment.region is not None
        super().__init__(
            scope,
            id,
            env=cdk.Environment(account=environment.account, region=environment.region) if explicit else None,
            # The name the id gives in the app, in a pipeline's Stage too (where it would be "<stage>-<id>"): a
            # pipeline then updates the stacks `cdk deploy` made instead of creating a second set beside them.
            stack_name=id,
            description=f"kvfleet {environment.name}: the topic every deployment's alarms notify",
        )
        cdk.Tags.of(self).add("kvfleet:environment", environment.name)
        self.key = kms.Key(
            self, "TopicKey", enable_key_rotation=True, description=f"kvfleet {environment.name} alarm topic"
        )
        conditions = self._from_own_alarms()
        for service, actions in SERVICE_GRANTS.items():
            self.key.add_to_resource_policy(
                iam.PolicyStatement(
                    principals=[iam.ServicePrincipal(service)],
                    actions=list(actions),
                    resources=["*"],  # in a key policy, "*" is this key
                    conditions=conditions,
                )
            )
        self.topic = sns.Topic(self, "Alarms", master_key=self.key, enforce_ssl=True)
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                principals=[iam.ServicePrincipal(CLOUDWATCH)],
                actions=["sns:Publish"],
                resources=[self.topic.topic_arn],
                conditions=conditions,
            )
        )
        self._subscribe(environment)
        cdk.CfnOutput(self, "TopicArn", value=self.topic.topic_arn)

    def _from_own_alarms(self) -> dict[str, dict[str, str]]:
        """A service principal acts here only for this account's CloudWatch alarms in this region."""
        alarms = self.format_arn(
            service="cloudwatch", resource="alarm", resource_name="*", arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME
        )
        return {"StringEquals": {"aws:SourceAccount": self.account}, "ArnLike": {"aws:SourceArn": alarms}}

    def _subscribe(self, environment: Environment) -> None:
        """The file's addresses. SNS mails each a confirmation link when the subscription is created, and an
        address hears nothing until it is followed: `kvfleet plan` says so, and so does the output `cdk deploy`
        prints (a synth-time annotation would break the CLI's quiet synth)."""
        emails = environment.notifications.emails
        for address in emails:
            self.topic.add_subscription(subscriptions.EmailSubscription(address))
        if emails:
            cdk.CfnOutput(
                self,
                "AlarmEmails",
                value=", ".join(emails),
                description="Subscribed to the alarm topic; each must follow the confirmation link SNS mails it "
                "before it receives any alarm",
            )


def notify(alarms: list[cw.Alarm], topic: sns.ITopic) -> None:
    """Every alarm tells the topic when it fires and when it clears."""
    action = cw_actions.SnsAction(topic)
    for alarm in alarms:
        alarm.add_alarm_action(action)
        alarm.add_ok_action(action)
