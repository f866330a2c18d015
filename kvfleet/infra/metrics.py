"""The metric factory: CloudWatch metrics for the contract's signals, and what a target reports about itself."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw

from kvfleet import contract

PERIOD = Duration.minutes(1)


@dataclass(frozen=True, kw_only=True)
class PlatformMetrics:
    """What the deployment target reports about itself (not the agent)."""

    errors_4xx: cw.IMetric | None = None
    errors_5xx: cw.IMetric | None = None
    instances: cw.IMetric | None = None  # default: counted from the replicas' data points


def signal_metric(
    deployment_id: str, s: contract.Signal, *, statistic: str | None = None, label: str | None = None
) -> cw.Metric:
    return cw.Metric(
        namespace=contract.NAMESPACE,
        metric_name=s.name,
        dimensions_map={contract.DEPLOYMENT_DIMENSION: deployment_id},
        statistic=statistic or s.statistic,
        period=PERIOD,
        label=label,
    )
