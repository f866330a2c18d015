"""What a file must decide before synth, as `kvfleet plan` says it: who hears the alarms, who shares each prefix
cache, what a target asks (EKS: who may call the model) (synth's refusal is held in tests/infra/test_alerts.py and
tests/infra/test_app.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.cli.plan_output import _notifications_line
from kvfleet.config.choices import UndecidedError, refuse_undecided, undecided
from tests.envs import SAGEMAKER_ENV, environment

UNDECIDED = SAGEMAKER_ENV.replace("notifications: none\n", "").replace("    serving:\n      tenancy: single\n", "")


def test_plan_says_what_is_left_open_at_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "open.yaml"
    f.write_text(UNDECIDED, encoding="utf-8")
    assert main(["plan", str(f)]) == 0  # planned: the choices are synth's
    out = capsys.readouterr().out.splitlines()
    assert f"alarms: undecided, synth refuses: {f}:1: notifications: nobody is told when an alarm fires" in "\n".join(
        out
    )
    [cache] = [line for line in out if line.startswith("chat: prefix cache:")]
    assert cache.startswith(f"chat: prefix cache: undecided, synth refuses: {f}:4: deployments[0].serving.tenancy:")
    assert main(["plan", str(f), "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["choices"]["prefix_caching"] is True and row["choices"]["tenancy"] is None
    assert row["choices"]["notifications"] is None and len(row["choices"]["undecided"]) == 2


def test_plan_says_what_the_file_chose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "chosen.yaml"
    text = SAGEMAKER_ENV.replace("notifications: none\n", "notifications: {emails: [oncall@example.com]}\n")
    f.write_text(text, encoding="utf-8")
    assert main(["plan", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "alarms notify oncall@example.com by email; SNS mails each address a confirmation link on deploy" in (
        "\n".join(out)
    )
    assert "chat: prefix cache: shared by every caller (serving.tenancy: single)" in out
    assert not any("undecided" in line for line in out)


def test_a_topic_in_another_account_is_named() -> None:
    text = SAGEMAKER_ENV.replace(
        "notifications: none\n",
        "account: '222222222222'\nnotifications: {topic_arn: arn:aws:sns:us-east-1:333333333333:t}\n",
    )
    line = _notifications_line(environment(text), None)
    assert "kvfleet does not read its policies" in line and "cloudwatch.amazonaws.com" in line
    assert "for alarms of account 222222222222 (the topic is in account 333333333333)" in line
    same = _notifications_line(environment(text.replace("333333333333", "222222222222")), None)
    assert "the topic is in account" not in same


def test_prefix_caching_off_needs_no_tenancy() -> None:
    env = environment("notifications: none\n" + UNDECIDED)
    assert undecided(env, [False]) == ()
    [problem] = undecided(env, [True])
    assert problem.field == "deployments[0].serving.tenancy"


@pytest.mark.parametrize(
    ("serving", "expect"),
    [
        ("      tenancy: single\n      tenant_header: X-T\n      tenant_secret: kvfleet/t\n", "tenancy: single shares"),
        ("      tenancy: isolated\n", "tenant_header: tenancy isolated needs"),
        ("      tenancy: shared\n", "use 'single' or 'isolated'"),
    ],
)
def test_contradictory_tenancy_is_refused_at_its_line(serving: str, expect: str) -> None:
    from kvfleet.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        environment(SAGEMAKER_ENV.replace("      tenancy: single\n", serving))
    [line] = info.value.lines
    assert expect in line and re.match(r"test.yaml:2[4-7]: deployments\[0\]\.serving\.", line), line


EKS_EXAMPLE = Path(__file__).parents[2] / "environments" / "platform.yaml"
EKS_CLIENTS = "      clients:\n        namespaces: [apps]\n"


def test_a_target_asks_its_own_choice_and_plan_says_it_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = EKS_EXAMPLE.read_text(encoding="utf-8")
    assert EKS_CLIENTS in text
    f = tmp_path / "eks.yaml"
    f.write_text(text.replace(EKS_CLIENTS, ""), encoding="utf-8")
    env = environment(text.replace(EKS_CLIENTS, ""))
    [problem] = undecided(env, [False])
    assert problem.field == "deployments[0].target.clients"
    assert "target.clients: cluster (every pod in the cluster)" in problem.message
    with pytest.raises(UndecidedError):
        refuse_undecided(env, [False])  # what synth calls before it builds a stack
    assert main(["plan", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    target_line = next(i for i, line in enumerate(text.replace(EKS_CLIENTS, "").splitlines(), 1) if "target:" in line)
    [line] = [line for line in out if line.startswith("coder: undecided")]
    assert line.startswith(f"coder: undecided, synth refuses: {f}:{target_line}: deployments[0].target.clients: "), line
    assert undecided(environment(text), [False]) == ()
    assert undecided(environment(text.replace(EKS_CLIENTS, "      clients: cluster\n")), [False]) == ()
