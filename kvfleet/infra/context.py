"""What a target's construct receives from the deployment stack, and what it gives back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from aws_cdk import aws_cloudwatch as cw
from constructs import Construct

from kvfleet.deployments import ResolvedDeployment
from kvfleet.infra.metrics import PlatformMetrics
from kvfleet.infra.network import ServingNetwork
from kvfleet.targets import TARGET_MODULES, part


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


@dataclass(frozen=True, kw_only=True)
class TargetSpec:
    """How the deployment stack builds a target: ``CONSTRUCT`` in the target's ``infra`` package."""

    construct_id: str  # the construct's id in the stack: logical ids derive from it, so it never changes
    build: Callable[[Construct, str, ServingContext], TargetConstruct]
    fleet_endpoints: bool = False  # instances of their own that need Session Manager and Auto Scaling endpoints


def target_spec(platform: str) -> TargetSpec:
    """The registered target's construct, its infra package imported on first use."""
    spec = part(platform, "infra").CONSTRUCT
    if not isinstance(spec, TargetSpec):
        raise TypeError(f"{TARGET_MODULES[platform]}.infra.CONSTRUCT is not a TargetSpec")
    return spec
