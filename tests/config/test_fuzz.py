"""Hostile and mutated environment files: every one is refused in a few lines with exit status 2, never a
traceback, a hang or a flood (issue "The agent and the config under faults and hostile input")."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.cli import main
from kvfleet.config.loader import MAX_PROBLEMS, parse_environment
from kvfleet.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEV = (ROOT / "environments" / "dev.yaml").read_bytes()
SOURCE = "f.yaml"


def problems(text: str | bytes) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_environment(text, source=SOURCE)
    return exc.value.lines


def test_non_utf8_byte_names_offset_and_line() -> None:
    raw = DEV[:50] + b"\xff" + DEV[50:]
    line = DEV.count(b"\n", 0, 50) + 1
    assert problems(raw) == [f"{SOURCE}:{line}: (file): byte 0xff at offset 50 is not UTF-8; save the file as UTF-8"]


def test_model_id_too_long_for_a_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = DEV.decode().replace("id: ", "id: /" + "a" * 300 + " #", 1)
    f = tmp_path / "e.yaml"
    f.write_text(text)
    assert main(["plan", str(f)]) == 2
    assert "File name too long" in capsys.readouterr().err


def test_deep_nesting() -> None:
    [line] = problems("name: dev\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested more than" in line


def test_self_referencing_alias() -> None:
    [line] = problems("name: dev\ndeployments: &a [*a]\n")
    assert line.startswith(f"{SOURCE}:2: (aliases): an alias refers to the node it is inside")


def test_alias_bomb() -> None:
    text = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
    )
    assert len(text) < 1500
    [line] = problems(text)
    assert "expand to more than" in line


def test_file_too_large() -> None:
    [line] = problems("name: dev\n" + "#" * 300_000 + "\n")
    assert "an environment file is at most" in line


def test_unknown_key_flood_is_capped() -> None:
    lines = problems(DEV.decode() + "".join(f"k{i}: 1\n" for i in range(5000)))
    assert len(lines) == MAX_PROBLEMS + 1
    assert lines[-1] == f"{SOURCE}: and {5000 - MAX_PROBLEMS:,} more problems; fix the ones above first"


def test_long_list_is_refused_in_one_line() -> None:
    lines = problems("name: dev\ndeployments:\n" + "- 1\n" * 10_000)
    assert len(lines) <= MAX_PROBLEMS + 1


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("max_replicas: 2", "max_replicas: true", "expected a whole number"),
        ("max_input_tokens: 4096", "max_input_tokens: .inf", "expected a"),
        ('version: "0.30.0"', 'version: "０.30.0"', "expected a release"),
        ('version: "0.30.0"', 'version: "99.0.0"', "kvfleet models vllm releases"),
        ("name: dev", "name: dev-", ": name: "),
    ],
)
def test_invalid_values_refused(old: str, new: str, expect: str) -> None:
    text = DEV.decode()
    assert old in text, old
    lines = problems(text.replace(old, new, 1))
    assert any(expect in line for line in lines), lines


def test_unknown_region_and_names() -> None:
    text = DEV.decode()
    assert any("not an AWS region" in line for line in problems(text.replace("region: us-east-1", "region: xx-mars-1")))
    assert problems(text.replace("- name: ", "- name: chat-x- #", 1))


def _plan(tmp_path: Path, raw: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "e.yaml"
    f.write_bytes(raw)
    rc = main(["plan", str(f)])
    err = capsys.readouterr().err
    assert rc in (0, 2)
    assert len(err.splitlines()) <= 2 * MAX_PROBLEMS


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_byte_mutations_never_raise(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: st.DataObject) -> None:
    raw = bytearray(DEV)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _plan(tmp_path, bytes(raw), capsys)


_scalars = st.one_of(st.booleans(), st.integers(-(10**6), 10**6), st.floats(), st.text(max_size=20), st.none())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(["max_replicas", "min_replicas", "max_input_tokens", "version", "name", "id", "platform"]),
    value=_scalars,
)
def test_generated_values_never_raise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: object
) -> None:
    import json

    lines = DEV.decode().splitlines()
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith(f"{key}:") or stripped.startswith(f"- {key}:"):
            prefix = line[: len(line) - len(stripped)] + ("- " if stripped.startswith("- ") else "")
            out.append(f"{prefix}{key}: {json.dumps(value)}")
        else:
            out.append(line)
    _plan(tmp_path, ("\n".join(out) + "\n").encode(), capsys)
