"""The agent's signal normalization: engine scrapes in, the contract's signals out (EMF, Prometheus, PutMetricData)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import boto3
import pytest
from botocore.serialize import create_serializer  # type: ignore[import-untyped]
from botocore.stub import ANY, Stubber  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from kvfleet import contract
from kvfleet.agent import metrics
from kvfleet.agent.aws import Retry
from kvfleet.agent.metrics import CloudWatchPublisher, Sample, SignalCollector, emf_line, emf_record, metric_map
from kvfleet.engines import ENGINES

KV = contract.KV_CACHE_UTILIZATION.name
WAITING = contract.REQUESTS_WAITING.name
RUNNING = contract.REQUESTS_RUNNING.name
SAT = contract.REPLICA_SATURATION.name
TTFT = contract.TIME_TO_FIRST_TOKEN.name
ITL = contract.INTER_TOKEN_LATENCY.name
TOKENS = contract.OUTPUT_TOKENS.name
PREEMPTIONS = contract.PREEMPTIONS.name
SHED = contract.REQUESTS_SHED.name
ERRORS = contract.SERVER_ERRORS.name

# vLLM 0.32 /metrics (trimmed to the families the agent reads, plus one it ignores).
VLLM_0_32 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 17.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4127
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7611304107205331e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 190233.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7611304107205331e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 48213.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7611304107205331e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="m"} 25.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 25.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="m"} 35.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 35.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="m"} 39.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 39.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="m"} 39.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="7.5",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="20.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="80.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="160.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="640.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 8.950000000000001
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1.7611304107205331e+09
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="m"} 900.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="m"} 1200.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.075",model_name="m"} 1200.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.15",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.2",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.4",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.5",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.75",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="2.5",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="5.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="7.5",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="10.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="20.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="40.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="80.0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 1210.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 30.899999999999448
# HELP vllm:inter_token_latency_seconds_created Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds_created gauge
vllm:inter_token_latency_seconds_created{engine="0",model_name="m"} 1.7611304107205331e+09
"""

