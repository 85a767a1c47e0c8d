"""Prometheus metrics: per-request latencies observed here, engine counters read at scrape time.

Names follow vLLM's (`vllm:num_requests_running` → `driftgate:num_requests_running`) so
existing dashboards need only the prefix changed. Each app gets its own registry, so several
apps in one process (tests) never share counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.outputs import ClusterStats, EngineStats

PREFIX = "driftgate:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# token counts, 1-2-5 per decade as vLLM's request_prompt_tokens / request_generation_tokens
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


class _EngineCollector:
    """Turns one `EngineStats` snapshot into gauges and counters on every scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats | None]) -> None:
        self._read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if stats is None:  # still loading: export nothing rather than zeros that look real
            return
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0-1).", stats.kv_usage),
            "num_kv_blocks_free": ("Free KV-cache blocks.", stats.num_blocks_free),
            "num_kv_blocks_cached": ("Free KV-cache blocks still holding a prefix hash.", stats.num_blocks_cached),
            "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / looked up.",
                                      stats.prefix_cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions),
            "prompt_tokens": ("Prompt tokens prefilled.", stats.num_prompt_tokens),
            "generation_tokens": ("Tokens generated.", stats.num_generation_tokens),
            "spec_decode_num_draft_tokens": ("Draft tokens verified (speculative decoding).", stats.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens the sampler kept.", stats.num_accepted_draft_tokens),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        if stats.max_loras:
            yield _lora_info(stats)
        if stats.cluster is not None:
            yield from _cluster_metrics(stats.cluster)


def _lora_info(stats: EngineStats) -> Metric:
    """vLLM's lora_requests_info: the adapters in use as labels (comma-separated), the scrape time as
    the value; LoRA-aware gateways (the Gateway API inference extension, llm-d) route by it."""
    info = GaugeMetricFamily(PREFIX + "lora_requests_info", "LoRA adapters the running and waiting requests use.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(stats.max_loras), ",".join(stats.running_loras), ",".join(stats.waiting_loras)], time.time())
    return info


def _cluster_metrics(cluster: ClusterStats) -> Iterator[Metric]:
    """Per-replica families (label `replica`) and the router's own counts; totals are above."""
    families = [
        (GaugeMetricFamily, "replica_up", "1 while the replica answers the router, 0 while it is down.",
         lambda r: float(r.is_alive)),
        (CounterMetricFamily, "replica_requests_dispatched", "Requests the router sent to the replica.",
         lambda r: r.num_dispatched),
        (GaugeMetricFamily, "replica_num_requests_running", "Requests in the replica's running batch.",
         lambda r: r.stats.num_running),
        (GaugeMetricFamily, "replica_num_requests_waiting", "Requests waiting in the replica's own queue.",
         lambda r: r.stats.num_waiting),
        (GaugeMetricFamily, "replica_kv_cache_usage_perc", "Fraction of the replica's KV blocks in use (0-1).",
         lambda r: r.stats.kv_usage),
        (GaugeMetricFamily, "replica_prefix_cache_hit_rate", "The replica's prompt tokens served from its cache.",
         lambda r: r.stats.prefix_cache_hit_rate),
        (CounterMetricFamily, "replica_prefix_cache_hits", "Prompt tokens found in the replica's prefix cache.",
         lambda r: r.stats.prefix_cache_hits),
    ]
    for family_type, name, doc, read in families:
        family = family_type(PREFIX + name, doc, labels=["replica"])
        for replica in cluster.replicas:
            family.add_metric([str(replica.replica_id)], read(replica))
        yield family
    yield GaugeMetricFamily(PREFIX + "router_num_requests_queued",
                            "Requests in the router's global queue (also counted in num_requests_waiting).",
                            value=cluster.num_queued)
    yield CounterMetricFamily(PREFIX + "router_requests_migrated",
                              "Requests withdrawn unstarted from one replica and routed again.",
                              value=cluster.num_migrated)


def cluster_health(stats: EngineStats) -> dict:
    """What /health adds for a cluster (nothing for one engine): each replica's state, the queue."""
    if stats.cluster is None:
        return {}
    return {"replicas": [{"replica": r.replica_id, "alive": r.is_alive, "dispatched": r.num_dispatched,
                          "running": r.stats.num_running, "waiting": r.stats.num_waiting}
                         for r in stats.cluster.replicas],
            "router_queued": stats.cluster.num_queued, "migrated": stats.cluster.num_migrated}


class ServerMetrics:
    """The metrics one app exports."""

    def __init__(self, read_stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status code.",
            ["route", "status"], registry=self.registry,
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished generation requests by finish reason.",
            ["finished_reason"], registry=self.registry,
        )
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first output token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to last output token.",
                                             _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first admission, in the engine's waiting queue.",
                                            _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens each finished request generated.", _TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(read_stats))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
