"""Prometheus metrics under the `fluxlab:` prefix, named as vLLM names them so dashboards carry over.

Each app gets its own CollectorRegistry (tests build several apps in one process). Engine-wide
counters and gauges are read from the engine thread's snapshot at scrape time; per-request
histograms are observed by the HTTP handlers when a request ends.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fluxlab.server.async_engine import AsyncEngine

# `*_created` series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

PREFIX = "fluxlab:"
# Latencies on CPU (tiny model) are milliseconds, on a busy GPU server tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPF_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class _EngineCollector(Collector):
    """Gauges and monotonic totals straight from the engine snapshot."""

    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.async_engine, self.model_name = async_engine, model_name

    def collect(self) -> Iterator:
        snap, labels = self.async_engine.snapshot, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", self.async_engine.num_waiting)
        yield gauge("kv_free_pages", "Free KV cache pages.", snap.kv_free_pages)
        yield gauge("kv_total_pages", "KV cache pages in the pool.", snap.kv_total_pages)
        yield gauge("kv_cached_pages", "KV pages holding prefix-cache blocks (unreferenced ones also count as free).",
                    snap.kv_cached_pages)
        yield counter("prefix_cache_queries", "Final leading blocks (block_length tokens each) looked up in the prefix cache at admission.",
                      snap.prefix_cache_queried_blocks)
        yield counter("prefix_cache_hits", "Looked-up blocks found in the prefix cache (their K/V is reused).",
                      snap.prefix_cache_hit_blocks)
        yield counter("generation_tokens", "Output tokens committed by the engine.", snap.total_generated_tokens)
        yield counter("forwards", "Model forwards run by the engine.", snap.total_forwards)
        yield counter("graph_forwards", "Forwards that replayed a CUDA graph (the rest ran eagerly).",
                      snap.graph_forwards)
        yield counter("forwards_launched_ahead", "Forwards launched before the last step's postprocess (async "
                      "scheduling: no block finished, so the same rows went again at once).", snap.forwards_launched_ahead)
        yield counter("engine_step_seconds", "Wall time of engine steps that ran a forward (schedule, forward, "
                      "decode); over forwards it is the mean step latency.", snap.total_step_seconds)
        yield counter("engine_host_seconds", "Of engine_step_seconds, the host work the GPU waits for: "
                      "from a forward's results to the next launch.", snap.total_host_seconds)
        tpf = snap.total_generated_tokens / snap.total_forwards if snap.total_forwards else 0.0
        yield gauge("avg_tokens_per_forward", "Generated tokens / forwards since start.", tpf)


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first committed block.",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last output.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens_per_forward = Histogram(PREFIX + "tokens_per_forward", "Accepted tokens per forward, per request.",
                                            labels, buckets=TPF_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.",
                                     labels, registry=self.registry)
        self.request_success = Counter(PREFIX + "request_success", "Requests that finished (stop or length), "
                                       "by finish reason.", labels + ["finished_reason"], registry=self.registry)
        self.request_aborted = Counter(PREFIX + "request_aborted", "Accepted requests that ended early: the client "
                                       "went away, or the server shut down.", labels + ["reason"],
                                       registry=self.registry)
        self.request_failed = Counter(PREFIX + "request_failed", "Accepted requests that the engine failed "
                                      "(a server error).", labels, registry=self.registry)
        self.request_rejected = Counter(PREFIX + "request_rejected", "Requests answered with an error before "
                                        "they reached the engine, by HTTP status.", labels + ["status"],
                                        registry=self.registry)
        self.registry.register(_EngineCollector(async_engine, model_name))

    def observe_finished(self, ttft_s: float, e2e_s: float, tokens_per_forward: float, finish_reason: str,
                         prompt_tokens: int) -> None:
        m = self.model_name
        self.ttft.labels(m).observe(ttft_s)
        self.e2e.labels(m).observe(e2e_s)
        if tokens_per_forward > 0:
            self.tokens_per_forward.labels(m).observe(tokens_per_forward)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.request_success.labels(m, finish_reason).inc()

    def observe_aborted(self, reason: str) -> None:
        self.request_aborted.labels(self.model_name, reason).inc()

    def observe_failed(self) -> None:
        self.request_failed.labels(self.model_name).inc()

    def observe_rejected(self, status: int) -> None:
        self.request_rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


