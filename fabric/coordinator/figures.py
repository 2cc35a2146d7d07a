"""The coordinator's figures as one typed tree, made in one place (``figures``) and
only rendered elsewhere: ``stats()`` (as plain data), the Prometheus endpoint and Ray's
metrics, ``kvfabric status``, the actor's one-line description, the chaos report.

Counters are defined (and annotated with their Prometheus ``Series``) where they are
counted — ``FabricStats``, ``CacheStats``, ``StorageStats`` — and copied in here;
gauges are read from the parts. Nothing here walks the tree: cheap enough for every
scrape."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fabric.cache.l3_transfers import StorageStats
from fabric.cache.results import DIRECTIONS, CacheStats, TierSizes
from fabric.coordinator.requests import FabricStats
from fabric.observe.histogram import Histogram
from fabric.observe.series import Series

if TYPE_CHECKING:
    from fabric.coordinator.core import CoordinatorCore

_STAGE = "Requests at the coordinator by stage (waiting, prefetching, running)."


def _stage(stage: str) -> Series:
    return Series("kvfabric_requests_in_progress", "gauge", _STAGE, (("stage", stage),))


@dataclass(frozen=True)
class Now:
    """What is going on at the moment."""

    waiting: Annotated[int, _stage("waiting")]
    prefetching: Annotated[int, _stage("prefetching")]
    running: Annotated[int, _stage("running")]
    leases: Annotated[int, Series("kvfabric_leases", "gauge", "Leases held by clients.")]
    sessions: Annotated[int, Series("kvfabric_sessions", "gauge", "Sessions keeping their KV.")]
    session_tokens: Annotated[
        int, Series("kvfabric_session_tokens", "gauge", "Tokens held for sessions.")
    ]
    pinned_tokens: Annotated[
        int, Series("kvfabric_pinned_tokens", "gauge", "Tokens pinned in the cache.")
    ]
    events_queued: Annotated[
        int,
        Series(
            "kvfabric_events_queued",
            "gauge",
            "KV events queued for take_events (or the publisher).",
        ),
    ]
    inflight: Annotated[
        dict[str, int],
        Series(
            "kvfabric_transfers_in_flight",
            "gauge",
            "Copy operations sent to the ranks or the storage actor and not yet completed.",
            by="direction",
            keys=DIRECTIONS,
        ),
    ]
    l3_attached: bool
    absent_ranks: tuple[str, ...]


@dataclass(frozen=True)
class Ranks:
    up: Annotated[
        dict[str, bool],
        Series(
            "kvfabric_rank_up",
            "gauge",
            "1 while a rank answers the coordinator's rounds, 0 while it is absent.",
            by="rank",
        ),
    ]
    lag_seconds: Annotated[
        dict[str, Histogram],
        Series(
            "kvfabric_rank_lag_seconds",
            "histogram",
            "How long after the first rank a rank finished the commands it reported done "
            "in a round (or replied to it, if later), by rank: a straggler's stand apart.",
            by="rank",
        ),
    ]
    stragglers: dict[str, dict]  # rank -> how late it is, while named
    stragglers_named: Annotated[
        int, Series("kvfabric_stragglers_named", "counter", "Times a rank was named a straggler.")
    ]


@dataclass(frozen=True)
class HostPool:
    capacity: int
    free: int


_PLACE = "a place: l3, or l2@<node> (that node's shared-memory L2)"


@dataclass(frozen=True)
class EngineFigures:
    """Pages of engines attached through a connector, in the coordinator's tree."""

    pages: Annotated[
        dict[str, int],
        Series(
            "kvfabric_engine_pages",
            "gauge",
            f"Engine pages whole in a place (every rank's shard there), by place ({_PLACE}).",
            by="place",
            keys=("l3",),
        ),
    ]
    bytes: Annotated[
        dict[str, int],
        Series(
            "kvfabric_engine_bytes",
            "gauge",
            "Bytes of engine page shards a place holds, by place.",
            by="place",
            keys=("l3",),
        ),
    ]
    tenants: dict[str, dict[str, int]]  # place -> tenant -> whole pages
    hit_pages: Annotated[
        dict[str, int],
        Series(
            "kvfabric_engine_hit_pages",
            "counter",
            "Engine pages lookups found whole, by tier: l2 (the asking node's L2), l3.",
            by="tier",
            keys=("l2", "l3"),
        ),
    ]
    lookup_pages: Annotated[
        int, Series("kvfabric_engine_lookup_pages", "counter", "Engine pages lookups asked for.")
    ]
    evicted_pages: Annotated[
        dict[str, int],
        Series(
            "kvfabric_engine_evicted_pages",
            "counter",
            "Engine pages the tree evicted (leaves first, in the eviction policy's order), "
            "by place.",
            by="place",
            keys=("l3",),
        ),
    ]
    prefetch_pages: Annotated[
        int,
        Series(
            "kvfabric_engine_prefetch_pages",
            "counter",
            "Engine pages ordered read from L3 into a node's L2 (best_effort lookups).",
        ),
    ]
    held_bytes: Annotated[
        dict[str, int],
        Series(
            "kvfabric_engine_held_bytes",
            "gauge",
            "Bytes of engine pages sessions and pins hold (kept in every place), by kind.",
            by="kind",
            keys=("session", "pin"),
        ),
    ]
    known_pages: Annotated[
        int,
        Series(
            "kvfabric_engine_known_pages",
            "gauge",
            "Engine pages the tree knows (whole somewhere, in part, or as a path).",
        ),
    ]
    leases: Annotated[
        int, Series("kvfabric_engine_leases", "gauge", "Engine lookups' leases held.")
    ]
    orders_waiting: Annotated[
        int,
        Series(
            "kvfabric_engine_orders_waiting_pages",
            "gauge",
            "Engine pages the tree evicted that no engine has been handed to delete yet.",
        ),
    ]


