"""Where alarms go: one SNS topic per environment (or the config's own), every deployment's alarms notify it.

CloudWatch cannot publish to a topic encrypted with the AWS managed key ``alias/aws/sns``: that key's policy
cannot be changed to let the CloudWatch service principal use it (CloudWatch User Guide, "Using Amazon
CloudWatch alarms": encrypted SNS topics need a customer managed key that grants cloudwatch.amazonaws.com
kms:Decrypt and kms:GenerateDataKey*). So the topic gets its own key, with that grant.
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
        self.key.grant(iam.ServicePrincipal(CLOUDWATCH), "kms:Decrypt", "kms:GenerateDataKey*")
        self.topic = sns.Topic(self, "Alarms", master_key=self.key, enforce_ssl=True)
        for address in environment.notifications.emails:
            self.topic.add_subscription(subscriptions.EmailSubscription(address))
        cdk.CfnOutput(self, "TopicArn", value=self.topic.topic_arn)


def notify(alarms: list[cw.Alarm], topic: sns.ITopic) -> None:
    """Every alarm tells the topic when it fires and when it clears."""
    action = cw_actions.SnsAction(topic)
    for alarm in alarms:
        alarm.add_alarm_action(action)
        alarm.add_ok_action(action)
