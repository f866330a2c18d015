"""The EC2 instances' user data: the static bash script ``user-data.sh`` with this deployment's values filled in.

The script holds every command; rendering only substitutes values, so the same script can be read, linted and
syntax-checked on its own, and the choices a deployment makes (local NVMe, weights from S3, a warm pool) are
bash conditionals on the variables set here rather than Python deciding which lines exist. The instance gets the
script without its comment lines (``commands``): EC2 takes 16 KB of user data at most.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment
from kvfleet.targets.ec2.config import Ec2Target

# The template's header still names this renderer by its path before targets had folders
# (kvfleet/infra/ec2/user_data.py): the script is every launch template's user data, and a changed byte replaces
# every instance of every fleet at the next deploy.
TEMPLATE = "user-data.sh"
HOST_MODEL_DIR = "/opt/kvfleet/model"  # the weights on the host: on local NVMe when the instance has it
ENV_FILE = "/etc/kvfleet/env"  # the container's --env-file
UNIT_FILE = "/etc/systemd/system/kvfleet.service"  # the container, started by the lifecycle step in service
BOOT_SCRIPT = "/usr/local/sbin/kvfleet-boot"  # the user data installs itself here for later boots
LIFECYCLE_UNIT = "kvfleet-lifecycle.service"  # runs `kvfleet-boot lifecycle` at every boot
LIFECYCLE_UNIT_FILE = f"/etc/systemd/system/{LIFECYCLE_UNIT}"
LIFECYCLE_ARG = "lifecycle"
WATCHDOG_UNIT = "kvfleet-watchdog.service"  # runs `kvfleet-boot watchdog` beside the container, in service
WATCHDOG_UNIT_FILE = f"/etc/systemd/system/{WATCHDOG_UNIT}"
WATCHDOG_ARG = "watchdog"
# With several engines on an instance: runs `kvfleet-boot drain`, which stops every engine once the group terminates
# the instance and completes the termination hook after the last has drained (the agents are not given the hook).
DRAIN_UNIT = "kvfleet-drain.service"
DRAIN_UNIT_FILE = f"/etc/systemd/system/{DRAIN_UNIT}"
DRAIN_ARG = "drain"
# The watchdog polls the agent's liveness route (contract.LIVENESS_ROUTE) this often, each poll given this long.
WATCH_POLL_S = 10
WATCH_TIMEOUT_S = 5
# The longest a healthy host may have no agent answering: the container's unit restarts it 5 s after it exits
# (RestartSec in the script), then the agent imports and listens; a Docker daemon restart takes its containers down
# as long. The engine's own restarts are not counted here: the agent answers through them, and the route itself says
# when one has gone on past the budget (restart_budget_s).
NO_AGENT_S = 60
# Failures in a row (503, refused, timed out) before the instance is marked unhealthy: NO_AGENT_S of polls, so a
# container restart is never taken for a dead host, and a failed engine is replaced about a minute after the agent
# says so.
WATCH_FAILURES = math.ceil(NO_AGENT_S / WATCH_POLL_S)
# SetInstanceHealth calls refused in a row (no route to the API, the role refused, throttled) before the watchdog
# powers the instance off instead: a stopped instance fails the group's EC2 health check ("checks that the instance
# is running", EC2 Auto Scaling User Guide, "About the health checks for your Auto Scaling group").
WATCH_API_TRIES = 3
HEALTH_CHECKS_SOURCE = "https://docs.aws.amazon.com/autoscaling/ec2/userguide/health-checks-overview.html"
POLL_S = 5  # how often the lifecycle step reads the target lifecycle state while the instance is in a pool
# The DLAMI release notes list each GPU AMI's "nvme_location": the Base OSS NVIDIA Driver AMIs assemble and mount
# the instance store there at boot, so the script reuses a mounted instance store instead of formatting it.
DLAMI_NVME_MOUNT = "/opt/dlami/nvme"
DLAMI_NVME_SOURCE = "https://docs.aws.amazon.com/dlami/latest/devguide/appendix-ami-release-notes.html"

_PLACEHOLDER = re.compile(r"\{\{([A-Z][A-Z0-9_]*)\}\}")
# A whole-line comment; not the "#!" line. The script's heredocs (units, env file) hold no such line.
_COMMENT_LINE = re.compile(r"^[ \t]*#(?!!).*\n", flags=re.MULTILINE)
# "User data is limited to 16 KB, in raw form, before it is base64-encoded" (Amazon EC2 User Guide, "Run commands
# when you launch an EC2 instance with user data input", user data limits).
USER_DATA_LIMIT_BYTES = 16 * 1024
USER_DATA_SOURCE = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/user-data.html"


@dataclass(frozen=True)
class Verbatim:
    """A value substituted as it is (a heredoc's body), not as one shell word."""

    text: str


Value = str | int | Verbatim


class TemplateError(ValueError):
    """A template and its values do not match: a bug in kvfleet, not in a user's configuration."""


def render(template: str, values: Mapping[str, Value]) -> str:
    """``template`` with every ``{{NAME}}`` replaced by ``values[NAME]``: shell-quoted, unless ``Verbatim``.

    Fails on a placeholder without a value, a value without a placeholder and a stray double brace, so a
    renamed variable cannot leave a placeholder in (or a setting out of) the script an instance runs.
    """
    names = set(_PLACEHOLDER.findall(template))
    if missing := sorted(names - values.keys()):
        raise TemplateError(f"no value for placeholder(s) {', '.join(missing)}")
    if unknown := sorted(values.keys() - names):
        raise TemplateError(f"no placeholder for value(s) {', '.join(unknown)}")
    for literal in _PLACEHOLDER.split(template)[::2]:  # the text between placeholders
        if stray := re.search(r"\{\{|\}\}", literal):
            raise TemplateError(f"malformed placeholder near {literal[max(0, stray.start() - 20) :][:40]!r}")
    return _PLACEHOLDER.sub(lambda m: _substitute(values[m[1]]), template)


def _substitute(v: Value) -> str:
    return v.text if isinstance(v, Verbatim) else shlex.quote(str(v))


@cache
def template() -> str:
    return resources.files("kvfleet.targets.ec2.infra").joinpath(TEMPLATE).read_text(encoding="utf-8")


def env_file(env: Mapping[str, str]) -> Verbatim:
    """The container's env file (``docker --env-file``: one ``NAME=value`` a line, no quoting)."""
    for k, v in env.items():
        # A newline would start another variable, or end the heredoc early.
        if "\n" in k or "\n" in v or "=" in k:
            raise TemplateError(f"{k!r} cannot go into an env file")
    return Verbatim("\n".join(f"{k}={v}" for k, v in sorted(env.items())))


@dataclass(frozen=True, kw_only=True)
class Boot:
    """What the fleet decides for its instances' boot; the rest comes from the deployment and the contract."""

    image: str  # the serving image's URI (may be a CDK token, resolved at deploy)
    log_group: str  # the container's log group (may be a CDK token)
    local_nvme: bool  # the weights go to the instance store
    drain_hook: str  # the termination hook the agent drains for
    heartbeat_s: int  # how often the agent heartbeats it (and the first boot the launch hook)
    warm_hook: str | None  # the launch hook to complete once ready on disk; None without a warm pool


def commands(text: str) -> str:
    """``text`` without its whole-line comments: what the instance runs, the same commands in fewer bytes."""
    return _COMMENT_LINE.sub("", text)


def user_data_script(r: ResolvedDeployment, boot: Boot) -> str:
    """The script ``r``'s instances run at first boot (and, installed, its lifecycle step at every boot)."""
    script = render(commands(template()), user_data_values(r, boot))
    if len(script.encode()) > USER_DATA_LIMIT_BYTES:  # a bug in kvfleet: no setting makes the script this long
        raise TemplateError(f"the user data is {len(script.encode())} bytes, EC2 takes {USER_DATA_LIMIT_BYTES}")
    return script


def user_data_values(r: ResolvedDeployment, boot: Boot) -> dict[str, Value]:
    """The template's values for ``r``: every path, port, uid and variable name from the contract."""
    d = r.deployment
    target = d.target
    assert isinstance(target, Ec2Target)
    env = r.container_environment()
    engines = r.candidate.engines_per_instance
    if engines == 1:
        # The agent drains for this hook and heartbeats it; the group's name it is only told on the instance.
        env[contract.ENV_LIFECYCLE_HOOK] = boot.drain_hook
        env[contract.ENV_LIFECYCLE_HEARTBEAT_S] = str(boot.heartbeat_s)
    # Several engines: the script's drain step holds and completes the hook once, after every agent has drained
    # (CompleteLifecycleAction ends the wait for the whole instance: one agent completing it would end the others).
    # The watchdog replaces the instance when the liveness route fails, which it does past
    # ResolvedDeployment.restart_budget_s (in the environment of every target's container).
    return {
        "IMAGE": boot.image,
        "SERVE_ARG": contract.SERVE_ARG,
        "LOG_GROUP": boot.log_group,
        "HOST_MODEL_DIR": HOST_MODEL_DIR,
        "LOCAL_NVME": int(boot.local_nvme),
        "MODEL_S3_URI": d.model.s3_uri or "",
        "CONTAINER_MODEL_DIR": contract.MODEL_DIR,
        "CONTAINER_HF_HOME": contract.HF_HOME,
        "AGENT_UID": contract.AGENT_UID,
        "SERVING_PORT": contract.SERVING_PORT,
        "ENGINES": engines,
        "GPUS_PER_ENGINE": r.candidate.gpus_per_replica,
        "SHM_SIZE_GIB": target.shm_size_gib,
        "DRAIN_BUDGET_S": r.scaling.drain_budget_s,
        "ENV_ASG_NAME": contract.ENV_ASG_NAME,
        "REGION_VARIABLE": contract.REGION_VARIABLE,
        "WARM_HOOK": boot.warm_hook or "",
        "DRAIN_HOOK": boot.drain_hook,
        "HEARTBEAT_S": boot.heartbeat_s,
        "HEALTH_ROUTE": contract.HEALTH_ROUTE,
        # The one padded launch-to-ready wait: the warm phase's engine start downloads and loads the weights.
        "WARM_READY_S": r.ready_window_s,
        "POLL_S": POLL_S,
        "ENV_FILE": ENV_FILE,
        "UNIT_FILE": UNIT_FILE,
        "LIVENESS_ROUTE": contract.LIVENESS_ROUTE,
        "WATCH_POLL_S": WATCH_POLL_S,
        "WATCH_TIMEOUT_S": WATCH_TIMEOUT_S,
        "WATCH_FAILURES": WATCH_FAILURES,
        "WATCH_API_TRIES": WATCH_API_TRIES,
        "WATCHDOG_UNIT_FILE": WATCHDOG_UNIT_FILE,
        "DRAIN_UNIT_FILE": DRAIN_UNIT_FILE,
        "BOOT_SCRIPT": BOOT_SCRIPT,
        "LIFECYCLE_UNIT_FILE": LIFECYCLE_UNIT_FILE,
        "CONTAINER_ENV": env_file(env),
    }
