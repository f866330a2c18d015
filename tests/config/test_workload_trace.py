"""``workload.trace``: an environment file's workload read from a request trace, once, when the file is loaded.

The trace's values fill what the file leaves out (typed values win); a trace that cannot be used is one
``file:line: deployments[i].workload.trace.<key>: what to change`` line and exit 2 from every edge that loads
the file (plan, simulate, synth and the CDK app).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvfleet.cli import main
from kvfleet.config.loader import load_located, parse_located, trace_workload
from kvfleet.deployments import plan_requests
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.workload.profile import profile
from kvfleet.workload.traces import read_trace

REPO = Path(__file__).resolve().parents[2]
CONV = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
EXAMPLE = REPO / "environments" / "chat-trace.yaml"

# Line numbers below are those of this text (line 1 is "name: traced"). {extra} follows the trace's path: indented
# 8 spaces it adds keys to the trace mapping, 6 spaces keys to the workload.
ENV = """\
name: traced
region: us-east-1
deployments:
  - name: chat
    model:
      id: meta-llama/Llama-3.1-8B
    engine:
      name: vllm
      version: "0.11.0"
    workload:
      trace:
        path: {path}
{extra}    target:
      platform: sagemaker
    scaling:
      min_replicas: 1
      max_replicas: 4
"""
PATH_LINE = 12

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
# Three minutes of one request every 2 s, with varied lengths.
ROWS = [
    (f"2023-11-16 18:{m:02d}:{s:02d}.0", 100 + 10 * (m * 60 + s) % 900, 20 + (m + s) % 50)
    for m in range(3)
    for s in range(0, 60, 2)
]


def csv_text(rows: list[tuple[str, int | str, int | str]] = ROWS) -> str:
    return HEADER + "".join(f"{t},{i},{o}\n" for t, i, o in rows)


def write_env(tmp_path: Path, trace_text: str | None = None, *, path: str = "../traces/t.csv", extra: str = "") -> Path:
    """An environment in tmp_path/envs/ naming a trace in tmp_path/traces/ (relative to the file's directory)."""
    (tmp_path / "envs").mkdir(exist_ok=True)
    (tmp_path / "traces").mkdir(exist_ok=True)
    if trace_text is not None:
        (tmp_path / "traces" / "t.csv").write_text(trace_text, encoding="utf-8")
    env = tmp_path / "envs" / "traced.yaml"
    env.write_text(ENV.format(path=path, extra=extra), encoding="utf-8")
    return env


# ---- the values a trace gives ------------------------------------------------------------------------------


def test_a_trace_fills_the_workload_from_its_profile(tmp_path: Path) -> None:
    env_file = write_env(tmp_path, csv_text())
    loaded = load_located(env_file)
    w = loaded.environment.deployments[0].workload
    p = profile(read_trace(tmp_path / "traces" / "t.csv"))
    assert w.max_input_tokens == p.input_tokens.p99 and w.max_output_tokens == p.output_tokens.p99
    assert w.avg_input_tokens == round(p.input_tokens.mean) and w.avg_output_tokens == round(p.output_tokens.mean)
    assert w.peak_requests_per_s == round(p.arrivals.peak_per_minute / 60, 3)
    assert w.trace is not None and w.trace.path == "../traces/t.csv"
    # The planner receives numbers: the request is built from the filled workload, nothing reads the trace again.
    [dr] = plan_requests(loaded.environment)
    assert dr.request.workload.max_input_tokens == w.max_input_tokens
    assert dr.request.workload.peak_requests_per_s == w.peak_requests_per_s
    assert len(loaded.traces[0]) == len(ROWS)


def test_values_typed_in_the_file_win_over_the_trace(tmp_path: Path) -> None:
    extra = "      avg_input_tokens: 150\n      max_output_tokens: 2000\n      peak_requests_per_s: 7\n"
    w = load_located(write_env(tmp_path, csv_text(), extra=extra)).environment.deployments[0].workload
    p = profile(read_trace(tmp_path / "traces" / "t.csv"))
    assert (w.avg_input_tokens, w.max_output_tokens, w.peak_requests_per_s) == (150, 2000, 7.0)
    assert w.max_input_tokens == p.input_tokens.p99  # left out: from the trace
    assert w.avg_output_tokens == round(p.output_tokens.mean)


def test_a_later_error_about_a_value_the_trace_gave_points_at_the_trace(tmp_path: Path) -> None:
    # The planner names workload keys; one the file does not hold came from the trace, and can be typed instead.
    loaded = load_located(write_env(tmp_path, csv_text(), extra="      max_output_tokens: 64\n"))
    assert set(loaded.from_trace[0]) == {
        "max_input_tokens",
        "avg_input_tokens",
        "avg_output_tokens",
        "peak_requests_per_s",
    }
    [line] = loaded.problem(KvfleetError("too long", field="deployments[0].workload.max_input_tokens")).lines
    assert line == (
        f"{loaded.source}:{PATH_LINE}: deployments[0].workload.max_input_tokens: too long (workload.max_input_tokens "
        "comes from workload.trace; type it in the workload to set it)"
    )
    [typed] = loaded.problem(KvfleetError("too long", field="deployments[0].workload.max_output_tokens")).lines
    assert typed == f"{loaded.source}:{PATH_LINE + 1}: deployments[0].workload.max_output_tokens: too long"


def test_a_mean_above_a_typed_maximum_is_capped_at_it(tmp_path: Path) -> None:
    w = load_located(write_env(tmp_path, csv_text(), extra="      max_input_tokens: 120\n")).environment
    workload = w.deployments[0].workload
    assert workload.max_input_tokens == 120 and workload.avg_input_tokens == 120


def test_window_and_rate_scale_apply_to_the_values_and_the_replay(tmp_path: Path) -> None:
    extra = "        start_s: 60\n        duration_s: 60\n        rate_scale: 2\n"
    loaded = load_located(write_env(tmp_path, csv_text(), extra=extra))
    trace = loaded.traces[0]
    assert len(trace) == 30  # one request every 2 s in the second minute
    assert trace.duration_s == pytest.approx(29.0)  # 58 s of arrivals at twice the rate
    w = loaded.environment.deployments[0].workload
    # Under a minute of arrivals: the mean rate, not the part of a minute they fill.
    assert w.peak_requests_per_s == trace_workload(profile(trace), {})["peak_requests_per_s"] == round(30 / 29, 3)


def test_the_path_is_relative_to_the_environment_file_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_file = write_env(tmp_path, csv_text())
    elsewhere = tmp_path / "elsewhere" / "deeper"  # where ../traces/t.csv is not
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    assert load_located(env_file).traces[0].source == str(tmp_path / "envs" / ".." / "traces" / "t.csv")
    # Text parsed without a file: relative to the directory given, else the working directory.
    text = env_file.read_text(encoding="utf-8")
    assert len(parse_located(text, source="x.yaml", directory=tmp_path / "envs").traces[0]) == len(ROWS)
    with pytest.raises(ConfigError, match=r"no trace file at \.\./traces/t\.csv; .* relative to the working directory"):
        parse_located(text, source="x.yaml")


def test_the_example_environment_plans_from_its_trace() -> None:
    loaded = load_located(EXAMPLE)
    [d] = loaded.environment.deployments
    assert d.workload.trace is not None
    p = profile(read_trace(CONV, fmt="azure", start_s=0, duration_s=600, rate_scale=0.5))
    assert d.workload.max_output_tokens == 1024  # typed in the file
    assert d.workload.max_input_tokens == p.input_tokens.p99
    assert d.workload.avg_output_tokens == round(p.output_tokens.mean)


def test_the_example_environment_matches_the_committed_json_schema() -> None:
    import jsonschema

    schema = json.loads((REPO / "environments" / "schema.json").read_text(encoding="utf-8"))
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    jsonschema.validate(data, schema)  # the maxima may be left to the trace
    del data["deployments"][0]["workload"]["trace"]
    del data["deployments"][0]["workload"]["max_output_tokens"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)


# ---- a trace that cannot be used: one line, at the key to change ---------------------------------------------


def plan_error(capsys: pytest.CaptureFixture[str], env_file: Path) -> str:
    assert main(["plan", str(env_file)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("trace_text", "path", "message"),
    [
        (None, "../traces/none.csv", "no trace file at"),
        (csv_text().replace("GeneratedTokens", "Output"), None, "missing column GeneratedTokens"),
        (csv_text([*ROWS[:3], (ROWS[3][0], -5, 10)]), None, "t.csv:5: ContextTokens: -5 is negative"),
        (csv_text([ROWS[1], ROWS[0]]), None, "t.csv:3: TIMESTAMP: earlier than the row before it"),
        (HEADER, None, "t.csv:1: (file): no requests"),
        ("", None, "t.csv:1: (file): not a trace kvfleet reads"),
        ("not a trace\n", None, "t.csv:1: (file): not a trace kvfleet reads"),
    ],
    ids=["missing-file", "missing-column", "negative-length", "unsorted", "header-only", "empty", "unknown-format"],
)
def test_a_bad_trace_is_one_line_at_its_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, trace_text: str | None, path: str | None, message: str
) -> None:
    env_file = write_env(tmp_path, trace_text, **({"path": path} if path else {}))
    line = plan_error(capsys, env_file)
    assert line.startswith(f"kvfleet: error: {env_file}:{PATH_LINE}: deployments[0].workload.trace.path: "), line
    assert message in line
    assert "; " in line  # and what to change


def test_an_empty_window_points_at_the_window(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    env_file = write_env(tmp_path, csv_text(), extra="        start_s: 3600\n")
    line = plan_error(capsys, env_file)
    assert f"{env_file}:{PATH_LINE + 1}: deployments[0].workload.trace.start_s: " in line
    assert "no requests between 3600 s" in line and "set start_s and duration_s" in line


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("rate_scale", "0", "rate_scale: must be greater than 0"),
        ("rate_scale", "true", "rate_scale: expected a number"),
        ("duration_s", ".inf", "duration_s: expected a finite number"),
        ("start_s", "-1", "start_s: must be at least 0"),
        ("format", "csv", "format: use 'azure', 'mooncake', 'burstgpt' or 'kvfleet'"),
        ("colour", "red", "colour: unknown key"),
    ],
)
def test_the_trace_mapping_is_strict(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, key: str, value: str, message: str
) -> None:
    env_file = write_env(tmp_path, csv_text(), extra=f"        {key}: {value}\n")
    line = plan_error(capsys, env_file)
    assert line.startswith(f"kvfleet: error: {env_file}:{PATH_LINE + 1}: deployments[0].workload.trace.{key}: ")
    assert message in line


