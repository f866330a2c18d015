"""EC2's scale to zero (``min_replicas`` 0): to zero after ``idle_s`` without a request, and back to one on the
first request refused at zero, ``wake_s`` later.

The agents' own signals cannot wake a group that has no instance, so both rules read the load balancer, which answers
503 itself when its target group has no registered target (Application Load Balancer User Guide, "Troubleshoot your
Application Load Balancers", HTTP 503) and counts those in HTTPCode_ELB_503_Count. Its metrics are reported only
while requests flow (same guide, "CloudWatch metrics for your Application Load Balancer"), so a minute without data
is a minute without requests: the idle alarm treats it as breaching, the wake alarm as not. The wake counts 503s only
while the group's desired capacity is 0, so a 503 in a rolling replacement never sets a larger fleet to one; the idle
rule counts the load balancer's own 5xx too, so the requests refused while a woken instance starts keep it from going
straight back to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.scaling.autoscalers import PERIOD_S

# From the first request refused at zero to the launch: the load balancer's 503 count closes its one-minute period,
# CloudWatch evaluates the alarm on it (within about a minute of the period's end) and the alarm runs the policy.
# A planning figure, not a measurement.
WAKE_S = 120.0


@dataclass(frozen=True, kw_only=True)
class ScaleToZero:
    """Two simple policies setting the group's exact capacity (0, then 1), each run by an alarm."""

    period_s: ClassVar[int] = PERIOD_S
    # The idle alarm: requests reaching the load balancer (served ``r`` and its own 5xx ``e``) under 1 a minute for
    # ``idle_periods`` minutes, missing data breaching.
    IDLE_EXPRESSION: ClassVar[str] = "FILL(r, 0) + FILL(e, 0)"
    IDLE_THRESHOLD: ClassVar[float] = 1.0
    IDLE_COMPARISON: ClassVar[str] = "LessThanThreshold"
    IDLE_MISSING_DATA: ClassVar[str] = "breaching"
    # The wake alarm: 503s (``e``) while the desired capacity (``d``) is 0, one or more in a minute, missing data not
    # breaching.
    WAKE_EXPRESSION: ClassVar[str] = "IF(d < 1, FILL(e, 0), 0)"
    WAKE_THRESHOLD: ClassVar[float] = 1.0
    WAKE_COMPARISON: ClassVar[str] = "GreaterThanOrEqualToThreshold"
    WAKE_MISSING_DATA: ClassVar[str] = "notBreaching"
    WAKE_PERIODS: ClassVar[int] = 1
    # Each policy's cooldown: one period. A simple policy's cooldown holds back every simple policy of the group
    # (EC2 Auto Scaling User Guide, "Scaling cooldowns for Amazon EC2 Auto Scaling": after the group launches or
    # terminates instances, no activity a simple policy starts begins before the cooldown ends), so the idle rule's
    # must not outlast the moment a request comes to wake the group; its alarm's periods are the idle wait.
    TO_ZERO_COOLDOWN_S: ClassVar[int] = PERIOD_S
    WAKE_COOLDOWN_S: ClassVar[int] = PERIOD_S
    idle_s: float
    wake_s: float = WAKE_S

    @property
    def idle_periods(self) -> int:
        return math.ceil(self.idle_s / self.period_s)

    def description(self) -> str:
        return f"scale to zero: no request for {math.ceil(self.idle_s) // 60} min"

    def idle(self, t_s: float, *, last_arrival_s: float, busy: bool) -> bool:
        """Time to go to zero: no request for ``idle_s`` and none still in flight."""
        return t_s - last_arrival_s >= self.idle_s and not busy

    def wakes(self, t_s: float, *, refused_s: float | None) -> bool:
        """Time to launch one: ``wake_s`` after the first request refused at zero."""
        return refused_s is not None and t_s - refused_s >= self.wake_s