def engine_figures(core: CoordinatorCore) -> EngineFigures:
    tree = core.engines.tree
    places, stats = tree.residency(), tree.stats
    return EngineFigures(
        pages={p: f["pages"] for p, f in places.items()},
        bytes={p: f["bytes"] for p, f in places.items()},
        tenants={p: f["tenants"] for p, f in places.items()},
        hit_pages={"l2": stats.l2_hit_pages, "l3": stats.hit_pages - stats.l2_hit_pages},
        lookup_pages=stats.lookup_pages,
        evicted_pages=dict(stats.evicted_by_place),
        prefetch_pages=stats.prefetch_pages,
        held_bytes={k: f["bytes"] for k, f in tree.holds.figures().items()},
        known_pages=len(tree),
        leases=tree.leased,
        orders_waiting=len(core.engines.orders),
    )


@dataclass(frozen=True)
class Figures:
    fabric: str
    epoch: Annotated[
        int, Series("kvfabric_epoch", "gauge", "The coordinator's epoch (rises on every restart).")
    ]
    counters: FabricStats
    cache: CacheStats
    l3_transfers: StorageStats
    now: Now
    device: TierSizes
    host: HostPool
    ranks: Ranks
    session_budget_tokens: int
    kv_bytes_per_token: int
    engines: EngineFigures

    @property
    def transfer_tokens(self) -> dict[str, int]:
        """Tokens copied between tiers, by direction (completed copies)."""
        return {
            "device_to_host": self.cache.written_tokens,
            "host_to_device": self.cache.loaded_back_tokens,
            "host_to_storage": self.l3_transfers.backed_up_tokens,
            "storage_to_host": self.l3_transfers.prefetched_tokens,
        }


