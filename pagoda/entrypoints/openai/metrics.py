"""Prometheus metrics of the server, under pagoda's names and under vLLM's `vllm:` names.

Load gauges and prefix-cache counters are read from the engine's stats snapshot at scrape time;
latency histograms and token counters are fed per request by `RequestTracker` as its consumer
sees outputs. The `vllm:` series carry the names, types and labels of vLLM's v1 server, so a
Grafana dashboard built for vLLM finds them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as prometheus_text
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.engine.engine_process import ServerEngine
from pagoda.outputs import RequestOutput

# fmt: off
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# fmt: on


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest stats snapshot at scrape time."""

    def __init__(self, engine: ServerEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        labels = [self.model_name]
        running = ("Samples being computed.", s.num_running)
        waiting = ("Samples waiting for a slot.", s.num_waiting)
        usage = ("Fraction of KV cache blocks in use (0-1).", s.kv_cache_usage)
        gauges = [
            ("pagoda_num_requests_running", *running),
            ("pagoda_num_requests_waiting", *waiting),
            ("pagoda_kv_cache_usage_perc", *usage),
            ("pagoda_kv_cache_free_blocks", "Free KV cache blocks.", s.num_free_blocks),
            ("pagoda_kv_cache_total_blocks", "Usable KV cache blocks.", s.num_blocks),
            (
                "pagoda_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache (fraction, since start-up).",
                s.prefix_cache_hit_rate,
            ),
            ("vllm:num_requests_running", *running),
            ("vllm:num_requests_waiting", *waiting),
            ("vllm:kv_cache_usage_perc", *usage),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        queries = ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        hits = ("Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        counters = [
            ("pagoda_prefix_cache_queries", *queries),
            ("pagoda_prefix_cache_hits", *hits),
            ("pagoda_engine_steps", "Engine steps (batches) run.", s.num_steps),
            ("vllm:prefix_cache_queries", *queries),
            ("vllm:prefix_cache_hits", *hits),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c
        loads = getattr(self.engine, "loads", None)  # data parallel: per-replica load
        if loads is not None:
            g = GaugeMetricFamily(
                "pagoda_replica_requests",
                "Requests in flight per data-parallel replica.",
                labels=["model_name", "replica"],
            )
            for i, n in enumerate(loads()):
                g.add_metric([self.model_name, str(i)], n)
            yield g


class _Alias(Collector):
    """The series of one metric again under other names, read at scrape time.

    Each observation is recorded once (histogram observes take a lock and walk the buckets,
    once per streamed token) and shown under pagoda's name and vLLM's.
    """

    def __init__(self, metric: Histogram | Counter, names: list[str]) -> None:
        self.metric = metric
        self.names = names

    def collect(self) -> Iterator[Metric]:
        for family in self.metric.collect():
            for name in self.names:
                alias = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    alias.add_sample(
                        name + sample.name[len(family.name) :],
                        sample.labels,
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield alias


class Metrics:
    """Everything /metrics shows, in a private registry (several apps may share a process)."""

    def __init__(self, engine: ServerEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self._model_name = model_name

        def hist(
            name: str, doc: str, aliases: tuple[str, ...] = (), buckets: tuple = _LATENCY_BUCKETS
        ) -> Histogram:
            parent = Histogram(
                name, doc, buckets=buckets, registry=self.registry, labelnames=["model_name"]
            )
            if aliases:
                self.registry.register(_Alias(parent, list(aliases)))
            return parent.labels(model_name)

        def counter(name: str, doc: str, aliases: tuple[str, ...] = ()) -> Counter:
            parent = Counter(name, doc, registry=self.registry, labelnames=["model_name"])
            if aliases:
                self.registry.register(_Alias(parent, list(aliases)))
            return parent.labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ("pagoda_time_to_first_token_seconds",),
        )
        # vLLM 0.9+ names ITL `inter_token_latency`; `time_per_output_token` is its older
        # name for the same series, still read by many dashboards.
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            ("vllm:time_per_output_token_seconds", "pagoda_inter_token_latency_seconds"),
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token of each finished request (decode time / (tokens - 1)).",
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            ("pagoda_e2e_request_latency_seconds",),
        )
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", (), _TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", (), _TOKEN_BUCKETS
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of admitted requests.", ("pagoda_prompt_tokens",)
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Generated tokens.", ("pagoda_generation_tokens",)
        )
        self._finished = Counter(
            "pagoda_requests_finished",
            "Finished requests (samples) by finish reason; abort: the client left.",
            registry=self.registry,
            labelnames=["model_name", "finish_reason"],
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests (samples) by finish reason.",
            registry=self.registry,
            labelnames=["model_name", "finished_reason"],
        )

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()
        self._success.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return prometheus_text(self.registry)


class RequestTracker:
    """Times one engine request as its consumer sees it and feeds the histograms."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_counted = False
        self.finished = False
        self.num_generated = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        m = self.metrics
        if not self.prompt_counted:
            self.prompt_counted = True
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if self.last_token is None:
                m.ttft.observe(now - self.arrival)
                self.first_token = now
            else:
                m.itl.observe(now - self.last_token)
            self.last_token = now
            self.num_generated += new_tokens
            m.generation_tokens.inc(new_tokens)
        if out.finished:
            self.finished = True
            m.e2e.observe(now - self.arrival)
            m.request_generation_tokens.observe(self.num_generated)
            samples = max(len(out.outputs), 1)
            per_sample = self.num_generated / samples
            if self.first_token is not None and per_sample > 1:
                m.tpot.observe((now - self.first_token) / (per_sample - 1))
            for c in out.outputs:
                m.finished(c.finish_reason or "unknown")

    def close(self) -> None:
        """The consumer is done: a request that did not finish was aborted (client left)."""
        if not self.finished:
            self.finished = True
            self.metrics.finished("abort")
