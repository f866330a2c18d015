"""The agent's signal loop: every publish interval the engine's /metrics (and its iteration statistics, where its
adapter has them) become the contract's signals, written as an EMF line on stdout (CloudWatch Logs) and, where
configured, sent with PutMetricData; and admission is held to the KV cache the engine reports."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import IO, Any

import aiohttp

from kvfleet import contract
from kvfleet.agent import metrics
from kvfleet.agent.admission import Admission
from kvfleet.agent.engine import EngineSupervisor
from kvfleet.agent.settings import AgentSettings

log = logging.getLogger(__name__)


class SignalLoop:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        engine: EngineSupervisor,
        admission: Admission,
        collector: metrics.SignalCollector,
        publisher: metrics.CloudWatchPublisher | None,
        stdout: IO[str],
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.admission = admission
        self.collector = collector
        self.publisher = publisher
        self.stdout = stdout
        self.session: aiohttp.ClientSession | None = None  # set by the agent's start: the scrapes' connections
        self._publishing: asyncio.Task[Any] | None = None
        self._kv_capacity: tuple[int, int] | None = None  # (blocks, tokens per block) admission was last set from

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.publish_interval_s)
            await self.publish_once()

    async def scrape(self, path: str | None = None) -> str | None:
        assert self.session is not None
        if not self.engine.ready:
            return None
        try:
            async with self.session.get(
                self.settings.engine_url + (path or self.settings.metrics_path), timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                if r.status != 200:
                    return None
                return await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None

    async def publish_once(self) -> None:
        try:
            text = await self.scrape()
            stats_path = self.settings.adapter.iteration_stats_path
            stats = await self.scrape(stats_path) if stats_path is not None else None
            sample = self.collector.update(text if text is not None else "", stats)
            self.admit_by_engine_cache()
            line = metrics.emf_line(
                sample,
                namespace=self.settings.namespace,
                deployment=self.settings.deployment,
                replica=self.settings.replica,
                timestamp_ms=int(time.time() * 1000),
            )
            self.stdout.write(line + "\n")
            self.stdout.flush()
            if self.publisher is not None and (self._publishing is None or self._publishing.done()):
                # One PutMetricData at a time; a slow or throttled call never delays serving.
                self._publishing = asyncio.create_task(self.publisher.publish(sample))
        except Exception:  # a metrics problem must never take the agent down
            log.exception("publishing signals failed")

    def admit_by_engine_cache(self) -> None:
        """Holds admission to the KV cache the engine reports (its adapter's capacity metric) where that is less
        than the plan's: the engine sizes its cache when it starts, from the memory it finds, so a first boot that
        compiles, another driver or a different release can leave fewer tokens than planned, and admitting by
        the plan would queue and preempt in the engine instead of shedding here. Read from each scrape (the
        first one comes within the publish interval of the engine's start), again after each restart."""
        capacity = self.collector.kv_capacity
        if capacity is None or capacity == self._kv_capacity:
            return
        self._kv_capacity = capacity
        s = self.settings
        tokens = capacity[0] * capacity[1]
        self.admission.budget_tokens = s.admitted_tokens_for(tokens)
        planned = s.token_budget
        if planned is None:
            return
        if tokens < planned * (1 - contract.KV_SHORTFALL_TOLERANCE):
            budget = self.admission.budget_tokens
            log.warning(
                "the engine allocated %d KV tokens (%d blocks of %d), %.0f%% fewer than the plan's %d%s; a first "
                "boot without the engine's compile cache, another driver or engine release, or other processes on "
                "the accelerator take memory the plan left to the cache: re-plan, or calibrate the plan "
                "with `kvfleet bench --calibrate`",
                tokens,
                capacity[0],
                capacity[1],
                (1 - tokens / planned) * 100,
                planned,
                f": admission now holds the replica to {budget} tokens" if budget is not None else "",
            )
        else:
            log.info("the engine allocated %d KV tokens; the plan expected %d", tokens, planned)
