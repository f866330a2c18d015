"""What a target's construct receives from the deployment stack, and what it gives back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from aws_cdk import aws_cloudwatch as cw

from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.metrics import PlatformMetrics
from kvfleet.infra.network import ServingNetwork


@dataclass(frozen=True, kw_only=True)
class ServingContext:
    """What every target's construct is built from."""

    resolved: ResolvedDeployment
    network: ServingNetwork
    region: str | None  # the stack's region when the file names one, else None (environment-agnostic)
    rollback_alarms: tuple[cw.IAlarm, ...]  # alarms an update may roll back on


class TargetConstruct(Protocol):
    @property
    def platform_metrics(self) -> PlatformMetrics:
        """What the target reports about itself, for the dashboard."""

    @property
    def outputs(self) -> Mapping[str, str]:
        """Stack output name -> value."""
