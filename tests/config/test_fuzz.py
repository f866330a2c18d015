"""Hostile and mutated environment files: every one is refused in a few lines with exit status 2, never a
traceback, a hang or a flood (issue "The agent and the config under faults and hostile input")."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.cli import main
from kvfleet.config.loader import MAX_PROBLEMS, parse_environment
from kvfleet.config.schema import Environment
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


# ---- documents generated over the schema ---------------------------------------------------------------------
# Structurally valid-ish files: each field drawn from values the schema takes and values it refuses, so both the
# accepting paths and the cross-field and cross-resource checks run.

_WEAK = re.compile(r"Input should|should match pattern|Tuple|dictionary|instance of|<block|<flow|\]\{|\[\^|\(\?P<")


def _maybe(value: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = _scalars) -> st.SearchStrategy[Any]:
    return st.one_of(value, value, value, junk)


_regions = st.sampled_from(["us-east-1", "us-west-2", "eu-west-1", "mars-1"])
_deployment = st.fixed_dictionaries(
    {
        "name": _maybe(st.sampled_from(["chat", "coder", "a", "x" * 31, "bad-"])),
        "model": st.fixed_dictionaries(
            {"id": _maybe(st.sampled_from(["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B", "no/such"]))},
            optional={
                "s3_uri": _maybe(
                    st.sampled_from(["s3://models-bucket/llama", "s3://Bad..bucket/x", "s3://192.168.0.1/x"])
                ),
                "hf_token_secret": _maybe(st.sampled_from(["kvfleet/hf-token", "bad secret", "arn:aws:s3:::x"])),
            },
        ),
        "engine": st.fixed_dictionaries(
            {
                "name": _maybe(st.sampled_from(["vllm", "trtllm"])),
                "version": _maybe(st.sampled_from(["0.30.0", "0.21.0", "0.11.0", "1.0.0", "9.9.9"])),
            }
        ),
        "workload": st.fixed_dictionaries(
            {
                "max_input_tokens": _maybe(st.sampled_from([1024, 4096, 400000])),
                "max_output_tokens": _maybe(st.sampled_from([256, 1024])),
            },
            optional={
                "avg_input_tokens": _maybe(st.sampled_from([500, 1500, 5000])),
                "ttft_ms": _maybe(st.sampled_from([200, 2500])),
                "streaming": _maybe(st.booleans()),
            },
        ),
        "target": st.one_of(
            st.fixed_dictionaries(
                {"platform": st.just("sagemaker")},
                optional={"inference_ami_version": st.sampled_from(["al2-ami-sagemaker-inference-gpu-2", "x"])},
            ),
            st.fixed_dictionaries(
                {"platform": st.just("ec2")},
                optional={
                    "load_balancer": st.fixed_dictionaries(
                        {},
                        optional={
                            "certificate_arn": st.sampled_from(
                                [
                                    f"arn:aws:acm:{r}:123456789012:certificate/abc-123"
                                    for r in ("us-east-1", "eu-west-1")
                                ]
                            ),
                            "internal": st.booleans(),
                        },
                    )
                },
            ),
            st.fixed_dictionaries({"platform": _maybe(st.sampled_from(["eks", "lambda"]))}),
        ),
    },
    optional={
        "scaling": st.fixed_dictionaries(
            {}, optional={"min_replicas": _maybe(st.integers(0, 3)), "max_replicas": _maybe(st.integers(1, 4))}
        ),
        "sizing": st.fixed_dictionaries(
            {},
            optional={
                "instance_type": _maybe(st.sampled_from(["ml.g6e.xlarge", "g6e.xlarge", "ml.nope.xlarge"])),
                "kv_cache_dtypes": _maybe(st.lists(st.sampled_from(["auto", "fp8", "int3"]), max_size=2)),
            },
        ),
        "image": st.fixed_dictionaries({"source": _maybe(st.sampled_from(["kvfleet", "dlc", "uri"]))}),
        "serving": st.fixed_dictionaries(
            {},
            optional={
                "tenant_header": _maybe(st.sampled_from(["X-Tenant", "X Tenant", ""])),
                "tenant_secret": _maybe(st.sampled_from(["kvfleet/tenant-salt", "bad secret"])),
                "admission": _maybe(st.booleans()),
                "tenancy": _maybe(st.sampled_from(["single", "isolated", "shared"])),
            },
        ),
    },
)
_documents = st.fixed_dictionaries(
    {
        "name": _maybe(st.sampled_from(["dev", "prod", "e" * 21])),
        "deployments": st.lists(_deployment, min_size=0, max_size=2),
    },
    optional={
        "region": _maybe(_regions),
        "network": st.fixed_dictionaries(
            {},
            optional={
                "availability_zones": st.lists(
                    st.sampled_from(["us-east-1a", "us-east-1b", "eu-west-1a", "use1-az1"]), max_size=3
                ),
                "max_azs": _maybe(st.integers(1, 7)),
            },
        ),
        "notifications": _maybe(st.sampled_from(["none", {"emails": ["a@example.com"]}, {"emails": []}, {}])),
    },
)


def _check(text: str) -> Environment | None:
    start = time.monotonic()
    try:
        env = parse_environment(text, source=SOURCE)
    except ConfigError as err:
        assert 1 <= len(err.lines) <= MAX_PROBLEMS + 1
        for line in err.lines:
            assert re.match(rf"{re.escape(SOURCE)}(:\d+)?: ", line), line
            said = re.sub(r"'[^']*'", "", line)  # the file's own values, echoed, may hold anything
            assert not _WEAK.search(said), line  # no regexes, pydantic type words or YAML token names
        env = None
    assert time.monotonic() - start < 5
    return env


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(doc=_documents)
def test_generated_documents_are_refused_plainly_or_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: dict[str, Any]
) -> None:
    text = yaml.safe_dump(doc, sort_keys=False)
    if _check(text) is None:
        return
    f = tmp_path / "e.yaml"
    f.write_text(text, encoding="utf-8")
    assert main(["plan", str(f)]) in (0, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 2 * MAX_PROBLEMS
    for line in err.splitlines():
        assert line.startswith(f"kvfleet: error: {f}:"), line  # planning errors carry the file and line too


_accepted = st.builds(
    lambda platform, mx, avg, kv, streaming, replicas, notifications: {
        "name": "dev",
        "region": "us-east-1",
        "notifications": notifications,
        "deployments": [
            {
                "name": "chat",
                "model": {"id": "meta-llama/Llama-3.1-8B"},
                "engine": {"name": "vllm", "version": "0.30.0"},
                "workload": {
                    "max_input_tokens": mx,
                    "max_output_tokens": 512,
                    "avg_input_tokens": min(avg, mx),
                    "streaming": streaming,
                },
                "target": {"platform": platform},
                "scaling": {"min_replicas": 1, "max_replicas": replicas},
                "sizing": {
                    "kv_cache_dtypes": kv,
                    "instance_type": "ml.g6e.xlarge" if platform == "sagemaker" else "g6e.xlarge",
                },
                "serving": {"tenancy": "single"},
            }
        ],
    },
    st.sampled_from(["sagemaker", "ec2"]),
    st.sampled_from([1024, 4096, 8192]),
    st.integers(1, 8192),
    st.sampled_from([["auto"], ["fp8"], ["auto", "fp8"]]),
    st.booleans(),
    st.integers(1, 4),
    st.sampled_from(["none", {"emails": ["oncall@example.com"]}]),
)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_accepted)
def test_plan_and_synth_agree(doc: dict[str, Any]) -> None:
    # What the loader and the planner accept, the stacks build: a file `kvfleet plan` passes, and that makes the
    # choices synth asks for (who hears the alarms, who shares the prefix cache), does not fail synth.
    from kvfleet.deployments import resolve_environment
    from kvfleet.infra.app import build_app
    from tests.infra.helpers import make_app

    env = _check(yaml.safe_dump(doc, sort_keys=False))
    assert env is not None
    resolve_environment(env)
    build_app(env, app=make_app(), nag=False)


# ---- one named case per class of problem the issue lists -----------------------------------------------------


def test_class_traceback_non_string_key_is_a_line() -> None:
    assert problems(DEV.decode() + "1: x\n")[-1].endswith("[1]: keys must be text")


def test_class_hang_alias_bomb_refused_in_bounded_time() -> None:
    text = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(9)
    )
    start = time.monotonic()
    problems(text)
    assert time.monotonic() - start < 5


def test_class_flood_capped_at_a_screenful() -> None:
    assert len(problems(DEV.decode() + "".join(f"k{i}: 1\n" for i in range(500)))) == MAX_PROBLEMS + 1


def test_class_invalid_accepted_dlc_without_a_container() -> None:
    text = DEV.decode().replace('version: "0.30.0"', 'version: "0.21.0"').replace("max_replicas: 2", "max_replicas: 1")
    text = text.replace("hf_token_secret: kvfleet/hf-token", "s3_uri: s3://models-bucket/llama")
    lines = problems(text + "    image:\n      source: dlc\n")
    assert any("engine.version: no AWS vLLM container for vLLM 0.21.0" in line for line in lines), lines


def test_class_weak_message_unclosed_quote_points_where_it_opens() -> None:
    # No other quote follows, so the scanner reads to the end of the file; PyYAML reports that end.
    text = (
        DEV.decode().replace('version: "0.30.0"', "version: 0.30.0").replace("region: us-east-1", 'region: "us-east-1')
    )
    [line] = problems(text)
    opened = text.splitlines().index('region: "us-east-1') + 1  # the scanner reads on to the end of the file
    assert line.startswith(f"{SOURCE}:{opened}: not valid YAML: a quoted value starts here")
