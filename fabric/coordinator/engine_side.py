"""The coordinator's side of engines attached through a connector
(``fabric.engines.vllm_connector``): their pages in the tree
(``fabric.cache.engine_tree``), the orders waiting for them
(``engine_orders``), and the calls they make — lookups, reports of stores,
sessions and pins, a replica's evicted blocks, pages that failed to load. Each
call's KV events join the coordinator's queue. Nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fabric.cache.engine_holds import HoldOptions
from fabric.cache.engine_input import (
    L3,
    PageName,
    StoredRun,
    check_count,
    check_group,
    check_place,
)
from fabric.cache.engine_places import Order
from fabric.cache.engine_tree import EngineTree
from fabric.cache.events import BlockStored
from fabric.config import FabricConfig
from fabric.coordinator.engine_orders import PendingOrders
from fabric.coordinator.event_queue import EventQueue


class EngineSide:
    def __init__(self, config: FabricConfig, events: EventQueue, clock: Callable[[], float]):
        cache = config.cache
        # Kept by the cache's eviction policy within L3's cap, place by place.
        self.tree = EngineTree(
            cache.eviction_policy,
            config.runtime.engine_pages,
            {L3: config.storage.max_bytes},
            cache.write_policy,
            HoldOptions(
                config.storage.max_bytes,
                cache.session_budget_fraction,
                cache.pin_budget_fraction,
                cache.tenant_share,
                cache.session_ttl_s,
            ),
        )
        self.orders = PendingOrders()
        # Under best_effort an engine's request takes only what its node's L2 has;
        # what only L3 has is prefetched there for the next (``EngineTree.lookup``).
        self.l2_only = config.prefetch.stop_policy == "best_effort"
        self.events = events
        self.clock = clock

    def clear(self) -> None:
        """L3 was cleared or detached: every engine page is forgotten (announced)."""
        self.events.add(self.tree.forget_all())
        self.orders.clear()

    def lookup(
        self,
        tag: str,
        world: int,
        chains: Sequence[Sequence[bytes]],
        leases: Sequence[str] | None = None,
        lease_s: float = 0.0,
        release: Sequence[str] = (),
        place: str = "",
        needs: Sequence[tuple[str, int]] = (),
    ) -> tuple[list[int], list[Order]]:
        """Per chain of page hashes, how many leading pages are whole for the
        engine's ``world`` ranks in L3 or in ``place`` (the asking node's L2;
        ``EngineTree.lookup``; under ``best_effort``, in ``place`` only), each
        chain's match leased under its name in ``leases`` for ``lease_s``; the
        leases ``release`` names end first. A *final* answer — the page after the
        match is one the tree evicted from L3, so the engine is not to look for
        more in the store — is sent as ``-1 - pages`` (``decode_answers``).
        ``needs``: a hybrid engine's component groups (``EngineTree.lookup``).

        With the answers go the orders this engine's ranks carry out (as a
        report's reply has them): among them, the room the lookup made in
        ``place`` for the pages the requests will store there, carried out in
        the same engine step, before those pages come."""
        if release:
            self.tree.release(release)
        final: list[bool] = []
        hits = self.tree.lookup(
            tag,
            world,
            chains,
            leases,
            lease_s,
            self.clock(),
            place,
            self.l2_only,
            final,
            needs,
        )
        self.orders.add(self.tree.take_orders())  # copies the hits asked for, room made
        self.events.add(self.tree.take_events())
        answers = [-1 - n if last else n for n, last in zip(hits, final, strict=True)]
        return answers, self.orders.take(tag, world, place) if chains else []

    def report(
        self,
        tag: str,
        world: int,
        reports: dict[int, Sequence[StoredRun]],
        place: str = "",
        place_bytes: int = 0,
        names: Sequence[PageName] = (),
    ) -> tuple[int, list[Order]]:
        """Ranks' reports of the pages they stored: how many pages became whole
        somewhere (each announced as a ``BlockStored``, under the engine's own
        ``names`` of the pages where it sent them), and the orders this engine's
        ranks carry out (in L3, and in ``place``: its node's L2, whose regions
        hold ``place_bytes`` for this engine)."""
        if place:
            check_group(tag, world)
            check_place(place)
            check_count(place_bytes, "place_bytes")
            self.tree.declare(place, tag, place_bytes)
        self.orders.stored_again(tag, world, reports)  # (deletes waiting for them: off)
        events, orders = self.tree.report(tag, world, reports, self.clock(), names)
        self.events.add(events)
        self.orders.add(orders)
        whole = sum(len(e.page_hashes) for e in events if isinstance(e, BlockStored))
        return whole, self.orders.take(tag, world, place)

    def hold(
        self,
        tag: str,
        world: int,
        chain: Sequence[bytes],
        name: str,
        kind: str,
        ttl_s: float | None = None,
    ) -> str | None:
        """Keep an engine's prefix (``chain``) in every place it is in, as a session
        (the configured TTL) or a pin (``ttl_s``) named ``name``; ``None``, or why
        nothing is held (``EngineTree.hold``)."""
        why = self.tree.hold(tag, world, chain, name, kind, ttl_s, self.clock())
        self.events.add(self.tree.take_events())  # what a hold it took over let go
        self.orders.add(self.tree.take_orders())
        return why

    def drop(
        self, tag: str, world: int, place: str, page_hashes: Sequence[bytes], everything: bool
    ) -> int:
        """Pages left a replica's blocks (``place``; vLLM evicted them: only the tree
        is told), or all of them did (``everything``: an engine's cache reset, or
        the engine gone); how many whole ones, each announced as a ``BlockRemoved``."""
        if everything:
            check_group(tag, world)
            events = self.tree.drop_place(place)
        else:
            events = self.tree.drop(tag, world, place, page_hashes)
        self.events.add(events)
        return sum(len(e.page_hashes) for e in events)

    def forget(self, tag: str, world: int, page_hashes: Sequence[bytes]) -> int:
        """Pages a rank could not load: matched no more until stored anew (each
        whole one announced as a ``BlockRemoved``); how many."""
        events = self.tree.forget(tag, world, page_hashes)
        self.events.add(events)
        self.orders.add(self.tree.take_orders())
        return sum(len(e.page_hashes) for e in events)
