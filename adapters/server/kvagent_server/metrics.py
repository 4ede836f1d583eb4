"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """Counters, histograms and gauges; gauges of state read their value when scraped."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("kvagent_prompt_tokens", "Prompt tokens of generations, by where their KV came "
                                     "from (reused: cached, transplanted: compiled skills, computed: prefilled).",
                                     ["kind"], registry=r)
        self.generated_tokens = Counter("kvagent_generated_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("kvagent_ttft_seconds", "Time from a generation's start to its first token "
                              "(server side).", buckets=TTFT_BUCKETS, registry=r)
        self.request_time = Histogram("kvagent_request_seconds", "Time to serve a request, streams to their last "
                                      "event.", ["route"], buckets=REQUEST_BUCKETS, registry=r)
        self.responses = Counter("kvagent_responses", "Responses by status code.", ["code"], registry=r)
        self.implicit_edits = Counter("kvagent_implicit_edits", "Changed regions of resent prompts, by what was done: "
                                      "replace, delete or insert (edited in place) or fallback (recomputed).",
                                      ["kind"], registry=r)
        self.errata = Counter("kvagent_errata", "Errata appended by field edits.", registry=r)
        self.evicted_cells = Counter("kvagent_evicted_cells", "KV cells removed by sessions' eviction cycles.",
                                     registry=r)
        self.parked = Counter("kvagent_parks", "Sessions parked (saved, sequence freed).", registry=r)
        self.restored = Counter("kvagent_restores", "Parked sessions restored on their next request.", registry=r)
        self.expired = Counter("kvagent_sessions_expired", "Keyed sessions forgotten after --session-idle-s unused.",
                               registry=r)
        self.cancelled = Counter("kvagent_cancelled_generations", "Generations cancelled (client gone) and rolled "
                                 "back.", registry=r)
        self.layouts = Counter("kvagent_proxy_layouts", "Requests forwarded to an engine, by layout: new, append, "
                               "inplace (a change near the end), errata, rebuild (errata folded in).", ["kind"],
                               registry=r)
        self.upstream_errors = Counter("kvagent_proxy_upstream_errors", "Engine failures seen by the proxy "
                                       "(interrupted: a stream stopped mid-reply).", ["kind"], registry=r)
        self.sessions = Gauge("kvagent_sessions", "Sessions by state (active: holding a sequence; parked).", ["state"],
                              registry=r)
        self.kv_cells_used = Gauge("kvagent_kv_cells_used", "KV cells held by live sessions (shared prefixes once).",
                                   registry=r)
        self.kv_cells_total = Gauge("kvagent_kv_cells_total", "Size of the KV pool.", registry=r)
        self.retained = Gauge("kvagent_retained", "Closed sessions' KV kept for reuse: sequences in the pool, and "
                              "prefixes stored in the ram and disk tiers.", ["where"], registry=r)
        self.retained_bytes = Gauge("kvagent_retained_bytes", "Bytes of the prefixes stored in each tier.", ["tier"],
                                    registry=r)
        self.requests_running = Gauge("kvagent_requests_running", "Requests working on a session now.", registry=r)
        self.requests_waiting = Gauge("kvagent_requests_waiting", "Requests waiting for their session or for room.",
                                      registry=r)

    def watch(self, *, active: Callable[[], float], parked: Callable[[], float], cells: Callable[[], float],
              total: int) -> None:
        """Read the state gauges from these callables at scrape time."""
        self.sessions.labels("active").set_function(active)
        self.sessions.labels("parked").set_function(parked)
        self.kv_cells_used.set_function(cells)
        self.kv_cells_total.set(total)

    def watch_retained(self, engine: Any) -> None:
        """The engine's retained sequences and tiers (``kvagent.kv.pool``, ``kvagent.kv.tiers``), read at scrape
        time."""
        self.retained.labels("pool").set_function(lambda: float(len(engine.pool.retained)))
        tiers = engine.tiers.tiers() if engine.tiers is not None else []
        for tier in tiers:
            self.retained.labels(tier.name).set_function(lambda t=tier: float(len(t)))
            self.retained_bytes.labels(tier.name).set_function(lambda t=tier: float(t.bytes))
        if tiers:
            self.registry.register(_TierRestores(tiers))

    def watch_sessions(self, held: Callable[[], float]) -> None:
        """The proxy's sessions (layouts held), read at scrape time."""
        self.sessions.labels("layouts").set_function(held)

    def count_generation(self, reused: int, computed: int, transplanted: int, generated: int,
                         ttft_s: float | None = None) -> None:
        self.prompt_tokens.labels("reused").inc(reused)
        self.prompt_tokens.labels("computed").inc(computed)
        self.prompt_tokens.labels("transplanted").inc(transplanted)
        self.generated_tokens.inc(generated)
        if generated and ttft_s is not None:
            self.ttft.observe(ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TierRestores(Collector):
    """``kvagent_tier_restores_total{tier}``: prefixes a new session restored from each tier (``Tier.restores``, read
    at scrape time): whether the tiers earn their memory."""

    def __init__(self, tiers: list[Any]) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("kvagent_tier_restores", "Prefixes restored from each tier by new sessions.",
                                     labels=["tier"])
        for tier in self.tiers:
            family.add_metric([tier.name], float(tier.restores))
        yield family
