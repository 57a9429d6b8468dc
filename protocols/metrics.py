"""Prometheus metrics: request-side instruments, plus engine and cache figures read at scrape time.

Labels are bounded: protocol, status code, cache tier, cache miss reason. Agents are counted, never
labelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from semantic.actors.cache_miss import Reason
from semantic.actors.interface import ServerView
from semantic.actors.system import AgentSystem
from semantic.protocols.tenancy import require_admin

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "semantic_requests", "HTTP requests by protocol and status", ["protocol", "status"], registry=r
        )
        self.request_duration = Histogram(
            "semantic_request_duration_seconds",
            "Request duration",
            ["protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "semantic_time_to_first_token_seconds",
            "Time from request to first generated token",
            ["protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_wait = Histogram(
            "semantic_engine_wait_seconds",
            "Time from the engine getting a request to the request joining the batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_rate = Histogram(
            "semantic_decode_tokens_per_second",
            "Per-request decode speed (tokens after the first / their time)",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.generated = Counter("semantic_generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter(
            "semantic_speculative_drafted_tokens",
            "Drafted tokens verified (speculative decoding)",
            registry=r,
        )
        self.accepted = Counter(
            "semantic_speculative_accepted_tokens", "Drafted tokens kept (speculative decoding)", registry=r
        )
        self.prompt_tokens = Counter(
            "semantic_prompt_tokens", "Prompt tokens, reused from a cache or prefilled", ["kind"], registry=r
        )
        self.cache_lookups = Counter(
            "semantic_cache_lookups", "Where each turn's cache came from", ["tier"], registry=r
        )
        self.loop_lag = Gauge(
            "semantic_event_loop_lag_seconds", "How late the event loop woke a timer", registry=r
        )

    def attach(self, system: AgentSystem, num_in_flight: Callable[[], int]) -> None:
        self.registry.register(_SystemCollector(system, num_in_flight))

    async def handle(self, request: web.Request) -> web.Response:
        require_admin(request, "read the server's metrics, which show every namespace's activity")
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def watch_loop_lag(self, interval_s: float = 0.5) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(interval_s)
            self.loop_lag.set(max(0.0, time.monotonic() - start - interval_s))


class _SystemCollector(Collector):
    """Engine, pool, persistence and model figures, read when Prometheus scrapes."""

    def __init__(self, system: AgentSystem, num_in_flight: Callable[[], int]) -> None:
        self.system = system
        self.num_in_flight = num_in_flight

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        view = ServerView(self.system)
        stats = view.engine_stats
        yield GaugeMetricFamily(
            "semantic_queue_depth", "Requests waiting to join the batch", stats.num_waiting
        )
        yield GaugeMetricFamily("semantic_batch_size", "Sequences decoding in the batch", stats.num_running)
        yield GaugeMetricFamily(
            "semantic_prefill_chunk_tokens",
            "Prompt tokens the last engine tick could prefill (the prefill budget)",
            stats.prefill_chunk_tokens,
        )
        yield GaugeMetricFamily(
            "semantic_requests_in_flight", "Admitted generation requests", self.num_in_flight()
        )
        pool = GaugeMetricFamily("semantic_pool_bytes", "KV block pool bytes", labels=["kind"])
        pool.add_metric(["used"], stats.pool_used_bytes)
        pool.add_metric(["budget"], stats.pool_budget_bytes)
        yield pool
        mlx_memory = GaugeMetricFamily("semantic_mlx_memory_bytes", "MLX memory on rank 0", labels=["kind"])
        mlx_memory.add_metric(["active"], stats.mlx_active_bytes)  # in arrays: weights, KV, activations
        mlx_memory.add_metric(["cache"], stats.mlx_cache_bytes)  # freed, kept by MLX for reuse
        yield mlx_memory
        yield GaugeMetricFamily(
            "semantic_active_agents",
            "Agents with an actor or a cache in memory",
            self.system.num_active_agents,
        )
        group = view.group_report()
        if group is not None:
            yield GaugeMetricFamily(
                "semantic_group_size", "Ranks the model is split over", group["world_size"]
            )
            memory = GaugeMetricFamily(
                "semantic_rank_active_memory_bytes", "MLX active memory of each rank", labels=["rank"]
            )
            for rank, num_bytes in enumerate(group["rank_active_memory_bytes"]):
                memory.add_metric([str(rank)], num_bytes)
            yield memory
        yield CounterMetricFamily(
            "semantic_evictions", "Agent caches evicted from memory", stats.num_evictions
        )
        turns = CounterMetricFamily(
            "semantic_cache_turns",
            "Turns by how their prompt met the agent's cached history: hit, or why it parted from it",
            labels=["reason"],
        )
        counted = self.system.cache_notes.num_turns_by_reason
        for reason in Reason:  # every label from the start, zeros included
            turns.add_metric([reason.value], counted[reason])
        yield turns
        yield CounterMetricFamily(
            "semantic_engine_tick_failures",
            "Engine ticks that raised; their requests failed and the engine served on",
            stats.num_tick_failures,
        )
        yield CounterMetricFamily(
            "semantic_evicted_caches_dropped",
            "Evicted caches not written: too many bytes already waited for the disk",
            view.num_evicted_caches_dropped,
        )
        disk = view.disk()
        yield CounterMetricFamily(
            "semantic_cache_loads", "Agent caches loaded from disk", disk.num_loads if disk else 0
        )
        if disk is not None:
            yield GaugeMetricFamily(
                "semantic_disk_cache_bytes", "Agents' cache files on disk", disk.num_bytes
            )
            yield CounterMetricFamily(
                "semantic_disk_evictions",
                "Cache files deleted to stay within the disk budget",
                disk.num_evictions,
            )
            yield SummaryMetricFamily(
                "semantic_persist_duration_seconds",
                "Time to write one agent's cache file",
                count_value=disk.num_writes,
                sum_value=disk.write_seconds_total,
            )
        swaps = self.system.models.swap_history
        yield SummaryMetricFamily(
            "semantic_model_swap_duration_seconds",
            "Model transitions (swap, unload, reload)",
            count_value=len(swaps),
            sum_value=sum(s.total_s for s in swaps),
        )
