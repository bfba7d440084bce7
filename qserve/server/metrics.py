"""Prometheus metrics, named like vLLM's (`qserve:` instead of `vllm:`).

Latencies and token counters are observed on the engine thread after each step, from the engine's
own timestamps (`RequestMetrics`, time.monotonic). Gauges of the scheduler and the KV cache are
read at scrape time from the last `EngineStats` snapshot. Each server has its own registry, so
several can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qserve.engine.outputs import RequestOutput
from qserve.engine.stats import EngineStats
from qserve.server.async_engine import StepObserver

logger = logging.getLogger("qserve")

PREFIX = "qserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)  # fmt: skip


@dataclass
class TokenTotals:
    prompt_tokens: int = 0
    generation_tokens: int = 0


class ServerMetrics(StepObserver):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._last_token_time: dict[str, float] = {}  # engine thread only
        self.totals = TokenTotals()  # written by the engine thread, read by StatLogger
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prefill tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Generated tokens.", labels, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between two steps that gave a request tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        reg.register(EngineStatsCollector(model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- StepObserver (engine thread) ----------------------------------------------------------

    def on_step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._observe(output)

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)

    def _observe(self, output: RequestOutput) -> None:
        metrics = output.metrics
        now = metrics.last_token_time
        num_new = sum(len(o.delta_token_ids) for o in output.outputs)
        if now is None or num_new == 0:
            return
        previous = self._last_token_time.get(output.request_id)
        if previous is None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.totals.prompt_tokens += len(output.prompt_token_ids)
            self.ttft.observe(now - metrics.arrival_time)
        else:
            self.itl.observe(now - previous)
        self.generation_tokens.inc(num_new)
        self.totals.generation_tokens += num_new
        self._last_token_time[output.request_id] = now
        if output.finished:
            self._finish(output)

    def _finish(self, output: RequestOutput) -> None:
        self._last_token_time.pop(output.request_id, None)
        finished_time = output.metrics.finished_time or output.metrics.last_token_time
        if finished_time is not None:
            self.e2e.observe(finished_time - output.metrics.arrival_time)
        for completion in output.outputs:
            reason = completion.finish_reason or "unknown"
            self.request_success.labels(self.model_name, reason).inc()


class EngineStatsCollector(Collector):
    """Gauges read from the engine thread's last snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        gauges = {
            "num_requests_running": ("Requests being computed.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks in use (1 = full).",
                stats.kv_cache_usage,
            ),
            "prefix_cache_hit_rate": ("Prefix-cache hits / lookups.", stats.prefix_cache_hit_rate),
            "kv_cache_free_blocks": ("KV blocks in the free pool.", stats.num_free_blocks),
            "kv_cache_num_blocks": ("KV blocks in all.", stats.num_blocks),
        }
        for name, (doc, value) in gauges.items():
            yield self._gauge(name, doc, value)
        preemptions = CounterMetricFamily(
            f"{PREFIX}num_preemptions",
            "Requests preempted (recomputed later).",
            labels=["model_name"],
        )
        preemptions.add_metric([self.model_name], stats.num_preemptions)
        yield preemptions

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge


class StatLogger:
    """Logs throughput, queue and KV cache every `interval` seconds while there is traffic."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], EngineStats], interval: float):
        self.metrics = metrics
        self.stats = stats
        self.interval = interval

    async def run(self) -> None:
        last, last_time = replace(self.metrics.totals), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            totals, now = replace(self.metrics.totals), time.monotonic()
            stats = self.stats()
            if totals != last or stats.num_running or stats.num_waiting:
                self._log(totals, last, now - last_time, stats)
            last, last_time = totals, now

    @staticmethod
    def _log(totals: TokenTotals, last: TokenTotals, seconds: float, stats: EngineStats) -> None:
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
            "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: "
            "%.1f%%",
            (totals.prompt_tokens - last.prompt_tokens) / seconds,
            (totals.generation_tokens - last.generation_tokens) / seconds,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * stats.prefix_cache_hit_rate,
        )
