"""Prometheus metrics of a fabric, by Prometheus' conventions.

Counters end in ``_total``; units are base units in the name (``_seconds``,
``_bytes``, ``_tokens``); latency and transfer sizes are histograms; labels
say which tier, direction, outcome or rank. Every series exists from the first
scrape (zeros included). A scrape reads a snapshot the coordinator refreshes
each second from ``CoordinatorCore.figures()`` — counters and sizes it keeps as
it goes, never a tree walk or an L3 scan. ``METRICS`` is the list the README
documents. The HTTP endpoint binds to 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from fabric.cache.results import DIRECTIONS
from fabric.observe.histogram import Histogram

TIERS = ("device", "host", "storage", "computed")
OUTCOMES = ("finished", "failed", "aborted")
PREFETCH_REFUSALS = ("below prefetch threshold", "no storage attached", "rate limited")
L3_REFUSALS = ("checksum", "format", "key", "provenance", "truncated", "symlink")

Samples = list[tuple[tuple[str, ...], float]]


@dataclass(frozen=True)
class Spec:
    """One metric: name (without ``_total`` for counters), type, unit, help,
    label names, and how to read its samples from a snapshot."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...]
    read: Callable[[Mapping[str, Any]], Any]


def _each(key: str, names: tuple[str, ...], scale: str = "") -> Callable[[Mapping], Samples]:
    def read(f: Mapping) -> Samples:
        values = f[key]
        k = f["kv_bytes_per_token"] if scale == "bytes" else 1
        return [((n,), float(values.get(n, 0)) * k) for n in names]

    return read


def _one(key: str) -> Callable[[Mapping], Samples]:
    return lambda f: [((), float(f[key]))]


def _pool(f: Mapping) -> Samples:
    pool = f["pool"]
    dev, host = pool["device"], pool["host"]
    return [
        (("device", "free"), dev["free"]),
        (("device", "evictable"), dev["evictable"]),
        (("device", "protected"), dev["protected"]),
        (("host", "free"), host["free"]),
        (("host", "used"), host["capacity"] - host["free"]),
    ]


def _l3(key: str) -> Callable[[Mapping], Samples]:
    return lambda f: [((), float(f["l3"].get(key, 0)))]


def _l3_refused(f: Mapping) -> Samples:
    l3 = f["l3"]
    return [((r,), float(l3.get(f"refused_{r}", 0))) for r in L3_REFUSALS]


