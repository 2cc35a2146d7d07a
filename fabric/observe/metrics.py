"""Prometheus metrics of a fabric, by Prometheus' conventions.

Counters end in ``_total``; units are base units in the name (``_seconds``,
``_bytes``, ``_tokens``); latency and transfer sizes are histograms; labels
say which tier, direction, outcome or rank. Every series exists from the first
scrape (zeros included). A scrape reads the figures the coordinator hands over
each second (``fabric.coordinator.figures``: counters and sizes it keeps as it
goes, never a tree walk or an L3 scan).

Most series are declared where their figure is defined (a ``Series`` on its
field, ``fabric.observe.series``) and found by walking the figures; the few
computed from several figures, and L3's and the KV publisher's (dicts from the
storage actors and the publisher), are ``DERIVED`` here. ``METRICS`` is every
series, the list docs/observing.md documents. The HTTP endpoint binds to 127.0.0.1
unless configured otherwise.
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

from fabric.coordinator.figures import Figures
from fabric.observe.histogram import Histogram
from fabric.observe.series import Samples, Series, declared, label_names, walk

L3_REFUSALS = ("checksum", "format", "key", "provenance", "truncated", "symlink")


@dataclass(frozen=True)
class Scrape:
    """What one scrape reads: the coordinator's figures, L3's counters (the storage
    actors' dict) and the KV event publisher's."""

    figures: Figures
    l3: Mapping[str, Any]
    kv_events: Mapping[str, Any]


@dataclass(frozen=True)
class Derived:
    series: Series
    read: Callable[[Scrape], Samples]


def _transfer_bytes(s: Scrape) -> Samples:
    per_token = s.figures.kv_bytes_per_token
    return [((d,), float(n * per_token)) for d, n in s.figures.transfer_tokens.items()]


def _pool(s: Scrape) -> Samples:
    dev, host = s.figures.device, s.figures.host
    return [
        (("device", "free"), dev.free),
        (("device", "evictable"), dev.evictable),
        (("device", "protected"), dev.protected),
        (("host", "free"), host.free),
        (("host", "used"), host.capacity - host.free),
    ]


def _tenant_pages(tenants: Mapping[str, Mapping[str, int]]) -> Samples:
    """Per place and tenant; from the first scrape, the connector's default tenant's
    L3 (``vllm``, 0 pages)."""
    out: Samples = [((p, t), float(n)) for p, by in tenants.items() for t, n in by.items()]
    return out or [(("l3", "vllm"), 0.0)]


def _l3(key: str) -> Callable[[Scrape], Samples]:
    return lambda s: [((), float(s.l3.get(key, 0)))]


def _published(key: str) -> Callable[[Scrape], Samples]:
    return lambda s: [((), float(s.kv_events.get(key, 0)))]


DERIVED: tuple[Derived, ...] = (
    Derived(
        Series(
            "kvfabric_transfer_bytes",
            "counter",
            "Bytes of KV copied between tiers, by direction, all ranks together.",
            by="direction",
        ),
        _transfer_bytes,
    ),
    Derived(
        Series(
            "kvfabric_pool_capacity_tokens",
            "gauge",
            "Tokens a tier's pool holds (device: L1, host: L2).",
            by="tier",
        ),
        lambda s: [(("device",), s.figures.device.capacity), (("host",), s.figures.host.capacity)],
    ),
    Derived(
        Series(
            "kvfabric_pool_tokens",
            "gauge",
            "Tokens of a tier's pool by state: free; on device also evictable (cached, "
            "unlocked) and protected (locked or leased); on host used.",
            (("tier", ""),),  # two labels; each sample of ``_pool`` gives both values
            by="state",
        ),
        _pool,
    ),
    Derived(
        Series(
            "kvfabric_rank_straggling",
            "gauge",
            "1 while a rank is named a straggler (runtime.straggler_*), else 0.",
            by="rank",
        ),
        lambda s: [((r,), float(r in s.figures.ranks.stragglers)) for r in s.figures.ranks.up],
    ),
    Derived(
        Series(
            "kvfabric_l3_pages",
            "gauge",
            "Page shards in L3 (as its backend counts them; 0 where it cannot say cheaply).",
        ),
        _l3("pages"),
    ),
    Derived(
        Series(
            "kvfabric_l3_size_bytes",
            "gauge",
            "Bytes in L3 (as its backend counts them; 0 where it cannot say cheaply).",
        ),
        _l3("bytes"),
    ),
    Derived(
        Series("kvfabric_l3_read_pages", "counter", "Page shards read from L3 and served."),
        _l3("get_pages"),
    ),
    Derived(
        Series("kvfabric_l3_written_pages", "counter", "Page shards written to L3."),
        _l3("set_pages"),
    ),
    Derived(
        Series(
            "kvfabric_l3_write_failed_pages",
            "counter",
            "Page shards L3 did not store because the write failed (a read-only or full "
            "store: see the status line).",
        ),
        _l3("set_failed"),
    ),
    Derived(
        Series(
            "kvfabric_l3_writable",
            "gauge",
            "1 while L3 takes writes, 0 after a write failed (until one goes through).",
        ),
        lambda s: [((), float(not s.l3.get("write_error")))],
    ),
    Derived(
        Series(
            "kvfabric_l3_missed_pages", "counter", "Page shards asked of L3 that it did not hold."
        ),
        _l3("get_miss"),
    ),
    Derived(
        Series(
            "kvfabric_l3_refused_pages",
            "counter",
            "Page shards read from L3 and refused by an integrity check, by reason.",
            by="reason",
        ),
        lambda s: [((r,), float(s.l3.get(f"refused_{r}", 0))) for r in L3_REFUSALS],
    ),
    Derived(
        Series(
            "kvfabric_engine_tenant_pages",
            "gauge",
            "Engine pages whole in a place, by place and tenant (the connector's namespace).",
            (("place", ""),),  # two labels; each sample gives both values
            by="tenant",
        ),
        lambda s: _tenant_pages(s.figures.engines.tenants),
    ),
    Derived(
        Series("kvfabric_kv_event_batches", "counter", "KV event batches published on ZMQ."),
        _published("published_batches"),
    ),
    Derived(
        Series(
            "kvfabric_kv_event_batches_dropped",
            "counter",
            "KV event batches dropped because the publisher's queue was full.",
        ),
        _published("dropped_batches"),
    ),
)

METRICS: tuple[Series, ...] = (*declared(Figures), *(d.series for d in DERIVED))


class FabricCollector(Collector):
    def __init__(self) -> None:
        self.scrape: Scrape | None = None

    def collect(self) -> Iterator[Metric]:
        scrape = self.scrape
        if scrape is None:
            return
        families: dict[str, tuple[Series, Samples]] = {}
        for series, samples in walk(scrape.figures):
            if series.name in families:
                families[series.name][1].extend(samples)
            else:
                families[series.name] = (series, list(samples))
        for d in DERIVED:
            families[d.series.name] = (d.series, d.read(scrape))
        for series, samples in families.values():
            yield _family(series, samples)


def _family(series: Series, samples: Samples) -> Metric:
    labels = list(label_names(series))
    if series.kind == "histogram":
        fam = HistogramMetricFamily(series.name, series.help, labels=labels)
        for values, hist in samples:
            assert isinstance(hist, Histogram)
            fam.add_metric(list(values), hist.buckets(), hist.sum)
        return fam
    cls = CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily
    fam = cls(series.name, series.help, labels=labels)
    for values, value in samples:
        fam.add_metric(list(values), float(value))
    return fam


class MetricsExporter:
    """Owns a registry with the fabric's collector; ``update`` swaps in new figures
    (from the thread that owns the core: they are a copy), scrapes read the last."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collector = FabricCollector()
        self.registry.register(self.collector)

    def update(
        self,
        figures: Figures,
        l3: Mapping[str, Any] | None = None,
        kv_events: Mapping[str, Any] | None = None,
    ) -> None:
        self.collector.scrape = Scrape(figures, dict(l3 or {}), dict(kv_events or {}))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