# vLLM 0.6 /metrics: the old KV-cache gauge and per-token histogram names, no engine label.
VLLM_0_6 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.083
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7611304107205331e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5120.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7611304107205331e+09
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5000.0
vllm:time_per_output_token_seconds_bucket{le="0.075",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.15",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.4",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="0.75",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5100.0
vllm:time_per_output_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 156.00000000000514
# HELP vllm:time_per_output_token_seconds_created Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds_created gauge
vllm:time_per_output_token_seconds_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7611304107205331e+09
"""

# trtllm-serve /prometheus/metrics.
TRTLLM = """\
# HELP trtllm_kv_cache_utilization KV cache utilization.
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="m"} 0.62
# HELP trtllm_num_requests_running Number of running requests.
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="m"} 9.0
# HELP trtllm_num_requests_waiting Number of waiting requests.
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="m"} 2.0
# HELP trtllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
trtllm_time_to_first_token_seconds_bucket{le="0.005",model_name="m"} 0.0
trtllm_time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 0.0
trtllm_time_to_first_token_seconds_bucket{le="0.02",model_name="m"} 0.0
trtllm_time_to_first_token_seconds_bucket{le="0.04",model_name="m"} 0.0
trtllm_time_to_first_token_seconds_bucket{le="0.06",model_name="m"} 30.0
trtllm_time_to_first_token_seconds_bucket{le="0.08",model_name="m"} 30.0
trtllm_time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 30.0
trtllm_time_to_first_token_seconds_bucket{le="0.25",model_name="m"} 30.0
trtllm_time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="0.75",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="2.5",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="5.0",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="7.5",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="10.0",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 33.0
trtllm_time_to_first_token_seconds_count{model_name="m"} 33.0
trtllm_time_to_first_token_seconds_sum{model_name="m"} 2.4000000000000004
# HELP trtllm_time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds_created gauge
trtllm_time_to_first_token_seconds_created{model_name="m"} 1.7611304107205331e+09
# HELP trtllm_time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE trtllm_time_per_output_token_seconds histogram
trtllm_time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 0.0
trtllm_time_per_output_token_seconds_bucket{le="0.025",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.075",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.15",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.2",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.3",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.4",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.5",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="0.75",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="1.0",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="2.5",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_count{model_name="m"} 2000.0
trtllm_time_per_output_token_seconds_sum{model_name="m"} 30.000000000000757
# HELP trtllm_time_per_output_token_seconds_created Histogram of time per output token in seconds.
# TYPE trtllm_time_per_output_token_seconds_created gauge
trtllm_time_per_output_token_seconds_created{model_name="m"} 1.7611304107205331e+09
"""

_LE = re.compile(r'le="([^"]+)"')


def _replace_value(line: str, update: Any) -> str:
    series, value = line.rsplit(" ", 1)
    return f"{series} {update(float(value))!r}"


def add(text: str, series: str, amount: float) -> str:
    """``text`` with every sample line starting with ``series`` increased by ``amount``."""
    assert any(ln.startswith(series) for ln in text.splitlines()), f"no series {series}"
    lines = [_replace_value(ln, lambda v: v + amount) if ln.startswith(series) else ln for ln in text.splitlines()]
    return "\n".join(lines) + "\n"


def set_value(text: str, series: str, value: float) -> str:
    assert any(ln.startswith(series) for ln in text.splitlines()), f"no series {series}"
    lines = [_replace_value(ln, lambda _: value) if ln.startswith(series) else ln for ln in text.splitlines()]
    return "\n".join(lines) + "\n"


def observe(text: str, histogram: str, seconds: float, n: int = 1, *, where: str = "") -> str:
    """The engine's next exposition after ``n`` observations of ``seconds`` in histogram ``histogram``
    (in the series whose line contains ``where``)."""

    def updated(line: str) -> str:
        if where not in line:
            return line
        if line.startswith(f"{histogram}_bucket{{"):
            match = _LE.search(line)
            assert match is not None
            return _replace_value(line, lambda v: v + n) if seconds <= float(match[1]) else line
        if line.startswith(f"{histogram}_count{{"):
            return _replace_value(line, lambda v: v + n)
        if line.startswith(f"{histogram}_sum{{"):
            return _replace_value(line, lambda v: v + seconds * n)
        return line

    return "\n".join(updated(line) for line in text.splitlines()) + "\n"


def restarted(text: str) -> str:
    """The same exposition from a freshly started engine: every counter and histogram back at zero."""

    def updated(line: str) -> str:
        if not line.startswith("#") and line.split("{", 1)[0].endswith(("_total", "_bucket", "_count", "_sum")):
            return _replace_value(line, lambda _: 0.0)
        return line

    return "\n".join(updated(line) for line in text.splitlines()) + "\n"


def second_model(text: str) -> str:
    """``text`` with every series repeated for a second model_name="m2" (one engine, two served models)."""
    out = []
    for line in text.splitlines():
        out.append(line)
        if 'model_name="m"' in line and not line.startswith("#"):
            out.append(line.replace('model_name="m"', 'model_name="m2"'))
    return "\n".join(out) + "\n"


def collector(version: str = "0.32.0", engine: str = "vllm") -> SignalCollector:
    return SignalCollector(engine=engine, engine_version=version)


# --- name mapping ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "kv_first", "itl_first"),
    [
        ("0.6.3", "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.8.5", "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.9.0", "vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.10.2", "vllm:kv_cache_usage_perc", "vllm:time_per_output_token_seconds"),
        ("0.11.0rc1", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
        ("v0.32", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"),
    ],
)
def test_vllm_versions_choose_their_own_names_first(version: str, kv_first: str, itl_first: str) -> None:
    table = metric_map("vllm", version)
    assert table.names(KV)[0] == kv_first
    assert table.names(ITL)[0] == itl_first
    # Every row still falls back to the other release's name.
    assert set(table.names(KV)) == {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"}
    assert table.names(PREEMPTIONS) == ("vllm:num_preemptions_total", "vllm:num_preemptions")


def test_trtllm_has_no_preemption_or_token_counter_and_no_engine_maps_agent_counters() -> None:
    trt = metric_map("trtllm", "1.0.0")
    assert trt.names(PREEMPTIONS) == () and trt.names(TOKENS) == ()
    assert trt.names(KV) == ("trtllm_kv_cache_utilization",)
    for name, engine in ENGINES.items():
        metrics.check_metric_rows(name, engine.metric_rows)
        for since, _ in engine.metric_rows:
            table = metric_map(name, since)
            assert table.names(SHED) == () and table.names(ERRORS) == ()


def test_the_table_is_the_adapters() -> None:
    for name, engine in ENGINES.items():
        for since, names in engine.metric_rows:
            assert dict(metric_map(name, since).candidates) == dict(names)


@pytest.mark.parametrize(
    "rows",
    [
        (("0.0.0", {SHED: ("vllm:num_requests_swapped",)}),),  # an agent counter
        (("0.0.0", {"Throughput": ("vllm:generation_tokens_total",)}),),  # not in the contract
        (("0.0.0", {KV: ()}),),  # no candidate
        (("0.9.0", {KV: ("vllm:kv_cache_usage_perc",)}),),  # no row for old versions
        (("0.0.0", {}), ("0.9.0", {}), ("0.9.0", {})),  # rows out of order
        (),  # no rows at all
    ],
)
def test_bad_metric_rows_are_refused(rows: Any) -> None:
    with pytest.raises(ValueError):
        metrics.check_metric_rows("vllm", rows)


def test_unknown_engine_or_version_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        metric_map("sglang", "0.4.0")
    with pytest.raises(ValueError, match="vllm version: expected a release"):
        metric_map("vllm", "latest")


# --- normalization --------------------------------------------------------------------------------


def test_vllm_first_scrape_is_the_baseline() -> None:
    sample = collector().update(VLLM_0_32)
    assert sample.gauges == {SAT: 0.4127, KV: 0.4127, WAITING: 3.0, RUNNING: 17.0}
    assert sample.deltas == {TOKENS: 0.0, PREEMPTIONS: 0.0, SHED: 0.0, ERRORS: 0.0}
    assert sample.distributions == {}
    assert sample.problem is None


def test_vllm_next_scrape_reports_the_interval_in_milliseconds() -> None:
    c = collector()
    c.update(VLLM_0_32)
    text = add(VLLM_0_32, "vllm:generation_tokens_total{", 640)
    text = add(text, "vllm:num_preemptions_total{", 2)
    text = set_value(text, "vllm:num_requests_waiting{", 0)
    text = observe(text, "vllm:time_to_first_token_seconds", 0.03, 3)  # (0.02, 0.04]: 30 ms
    text = observe(text, "vllm:time_to_first_token_seconds", 0.6)  # (0.5, 0.75]: 625 ms
    text = observe(text, "vllm:time_to_first_token_seconds", 3000.0)  # +Inf: its lower bound, 2560 s
    text = observe(text, "vllm:inter_token_latency_seconds", 0.02, 100)  # (0.01, 0.025]: 17.5 ms
    sample = c.update(text)
    assert sample.gauges[WAITING] == 0.0
    assert sample.deltas == {TOKENS: 640.0, PREEMPTIONS: 2.0, SHED: 0.0, ERRORS: 0.0}
    assert sample.distributions == {
        TTFT: ((30.0, 625.0, 2_560_000.0), (3.0, 1.0, 1.0)),
        ITL: ((17.5,), (100.0,)),
    }
    # Nothing new: the next interval's counters are zero and no distribution is reported.
    quiet = c.update(text)
    assert quiet.deltas[TOKENS] == 0.0 and quiet.distributions == {}


def test_engine_restart_counts_the_new_values_as_the_increase() -> None:
    c = collector()
    c.update(VLLM_0_32)
    before = add(VLLM_0_32, "vllm:num_preemptions_total{", 3)
    assert c.update(before).deltas[PREEMPTIONS] == 3.0
    after = add(restarted(before), "vllm:num_preemptions_total{", 1)
    after = observe(after, "vllm:time_to_first_token_seconds", 0.07, 2)  # (0.06, 0.08]: 70 ms
    sample = c.update(after)
    assert sample.deltas[PREEMPTIONS] == 1.0
    assert sample.distributions[TTFT] == ((70.0,), (2.0,))
    assert c.totals[PREEMPTIONS] == 4.0


def test_old_vllm_names() -> None:
    c = collector("0.6.3")
    first = c.update(VLLM_0_6)
    assert first.gauges == {SAT: 0.083, KV: 0.083, WAITING: 0.0, RUNNING: 4.0}
    text = observe(VLLM_0_6, "vllm:time_per_output_token_seconds", 0.03, 10)  # (0.025, 0.05]: 37.5 ms
    text = add(text, 'vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"}', 10)
    sample = c.update(text)
    assert sample.distributions == {ITL: ((37.5,), (10.0,))}  # this excerpt has no time-to-first-token
    assert sample.deltas[TOKENS] == 10.0


def test_very_old_untyped_preemption_counter() -> None:
    c = collector("0.3.0")
    c.update('vllm:num_preemptions{model_name="m"} 5.0\n')
    assert c.update('vllm:num_preemptions{model_name="m"} 7.0\n').deltas[PREEMPTIONS] == 2.0


@pytest.mark.parametrize(("version", "expected"), [("0.11.0", (17.5,)), ("0.10.0", (62.5,))])
def test_when_both_latency_histograms_exist_the_version_decides(version: str, expected: tuple[float, ...]) -> None:
    old_section = VLLM_0_6[VLLM_0_6.index("# HELP vllm:time_per_output_token_seconds ") :]
    both = VLLM_0_32 + old_section.replace('model_name="meta-llama/Llama-3.1-8B-Instruct"', 'model_name="m"')
    c = collector(version)
    c.update(both)
    text = observe(both, "vllm:inter_token_latency_seconds", 0.02, 4)  # new name: 17.5 ms
    text = observe(text, "vllm:time_per_output_token_seconds", 0.06, 4)  # old name: 62.5 ms
    assert c.update(text).distributions[ITL] == (expected, (4.0,))


@pytest.mark.parametrize(("version", "expected"), [("0.8.0", 0.083), ("0.9.0", 0.4127)])
def test_when_both_cache_gauges_exist_the_version_decides(version: str, expected: float) -> None:
    both = VLLM_0_32 + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.083\n'
    assert collector(version).update(both).gauges[KV] == expected


def test_trtllm() -> None:
    c = collector("1.0.0", engine="trtllm")
    first = c.update(TRTLLM)
    assert first.gauges == {SAT: 0.62, KV: 0.62, RUNNING: 9.0, WAITING: 2.0}
    assert first.deltas == {SHED: 0.0, ERRORS: 0.0}  # no engine counters to normalize
    text = observe(TRTLLM, "trtllm_time_to_first_token_seconds", 0.05, 4)  # (0.04, 0.06]: 50 ms
    text = observe(text, "trtllm_time_per_output_token_seconds", 0.015, 40)  # (0.01, 0.025]: 17.5 ms
    sample = c.update(text)
    assert sample.distributions == {TTFT: ((50.0,), (4.0,)), ITL: ((17.5,), (40.0,))}
    assert PREEMPTIONS not in sample.deltas and TOKENS not in sample.deltas


# TensorRT-LLM 1.0's Prometheus text (NVIDIA/TensorRT-LLM#5785): request histograms only, without the trtllm_
# prefix; the KV cache and the queue are in the iteration statistics on /metrics (the example of the 1.0
# trtllm-serve documentation, kvCacheStats as printed there).
TRTLLM_1_0 = "\n".join(
    line.replace("trtllm_time", "time")
    for line in TRTLLM.splitlines()
    if "kv_cache" not in line and "num_requests" not in line
)
ITERATION_STATS = json.dumps(
    [
        {"iter": 1, "numActiveRequests": 3, "numQueuedRequests": 0, "kvCacheStats": {"maxNumBlocks": 101256,
         "freeNumBlocks": 101250, "usedNumBlocks": 6, "tokensPerBlock": 32}},
        {"iter": 2, "numActiveRequests": 4, "numQueuedRequests": 5, "kvCacheStats": {"maxNumBlocks": 101256,
         "freeNumBlocks": 50628, "usedNumBlocks": 50628, "tokensPerBlock": 32}},
    ]
)  # fmt: skip


def test_trtllm_1_0_signals_come_from_its_iteration_statistics() -> None:
    """At the pinned TensorRT-LLM the Prometheus text has no KV or queue gauge: the newest iteration's statistics
    give KV use (used over max blocks), the queue, the running requests and the allocated cache, and the
    unprefixed histograms still give TTFT and ITL."""
    c = SignalCollector(engine="trtllm", engine_version="1.0.0", max_num_seqs=8)
    sample = c.update(TRTLLM_1_0, ITERATION_STATS)
    assert sample.gauges == {KV: 0.5, WAITING: 5.0, RUNNING: 4.0, SAT: 0.5}
    assert c.kv_capacity == (101256, 32)  # what the bench's drift gate reads back through the agent
    text = observe(TRTLLM_1_0, "time_to_first_token_seconds", 0.05, 4)
    assert c.update(text, "[]").distributions == {TTFT: ((50.0,), (4.0,))}
    # No iteration since the last read: nothing ran or waited.
    assert c.update(text, "[]").gauges == {KV: 0.0, WAITING: 0.0, RUNNING: 0.0, SAT: 0.0}


def test_the_engines_own_gauges_win_over_its_iteration_statistics() -> None:
    c = collector("1.3.0", engine="trtllm")
    assert c.update(TRTLLM, ITERATION_STATS).gauges == {SAT: 0.62, KV: 0.62, RUNNING: 9.0, WAITING: 2.0}


@pytest.mark.parametrize("body", ["", "not json", '{"error": "x"}', "[[[[", '[{"kvCacheStats": {"maxNumBlocks": 0}}]'])
def test_unreadable_iteration_statistics_add_nothing(body: str) -> None:
    c = collector("1.0.0", engine="trtllm")
    sample = c.update(TRTLLM_1_0, body)
    assert KV not in sample.gauges and c.kv_capacity is None
    assert metrics.iteration_gauges(body) is None or not metrics.iteration_gauges(body).gauges


@pytest.mark.parametrize(
    ("kv", "running", "max_num_seqs", "expected"),
    [
        (0.2, 16, 16, 1.0),  # max_num_seqs binds: KV use stays low however loaded the replica is
        (0.9, 3, 16, 0.9),  # the cache binds
        (0.2, 16, None, 0.2),  # max_num_seqs left to the engine: KV use alone
        (0.5, 40, 16, 1.0),  # never above 1
    ],
)
def test_saturation_is_whichever_limit_binds(
    kv: float, running: float, max_num_seqs: int | None, expected: float
) -> None:
    c = SignalCollector(engine="vllm", engine_version="0.32.0", max_num_seqs=max_num_seqs)
    text = set_value(VLLM_0_32, 'vllm:kv_cache_usage_perc{engine="0",model_name="m"}', kv)
    text = set_value(text, 'vllm:num_requests_running{engine="0",model_name="m"}', running)
    sample = c.update(text)
    assert sample.gauges[SAT] == pytest.approx(expected)
    exported = {
        sample.name: sample.value
        for family in text_string_to_metric_families(c.prometheus_text(deployment="d"))
        for sample in family.samples
    }
    assert exported[contract.REPLICA_SATURATION.prometheus_name] == pytest.approx(expected)
    # No engine gauges at all: no saturation either, rather than a made-up 0.
    assert SAT not in SignalCollector(engine="vllm", engine_version="0.32.0", max_num_seqs=16).update("").gauges
    with pytest.raises(ValueError, match="max_num_seqs"):
        SignalCollector(engine="vllm", engine_version="0.32.0", max_num_seqs=0)


def test_several_series_are_combined() -> None:
    text = second_model(VLLM_0_32)
    text = set_value(text, 'vllm:kv_cache_usage_perc{engine="0",model_name="m2"}', 0.9)
    c = collector()
    first = c.update(text)
    assert first.gauges == {SAT: 0.9, KV: 0.9, WAITING: 6.0, RUNNING: 34.0}  # utilization: max; counts: sum
    text = add(text, 'vllm:generation_tokens_total{engine="0",model_name="m"}', 10)
    text = add(text, 'vllm:generation_tokens_total{engine="0",model_name="m2"}', 5)
    text = observe(text, "vllm:time_to_first_token_seconds", 0.03, where='model_name="m"')
    text = observe(text, "vllm:time_to_first_token_seconds", 0.03, where='model_name="m2"')
    text = observe(text, "vllm:time_to_first_token_seconds", 0.3, where='model_name="m2"')
    sample = c.update(text)
    assert sample.deltas[TOKENS] == 15.0
    assert sample.distributions[TTFT] == ((30.0, 375.0), (2.0, 1.0))


def test_a_series_appearing_later_counts_from_zero() -> None:
    c = collector()
    c.update(VLLM_0_32)
    later = second_model(VLLM_0_32)
    later = set_value(later, 'vllm:generation_tokens_total{engine="0",model_name="m2"}', 7)
    assert c.update(later).deltas[TOKENS] == 7.0


def test_a_missing_metric_is_an_absent_signal() -> None:
    text = "\n".join(ln for ln in VLLM_0_32.splitlines() if "num_requests_waiting" not in ln) + "\n"
    sample = collector().update(text)
    assert WAITING not in sample.gauges
    assert sample.gauges[KV] == 0.4127 and sample.problem is None


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m" 0.5\n',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} half\n',
        'vllm:time_to_first_token_seconds_bucket{le="soon",model_name="m"} 1.0\n',
        VLLM_0_32.replace('le="0.5"', 'le="0.5'),
    ],
)
def test_malformed_scrape_reports_a_problem_and_keeps_the_state(text: str) -> None:
    c = collector()
    c.update(VLLM_0_32)
    c.record(SHED, 2)
    sample = c.update(text)
    assert sample.problem is not None and sample.problem.startswith("unreadable engine metrics")
    assert (sample.gauges, sample.distributions) == ({}, {})
    assert sample.deltas == {SHED: 2.0, ERRORS: 0.0}
    # The next good scrape reports the increase since the last good one.
    assert c.update(add(VLLM_0_32, "vllm:generation_tokens_total{", 100)).deltas[TOKENS] == 100.0


@pytest.mark.parametrize("text", ["", "# HELP process_cpu_seconds_total CPU.\nprocess_cpu_seconds_total 12.5\n"])
def test_a_scrape_without_engine_metrics_is_a_problem(text: str) -> None:
    sample = collector().update(text)
    assert sample.problem == "no vllm metrics in the scrape"
    assert sample.deltas == {SHED: 0.0, ERRORS: 0.0}


def test_agent_counters_accumulate_until_the_next_sample() -> None:
    c = collector()
    c.record(SHED)
    c.record(SHED, 2)
    c.record(ERRORS, 1)
    assert c.totals[SHED] == 3.0  # visible to the re-export before the next sample
    assert c.update(VLLM_0_32).deltas == {TOKENS: 0.0, PREEMPTIONS: 0.0, SHED: 3.0, ERRORS: 1.0}
    assert c.update(VLLM_0_32).deltas[SHED] == 0.0
    with pytest.raises(ValueError, match="not an agent counter"):
        c.record(TOKENS)
    with pytest.raises(ValueError, match=">= 0"):
        c.record(SHED, -1)


def test_more_than_a_hundred_buckets_are_merged_into_a_hundred_values() -> None:
    bounds = [0.001 * (i + 1) for i in range(250)]
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{le="{b!r}"}} 0.0' for b in bounds]
    lines += ['vllm:time_to_first_token_seconds_bucket{le="+Inf"} 0.0', "vllm:time_to_first_token_seconds_sum 0.0"]
    text = "\n".join(lines) + "\n"
    c = collector()
    c.update(text)
    for b in bounds:
        text = observe(text, "vllm:time_to_first_token_seconds", b - 0.0005)
    values, counts = c.update(text).distributions[TTFT]
    assert len(values) == metrics.MAX_DISTRIBUTION_VALUES
    assert sum(counts) == 250.0
    assert list(values) == sorted(values) and values[0] < 5.0 and values[-1] > 245.0


def test_sample_rejects_what_cloudwatch_would() -> None:
    with pytest.raises(ValueError, match="not a gauge"):
        Sample(gauges={TOKENS: 1.0})
    with pytest.raises(ValueError, match="no signal named"):
        Sample(deltas={"Tokens": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        Sample(deltas={TOKENS: -1.0})
    with pytest.raises(ValueError, match=r"1\.\.100 values"):
        Sample(distributions={TTFT: (tuple(float(i) for i in range(101)), (1.0,) * 101)})
    with pytest.raises(ValueError, match="non-finite"):
        Sample(gauges={KV: math.nan})


# --- EMF ------------------------------------------------------------------------------------------------


def _interval_sample() -> SignalCollector:
    c = collector()
    c.update(VLLM_0_32)
    text = add(VLLM_0_32, "vllm:generation_tokens_total{", 640)
    text = observe(text, "vllm:time_to_first_token_seconds", 0.03, 3)
    text = observe(text, "vllm:time_to_first_token_seconds", 0.6)
    c.record(ERRORS)
    c.update(text)
    return c


def test_emf_record_declares_present_signals_with_contract_units() -> None:
    c = _interval_sample()
    assert c.latest is not None
    record = emf_record(c.latest, namespace="Kvfleet", deployment="prod-chat", replica="i-0abc", timestamp_ms=1_700)
    directive = record["_aws"]["CloudWatchMetrics"][0]
    assert record["_aws"]["Timestamp"] == 1_700
    assert directive["Namespace"] == "Kvfleet"
    assert directive["Dimensions"] == [["Deployment"], ["Deployment", "Replica"]]
    declared = [(m["Name"], m["Unit"]) for m in directive["Metrics"]]
    assert declared == [
        (SAT, "None"),
        (KV, "None"),
        (WAITING, "Count"),
        (RUNNING, "Count"),
        (TTFT, "Milliseconds"),  # no latency observations: no InterTokenLatency
        (TOKENS, "Count"),
        (PREEMPTIONS, "Count"),
        (SHED, "Count"),
        (ERRORS, "Count"),
    ]
    assert (record["Deployment"], record["Replica"]) == ("prod-chat", "i-0abc")
    assert record[KV] == 0.4127 and record[TOKENS] == 640.0 and record[ERRORS] == 1.0
    assert record[TTFT] == {
        "Values": [30.0, 625.0],
        "Counts": [3.0, 1.0],
        # The statistic set the AWS EMF libraries add, consistent with the values: 3 x 30 + 625.
        "Min": 30.0,
        "Max": 625.0,
        "Count": 4.0,
        "Sum": 715.0,
    }
    assert ITL not in record and "StorageResolution" not in json.dumps(record)


def test_emf_line_is_one_json_line() -> None:
    c = _interval_sample()
    assert c.latest is not None
    kwargs: dict[str, Any] = {"namespace": "Kvfleet", "deployment": "d", "replica": "r", "timestamp_ms": 5}
    line = emf_line(c.latest, **kwargs)
    assert "\n" not in line
    assert json.loads(line) == emf_record(c.latest, **kwargs)


def test_emf_record_of_a_failed_scrape_carries_the_problem() -> None:
    sample = collector().update("<html></html>")
    record = emf_record(sample, namespace="Kvfleet", deployment="d", replica="r", timestamp_ms=5)
    assert [m["Name"] for m in record["_aws"]["CloudWatchMetrics"][0]["Metrics"]] == [SHED, ERRORS]
    assert record["ScrapeProblem"].startswith("unreadable engine metrics")


# --- Prometheus re-export -----------------------------------------------------------------------------


def _parse(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_prometheus_text_parses_back_under_the_contract_names() -> None:
    c = _interval_sample()
    families = _parse(c.prometheus_text(deployment="prod-chat"))
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["deployment"] == "prod-chat"
    assert families["kvfleet_kv_cache_utilization"].type == "gauge"
    assert families["kvfleet_kv_cache_utilization"].samples[0].value == 0.4127
    tokens = families["kvfleet_output_tokens"]
    assert tokens.type == "counter"
    assert [(s.name, s.value) for s in tokens.samples] == [("kvfleet_output_tokens_total", 640.0)]
    assert families["kvfleet_server_errors"].samples[0].value == 1.0
    ttft = families["kvfleet_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert buckets["0.02"] == 0.0 and buckets["0.04"] == 3.0 and buckets["0.5"] == 3.0 and buckets["0.75"] == 4.0
    assert buckets["+Inf"] == 4.0
    by_name = {s.name: s.value for s in ttft.samples if not s.name.endswith("_bucket")}
    assert by_name["kvfleet_time_to_first_token_seconds_count"] == 4.0
    assert by_name["kvfleet_time_to_first_token_seconds_sum"] == pytest.approx(0.03 * 3 + 0.6)
    assert families["kvfleet_inter_token_latency_seconds"].samples[-1].value == 0.0  # seen, nothing observed


def test_prometheus_counters_and_histograms_survive_an_engine_restart() -> None:
    c = _interval_sample()
    assert c.latest is not None
    text = add(restarted(VLLM_0_32), "vllm:generation_tokens_total{", 5)
    text = observe(text, "vllm:time_to_first_token_seconds", 0.07, 2)
    c.update(text)
    families = _parse(c.prometheus_text(deployment="d"))
    assert families["kvfleet_output_tokens"].samples[0].value == 645.0
    buckets = {
        s.labels["le"]: s.value for s in families["kvfleet_time_to_first_token_seconds"].samples if "le" in s.labels
    }
    assert buckets["0.08"] == 5.0 and buckets["+Inf"] == 6.0
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative


def test_prometheus_text_without_a_sample_and_after_a_failed_scrape() -> None:
    only_counter = _parse(metrics.prometheus_text(None, totals={SHED: 2.0}, deployment="d"))
    assert list(only_counter) == ["kvfleet_requests_shed"]
    c = _interval_sample()
    c.update("<html></html>")
    assert "kvfleet_kv_cache_utilization" not in _parse(c.prometheus_text(deployment="d"))  # no stale gauges
    with pytest.raises(ValueError, match="not a delta"):
        metrics.prometheus_text(None, totals={KV: 1.0}, deployment="d")


# --- PutMetricData ------------------------------------------------------------------------------------


def _client() -> Any:
    return boto3.client("cloudwatch", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


class _Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class _Ceiling(random.Random):
    """Jitter that always draws the ceiling, to see the backoff's shape."""

    def uniform(self, a: float, b: float) -> float:
        return b


def _publisher(client: Any, sleep: _Sleeps, **kwargs: Any) -> CloudWatchPublisher:
    return CloudWatchPublisher(
        client=client, namespace="Kvfleet", deployment="prod-chat", replica="i-0abc", sleep=sleep, **kwargs
    )


SMALL = Sample(gauges={KV: 0.5}, deltas={SHED: 1.0}, distributions={TTFT: ((30.0, 625.0), (3.0, 1.0))})


def _full_sample() -> Sample:
    values = tuple(float(i + 1) for i in range(100))
    return Sample(
        gauges={KV: 0.5, WAITING: 2.0, RUNNING: 8.0},
        deltas={TOKENS: 900.0, PREEMPTIONS: 0.0, SHED: 1.0, ERRORS: 0.0},
        distributions={TTFT: (values, (1.0,) * 100), ITL: (values, (2.0,) * 100)},
    )


def test_publish_sends_every_signal_per_dimension_set() -> None:
    client = _client()
    deployment = [{"Name": "Deployment", "Value": "prod-chat"}]
    replica = [*deployment, {"Name": "Replica", "Value": "i-0abc"}]
    expected = [
        {"MetricName": name, "Dimensions": dims, "Timestamp": ANY, "Unit": unit, **value}
        for dims in (deployment, replica)
        for name, unit, value in (
            (KV, "None", {"Value": 0.5}),
            (TTFT, "Milliseconds", {"Values": [30.0, 625.0], "Counts": [3.0, 1.0]}),
            (SHED, "Count", {"Value": 1.0}),
        )
    ]
    sleep = _Sleeps()
    with Stubber(client) as stub:
        stub.add_response("put_metric_data", {}, {"Namespace": "Kvfleet", "MetricData": expected})
        assert asyncio.run(_publisher(client, sleep).publish(SMALL)) is True
        stub.assert_no_pending_responses()
    assert sleep.delays == []


def test_a_large_sample_is_batched() -> None:
    client = _client()
    sample = _full_sample()
    publisher = _publisher(client, _Sleeps(), max_data_per_call=4)
    data = publisher.metric_data(sample, timestamp=datetime.now(UTC))
    assert len(data) == 18
    with Stubber(client) as stub:
        for start in range(0, 18, 4):
            batch = [{**d, "Timestamp": ANY} for d in data[start : start + 4]]
            stub.add_response("put_metric_data", {}, {"Namespace": "Kvfleet", "MetricData": batch})
        assert asyncio.run(publisher.publish(sample)) is True
        stub.assert_no_pending_responses()


def test_batches_respect_cloudwatch_limits() -> None:
    # Far more than one replica publishes, to exercise the real limits: 1000 data, and the request size.
    publisher = _publisher(_client(), _Sleeps())
    many = [{"MetricName": KV, "Unit": "None", "Value": 0.5}] * 2500
    assert [len(b) for b in publisher.batches(many)] == [1000, 1000, 500]
    heavy = [{"MetricName": TTFT, "Values": [123.456789] * 150, "Counts": [1.0] * 150}] * 400
    batches = publisher.batches(heavy)
    assert sum(len(b) for b in batches) == 400 and len(batches) > 1
    operation = _client().meta.service_model.operation_model("PutMetricData")
    for batch in batches:
        body = create_serializer("query").serialize_to_request({"Namespace": "Kvfleet", "MetricData": batch}, operation)
        assert len(urlencode(body["body"])) < 1_000_000


def test_throttled_twice_then_accepted() -> None:
    client = _client()
    sleep = _Sleeps()
    with Stubber(client) as stub:
        stub.add_client_error("put_metric_data", service_error_code="Throttling", http_status_code=400)
        stub.add_client_error("put_metric_data", service_error_code="Throttling", http_status_code=400)
        stub.add_response("put_metric_data", {})
        assert asyncio.run(_publisher(client, sleep, rng=random.Random(3)).publish(SMALL)) is True
        stub.assert_no_pending_responses()
    assert len(sleep.delays) == 2
    # Half the doubled step, plus jitter up to as much again: 0.1-0.2 s, then 0.2-0.4 s.
    assert 0.1 <= sleep.delays[0] <= 0.2 and 0.2 <= sleep.delays[1] <= 0.4


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("ThrottlingException", 400),
        ("RequestLimitExceeded", 400),
        ("ServiceUnavailable", 503),
        ("InternalFailure", 500),
        ("InternalServerError", 500),  # any 5xx, whatever its code
    ],
)
def test_other_transient_errors_are_retried(code: str, status: int) -> None:
    client = _client()
    sleep = _Sleeps()
    with Stubber(client) as stub:
        stub.add_client_error("put_metric_data", service_error_code=code, http_status_code=status)
        stub.add_response("put_metric_data", {})
        assert asyncio.run(_publisher(client, sleep).publish(SMALL)) is True
    assert len(sleep.delays) == 1


