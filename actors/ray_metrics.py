"""kvfabric's figures as ``ray.util.metrics``, so they reach Ray's metrics export
(and the dashboard's metrics view) next to Ray's own. Counters are fed with the
increase since the last update (Ray refuses an increase of 0, so a series
appears once it first grows; the Prometheus endpoint has every series from the
start)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from fabric.cache.results import DIRECTIONS
from fabric.coordinator.figures import Figures
from fabric.observe.histogram import SECONDS


class _Deltas:
    """A Counter fed from cumulative values: ``inc`` by what each series grew."""

    def __init__(self, counter: Counter, key: str) -> None:
        self.counter, self.key = counter, key
        self.last: dict[tuple, float] = {}

    def update(self, values: Mapping[tuple, float]) -> None:
        for tags, value in values.items():
            grown = value - self.last.get(tags, 0.0)
            if grown > 0:
                self.counter.inc(grown, tags=dict(zip(self.key.split(","), tags, strict=True)))
            self.last[tags] = value


class CoordinatorMetrics:
    def __init__(self, fabric: str) -> None:
        base = {"fabric": fabric}

        def counter(name: str, help: str, key: str) -> _Deltas:
            c = Counter(name, help, tag_keys=("fabric", *key.split(",")))
            c.set_default_tags(base)
            return _Deltas(c, key)

        self.prompt = counter(
            "kvfabric_prompt_tokens",
            "Prompt tokens of finished requests by where their KV came from.",
            "source",
        )
        self.requests = counter("kvfabric_requests", "Requests that ended, by outcome.", "outcome")
        self.transfer = counter(
            "kvfabric_transfer_bytes", "Bytes of KV copied between tiers, all ranks.", "direction"
        )
        self.evicted = counter("kvfabric_evicted_tokens", "Tokens evicted from a tier.", "tier")
        self.rounds = counter("kvfabric_consensus_rounds", "Consensus rounds run.", "kind")
        self.pool = Gauge(
            "kvfabric_pool_tokens",
            "Tokens of a tier's pool by state.",
            tag_keys=("fabric", "tier", "state"),
        )
        self.pool.set_default_tags(base)
        # Gauges, so the series exist from the start (a counter appears only once
        # it grows, and a fabric may never reset).
        self.resets = Gauge(
            "kvfabric_resets", "L1/L2 resets since the coordinator started.", tag_keys=("fabric",)
        )
        self.resets.set_default_tags(base)
        self.l3 = Gauge(
            "kvfabric_l3", "L3 usage: bytes and pages held, 0 with none attached.",
            tag_keys=("fabric", "unit"),
        )  # fmt: skip
        self.l3.set_default_tags(base)
        self.engines = EngineMetrics(base, counter)
        self.request_seconds = Histogram(
            "kvfabric_request_duration_seconds",
            "Seconds from a request's submission to its result.",
            boundaries=list(SECONDS),
            tag_keys=("fabric",),
        )
        self.request_seconds.set_default_tags(base)
        self.round_seconds = Histogram(
            "kvfabric_consensus_round_duration_seconds",
            "Seconds of one consensus round (batch out, reports reduced).",
            boundaries=list(SECONDS),
            tag_keys=("fabric",),
        )
        self.round_seconds.set_default_tags(base)

    def update(self, f: Figures, l3: Mapping[str, Any] | None = None) -> None:
        c = f.counters
        self.resets.set(c.resets)
        attached = bool(l3 and l3.get("attached"))
        for unit in ("bytes", "pages"):
            value = l3.get(unit) if attached and l3 else 0
            self.l3.set(value if isinstance(value, int | float) else 0, tags={"unit": unit})
        self.prompt.update({(t,): n for t, n in c.tokens.as_dict().items()})
        self.requests.update(
            {("finished",): c.finished, ("failed",): c.failed, ("aborted",): c.aborted}
        )
        per_token = f.kv_bytes_per_token
        self.transfer.update({(d,): n * per_token for d, n in f.transfer_tokens.items()})
        self.evicted.update(
            {("device",): f.cache.device_evicted_tokens, ("host",): f.cache.host_evicted_tokens}
        )
        self.rounds.update({("step",): c.rounds})
        dev, host = f.device, f.host
        for tier, state, tokens in (
            ("device", "free", dev.free),
            ("device", "evictable", dev.evictable),
            ("device", "protected", dev.protected),
            ("host", "free", host.free),
            ("host", "used", host.capacity - host.free),
        ):
            self.pool.set(tokens, tags={"tier": tier, "state": state})
        self.engines.update(f)


class EngineMetrics:
    """Engine pages in the coordinator's tree: per place and tenant, hits per tier,
    evictions per place."""

    def __init__(self, base: dict[str, str], counter: Callable[[str, str, str], _Deltas]) -> None:
        self.engine_pages = Gauge(
            "kvfabric_engine_pages",
            "Engine pages whole in a place (l3, or l2@<node>), by place and tenant.",
            tag_keys=("fabric", "place", "tenant"),
        )
        self.engine_pages.set_default_tags(base)
        # A gauge of the running total (a counter appears only once it grows, and a
        # fabric may serve no engine): rate() reads it as a counter's.
        self.engine_hits = Gauge(
            "kvfabric_engine_hit_pages",
            "Engine pages lookups found whole since the coordinator started, by tier.",
            tag_keys=("fabric", "tier"),
        )
        self.engine_hits.set_default_tags(base)
        self.engine_evicted = counter(
            "kvfabric_engine_evicted_pages", "Engine pages the tree evicted, by place.", "place"
        )
        self._engine_tags: set[tuple[str, str]] = set()

    def update(self, f: Figures) -> None:
        e = f.engines
        now = {(p, t): n for p, by in e.tenants.items() for t, n in by.items()}
        now = now or {("l3", "vllm"): 0}  # from the start: the connector's default tenant
        for place, tenant in self._engine_tags - set(now):  # gone: shown as 0, not stale
            self.engine_pages.set(0, tags={"place": place, "tenant": tenant})
        for (place, tenant), n in now.items():
            self.engine_pages.set(n, tags={"place": place, "tenant": tenant})
        self._engine_tags = set(now)
        for tier, n in e.hit_pages.items():
            self.engine_hits.set(n, tags={"tier": tier})
        self.engine_evicted.update({(p,): n for p, n in e.evicted_pages.items()})


class RankMetrics:
    def __init__(self, fabric: str, rank: str) -> None:
        c = Counter(
            "kvfabric_rank_transfer_bytes",
            "Bytes of KV this rank copied, by direction (its shard of each page).",
            tag_keys=("fabric", "rank", "direction"),
        )
        c.set_default_tags({"fabric": fabric, "rank": rank})
        self.transfer = _Deltas(c, "direction")
        self.seconds = Histogram(
            "kvfabric_rank_transfer_duration_seconds",
            "Seconds one copy took on this rank (a merged L1<->L2 copy, a backup to L3, "
            "a prefetch batch from L3), by direction.",
            boundaries=list(SECONDS),
            tag_keys=("fabric", "rank", "direction"),
        )
        self.seconds.set_default_tags({"fabric": fabric, "rank": rank})

    def update(
        self, moved_bytes: Mapping[str, int], seconds: Iterable[tuple[str, float]] = ()
    ) -> None:
        self.transfer.update({(d,): moved_bytes[d] for d in DIRECTIONS})
        for direction, took in seconds:
            self.seconds.observe(took, tags={"direction": direction})


def node_ip() -> str:
    """This actor's node address, for its repr ("?" outside a Ray worker)."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return "?"
