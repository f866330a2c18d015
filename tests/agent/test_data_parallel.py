"""A data-parallel vLLM replica (data_parallel_size engine cores behind one server) read as all its cores: the
sequence slots of every core, KV use over the replica's cache, and the replica's cache for admission."""

from __future__ import annotations

import logging

import pytest

from kvfleet import contract
from kvfleet.agent.metrics import SignalCollector
from kvfleet.agent.server import Agent
from kvfleet.engines.base import EngineArgs
from tests.agent.harness import settings

KV = contract.KV_CACHE_UTILIZATION.name
RUNNING = contract.REQUESTS_RUNNING.name
WAITING = contract.REQUESTS_WAITING.name
SAT = contract.REPLICA_SATURATION.name

CORES = 4
PER_CORE_SEQS = 12
PER_CORE_TOKENS = 359_136
BLOCK = 16
PLANNED = CORES * PER_CORE_TOKENS  # the plan's replica_kv_cache_tokens: every core's cache


def dp_scrape(running: list[float], kv: list[float], *, waiting: float = 0.0, blocks: int | str | None = None) -> str:
    """vLLM's /metrics for one server of len(running) engine cores: each gauge once per engine=<index>
    (vllm/v1/metrics/loggers.py make_per_engine), and cache_config_info once per core, each carrying the front
    end's cache config, whose num_gpu_blocks is the sum over the cores (vllm/v1/engine/utils.py)."""
    total = PLANNED // BLOCK if blocks is None else blocks
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        *(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} {r}' for i, r in enumerate(running)),
        "# TYPE vllm:num_requests_waiting gauge",
        *(f'vllm:num_requests_waiting{{engine="{i}",model_name="m"}} {waiting}' for i in range(len(running))),
        "# TYPE vllm:kv_cache_usage_perc gauge",
        *(f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} {k}' for i, k in enumerate(kv)),
        "# TYPE vllm:cache_config_info gauge",
        *(
            f'vllm:cache_config_info{{block_size="{BLOCK}",engine="{i}",num_gpu_blocks="{total}"}} 1.0'
            for i in range(len(running))
        ),
    ]
    return "\n".join(lines) + "\n"


def dp_collector(cores: int = CORES) -> SignalCollector:
    return SignalCollector(engine="vllm", engine_version="0.32.0", max_num_seqs=PER_CORE_SEQS, data_parallel_size=cores)


def test_the_slots_are_every_cores() -> None:
    """4 cores x 3 running: 12 of 48 slots, a quarter saturated (read against one core's 12 it was 1.0)."""
    sample = dp_collector().update(dp_scrape([3, 3, 3, 3], [0.05] * CORES))
    assert sample.gauges[RUNNING] == 12.0
    assert sample.gauges[SAT] == pytest.approx(0.25)
    # Every core full: the replica is.
    assert dp_collector().update(dp_scrape([12] * CORES, [0.05] * CORES)).gauges[SAT] == pytest.approx(1.0)


def test_kv_use_is_used_over_the_replicas_cache() -> None:
    """One full core of four holds a quarter of the replica's cache, not all of it."""
    sample = dp_collector().update(dp_scrape([1, 1, 1, 1], [1.0, 0.0, 0.0, 0.0]))
    assert sample.gauges[KV] == pytest.approx(0.25)
    assert sample.gauges[SAT] == pytest.approx(0.25)
    sample = dp_collector().update(dp_scrape([1, 1, 1, 1], [0.9, 0.5, 0.7, 0.3]))
    assert sample.gauges[KV] == pytest.approx(0.6)


def test_a_second_model_on_one_core_is_still_its_fullest_part() -> None:
    """Within a core the series of several model_name labels are one cache: the fullest, as before."""
    text = dp_scrape([2], [0.3]) + 'vllm:kv_cache_usage_perc{engine="0",model_name="m2"} 0.8\n'
    assert dp_collector(1).update(text).gauges[KV] == pytest.approx(0.8)


def test_one_core_reads_as_before() -> None:
    """data_parallel_size 1 (the default): saturation is running over max_num_seqs, KV use the one core's."""
    one = SignalCollector(engine="vllm", engine_version="0.32.0", max_num_seqs=PER_CORE_SEQS)
    sample = one.update(dp_scrape([3], [0.1], blocks=PER_CORE_TOKENS // BLOCK))
    assert sample.gauges == {RUNNING: 3.0, WAITING: 0.0, KV: 0.1, SAT: pytest.approx(0.25)}
    assert one.kv_capacity == (PER_CORE_TOKENS // BLOCK, BLOCK)


def test_the_replicas_cache_is_counted_once() -> None:
    """Every core's cache_config_info carries the replica's total blocks: the capacity is that total, not the
    total once per core and not one core's share."""
    c = dp_collector()
    c.update(dp_scrape([0] * CORES, [0.0] * CORES))
    assert c.kv_capacity == (PLANNED // BLOCK, BLOCK)
    # Before the engine has profiled memory the label reads "None": no capacity yet.
    c = dp_collector()
    c.update(dp_scrape([0] * CORES, [0.0] * CORES, blocks="None"))
    assert c.kv_capacity is None


def test_bad_data_parallel_size_is_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        dp_collector(0)


def test_the_agent_admits_the_replicas_planned_tokens(caplog: pytest.LogCaptureFixture) -> None:
    """The agent built from a DP plan: slots from data_parallel_size, admission held to the replica's cache, and
    no "fewer KV tokens than planned" warning when the engine allocated what the plan expected."""
    caplog.set_level(logging.INFO, logger="kvfleet.agent.server")
    args = EngineArgs(max_model_len=1024, max_num_seqs=PER_CORE_SEQS, data_parallel_size=CORES)
    agent = Agent(settings(engine_args=args, token_budget=PLANNED, admission_factor=1.0))
    sample = agent.collector.update(dp_scrape([3] * CORES, [0.1] * CORES))
    assert sample.gauges[SAT] == pytest.approx(0.25)
    agent.signals.admit_by_engine_cache()
    assert agent.admission.budget_tokens == PLANNED
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "KV tokens" in r.getMessage()]
    # A replica whose cores found less memory than planned is still held to what they allocated.
    agent.collector.update(dp_scrape([0] * CORES, [0.0] * CORES, blocks=PLANNED // BLOCK // 2))
    agent.signals.admit_by_engine_cache()
    assert agent.admission.budget_tokens == PLANNED // 2
    assert [r for r in caplog.records if r.levelname == "WARNING" and "50% fewer" in r.getMessage()]