def test_throttled_forever_gives_up_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    client = _client()
    sleep = _Sleeps()
    publisher = _publisher(client, sleep, retry=Retry(attempts=6, base_s=0.2, cap_s=1.0), rng=_Ceiling())
    with Stubber(client) as stub, caplog.at_level(logging.WARNING, logger=metrics.__name__):
        for _ in range(6):
            stub.add_client_error("put_metric_data", service_error_code="Throttling", http_status_code=400)
        assert asyncio.run(publisher.publish(SMALL)) is False
        stub.assert_no_pending_responses()
    assert sleep.delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])  # doubling, capped; 5 retries, 6 calls
    assert "PutMetricData failed after 6 attempt(s)" in caplog.text


def test_a_non_retryable_error_fails_at_once(caplog: pytest.LogCaptureFixture) -> None:
    client = _client()
    sleep = _Sleeps()
    with Stubber(client) as stub, caplog.at_level(logging.WARNING, logger=metrics.__name__):
        stub.add_client_error("put_metric_data", service_error_code="InvalidParameterValue", http_status_code=400)
        stub.add_response("put_metric_data", {})  # would be taken by a retry
        assert asyncio.run(_publisher(client, sleep).publish(SMALL)) is False
        with pytest.raises(AssertionError):
            stub.assert_no_pending_responses()  # the response a retry would have taken is still there
    assert sleep.delays == []
    assert "PutMetricData failed (not retryable): " in caplog.text


