"""A line every few seconds of what the engine did, as vLLM's server logs it: what operators tail
to see load and throughput without a metrics stack. Quiet while the engine is idle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from engine.outputs import EngineStats

logger = logging.getLogger("driftgate.server.stats")


class StatsReport:
    """Turns successive `EngineStats` snapshots into one line per interval: the rates are over the
    interval (tokens per second, the prefix-cache hit rate of the prompts looked up in it)."""

    def __init__(self, start: EngineStats, now: float) -> None:
        self._last, self._last_at = start, now

    def line(self, stats: EngineStats, now: float) -> str | None:
        """The interval's line, or None when nothing ran, waited or finished since the last one."""
        last, since = self._last, now - self._last_at
        self._last, self._last_at = stats, now
        if since <= 0:
            return None
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generated = stats.num_generation_tokens - last.num_generation_tokens
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        preempted = stats.num_preemptions - last.num_preemptions
        return (f"prompt throughput {prompt / since:.1f} tokens/s, generation throughput {generated / since:.1f} "
                f"tokens/s, running {stats.num_running} reqs, waiting {stats.num_waiting} reqs, KV cache usage "
                f"{100 * stats.kv_usage:.1f}%, prefix cache hit rate {100 * hits / queries if queries else 0:.1f}%"
                + (f", preempted {preempted}" if preempted else ""))


async def log_stats_every(interval_s: float, read_stats: Callable[[], EngineStats | None]) -> None:
    """Log a StatsReport line every `interval_s` seconds until cancelled (nothing while loading: an
    engine attached later starts from zero counters)."""
    report = StatsReport(read_stats() or EngineStats(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        stats = read_stats()
        if stats is not None and (line := report.line(stats, time.monotonic())) is not None:
            logger.info(line)
