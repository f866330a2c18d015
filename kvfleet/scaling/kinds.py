"""Which rule scales a fleet: the one spelling of each autoscaler kind.

``kvfleet.targets`` names each target's kind, the fleet simulator runs it and the stacks render it, all from here.
"""

from __future__ import annotations

from enum import StrEnum


class AutoscalerKind(StrEnum):
    # Application Auto Scaling target tracking (SageMaker variants): scale out and in on each signal's target.
    TARGET_TRACKING = "target_tracking"
    # What kvfleet deploys on EC2 Auto Scaling: target tracking scales out only, the step "one fewer" rule in.
    EC2 = "ec2"
    # Kubernetes' Horizontal Pod Autoscaler, through a KEDA ScaledObject (EKS).
    HPA = "hpa"
    # A fixed fleet (a benchmark shape, one engine): nothing scales.
    NONE = "none"
