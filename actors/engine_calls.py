"""The coordinator's calls for engines attached through a connector
(``fabric.engines.vllm_connector``): one lookup and one report per engine step,
answered from the tree's engine pages (``CoordinatorCore.engines``), their
core time counted in ``core_time_s`` as every other core call's."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from fabric.cache.engine_places import Order


class EngineCalls:
    """Mixed into ``CoordinatorActor``: ``core`` is its ``CoordinatorCore``,
    ``_wake`` starts its next step."""

    core: Any

    def _wake(self) -> None:
        raise NotImplementedError

    async def engine_lookup(
        self,
        tag: str,
        world: int,
        chains: list[list[bytes]],
        leases: list[str] | None = None,
        lease_s: float = 0.0,
        release: list[str] | None = None,
        place: str = "",
        needs: list[tuple[str, int]] | None = None,
    ) -> tuple[list[int], list[Order]]:
        """One engine step's lookups: per chain, the leading pages every rank
        stored in L3 or in ``place`` (the engine's node's L2), leased under
        ``leases`` (one name a chain) for ``lease_s``; the leases ``release``
        names end first; ``needs``: a hybrid engine's component groups. With
        them, the orders the engine's ranks carry out."""
        started = time.perf_counter()
        try:
            return self.core.engines.lookup(
                tag,
                world,
                chains,
                leases,
                lease_s,
                release or (),
                place,
                [tuple(n) for n in needs or ()],
            )
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started

    async def engine_report(
        self,
        tag: str,
        world: int,
        reports: dict[int, list],
        place: str = "",
        place_bytes: int = 0,
        names: list | None = None,
    ) -> tuple[int, list[Order]]:
        """One engine step's stores, by rank: the pages that became whole, and the
        orders the engine's ranks carry out (in L3 and in ``place``, its node's L2,
        whose regions hold ``place_bytes`` for it). ``names``: the engine's own
        names of pages (``PageName``), for the KV events."""
        started = time.perf_counter()
        try:
            whole, drops = self.core.engines.report(
                tag, world, reports, place, place_bytes, names or ()
            )
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started
        if whole:
            self._wake()  # their KV events go out with the next step
        return whole, drops

    async def engine_forget(self, tag: str, world: int, page_hashes: list[bytes]) -> int:
        """Pages a rank could not load; how many whole ones are forgotten."""
        started = time.perf_counter()
        try:
            return self.core.engines.forget(tag, world, page_hashes)
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started

    async def engine_drop(
        self, tag: str, world: int, place: str, page_hashes: list[bytes], everything: bool = False
    ) -> int:
        """Pages left a replica's blocks (vLLM evicted them), or all did."""
        started = time.perf_counter()
        try:
            return self.core.engines.drop(tag, world, place, page_hashes, everything)
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started

    async def engine_hold(
        self,
        tag: str,
        world: int,
        chain: list[bytes],
        name: str,
        kind: str,
        ttl_s: float | None = None,
    ) -> str | None:
        """Keep an engine's prefix as a session or a pin; ``None``, or why not."""
        started = time.perf_counter()
        try:
            return self.core.engines.hold(tag, world, chain, name, kind, ttl_s)
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started

    def engine_stats(self) -> dict[str, Any]:
        """The tree's engine-page counters, what it holds per place (whole pages,
        bytes, pages per tenant) and the evictions waiting for an engine."""
        tree = self.core.engines.tree
        return {
            **asdict(tree.stats),
            "known": len(tree),
            "leased": tree.leased,
            "places": tree.residency(),
            "orders_waiting": len(self.core.engines.orders),
            "orders_let_go": self.core.engines.orders.let_go,
            "holds": tree.holds.figures(),
        }
