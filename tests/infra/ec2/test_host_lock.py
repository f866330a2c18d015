"""EC2's AMI pinned per release: the lock beside the environment file (kvfleet.config.host_lock), read offline by
synth, rewritten only by `kvfleet plan --refresh-host-images` (SSM and EC2 stubbed here), shown by `kvfleet diff`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import boto3
import pytest
from aws_cdk.assertions import Template
from botocore.stub import Stubber

from kvfleet.cli.host_images import host_images, refresh_host_images
from kvfleet.config.host_lock import LockError, PinnedImage, lock_path, lock_text, read_lock
from kvfleet.config.loader import load_located
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.infra.app import build_app
from kvfleet.plandiff import describe, diff_plans
from kvfleet.targets.ec2.config import Ec2Target
from tests.infra.ec2.envs import EC2_ENV
from tests.infra.helpers import make_app, props

PARAMETER = Ec2Target.model_fields["ami_parameter"].default
RELEASE = "Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) 20260901"
OLDER = "Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) 20260519"


def pin(image_id: str = "ami-0123456789abcdef0", name: str = RELEASE, version: int = 41) -> PinnedImage:
    return PinnedImage(
        parameter=PARAMETER,
        region="us-east-1",
        image_id=image_id,
        image_name=name,
        parameter_version=version,
        resolved_on="2026-09-10",
    )


def env_file(tmp_path: Path, *images: PinnedImage) -> Path:
    path = tmp_path / "test.yaml"
    path.write_text(EC2_ENV, encoding="utf-8")
    if images:
        lock_path(path).write_text(lock_text(images), encoding="utf-8")
    return path


def synth(path: Path) -> Template:
    # The loader reads the lock beside the file; the app is given what it pinned (no context, no second read).
    loaded = load_located(path)
    app = make_app()
    build_app(loaded.environment, app=app, nag=False, host_images=loaded.host_images)
    [stack] = [s for s in app.node.children if isinstance(s, cdk.Stack) and "chat" in s.node.id]
    return Template.from_stack(stack)


def image_id(t: Template) -> Any:
    [lt] = props(t, "AWS::EC2::LaunchTemplate")
    return lt["LaunchTemplateData"]["ImageId"]


def test_the_lock_is_beside_the_environment_file_and_round_trips(tmp_path: Path) -> None:
    assert lock_path("environments/prod.yaml") == Path("environments/prod.lock.json")
    path = lock_path(env_file(tmp_path, pin()))
    assert read_lock(path) == (pin(),)
    assert read_lock(tmp_path / "none.lock.json") == ()  # no lock: nothing pinned


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"image_id": "ami-XYZ"}, "images[0].image_id"),
        ({"parameter_version": "41"}, "images[0].parameter_version"),
        ({"image_name": None, "drop": "image_name"}, "images[0].image_name: missing"),
    ],
)
def test_a_malformed_lock_is_one_line_naming_the_field(tmp_path: Path, row: dict[str, Any], says: str) -> None:
    raw = json.loads(lock_text([pin()]))
    raw["images"][0].update({k: v for k, v in row.items() if k != "drop"})
    if "drop" in row:
        del raw["images"][0][row["drop"]]
    path = tmp_path / "x.lock.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(LockError, match=r"^[^\n]+$") as info:
        read_lock(path)
    assert says in str(info.value)


def test_the_loader_reads_the_lock_beside_the_file_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    path = env_file(tmp_path, pin())
    assert load_located(path).host_images == (pin(),)
    # The stack is not the one to read it: the app's context names no file here, and the pin is still deployed.
    assert image_id(synth(path)) == "ami-0123456789abcdef0"
    lock_path(path).write_text('{"images": [{"image_id": "ami-1"}]}', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_located(path)
    [line] = info.value.lines
    assert line.startswith(f"{lock_path(path)}: images[0].") and "refresh-host-images" in line


def test_the_bridge_pins_only_the_deployments_parameter_in_the_files_region(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvfleet.deployments import resolve_environment

    env = load_located(env_file(tmp_path)).environment
    other_region = replace(pin(), region="eu-west-1")
    other_parameter = replace(pin(), parameter="/aws/service/other/ami-id")
    [r] = resolve_environment(env, host_images=(other_region, other_parameter))
    assert r.host_image is None
    [r] = resolve_environment(env, host_images=(other_region, pin()))
    assert r.host_image == pin()


def test_synth_deploys_the_pinned_ami_and_checks_its_releases_driver(tmp_path: Path) -> None:
    t = synth(env_file(tmp_path, pin()))
    assert image_id(t) == "ami-0123456789abcdef0"  # no SSM lookup at deploy: a pipeline run replaces nothing
    assert not [k for k in t.to_json().get("Parameters", {}) if k.startswith("SsmParameterValue")]
    # Without a lock row the parameter is resolved at each deploy, as before.
    (tmp_path / "unlocked").mkdir()
    unpinned = synth(env_file(tmp_path / "unlocked"))
    assert "SsmParameterValue" in json.dumps(image_id(unpinned))


def test_a_pinned_release_without_a_known_driver_fails_synth_with_the_fix(tmp_path: Path) -> None:
    unknown = "Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023) 20990101"
    with pytest.raises(KvfleetError, match="is not a known ec2 host") as info:
        synth(env_file(tmp_path, pin(name=unknown)))
    assert unknown in str(info.value)


def test_the_driver_checked_is_the_pinned_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pinned release's driver is the one checked: an older release whose driver cannot run the image's CUDA fails
    # synth even though the parameter's own row (the newest release) could.
    import dataclasses

    from kvfleet.infra import cuda
    from kvfleet.targets.ec2.infra import fleet
    from kvfleet.targets.ec2.infra.hosts import HOSTS

    rows = tuple(
        dataclasses.replace(h, driver_branch=550, cuda=(12, 4)) if h.setting == OLDER else h for h in cuda.hosts(HOSTS)
    )
    monkeypatch.setattr(fleet, "hosts", lambda rule: rows)
    monkeypatch.setattr(cuda, "hosts", lambda rule: rows)
    synth(env_file(tmp_path, pin()))
    with pytest.raises(KvfleetError, match=r"CUDA 13\.0"):
        synth(env_file(tmp_path, pin(name=OLDER)))


def stubbed(ami: str, name: str, version: int) -> tuple[Any, list[Stubber]]:
    ssm = boto3.client("ssm", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    s_ssm, s_ec2 = Stubber(ssm), Stubber(ec2)
    s_ssm.add_response(
        "get_parameter",
        {"Parameter": {"Name": PARAMETER, "Type": "String", "Value": ami, "Version": version}},
        {"Name": PARAMETER},
    )
    s_ec2.add_response("describe_images", {"Images": [{"ImageId": ami, "Name": name}]}, {"ImageIds": [ami]})
    s_ssm.activate()
    s_ec2.activate()
    clients = {"ssm": ssm, "ec2": ec2}
    return (lambda service, region: clients[service]), [s_ssm, s_ec2]


def test_refresh_pins_what_the_parameter_holds_and_only_a_change_rewrites(tmp_path: Path) -> None:
    path = env_file(tmp_path)
    clients, stubs = stubbed("ami-0aaaaaaaaaaaaaaaa", OLDER, 40)
    lines = refresh_host_images(str(path), clients=clients, today="2026-05-20")
    assert lines == [f"{lock_path(path)}: {PARAMETER} in us-east-1: pinned to ami-0aaaaaaaaaaaaaaaa ({OLDER})"]
    for s in stubs:
        s.assert_no_pending_responses()
    assert host_images(str(path))["chat"]["image_id"] == "ami-0aaaaaaaaaaaaaaaa"
    # The same AMI again: the lock is left as it was (its first pinning day kept).
    clients, _ = stubbed("ami-0aaaaaaaaaaaaaaaa", OLDER, 40)
    assert refresh_host_images(str(path), clients=clients, today="2026-06-01") == [f"{lock_path(path)}: unchanged"]
    assert read_lock(lock_path(path))[0].resolved_on == "2026-05-20"
    # A new release: the change is said, and written.
    clients, _ = stubbed("ami-0bbbbbbbbbbbbbbbb", RELEASE, 41)
    [line] = refresh_host_images(str(path), clients=clients, today="2026-09-10")
    assert "ami-0aaaaaaaaaaaaaaaa" in line and "-> ami-0bbbbbbbbbbbbbbbb" in line
    assert read_lock(lock_path(path))[0].parameter_version == 41


def test_kvfleet_diff_shows_a_new_host_image() -> None:
    def plan(image: dict[str, Any] | None) -> list[dict[str, Any]]:
        row: dict[str, Any] = {"deployment": "chat", "candidates": [{"instance_type": "g6e.xlarge"}]}
        return [{**row, "host_image": image}] if image is not None else [row]

    old = {"parameter": PARAMETER, "image_id": "ami-0aaaaaaaaaaaaaaaa", "image_name": OLDER}
    new = {**old, "image_id": "ami-0bbbbbbbbbbbbbbbb", "image_name": RELEASE}
    text = describe(diff_plans(plan(old), plan(new)))
    assert f"host image: ami-0aaaaaaaaaaaaaaaa ({OLDER}) -> ami-0bbbbbbbbbbbbbbbb ({RELEASE})" in text
    assert describe(diff_plans(plan(old), plan(old))) == "chat: unchanged"
    unpinned = {"parameter": PARAMETER, "image_id": None}
    assert f"-> ami-0aaaaaaaaaaaaaaaa ({OLDER})" in describe(diff_plans(plan(unpinned), plan(old)))
    # A deployed plan written before plans said their image: the first pinned release shows what it pins.
    assert "host image: - -> ami-0aaaaaaaaaaaaaaaa" in describe(diff_plans(plan(None), plan(old)))


def test_kvfleet_plan_says_whether_each_host_image_is_pinned(tmp_path: Path) -> None:
    from kvfleet.cli.plan import host_image_lines

    (tmp_path / "unlocked").mkdir()
    unpinned = env_file(tmp_path / "unlocked")
    [line] = host_image_lines(str(unpinned), host_images(str(unpinned)))
    assert line.startswith("chat: host image unpinned: ") and PARAMETER in line
    assert f"kvfleet plan {unpinned} --refresh-host-images" in line
    pinned_file = env_file(tmp_path, pin())
    [line] = host_image_lines(str(pinned_file), host_images(str(pinned_file)))
    assert line == (
        f"chat: host image pinned: ami-0123456789abcdef0 ({RELEASE}) in us-east-1, as the parameter held it on "
        "2026-09-10"
    )
