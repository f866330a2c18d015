"""A deployment's scaling as decided: the file's values, or where the file derives them the replay's choice
(``kvfleet.tuning``). ``kvfleet.deployments`` resolves it once; the stacks render its autoscaler, the plan prints
it and the fleet simulator replays it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.scaling.autoscalers import SCALE_OUT_COOLDOWN_S, Autoscaler, Hpa, OneFewer, TargetTracking
from kvfleet.scaling.kinds import AutoscalerKind
from kvfleet.scaling.signals import SignalTarget, signal_targets
from kvfleet.scaling.to_zero import ScaleToZero


def autoscaler(
    kind: AutoscalerKind,
    *,
    min_replicas: int,
    max_replicas: int,
    saturation_target: float,
    queue_target: float,
    scale_in_wait_s: float,
    scale_out_cooldown_s: float = SCALE_OUT_COOLDOWN_S,
) -> Autoscaler | None:
    """The autoscaler of ``kind`` on the two signals (None: a fixed fleet)."""
    if kind == AutoscalerKind.NONE:
        return None
    targets = signal_targets(saturation=saturation_target, queue=queue_target)
    if kind == AutoscalerKind.TARGET_TRACKING:
        return TargetTracking(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            targets=targets,
            scale_in_cooldown_s=scale_in_wait_s,
            scale_out_cooldown_s=scale_out_cooldown_s,
        )
    if kind == AutoscalerKind.EC2:
        return OneFewer(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            targets=targets,
            wait_s=scale_in_wait_s,
            scale_out_cooldown_s=scale_out_cooldown_s,
        )
    return Hpa(min_replicas=min_replicas, max_replicas=max_replicas, targets=targets, stabilization_s=scale_in_wait_s)


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    kind: AutoscalerKind  # the target's autoscaler (kvfleet.targets)
    min_replicas: int  # 0: scale to zero (EC2 only)
    max_replicas: int
    saturation_target: float  # contract.REPLICA_SATURATION per replica
    queue_depth_target: float  # contract.REQUESTS_WAITING per replica
    # Seconds of low load before a scale-in acts: the EC2 alarm and its cooldown, the HPA's stabilization window,
    # the cooldown between SageMaker's scale-ins (ScalingConfig.scale_in_wait_s).
    scale_in_wait_s: int
    drain_budget_s: int
    admission_queue: int | None = None  # requests per replica the agent lets wait; None: the plan's

    @property
    def scales(self) -> bool:
        """Whether anything scales: a range of replicas, not a fixed count."""
        return self.max_replicas > self.min_replicas

    @property
    def signal_targets(self) -> tuple[SignalTarget, ...]:
        return signal_targets(saturation=self.saturation_target, queue=self.queue_depth_target)

    @property
    def autoscaler(self) -> Autoscaler | None:
        """The target's autoscaler with these values."""
        return self.on(self.kind)

    def on(self, kind: AutoscalerKind) -> Autoscaler | None:
        """The autoscaler of ``kind`` with these values (the EKS manifests render the HPA of any deployment)."""
        return autoscaler(
            kind,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            saturation_target=self.saturation_target,
            queue_target=self.queue_depth_target,
            scale_in_wait_s=self.scale_in_wait_s,
        )

    def to_zero(self, idle_s: float) -> ScaleToZero | None:
        """With ``min_replicas`` 0, the rule that takes the fleet to zero after ``idle_s`` without a request."""
        return ScaleToZero(idle_s=idle_s) if self.min_replicas == 0 else None