def test_without_a_trace_the_maxima_are_required_and_the_message_says_so() -> None:
    text = ENV.format(path="x", extra="").replace("      trace:\n        path: x\n", "      itl_ms: 50\n")
    with pytest.raises(ConfigError) as info:
        parse_located(text, source="e.yaml")
    assert info.value.lines[0] == (
        "e.yaml:10: deployments[0].workload.max_input_tokens: required field is missing; give it, or a "
        "workload.trace to read it from"
    )


def test_simulate_and_synth_refuse_a_bad_trace_with_the_same_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env_file = write_env(tmp_path, csv_text([ROWS[1], ROWS[0]]))
    expected = plan_error(capsys, env_file)
    for argv in (["simulate", str(env_file)], ["synth", str(env_file), "--cdk", str(tmp_path / "no-cdk")]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [expected]


def test_the_cdk_app_refuses_a_bad_trace_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfleet.infra import app

    env_file = write_env(tmp_path, HEADER)
    status = tmp_path / "status"
    real_app = app.cdk.App
    # `-c env=FILE`, as the CDK CLI passes it (its environment variable reaches only a freshly started jsii kernel).
    monkeypatch.setattr(
        app.cdk, "App", lambda: real_app(context={"env": str(env_file)}, outdir=str(tmp_path / "cdk.out"))
    )
    monkeypatch.setenv("KVFLEET_SYNTH_STATUS", str(status))
    with pytest.raises(SystemExit) as info:
        app.main()
    assert info.value.code == 2 and status.read_text(encoding="utf-8") == "2"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if "!!" not in x]  # without Node's end-of-life banner, if jsii prints it
    assert line.startswith(f"{env_file}:{PATH_LINE}: deployments[0].workload.trace.path: ") and "no requests" in line


# ---- simulate replays the environment's own trace ------------------------------------------------------------


def test_simulate_replays_the_environments_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    env_file = write_env(tmp_path, csv_text())
    assert main(["simulate", str(env_file), "--json"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["requests"] == len(ROWS)
    assert main(["simulate", str(env_file)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith(str(tmp_path / "envs" / ".." / "traces" / "t.csv")) and "Poisson" not in head


def test_a_trace_on_the_command_line_overrides_the_environments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env_file = write_env(tmp_path, csv_text())
    other = tmp_path / "other.csv"
    other.write_text(csv_text(ROWS[:10]), encoding="utf-8")
    assert main(["simulate", str(env_file), "--trace", str(other), "--json"]) == 0
    [report] = json.loads(capsys.readouterr().out)
    assert report["requests"] == 10