METRICS: tuple[Spec, ...] = (
    Spec(
        "kvfabric_requests_submitted",
        "counter",
        "Requests submitted to the coordinator (decode appends included).",
        (),
        lambda f: [((), float(f["requests"]["submitted"]))],
    ),
    Spec(
        "kvfabric_requests",
        "counter",
        "Requests that ended, by outcome: finished (KV leased), failed (an error "
        "returned), aborted (by the client or a timeout).",
        ("outcome",),
        lambda f: [((o,), float(f["requests"][o])) for o in OUTCOMES],
    ),
    Spec(
        "kvfabric_request_retries",
        "counter",
        "Requests put back in the queue after a reset (rank lost or restarted).",
        (),
        lambda f: [((), float(f["requests"]["retried"]))],
    ),
    Spec(
        "kvfabric_prompt_tokens",
        "counter",
        "Prompt tokens of finished requests by where their KV came from: device "
        "(L1 hit), host (L2, loaded back), storage (L3, prefetched) or computed.",
        ("source",),
        _each("prompt_tokens", TIERS),
    ),
    Spec(
        "kvfabric_evicted_tokens",
        "counter",
        "Tokens whose KV was evicted from a tier (device: L1, host: L2).",
        ("tier",),
        _each("evicted_tokens", ("device", "host")),
    ),
    Spec(
        "kvfabric_transfer_tokens",
        "counter",
        "Tokens of KV copied between tiers, by direction (completed copies).",
        ("direction",),
        _each("transfer_tokens", DIRECTIONS),
    ),
    Spec(
        "kvfabric_transfer_bytes",
        "counter",
        "Bytes of KV copied between tiers, by direction, all ranks together.",
        ("direction",),
        _each("transfer_tokens", DIRECTIONS, scale="bytes"),
    ),
    Spec(
        "kvfabric_failed_write_tokens",
        "counter",
        "Tokens whose L1 -> L2 write-through failed on some rank (they stay L1-only).",
        (),
        _one("failed_write_tokens"),
    ),
    Spec(
        "kvfabric_failed_backups",
        "counter",
        "L2 -> L3 backups that failed on some rank or in the storage actor.",
        (),
        _one("failed_backups"),
    ),
    Spec(
        "kvfabric_bad_hit_answers",
        "counter",
        "Hit answers from the storage actor refused because their page hashes are "
        "not the chain of the pages asked about (the prefetch is revoked).",
        (),
        _one("bad_hit_answers"),
    ),
    Spec(
        "kvfabric_transfer_size_tokens",
        "histogram",
        "Tokens moved by one transfer operation, by direction.",
        ("direction",),
        lambda f: [((d,), f["transfer_sizes"][d]) for d in DIRECTIONS],
    ),
    Spec(
        "kvfabric_request_duration_seconds",
        "histogram",
        "Seconds from a request's submission to its result (queueing, prefetch, "
        "load-back and compute included).",
        (),
        lambda f: [((), f["request_seconds"])],
    ),
    Spec(
        "kvfabric_consensus_round_duration_seconds",
        "histogram",
        "Seconds of one consensus round: batch sent to every rank until their "
        "reports are reduced (MIN/MAX).",
        (),
        lambda f: [((), f["round_seconds"])],
    ),
    Spec(
        "kvfabric_consensus_rounds",
        "counter",
        "Consensus rounds (coordinator steps) run.",
        (),
        _one("rounds"),
    ),
    Spec(
        "kvfabric_resets",
        "counter",
        "L1/L2 resets (a rank lost, restarted or failing a copy).",
        (),
        _one("resets"),
    ),
    Spec(
        "kvfabric_bad_messages",
        "counter",
        "Rank reports refused as malformed.",
        (),
        _one("bad_messages"),
    ),
    Spec(
        "kvfabric_step_errors",
        "counter",
        "Coordinator steps that failed and were recovered from.",
        (),
        _one("step_errors"),
    ),
    Spec(
        "kvfabric_storage_errors",
        "counter",
        "Calls to the storage actor that failed.",
        (),
        _one("storage_errors"),
    ),
    Spec(
        "kvfabric_leases_expired",
        "counter",
        "Leases dropped because their TTL passed unrenewed.",
        (),
        _one("leases_expired"),
    ),
    Spec(
        "kvfabric_leases_reclaimed",
        "counter",
        "Leases dropped because the driver that held them exited.",
        (),
        _one("leases_reclaimed"),
    ),
    Spec(
        "kvfabric_events_dropped",
        "counter",
        "KV events dropped from a full queue that nobody took them from.",
        (),
        _one("events_dropped"),
    ),
    Spec(
        "kvfabric_events_queued",
        "gauge",
        "KV events queued for take_events (or the publisher).",
        (),
        _one("events_queued"),
    ),
    Spec(
        "kvfabric_adopted_tokens",
        "counter",
        "L2 tokens a restarted coordinator took back from what every rank still held.",
        (),
        _one("adopted_tokens"),
    ),
    Spec(
        "kvfabric_coordinator_busy_seconds",
        "counter",
        "Seconds the coordinator spent in its own logic (admission, reduction, commit).",
        (),
        _one("core_seconds"),
    ),
    Spec(
        "kvfabric_prefetches_started",
        "counter",
        "L3 -> L2 prefetches started.",
        (),
        _one("prefetch_started"),
    ),
    Spec(
        "kvfabric_prefetches_refused",
        "counter",
        "L3 prefetches not started, by reason.",
        ("reason",),
        _each("prefetch_refusals", PREFETCH_REFUSALS),
    ),
    Spec(
        "kvfabric_pool_capacity_tokens",
        "gauge",
        "Tokens a tier's pool holds (device: L1, host: L2).",
        ("tier",),
        lambda f: [((t,), float(f["pool"][t]["capacity"])) for t in ("device", "host")],
    ),
    Spec(
        "kvfabric_pool_tokens",
        "gauge",
        "Tokens of a tier's pool by state: free; on device also evictable (cached, "
        "unlocked) and protected (locked or leased); on host used.",
        ("tier", "state"),
        _pool,
    ),
    Spec(
        "kvfabric_requests_in_progress",
        "gauge",
        "Requests at the coordinator by stage (waiting, prefetching, running).",
        ("stage",),
        lambda f: [((k,), float(v)) for k, v in f["requests_now"].items()],
    ),
    Spec(
        "kvfabric_transfers_in_flight",
        "gauge",
        "Copy operations sent to the ranks or the storage actor and not yet completed.",
        ("direction",),
        _each("inflight_transfers", DIRECTIONS),
    ),
    Spec("kvfabric_leases", "gauge", "Leases held by clients.", (), _one("leases")),
    Spec("kvfabric_sessions", "gauge", "Sessions keeping their KV.", (), _one("sessions")),
    Spec(
        "kvfabric_session_tokens",
        "gauge",
        "Tokens held for sessions.",
        (),
        _one("session_tokens"),
    ),
    Spec(
        "kvfabric_pinned_tokens", "gauge", "Tokens pinned in the cache.", (), _one("pinned_tokens")
    ),
    Spec(
        "kvfabric_epoch",
        "gauge",
        "The coordinator's epoch (rises on every restart).",
        (),
        _one("epoch"),
    ),
    Spec(
        "kvfabric_rank_up",
        "gauge",
        "1 while a rank answers the coordinator's rounds, 0 while it is absent.",
        ("rank",),
        lambda f: [((r,), float(up)) for r, up in f["ranks"].items()],
    ),
    Spec(
        "kvfabric_rank_lag_seconds",
        "histogram",
        "How long after the first rank a rank finished the commands it reported done "
        "in a round (or replied to it, if later), by rank: a straggler's stand apart.",
        ("rank",),
        lambda f: [((r,), h) for r, h in f["rank_lag_seconds"].items()],
    ),
    Spec(
        "kvfabric_rank_straggling",
        "gauge",
        "1 while a rank is named a straggler (runtime.straggler_*), else 0.",
        ("rank",),
        lambda f: [((r,), float(r in f["stragglers"])) for r in f["rank_lag_seconds"]],
    ),
    Spec(
        "kvfabric_stragglers_named",
        "counter",
        "Times a rank was named a straggler.",
        (),
        _one("stragglers_named"),
    ),
    Spec(
        "kvfabric_l3_pages",
        "gauge",
        "Page shards in L3 (as its backend counts them; 0 where it cannot say cheaply).",
        (),
        _l3("pages"),
    ),
    Spec(
        "kvfabric_l3_size_bytes",
        "gauge",
        "Bytes in L3 (as its backend counts them; 0 where it cannot say cheaply).",
        (),
        _l3("bytes"),
    ),
    Spec(
        "kvfabric_l3_read_pages",
        "counter",
        "Page shards read from L3 and served.",
        (),
        _l3("get_pages"),
    ),
    Spec(
        "kvfabric_l3_written_pages",
        "counter",
        "Page shards written to L3.",
        (),
        _l3("set_pages"),
    ),
    Spec(
        "kvfabric_l3_write_failed_pages",
        "counter",
        "Page shards L3 did not store because the write failed (a read-only or full "
        "store: see the status line).",
        (),
        _l3("set_failed"),
    ),
    Spec(
        "kvfabric_l3_writable",
        "gauge",
        "1 while L3 takes writes, 0 after a write failed (until one goes through).",
        (),
        lambda f: [((), float(not f["l3"].get("write_error")))],
    ),
    Spec(
        "kvfabric_l3_missed_pages",
        "counter",
        "Page shards asked of L3 that it did not hold.",
        (),
        _l3("get_miss"),
    ),
    Spec(
        "kvfabric_l3_refused_pages",
        "counter",
        "Page shards read from L3 and refused by an integrity check, by reason.",
        ("reason",),
        _l3_refused,
    ),
    Spec(
        "kvfabric_kv_event_batches",
        "counter",
        "KV event batches published on ZMQ.",
        (),
        lambda f: [((), float(f["kv_events"].get("published_batches", 0)))],
    ),
    Spec(
        "kvfabric_kv_event_batches_dropped",
        "counter",
        "KV event batches dropped because the publisher's queue was full.",
        (),
        lambda f: [((), float(f["kv_events"].get("dropped_batches", 0)))],
    ),
)


