"""What each served model's engine holds, read when Prometheus scrapes (a collector, so nothing
runs between scrapes): rows running and waiting, memory, disk-tier hits, speculation's drafts,
restarts. A model not loaded reports its rows and memory as 0; its counters begin again from 0
with each load (Prometheus reads a counter that went down as a reset)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.engine.stats import EngineStats

MODEL = ["model_name"]


class EngineCollector(Collector):
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "running": GaugeMetricFamily(
                "vllm:num_requests_running", "Requests with a row in the batch.", labels=MODEL
            ),
            "waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting for a row.", labels=MODEL
            ),
            "active": GaugeMetricFamily(
                "omlx_memory_active_bytes",
                "Bytes in live MLX arrays, weights included (engines in the server's own"
                " process share one number).",
                labels=MODEL,
            ),
            "cache": GaugeMetricFamily(
                "omlx_memory_cache_bytes",
                "Bytes MLX keeps from freed arrays for reuse.",
                labels=MODEL,
            ),
            "prefixes": GaugeMetricFamily(
                "omlx_prefix_cache_bytes", "Bytes of the prefix cache's entries.", labels=MODEL
            ),
            "loaded": GaugeMetricFamily(
                "omlx_model_loaded", "1 while the model is loaded, else 0.", labels=MODEL
            ),
        }
        counters = {
            "disk_hits": CounterMetricFamily(
                "omlx_kv_disk_hits", "Prefixes read back from the disk tier.", labels=MODEL
            ),
            "disk_tokens": CounterMetricFamily(
                "omlx_kv_disk_hit_tokens",
                "Tokens of the prefixes read back from the disk tier.",
                labels=MODEL,
            ),
            "drafted": CounterMetricFamily(
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens verified (predictions, prompt lookup, a draft model).",
                labels=MODEL,
            ),
            "accepted": CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted: equal to the model's own sample at their position.",
                labels=MODEL,
            ),
            "restarts": CounterMetricFamily(
                "omlx_engine_restarts",
                "Engine processes started again after one died.",
                labels=MODEL,
            ),
            "loads": CounterMetricFamily(
                "omlx_model_loads", "Times the model was loaded.", labels=MODEL
            ),
        }
        for slot in self.pool.slots.values():
            name = [slot.name]
            served = slot.served
            stats = served.engine.snapshot() if served is not None else None
            for key, value in _gauges(stats).items():
                gauges[key].add_metric(name, value)
            gauges["loaded"].add_metric(name, float(served is not None))
            for key, value in _counters(stats).items():
                counters[key].add_metric(name, value)
            restarts = served.engine.transport.restarts if served is not None else 0
            counters["restarts"].add_metric(name, restarts)
            # a model served alone is attached loaded, not counted as a load (pool.single)
            counters["loads"].add_metric(name, max(slot.loads, int(served is not None)))
        yield from gauges.values()
        yield from counters.values()


def _gauges(stats: EngineStats | None) -> dict[str, float]:
    if stats is None:
        return {"running": 0, "waiting": 0, "active": 0, "cache": 0, "prefixes": 0}
    return {
        "running": stats.running,
        "waiting": stats.waiting,
        "active": stats.active_memory,
        "cache": stats.cache_memory,
        "prefixes": stats.prefix_cache_bytes,
    }


def _counters(stats: EngineStats | None) -> dict[str, float]:
    if stats is None:
        return {"disk_hits": 0, "disk_tokens": 0, "drafted": 0, "accepted": 0}
    t = stats.tallies
    return {
        "disk_hits": t.disk_hits,
        "disk_tokens": t.disk_hit_tokens,
        "drafted": t.draft_tokens,
        "accepted": t.accepted_tokens,
    }
