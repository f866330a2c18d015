"""Each autoscaler kvfleet deploys, written once: its parameters, the rule the fleet simulator executes
(``controller``) and what the stacks render (CloudWatch policies, alarms and metric math; a KEDA ScaledObject's
triggers and HPA behaviour). Pure Python (standard library and the contract's signals).

- ``kinds``: the autoscaler kinds (``AutoscalerKind``).
- ``policy``: a deployment's scaling as decided (``ScalingPolicy``, what ``kvfleet.deployments`` resolves and every
  stack, the plan and the simulator read) and the autoscaler it deploys (``autoscaler``).
- ``autoscalers``: target tracking, EC2's "one fewer" step rule, the HPA.
- ``to_zero``: EC2's scale to zero and its wake.
"""

from __future__ import annotations

from kvfleet.scaling.autoscalers import (
    Autoscaler,
    Controller,
    Decision,
    Hpa,
    HpaTrigger,
    Observation,
    OneFewer,
    TargetTracking,
)
from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.scaling.policy import ScalingPolicy, autoscaler
from kvfleet.scaling.signals import SignalTarget, signal_targets
from kvfleet.scaling.to_zero import WAKE_S, ScaleToZero

__all__ = [
    "WAKE_S",
    "Autoscaler",
    "AutoscalerKind",
    "Controller",
    "Decision",
    "Hpa",
    "HpaTrigger",
    "Observation",
    "OneFewer",
    "ScaleToZero",
    "ScalingPolicy",
    "SignalTarget",
    "TargetTracking",
    "autoscaler",
    "signal_targets",
]
