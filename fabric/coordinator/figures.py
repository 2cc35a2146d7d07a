"""The coordinator's figures, read without walking the tree: ``snapshot`` for
``stats()`` and ``figures`` for the metrics, ``status`` and the actor's line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.coordinator.requests import FabricStats

if TYPE_CHECKING:
    from fabric.coordinator.core import CoordinatorCore


def snapshot(core: CoordinatorCore) -> dict:
    """Counters and sizes for ``stats()``."""
    s = core.stats
    return {
        "epoch": core.rounds.epoch,
        "waiting": len(core.scheduler.waiting),
        "running": len(core.scheduler.running),
        "leases": len(core.leases),
        "absent_ranks": core.rounds.names(sorted(core.rounds.absent)) if core.rounds.absent else "",
        "requests": request_counts(core.stats),
        "tokens": {"prompt": s.prompt_tokens, **s.tokens.as_dict()},
        "mean_latency_s": s.latency_s_total / s.finished if s.finished else 0.0,
        "resets": s.resets,
        "reset_reasons": dict(s.by_reason),
        "rounds": s.rounds,
        "rounds_skipped": s.rounds_skipped,
        "cache": core.cache.stats.counters(),
        "prefetching": len(core.scheduler.prefetching),
        "storage_ops": core.cache.l3.snapshot(),
        "pending_writes": len(core.cache.writes.pending),
        "pending_loads": len(core.cache.loads.pending),
        "bad_messages": s.bad_messages,
        "step_errors": s.step_errors,
        "leases_expired": s.leases_expired,
        "leases_reclaimed": s.leases_reclaimed,
        "adopted_tokens": s.adopted_tokens,
        "events_queued": len(core.events),
        "events_dropped": s.events_dropped,
        "stragglers": core.rounds.stragglers.status(),
        "stragglers_named": core.rounds.stragglers.named,
        "core_time_s": s.core_time_s,
        "storage_errors": s.storage_errors,
        "storage_restores": s.storage_restores,
        "device": vars(core.cache.device_sizes()),
        "host": vars(core.cache.host_sizes()),
        "sessions": {
            "held": len(core.cache.sessions.held),
            "held_tokens": core.cache.sessions.held_tokens,
            "budget_tokens": core.cache.sessions.budget,
            "refused": s.sessions_refused,
        },
        "pinned_tokens": core.cache.pins.pinned_size,
    }


def request_counts(stats: FabricStats) -> dict[str, int]:
    s = stats
    return {
        "submitted": s.submitted,
        "finished": s.finished,
        "failed": s.failed,
        "aborted": s.aborted,
        "retried": s.retried,
        "gave_up": s.gave_up,
    }


def figures(core: CoordinatorCore) -> dict:
    """What the metrics export: counters, gauges and histograms, read without
    walking the tree (cheap enough for every scrape)."""
    s, cache, l3 = core.stats, core.cache, core.cache.l3
    device = cache.device_sizes()
    host = cache.ctl.host
    transfers = {
        "device_to_host": cache.stats.written_tokens,
        "host_to_device": cache.stats.loaded_back_tokens,
        "host_to_storage": l3.stats.backed_up_tokens,
        "storage_to_host": l3.stats.prefetched_tokens,
    }
    return {
        "epoch": core.rounds.epoch,
        "requests": request_counts(core.stats),
        "prompt_tokens": s.tokens.as_dict(),
        "evicted_tokens": {
            "device": cache.stats.device_evicted_tokens,
            "host": cache.stats.host_evicted_tokens,
        },
        "transfer_tokens": transfers,
        "failed_write_tokens": cache.stats.failed_write_tokens,
        "failed_backups": l3.stats.failed_backups,
        "bad_hit_answers": l3.stats.bad_answers,
        "transfer_sizes": cache.stats.transfer_sizes,
        "kv_bytes_per_token": core.config.model.kv_bytes_per_token,
        "request_seconds": s.request_seconds,
        "round_seconds": s.round_seconds,
        "rounds": s.rounds,
        "resets": s.resets,
        "bad_messages": s.bad_messages,
        "step_errors": s.step_errors,
        "storage_errors": s.storage_errors,
        "leases_expired": s.leases_expired,
        "leases_reclaimed": s.leases_reclaimed,
        "adopted_tokens": s.adopted_tokens,
        "events_queued": len(core.events),
        "events_dropped": s.events_dropped,
        "stragglers": core.rounds.stragglers.status(),
        "stragglers_named": core.rounds.stragglers.named,
        "rank_lag_seconds": dict(
            zip(core.rounds.stragglers.names, core.rounds.stragglers.seconds, strict=True)
        ),
        "sessions_refused": s.sessions_refused,
        "core_seconds": s.core_time_s,
        "prefetch_started": l3.stats.prefetch_started,
        "prefetch_revoked": l3.stats.prefetch_revoked,
        "prefetch_refusals": dict(l3.stats.refusals),
        "pool": {
            "device": {
                "capacity": device.capacity,
                "free": device.free,
                "evictable": device.evictable,
                "protected": device.protected,
            },
            "host": {
                "capacity": host.capacity_tokens,
                "free": host.available_pages * cache.page_size,
            },
        },
        "requests_now": {
            "waiting": len(core.scheduler.waiting),
            "prefetching": len(core.scheduler.prefetching),
            "running": len(core.scheduler.running),
        },
        "inflight_transfers": {
            "device_to_host": len(cache.writes.pending),
            "host_to_device": len(cache.loads.pending),
            "host_to_storage": len(l3.backups),
            "storage_to_host": len(l3.by_op),
        },
        "leases": len(core.leases),
        "sessions": len(cache.sessions.held),
        "session_tokens": cache.sessions.held_tokens,
        "pinned_tokens": cache.pins.pinned_size,
        "ranks": {str(r): i not in core.rounds.absent for i, r in enumerate(core.topology.ranks)},
    }