def _frozen(value: Any) -> Any:
    """Histograms copied as ``(buckets, sum)`` so a scrape in another thread reads
    a consistent snapshot; everything else as is."""
    if isinstance(value, Histogram):
        return (value.buckets(), value.sum)
    if isinstance(value, Mapping):
        return {k: _frozen(v) for k, v in value.items()}
    return value


class FabricCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        f = self.snapshot
        if f is None:
            return
        for spec in METRICS:
            yield _family(spec, spec.read(f))


def _family(spec: Spec, samples: Any) -> Metric:
    labels = list(spec.labels)
    if spec.kind == "histogram":
        fam = HistogramMetricFamily(spec.name, spec.help, labels=labels)
        for values, (buckets, total) in samples:
            fam.add_metric(list(values), buckets, total)
        return fam
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    fam = cls(spec.name, spec.help, labels=labels)
    for values, value in samples:
        fam.add_metric(list(values), value)
    return fam


class MetricsExporter:
    """Owns a registry with the fabric's collector; ``update`` swaps in a new
    snapshot (from the thread that owns the core), scrapes read the last one."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collector = FabricCollector()
        self.registry.register(self.collector)

    def update(
        self,
        figures: Mapping[str, Any],
        l3: Mapping[str, Any] | None = None,
        kv_events: Mapping[str, Any] | None = None,
    ) -> None:
        snapshot = _frozen(figures)
        snapshot["l3"] = dict(l3 or {})
        snapshot["kv_events"] = dict(kv_events or {})
        self.collector.snapshot = snapshot

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
