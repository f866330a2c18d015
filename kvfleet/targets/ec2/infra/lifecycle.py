"""The lifecycle transitions an Auto Scaling group with a warm pool pauses an instance in, as EC2 Auto Scaling
documents them, and which kvfleet process completes each one's hook.

Data, not code: tests run the user data's lifecycle step for every transition it owns and check that the agent
is told the hook of the one it owns, so a transition without a completer fails a test instead of timing out in
production.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# "Use lifecycle hooks with a warm pool": with an EC2_INSTANCE_LAUNCHING hook a new instance pauses at
# Warmed:Pending:Wait going into the pool and again at Pending:Wait when it leaves it; one launched straight into
# the group pauses at Pending:Wait only; a terminating one at Terminating:Wait (Warmed:Pending:Wait only with an
# instance reuse policy, which kvfleet does not set). cloud-init runs user data on the first boot only.
WARM_POOL_LIFECYCLE = "https://docs.aws.amazon.com/autoscaling/ec2/userguide/warm-pool-instance-lifecycle.html"
# "Retrieve the target lifecycle state through instance metadata": autoscaling/target-lifecycle-state reads
# InService, Warmed:Stopped, Warmed:Running, Warmed:Hibernated or Terminated (among others) during the wait.
TARGET_STATE_IMDS = (
    "https://docs.aws.amazon.com/autoscaling/ec2/userguide/retrieving-target-lifecycle-state-through-imds.html"
)

LAUNCHING = "autoscaling:EC2_INSTANCE_LAUNCHING"
TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
WARMED = ("Warmed:Stopped", "Warmed:Running", "Warmed:Hibernated")  # one per pool state


class Completer(StrEnum):
    LIFECYCLE_STEP = "user data lifecycle step"  # kvfleet-lifecycle.service, at every boot
    AGENT = "serving agent"  # drains, then completes the drain hook


@dataclass(frozen=True, kw_only=True)
class Transition:
    name: str
    hook: str  # the lifecycle transition of the hook that pauses it
    wait_state: str
    target_states: tuple[str, ...]  # what IMDS reads as the target lifecycle state during the wait
    boots: bool  # the instance boots into the wait (a stopped instance starts); else a process already runs
    warm_pool: bool  # happens only with a warm pool
    completed_by: Completer


TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        name="launch into the group",
        hook=LAUNCHING,
        wait_state="Pending:Wait",
        target_states=("InService",),
        boots=True,
        warm_pool=False,
        completed_by=Completer.LIFECYCLE_STEP,
    ),
    Transition(
        name="warm-pool entry",
        hook=LAUNCHING,
        wait_state="Warmed:Pending:Wait",
        target_states=WARMED,
        boots=True,
        warm_pool=True,
        completed_by=Completer.LIFECYCLE_STEP,
    ),
    Transition(
        name="warm-pool exit, stopped pool",
        hook=LAUNCHING,
        wait_state="Pending:Wait",
        target_states=("InService",),
        boots=True,
        warm_pool=True,
        completed_by=Completer.LIFECYCLE_STEP,
    ),
    Transition(
        name="warm-pool exit, running or hibernated pool",
        hook=LAUNCHING,
        wait_state="Pending:Wait",
        target_states=("InService",),
        boots=False,  # the process that completed the entry is still running (or resumes with the memory)
        warm_pool=True,
        completed_by=Completer.LIFECYCLE_STEP,
    ),
    Transition(
        name="warm-pool termination, running or hibernated pool",
        hook=TERMINATING,
        wait_state="Warmed:Terminating:Wait",
        target_states=("Warmed:Terminated",),
        boots=False,
        warm_pool=True,
        completed_by=Completer.LIFECYCLE_STEP,
        # A stopped pool's instance runs nothing: its hook ends at its timeout, with its default result CONTINUE.
    ),
    Transition(
        name="termination",
        hook=TERMINATING,
        wait_state="Terminating:Wait",
        target_states=("Terminated",),
        boots=False,
        warm_pool=False,
        completed_by=Completer.AGENT,
    ),
)