def test_any_failure_is_logged_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def put_metric_data(self, **kwargs: Any) -> object:
            raise RuntimeError("no route to host")

    with caplog.at_level(logging.WARNING, logger=metrics.__name__):
        assert asyncio.run(_publisher(Broken(), _Sleeps()).publish(SMALL)) is False
    assert "no route to host" in caplog.text


def test_an_empty_sample_makes_no_call() -> None:
    client = _client()
    with Stubber(client):
        assert asyncio.run(_publisher(client, _Sleeps()).publish(Sample())) is True


def test_counters_from_zero_counts_what_happened_before_the_first_good_scrape() -> None:
    # The agent's own engine starts at 0: tokens generated before the first successful scrape are real.
    text = (
        '# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{engine="0",model_name="m"} 1056.0\n'
    )
    owned = SignalCollector(engine="vllm", engine_version="0.32.0", counters_from_zero=True)
    assert owned.update("").deltas.get("OutputTokens") is None  # engine still starting
    assert owned.update(text).deltas["OutputTokens"] == 1056.0
    foreign = SignalCollector(engine="vllm", engine_version="0.32.0")
    assert foreign.update(text).deltas["OutputTokens"] == 0.0  # an engine running before us: baseline only


def test_the_scrape_reads_only_wanted_lines_and_the_same_values() -> None:
    # The collector drops every line it will not read before parsing; what it reads is unchanged by that.
    from kvfleet.agent.metrics import _Scrape

    wanted = collector()._wanted
    full, filtered = _Scrape(VLLM_0_32), _Scrape(VLLM_0_32, wanted)
    assert filtered._by_name and set(filtered._by_name) <= wanted
    assert filtered._by_name == {k: v for k, v in full._by_name.items() if k in wanted}
