"""Reading real traces, and refusing broken ones in one line."""

from __future__ import annotations

import csv
import json
import statistics
from datetime import datetime
from pathlib import Path

import pytest

from kvfleet import contract
from kvfleet.workload.profile import profile, render
from kvfleet.workload.traces import TraceError, read_trace

REPO = Path(__file__).resolve().parents[2]
CONV = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
CODE = REPO / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"


def _rows(path: Path) -> list[tuple[float, int, int]]:
    with path.open(newline="", encoding="utf-8") as f:
        return [
            (datetime.fromisoformat(r["TIMESTAMP"]).timestamp(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for r in csv.DictReader(f)
        ]


def test_azure_conversation_trace_is_read_whole() -> None:
    rows = _rows(CONV)
    trace = read_trace(CONV)
    assert trace.fmt == "azure" and len(trace) == len(rows) == 19_366
    assert list(trace.input_tokens) == [r[1] for r in rows]
    assert list(trace.output_tokens) == [r[2] for r in rows]
    assert trace.arrival_s[0] == 0.0
    assert trace.duration_s == pytest.approx(rows[-1][0] - rows[0][0], abs=1e-3)
    p = profile(trace)
    assert p.input_tokens.p50 == statistics.median_low(r[1] for r in rows)
    assert p.output_tokens.max == max(r[2] for r in rows)
    assert p.input_tokens.mean == pytest.approx(statistics.fmean(r[1] for r in rows))
    assert p.arrivals.mean_per_s == pytest.approx(len(rows) / (rows[-1][0] - rows[0][0]))
    assert p.arrivals.peak_to_mean > 1.0
    assert p.prefix_reuse is None  # the Azure traces carry no prefix hashes
    assert "19,366 requests" in render(p)


def test_window_and_rate_scale() -> None:
    rows = _rows(CODE)
    t0 = rows[0][0]
    kept = [r for r in rows if 600 <= r[0] - t0 < 900]
    trace = read_trace(CODE, start_s=600, duration_s=300, rate_scale=3.0)
    assert len(trace) == len(kept)
    assert trace.skipped == len(rows) - len(kept)
    assert trace.duration_s == pytest.approx((kept[-1][0] - kept[0][0]) / 3.0, abs=1e-3)
    assert list(trace.input_tokens) == [r[1] for r in kept]


def test_code_trace_is_burstier_than_conversation() -> None:
    # The Splitwise paper's characterization: the coding service arrives in bursts, conversation near-Poisson.
    code, conv = profile(read_trace(CODE)).arrivals, profile(read_trace(CONV)).arrivals
    assert code.interarrival_cv is not None and conv.interarrival_cv is not None
    assert code.interarrival_cv > 2 * conv.interarrival_cv
    assert 0.8 < conv.interarrival_cv < 1.5


def test_mooncake_prefix_reuse_counts_the_leading_run_of_known_blocks(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    records = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},  # reuses 2 blocks
        {"timestamp": 2500, "input_length": 1024, "output_length": 10, "hash_ids": [3, 1]},  # 1 known, not leading
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = read_trace(f)
    assert trace.fmt == "mooncake" and list(trace.arrival_s) == [0.0, 0.0, 2.5]
    reuse = profile(trace).prefix_reuse
    assert reuse is not None and not reuse.measured
    assert reuse.reused_token_fraction == pytest.approx(1024 / (1024 + 1500 + 1024))
    assert reuse.requests_with_reuse_fraction == pytest.approx(1 / 3)


def test_burstgpt_failed_requests_are_left_out(tmp_path: Path) -> None:
    f = tmp_path / "b.csv"
    f.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n"
    )
    trace = read_trace(f)
    assert trace.fmt == "burstgpt" and len(trace) == 2 and trace.failed == 1
    assert list(trace.arrival_s) == [0.0, 113.0]


def test_agent_request_log_is_read_among_other_output(tmp_path: Path) -> None:
    k = contract.REQUEST_LOG_FIELDS
    rec = {contract.REQUEST_LOG_KIND_KEY: contract.REQUEST_LOG_KIND, k.tenant: "ab12", k.status: 200}
    lines = [
        json.dumps({"_aws": {"CloudWatchMetrics": []}, "KvCacheUtilization": 0.4}),
        "INFO: engine started",
        json.dumps({**rec, k.time: 100.0, k.prompt_tokens: 900, k.cached_tokens: 512, k.output_tokens: 40}),
        json.dumps({**rec, k.time: 101.5, k.prompt_tokens: 300, k.cached_tokens: 0, k.output_tokens: 7, k.status: 503}),
        json.dumps({**rec, k.time: 102.0, k.prompt_tokens: 100, k.cached_tokens: 0, k.output_tokens: 5}),
    ]
    f = tmp_path / "agent.log"
    f.write_text("\n".join(lines) + "\n")
    trace = read_trace(f)
    assert trace.fmt == "kvfleet" and len(trace) == 2 and trace.failed == 1
    assert list(trace.arrival_s) == [0.0, 2.0]
    reuse = profile(trace).prefix_reuse
    assert reuse is not None and reuse.measured and reuse.reused_token_fraction == pytest.approx(512 / 1000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "t.csv:1: (file): not a trace kvfleet reads"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "t.csv:1: (file): no requests"),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,10\n", "t.csv:1: header: missing column GeneratedTokens"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,-5,10\n",
            "t.csv:2: ContextTokens: -5 is negative",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,10\n2023-11-16 18:15:40,5,10\n",
            "t.csv:3: TIMESTAMP: earlier than the row before it",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,10\n", "t.csv:2: TIMESTAMP: 'yesterday' is not a date"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5.5,10\n", "t.csv:2: ContextTokens: '5.5'"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5\n", "t.csv:2: GeneratedTokens: the row has"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,3\n", "t.csv:2: ContextTokens: 0 tokens"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,99999999999999,3\n",
            "t.csv:2: ContextTokens: more than",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n',
            "t.csv:2: output_length: missing",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2\n',
            "t.csv:2: (line): not a JSON object",
        ),
        (
            '{"timestamp": 0, "input_length": true, "output_length": 1}\n',
            "t.csv:1: input_length: True is not a token count",
        ),
        (
            '{"timestamp": "soon", "input_length": 3, "output_length": 1}\n',
            "t.csv:1: timestamp: 'soon' is not a time",
        ),
        (
            '{"timestamp": NaN, "input_length": 3, "output_length": 1}\n',
            "t.csv:1: timestamp: nan is not a time",
        ),
    ],
)
def test_bad_traces_get_one_line(tmp_path: Path, text: str, expected: str) -> None:
    f = tmp_path / "t.csv"
    f.write_text(text)
    with pytest.raises(TraceError) as err:
        read_trace(f)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / expected.split(":", 1)[0]) + ":" + expected.split(":", 1)[1]), message


def test_not_utf8_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,\xff\n")
    with pytest.raises(TraceError, match="0xff is not UTF-8"):
        read_trace(f)
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_trace(tmp_path / "absent.csv")


def test_empty_window_says_what_the_trace_spans() -> None:
    with pytest.raises(TraceError, match=r"no requests between 7200 s and .* it spans 3502 s"):
        read_trace(CONV, start_s=7200)


@pytest.mark.parametrize("kwargs", [{"rate_scale": 0.0}, {"start_s": -1.0}, {"duration_s": 0.0}])
def test_bad_window_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(TraceError):
        read_trace(CONV, **kwargs)  # type: ignore[arg-type]