def figures(core: CoordinatorCore) -> Figures:
    """The coordinator's figures now (counters copied: the tree does not change
    under its reader)."""
    cache, l3, sched, rounds = core.cache, core.cache.l3, core.scheduler, core.rounds
    stragglers = rounds.stragglers
    host = cache.ctl.host
    return Figures(
        fabric=core.config.runtime.name,
        epoch=rounds.epoch,
        counters=copy.deepcopy(core.stats),
        cache=copy.deepcopy(cache.stats),
        l3_transfers=copy.deepcopy(l3.stats),
        now=Now(
            waiting=len(sched.waiting),
            prefetching=len(sched.prefetching),
            running=len(sched.running),
            leases=len(core.leases),
            sessions=len(cache.sessions.held),
            session_tokens=cache.sessions.held_tokens,
            pinned_tokens=cache.pins.pinned_size,
            events_queued=len(core.events),
            inflight={
                "device_to_host": len(cache.writes.pending),
                "host_to_device": len(cache.loads.pending),
                "host_to_storage": len(l3.backups),
                "storage_to_host": len(l3.by_op),
            },
            l3_attached=l3.attached,
            absent_ranks=tuple(rounds.names([i]) for i in sorted(rounds.absent)),
        ),
        device=cache.device_sizes(),
        host=HostPool(host.capacity_tokens, host.available_pages * cache.page_size),
        ranks=Ranks(
            up={str(r): i not in rounds.absent for i, r in enumerate(core.topology.ranks)},
            lag_seconds=copy.deepcopy(dict(zip(stragglers.names, stragglers.seconds, strict=True))),
            stragglers=stragglers.status(),
            stragglers_named=stragglers.named,
        ),
        session_budget_tokens=cache.sessions.budget,
        kv_bytes_per_token=core.config.model.kv_bytes_per_token,
        engines=engine_figures(core),
    )


def one_line(f: Figures) -> str:
    """The coordinator's role and live figures in one line (``kvfabric status``)."""
    moved, dev = f.transfer_tokens, f.device
    return (
        f"kvfabric coordinator {f.fabric}: epoch {f.epoch}, "
        f"{f.counters.rounds} rounds, {f.counters.finished} served, "
        f"L1 {dev.capacity - dev.free}/{dev.capacity} tokens, moved tokens "
        f"L1>L2 {moved['device_to_host']} L2>L1 {moved['host_to_device']} "
        f"L2>L3 {moved['host_to_storage']} L3>L2 {moved['storage_to_host']}"
    )


def status_view(
    f: Figures,
    actors: list[dict[str, Any]],
    l3: Mapping[str, Any],
    kv_events: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What ``kvfabric status`` shows (and ``kvfabric top`` draws): the figures, every
    actor's line, L3's counters and the KV publisher's."""
    c = f.counters
    latency = c.request_seconds
    return {
        "fabric": f.fabric,
        "epoch": f.epoch,
        "actors": actors,
        "tiers": {
            "device": {
                "capacity": f.device.capacity,
                "free": f.device.free,
                "evictable": f.device.evictable,
                "protected": f.device.protected,
            },
            "host": {"capacity": f.host.capacity, "free": f.host.free},
        },
        "inflight_transfers": dict(f.now.inflight),
        "transfer_tokens": f.transfer_tokens,
        "requests": {
            "submitted": c.submitted,
            "finished": c.finished,
            "failed": c.failed,
            "aborted": c.aborted,
            "retried": c.retried,
            "gave_up": c.gave_up,
        },
        "requests_now": {
            "waiting": f.now.waiting,
            "prefetching": f.now.prefetching,
            "running": f.now.running,
        },
        "prompt_tokens": c.tokens.as_dict(),
        "mean_latency_ms": round(1000 * latency.sum / latency.count, 2) if latency.count else None,
        "leases": f.now.leases,
        "sessions": f.now.sessions,
        "pinned_tokens": f.now.pinned_tokens,
        "rounds": c.rounds,
        "resets": c.resets,
        "events_queue": {"queued": f.now.events_queued, "dropped": c.events_dropped},
        "stragglers": f.ranks.stragglers,
        "l3": dict(l3),
        "kv_events": dict(kv_events) if kv_events is not None else None,
        "engines": _engines_view(f.engines),
    }


def _engines_view(e: EngineFigures) -> dict[str, Any]:
    """Engine pages per place (whole pages, bytes, pages per tenant), hits per tier."""
    return {
        "places": {
            p: {"pages": n, "bytes": e.bytes.get(p, 0), "tenants": dict(e.tenants.get(p, {}))}
            for p, n in e.pages.items()
        },
        "hit_pages": dict(e.hit_pages),
        "evicted_pages": dict(e.evicted_pages),
        "prefetch_pages": e.prefetch_pages,
        "held_bytes": dict(e.held_bytes),
    }
