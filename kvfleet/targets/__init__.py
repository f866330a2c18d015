"""Deployment targets: one folder per target, and the registry every layer reads target names from.

A target is a package here (or anywhere importable) whose ``__init__`` exposes ``TARGET``, a ``Target`` record: its
hosting shape, autoscaler and stack outputs. ``TARGET_MODULES`` names each package, one line per target; a package
is imported the first time its target is asked for. Beside ``__init__``, the package holds one module per layer
that needs the target, each found by its name (``part``):

- ``config``: ``SECTION``, the environment file's ``target:`` section (a ``kvfleet.config.targets.TargetSection``
  whose ``platform`` literal is the target's name), with the checks that need the rest of the file;
- ``infra``: ``CONSTRUCT``, the CDK construct that deploys it (a ``kvfleet.infra.context.TargetSpec``);
- ``live``: ``run``, what `kvfleet check` asks the deployed target (``kvfleet.bench.live``);
- ``pipeline``: ``grant_live_check``, what the release pipeline's live-check role may ask it.

Standard library, the pure sizing core and the autoscaler kinds only, so the ``kvfleet`` command reads the
registry without loading the config schema or CDK: ``__init__`` never imports its other modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType

from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.sizing.hosting import Hosting

# Target name -> the package that holds it.
TARGET_MODULES: dict[str, str] = {
    "sagemaker": "kvfleet.targets.sagemaker",
    "ec2": "kvfleet.targets.ec2",
    "eks": "kvfleet.targets.eks",
}

# The modules a target's package holds besides its __init__, each for the layer named after it.
PARTS = ("config", "infra", "live", "pipeline")


# What the agent needs after its drain budget to end each remaining stream with an error event and close it
# (kvfleet.agent.server.ABORT_GRACE_S; a test holds them equal): a platform's kill must come no sooner.
STREAM_CLOSE_S = 5


@dataclass(frozen=True, kw_only=True)
class ScaleInDrain:
    """A platform that kills a replica its autoscaler removes a fixed time after asking it to stop, whatever the
    deployment's drain budget: the generations still running then are cut. The rule and where it is written."""

    kill_after_s: int  # from the stop signal (SIGTERM) to the kill (SIGKILL)
    rule: str
    source: str

    def drain_s(self, budget_s: int) -> int:
        """The drain a removed replica gets: the budget, or less where the kill comes first (ending the remaining
        streams with an error event before it, not with a cut connection)."""
        return max(0, min(budget_s, self.kill_after_s - STREAM_CLOSE_S))


@dataclass(frozen=True, kw_only=True)
class TypeChangeRule:
    """A platform that fails an update changing the instance type of a deployment registered for autoscaling: the
    change takes two deploys, ``procedure`` (one line), and kvfleet refuses it in one (`kvfleet diff`)."""

    procedure: str
    source: str


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    summary: str
    hosting: Hosting
    # The autoscaler the target's stacks render and the fleet simulator runs (kvfleet.scaling): Application Auto
    # Scaling target tracking (SageMaker), EC2 Auto Scaling policies (EC2), KEDA's HPA (EKS).
    autoscaler: AutoscalerKind
    # The stack output that says where clients reach the deployment (the construct's ``outputs`` key; `kvfleet
    # bench --env` reads it back from CloudFormation): SageMaker's endpoint name, the EC2 load balancer's DNS name.
    # None: no address outside the cluster (EKS's Service is ClusterIP).
    address_output: str | None = None
    # The stack output naming the group of machines that serves it (`kvfleet check` reads their health from it):
    # the EC2 Auto Scaling group, the EKS node group. None: the endpoint's own status says it (SageMaker).
    group_output: str | None = None
    # Why the target cannot scale to zero (scaling.min_replicas 0); None where it can.
    no_scale_to_zero: str | None = None
    # Whether the target can keep a warm pool of pre-initialized instances (EC2 Auto Scaling's), which the standby
    # comparison then replays.
    warm_pools: bool = False
    # How the platform ends a replica its autoscaler removes, where it kills it before the drain budget runs out
    # (the simulator cuts what is still running then); None: the target's own drain waits the budget out.
    scale_in_drain: ScaleInDrain | None = None
    # Where an instance-type change of a scaling deployment takes two deploys; None: one update does it.
    type_change: TypeChangeRule | None = None


def unknown_target(name: str) -> str:
    """The one-line refusal of a name the registry does not hold."""
    return f"unknown target {name!r}; known: {', '.join(TARGET_MODULES)}"


def part(name: str, role: str) -> ModuleType:
    """The module of target ``name`` for one layer (one of ``PARTS``), imported on first use."""
    if role not in PARTS:
        raise ValueError(f"a target has no {role!r} part; its parts are {', '.join(PARTS)}")
    if name not in TARGET_MODULES:
        raise ValueError(unknown_target(name))
    return importlib.import_module(f"{TARGET_MODULES[name]}.{role}")


class _Registry(Mapping[str, Target]):
    """``TARGET_MODULES`` as records, each package imported on first use."""

    def __getitem__(self, name: str) -> Target:
        module = importlib.import_module(TARGET_MODULES[name])
        found: Target = module.TARGET
        if found.name != name:
            raise ValueError(f"{TARGET_MODULES[name]}.TARGET is named {found.name!r}, registered as {name!r}")
        return found

    def __contains__(self, name: object) -> bool:
        return name in TARGET_MODULES

    def __iter__(self) -> Iterator[str]:
        return iter(TARGET_MODULES)

    def __len__(self) -> int:
        return len(TARGET_MODULES)


TARGETS: Mapping[str, Target] = _Registry()


def target(name: str) -> Target:
    if name not in TARGET_MODULES:
        raise ValueError(unknown_target(name))
    return TARGETS[name]


def type_change_rules() -> dict[str, str]:
    """Each target whose instance-type change of a scaling deployment takes two deploys -> those deploys."""
    return {name: t.type_change.procedure for name, t in TARGETS.items() if t.type_change is not None}


__all__ = [
    "PARTS",
    "STREAM_CLOSE_S",
    "TARGETS",
    "TARGET_MODULES",
    "ScaleInDrain",
    "Target",
    "TypeChangeRule",
    "part",
    "target",
    "type_change_rules",
    "unknown_target",
]
