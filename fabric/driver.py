"""Replay packed prompts through a running fabric with a window in flight.

Results are collected in completion order, not submission order: a request
that waits for L1 room must not wait behind leases this driver has not yet
released.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fabric.errors import FabricError


@dataclass
class DriveStats:
    latencies_s: list[float] = field(default_factory=list)
    tokens_by_tier: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0, "computed": 0}
    )
    refused: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def percentile_ms(self, q: float) -> float | None:
        xs = sorted(self.latencies_s)
        return round(1000 * xs[int(q * (len(xs) - 1))], 2) if xs else None


def drive(
    fabric: Any,
    prompts: Iterable[bytes],
    inflight: int = 8,
    on_done: Callable[[int], None] | None = None,
) -> DriveStats:
    """Submit every prompt (packed tokens), keep at most ``inflight`` pending,
    release each lease as soon as its result arrives."""
    stats = DriveStats()
    pending: dict[Any, float] = {}
    done = 0
    started = time.perf_counter()

    def collect_one() -> None:
        nonlocal done
        ready, _ = fabric.wait(list(pending))
        for ref in ready:
            t0 = pending.pop(ref)
            try:
                result = fabric.result(ref)
            except FabricError as exc:
                stats.refuse(str(exc))
            else:
                if result.error:
                    stats.refuse(result.error)
                else:
                    stats.latencies_s.append(time.perf_counter() - t0)
                    stats.tokens_by_tier["device"] += result.device_hit_tokens
                    stats.tokens_by_tier["host"] += result.host_hit_tokens
                    stats.tokens_by_tier["storage"] += result.storage_hit_tokens
                    stats.tokens_by_tier["computed"] += result.computed_tokens
                    fabric.release(result.lease)
            done += 1
            if on_done is not None:
                on_done(done)

    limit = fabric.config.cache.device_tokens
    for packed in prompts:
        if len(packed) // 4 > limit:
            stats.refuse("larger than L1")
            done += 1
            if on_done is not None:
                on_done(done)
            continue
        pending[fabric.submit_async(packed)] = time.perf_counter()
        while len(pending) >= inflight:
            collect_one()
    while pending:
        collect_one()
    stats.elapsed_s = time.perf_counter() - started
    return stats
