"""One stack per deployment: it composes the network, the target's construct and the monitoring.

The target's construct is its folder's ``CONSTRUCT`` (``kvfleet/targets/<name>/infra/__init__.py``, a
``TargetSpec``), found through the target registry: a new target needs nothing here.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import CfnOutput, Stack, Tags
from aws_cdk import aws_sns as sns
from constructs import Construct

from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.alerts import AlertsStack, notify
from kvfleet.infra.context import ServingContext, target_spec
from kvfleet.infra.monitoring import ServingMonitoring
from kvfleet.infra.network import ServingNetwork, zones_context


class DeploymentStack(Stack):
    def __init__(
        self, scope: Construct, id: str, *, resolved: ResolvedDeployment, alerts: AlertsStack | None = None
    ) -> None:
        r = resolved
        env_cfg = r.environment
        explicit = env_cfg.account is not None and env_cfg.region is not None
        super().__init__(
            scope,
            id,
            env=cdk.Environment(account=env_cfg.account, region=env_cfg.region) if env_cfg.region else None,
            # The name the id gives in the app, in a pipeline's Stage too (where it would be "<stage>-<id>"): a
            # pipeline then updates the stacks `cdk deploy` made instead of creating a second set beside them.
            stack_name=id,
            description=(
                f"kvfleet {r.deployment_id}: {r.model_id} on {r.candidate.label()} with {r.engine} "
                f"{r.deployment.engine.version}"
            ),
        )
        self._tag(r)
        spec = target_spec(r.deployment.target.platform)
        zones_context(self, env_cfg.network, env_cfg.region if explicit else None)
        self.network = ServingNetwork(
            self,
            "Network",
            config=env_cfg.network,
            region=env_cfg.region if explicit else None,
            fleet=spec.fleet_endpoints,
        )
        # The signal alarms come first: a SageMaker endpoint's update rolls back on them.
        self.monitoring = self._signal_alarms(r)
        context = ServingContext(
            resolved=r,
            network=self.network,
            region=env_cfg.region,
            rollback_alarms=tuple(self.monitoring.rollback_alarms),
        )
        self.target = spec.build(self, spec.construct_id, context)
        for name, value in self.target.outputs.items():
            CfnOutput(self, name, value=value)
        dashboard = self.monitoring.add_dashboard(self.target.platform_metrics)
        notify(self.monitoring.alarms, self._alarm_topic(r, alerts))
        CfnOutput(self, "Dashboard", value=dashboard.dashboard_name)

    def _tag(self, r: ResolvedDeployment) -> None:
        for key, value in (
            ("kvfleet:environment", r.environment.name),
            ("kvfleet:deployment", r.deployment.name),
            ("kvfleet:model", r.model_id),
        ):
            Tags.of(self).add(key, value)

    def _signal_alarms(self, r: ResolvedDeployment) -> ServingMonitoring:
        return ServingMonitoring(
            self,
            "Monitoring",
            deployment_id=r.deployment_id,
            scaling=r.scaling,
            signals_published=r.deployment.image.source != "dlc",
            max_num_seqs=r.engine_args.max_num_seqs,
            data_parallel_size=r.engine_args.data_parallel_size or 1,
            slots_bind=r.candidate.limited_by != "kv-cache",
        )

    def _alarm_topic(self, r: ResolvedDeployment, alerts: AlertsStack | None) -> sns.ITopic:
        """The file's existing topic, else the one the environment's alerts stack creates."""
        topic_arn = r.environment.notifications.topic_arn
        if topic_arn is not None:
            return sns.Topic.from_topic_arn(self, "AlarmTopic", topic_arn)
        assert alerts is not None, "the environment's alerts stack creates the topic"
        return alerts.topic
