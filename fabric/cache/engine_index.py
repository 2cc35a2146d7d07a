"""Engine pages in a radix tree: what engines attached through a connector
(``fabric.engines.vllm_connector``) stored, place by place, rank by rank.

An engine of ``world`` ranks (TP times PP) stores each page of a prompt as
``world`` shard pages, one per rank. Pages are named by their chain hash
(``fabric.cache.keys``), which names the whole prefix before the page: the
coordinator never sees an engine's tokens, so this tree's keys are the hashes
themselves (a ``RadixTree`` whose page is one 32-byte hash), and a request's
chain of hashes is its path. A node is a run of whole pages; each engine
identity (page tag and world) is a subtree of its own, under its namespaces.

A node's residency is per place (``StoredRun.place``: the fabric's L3, or one
node's shared-memory L2), a mask of the ranks whose shard is there: a page is
*whole* in a place once every rank's shard is (the MIN over ranks, as for the
fabric's own ranks). Every change of what is whole is a KV event
(``BlockStored`` / ``BlockRemoved``, medium ``storage`` for L3, ``host`` for a
node's L2, with the place). A page a rank failed to load leaves every place
at once (``forget``): its bytes are gone or bad. A run whose parent the tree
does not know yet waits for it.

This is what is where; what is kept, looked up and leased is decided by
``fabric.cache.engine_tree``. Nothing here imports Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from fabric.cache.engine_input import (
    HASH_BYTES,
    L1_AT,
    L3,
    PageName,
    StoredRun,
    check_group,
    check_hashes,
    check_names,
    check_place,
    check_reports,
)
from fabric.cache.engine_places import (
    DELETE,
    Order,
    Places,
    Whole,
    event_place,
    group_of,
    medium_of,
    namespace_of,
    place_of,
)
from fabric.cache.events import BlockRemoved, BlockStored, KVEvent
from fabric.cache.keys import TOKEN_BYTES
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from policies import get_eviction_policy

# Runs whose parent page the tree does not know yet (a rank's later store
# reported first), kept at most this many until it comes.
MAX_ORPHANS = 4096
# Pages the tree evicted from L3, remembered (at most this many) so that a lookup
# stopping at one is final: the engine does not look in the store beyond it.
MAX_GONE = 1 << 18
# A replica's blocks (an L1 place) not heard of for this long are forgotten: the
# replica is gone (a process stopped before its connector could say so), or idle
# (the tree then knows less of its L1 than there is, never more).
L1_TTL_S = 600.0

Group = tuple[str, int]  # the engine's page tag and world


@dataclass
class EngineTreeStats:
    lookups: int = 0
    lookup_pages: int = 0
    hit_pages: int = 0
    l2_hit_pages: int = 0
    prefetch_pages: int = 0  # ordered read from L3 into a node's L2
    reported_pages: int = 0
    whole_pages: int = 0  # made whole in L3 (``whole_by_place``: in every place)
    forgotten_pages: int = 0
    evicted_pages: int = 0
    leases: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    orphans_dropped: int = 0
    whole_by_place: dict[str, int] = field(default_factory=dict)
    evicted_by_place: dict[str, int] = field(default_factory=dict)


class _Tree(RadixTree):
    """The structure (walks, splits, detaches); the places keep the leaf sets."""

    def __init__(self, owner: EngineIndex) -> None:
        self.owner = owner
        super().__init__(HASH_BYTES // TOKEN_BYTES, owner.policy)

    def refresh(self, node: TreeNode) -> None:
        self.owner.places.refresh(node)


class EngineIndex:
    """Engine pages by place (see the module); ``capacity``: bytes per place
    (``L3``, a node's L2, or ``L2_AT`` for every node's), kept by the subclass."""

    def __init__(
        self, eviction_policy: str, index_pages: int, capacity: dict[str, int] | None
    ) -> None:
        if not isinstance(index_pages, int) or index_pages < 1:
            raise ValueError(f"index_pages {index_pages!r} is refused: allowed is an int >= 1")
        self.index_pages = index_pages
        self.policy = get_eviction_policy(eviction_policy)
        self.policy.bind(index_pages)
        self.places = Places(self.policy, dict(capacity or {}))
        self.tree = _Tree(self)
        self.stats = EngineTreeStats()
        self.now = 0.0
        self.clear()

    def clear(self) -> None:
        """Forget every page."""
        self.tree.clear()
        self.places.clear()
        self.where: dict[tuple[str, int, bytes], TreeNode] = {}
        self.ranks: dict[Group, dict[int, int]] = {}  # bytes of a page, per rank
        self.orders: list[Order] = []  # for the ranks to carry out, taken by ``take_orders``
        self.gone: OrderedDict[tuple[str, int, bytes], None] = OrderedDict()
        self.l1_heard: dict[str, float] = {}  # L1 place -> when a report or drop named it
        # A page's name in its engine (``PageName``): its block hash there, its tokens.
        self.names: dict[tuple[str, int, bytes], tuple[bytes, bytes]] = {}
        self._orphans: OrderedDict[tuple[str, int, bytes], list[tuple[int, StoredRun]]] = (
            OrderedDict()
        )

    def forget_all(self) -> list[KVEvent]:
        """Forget every page (and lease: the store was cleared); a ``BlockRemoved``
        per node and place it was whole in, so a subscriber's view empties too."""
        events: list[KVEvent] = []
        for node in self.tree.walk():
            full = (1 << group_of(node)[1]) - 1
            for place, mask in (node.places or {}).items():
                if mask == full:
                    hashes = tuple(node.page_hashes or ())
                    removed = BlockRemoved(
                        hashes, medium_of(place), namespace_of(node), event_place(place)
                    )
                    events.append(self._named(group_of(node), removed))
        self.clear()
        return events

    def __len__(self) -> int:
        """Pages the tree knows (whole somewhere, in part, or as a path only)."""
        return len(self.where)

    # -- reports -----------------------------------------------------------------------

    def record(
        self,
        tag: str,
        world: int,
        reports: dict[int, Sequence[StoredRun]],
        now: float = 0.0,
        names: Sequence[PageName] = (),
    ) -> list[KVEvent]:
        """Record, per rank, the pages it stored (used ``now``), and the engine's
        ``names`` of pages (kept while the tree knows the page); the events of the
        pages this made whole somewhere (one per run)."""
        check_group(tag, world)
        check_reports(world, reports)
        check_names(names)
        for name in names:
            self.names[(tag, world, name.page)] = (name.engine_hash, name.tokens)
        events: list[KVEvent] = []
        sizes = self.ranks.setdefault((tag, world), {})
        self.now = now
        for rank, runs in reports.items():
            for run in runs:
                if run.place.startswith(L1_AT):
                    self.l1_heard[run.place] = now
                if run.page_bytes and not sizes.get(rank):  # a rank's page size never changes
                    sizes[rank] = run.page_bytes
                    self.places.recount(self.tree.walk(), self.ranks)  # counted 0 before
                self._record(tag, world, rank, run, events)
        for name in names:  # a page the tree does not know (its run waits for a parent)
            if (tag, world, name.page) not in self.where:
                self.names.pop((tag, world, name.page), None)
        for e in events:
            n, by = len(e.page_hashes), self.stats.whole_by_place
            key = place_of(e.medium, e.place)
            by[key] = by.get(key, 0) + n
            self.stats.whole_pages += n if key == L3 else 0
        return events

    def _record(self, tag: str, world: int, rank: int, run: StoredRun, events: list) -> None:
        """Mark ``run``'s pages stored by ``rank`` in its place, growing the path."""
        if run.parent is None:
            node, at = self.tree.root, -1
        else:
            node = self.where.get((tag, world, run.parent))  # type: ignore[assignment]
            if node is None:
                self._orphan(tag, world, rank, run)
                return
            at = node.page_hashes.index(run.parent)  # type: ignore[union-attr]
        whole = Whole(run.namespace, run.place, run.parent)
        hashes, i = run.hashes, 0
        if run.place == L3 and run.page_bytes and self.gone:  # stored anew (not found)
            for h in hashes:
                self.gone.pop((tag, world, h), None)
        while i < len(hashes):
            inside = node.page_hashes[at + 1 :] if node is not self.tree.root else []
            k = 0
            while k < len(inside) and i + k < len(hashes) and inside[k] == hashes[i + k]:
                k += 1
            if k:
                node = self._mark(tag, world, node, at + 1, at + 1 + k, rank, run.place, whole)
                at, i = len(node.page_hashes) - 1, i + k  # type: ignore[arg-type]
                continue
            if inside:  # the run leaves this node mid-way: the node ends here
                node = self._split(node, at + 1)
            child = self.where.get((tag, world, hashes[i]))
            if child is None:
                child = self._attach(tag, world, node, run.namespace, hashes[i:])
            node, at = child, -1
        events.extend(self._named((tag, world), e) for e in whole.events)
        self.stats.reported_pages += len(hashes)
        if self._orphans:
            for h in hashes:
                for rank_, waiting in self._orphans.pop((tag, world, h), ()):
                    self._record(tag, world, rank_, waiting, events)

    def _orphan(self, tag: str, world: int, rank: int, run: StoredRun) -> None:
        key = (tag, world, run.parent)
        self._orphans.setdefault(key, []).append((rank, run))  # type: ignore[index]
        self._orphans.move_to_end(key)  # type: ignore[arg-type]
        while len(self._orphans) > MAX_ORPHANS:
            _, dropped = self._orphans.popitem(last=False)
            self.stats.orphans_dropped += len(dropped)

    def _attach(
        self, tag: str, world: int, parent: TreeNode, namespace: str, hashes: Sequence[bytes]
    ) -> TreeNode:
        node = self.tree.attach(parent, f"{tag}/{world}/{namespace}", b"".join(hashes), 0.0, 0)
        node.page_hashes = list(hashes)
        node.places = {}
        node.last_access = node.created = self.now
        for h in hashes:
            self.where[(tag, world, h)] = node
        if self.policy.remembers:
            self.policy.admitted(node, hash(node.key[:HASH_BYTES]))
        self.places.refresh(node)
        self.places.refresh(parent)
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` pages; the upper part (the same places)."""
        upper = self.tree.split(node, at * HASH_BYTES)
        upper.places = dict(node.places or {})
        tag, world = group_of(node)
        for h in upper.page_hashes or ():
            self.where[(tag, world, h)] = upper
        self.places.split(upper, node)
        return upper

    def _mark(
        self,
        tag: str,
        world: int,
        node: TreeNode,
        lo: int,
        hi: int,
        rank: int,
        place: str,
        whole: Whole,
    ) -> TreeNode:
        """Pages ``lo..hi`` of ``node`` are stored by ``rank`` in ``place``; the
        node they are now, alone."""
        node = self._isolate(node, lo, hi)
        node.last_access = max(node.last_access, self.now)
        size = self.ranks[(tag, world)].get(rank, 0)
        if self.places.add(node, place, 1 << rank, (1 << world) - 1, size):
            whole.add(node)
        return node

    def _isolate(self, node: TreeNode, lo: int, hi: int) -> TreeNode:
        """Pages ``lo..hi`` of ``node`` as a node of their own."""
        if hi < len(node.page_hashes or ()):
            node = self._split(node, hi)  # the upper part: pages 0..hi
        if lo:
            self._split(node, lo)  # ``node`` keeps pages lo..hi
        return node

    # -- forgetting ----------------------------------------------------------------------

    def forget(self, tag: str, world: int, hashes: Sequence[bytes]) -> list[KVEvent]:
        """Remove ``hashes`` from every place (a rank could not load them: gone, or
        refused by its checks); a ``BlockRemoved`` per place they were whole in, and
        an order to delete the shards the other ranks hold."""
        check_group(tag, world)
        check_hashes(hashes, "hashes")
        events: list[KVEvent] = []
        for h in hashes:
            node = self.where.get((tag, world, h))
            if node is None:
                continue
            at = node.page_hashes.index(h)  # type: ignore[union-attr]
            node = self._isolate(node, at, at + 1)
            self.stats.forgotten_pages += 1
            for place in list(node.places or ()):  # the other ranks' shards go too
                events.extend(self._leave(node, place, DELETE))
            self._prune(node)
        return events

    def drop(self, tag: str, world: int, place: str, hashes: Sequence[bytes]) -> list[KVEvent]:
        """``hashes`` left ``place`` (vLLM evicted them from a replica's blocks, and
        only the tree is to be told): a ``BlockRemoved`` per run whole there."""
        check_group(tag, world)
        check_place(place)
        check_hashes(hashes, "hashes")
        if place in self.l1_heard:
            self.l1_heard[place] = max(self.l1_heard[place], self.now)
        events: list[KVEvent] = []
        i = 0
        while i < len(hashes):
            node = self.where.get((tag, world, hashes[i]))
            if node is None or place not in (node.places or {}):
                i += 1
                continue
            page_hashes = node.page_hashes or []
            at = end = page_hashes.index(hashes[i])
            while end < len(page_hashes) and i < len(hashes) and page_hashes[end] == hashes[i]:
                end, i = end + 1, i + 1  # a run of the node's pages, in order
            node = self._isolate(node, at, end)
            events.extend(self._leave(node, place))
            self._prune(node)
        return events

    def drop_place(self, place: str) -> list[KVEvent]:
        """Every page leaves ``place`` (a replica's blocks were all cleared, or it
        went away); a ``BlockRemoved`` per node whole there."""
        check_place(place)
        self.l1_heard.pop(place, None)
        for key, waiting in list(self._orphans.items()):  # runs there waiting for a parent
            kept = [(rank, run) for rank, run in waiting if run.place != place]
            if kept:
                self._orphans[key] = kept
            else:
                del self._orphans[key]
        events: list[KVEvent] = []
        for node in [n for n in self.tree.walk() if place in (n.places or {})]:
            events.extend(self._leave(node, place))
        for node in [n for n in self.tree.walk() if not n.children]:
            self._prune(node)
        return events

    def forget_silent_l1(self, now: float) -> list[KVEvent]:
        """Every L1 place not heard of for ``L1_TTL_S`` leaves (``drop_place``)."""
        silent = [p for p, heard in self.l1_heard.items() if heard < now - L1_TTL_S]
        return [e for place in silent for e in self.drop_place(place)]

    def _leave(self, node: TreeNode, place: str, kind: str | None = None) -> list[KVEvent]:
        """``node`` leaves ``place``: its event if it was whole there; with ``kind``,
        the order its ranks there carry out (``Order``), queued."""
        tag, world = group_of(node)
        full = (1 << world) - 1
        mask = self.places.remove(node, place, self.ranks.get((tag, world), {}))
        hashes = tuple(node.page_hashes or ())
        if kind is not None and not place.startswith(L1_AT):  # vLLM's: not the tree's to order
            self.orders.append(self._order(node, place, mask, kind))
        if mask != full:
            return []
        removed = BlockRemoved(hashes, medium_of(place), namespace_of(node), event_place(place))
        return [self._named((tag, world), removed)]

    def _named(self, group: tuple[str, int], event: KVEvent) -> KVEvent:
        """``event`` with the engine's names of its pages, where the engine told
        every one (and its parent's: a run is never announced as a chain's start)."""
        if not self.names or not isinstance(event, (BlockStored, BlockRemoved)):
            return event
        names = [self.names.get((*group, h)) for h in event.page_hashes]
        if not names or any(n is None for n in names):
            return event
        hashes = tuple(n[0] for n in names)  # type: ignore[index]
        if isinstance(event, BlockRemoved):
            return msgspec.structs.replace(event, engine_hashes=hashes)
        parent = None
        if event.parent_hash is not None:
            parent = self.names.get((*group, event.parent_hash))
            if parent is None:
                return event
        tokens = b"".join(n[1] for n in names)  # type: ignore[index]
        return msgspec.structs.replace(
            event,
            engine_hashes=hashes,
            engine_parent=parent[0] if parent else None,
            tokens=tokens,
        )

    def _prune(self, node: TreeNode) -> None:
        """Detach ``node`` and its ancestors while they are in no place, childless
        and unleased: nothing can be matched through them."""
        root = self.tree.root
        while node is not root and not node.places and not node.children and not node.lock_ref:
            parent = node.parent
            assert parent is not None
            tag, world = group_of(node)
            for h in node.page_hashes or ():
                self.where.pop((tag, world, h), None)
                if self.names:
                    self.names.pop((tag, world, h), None)
            self.places.detach(node)
            self.tree.detach_leaf(node)
            if self.policy.remembers:
                self.policy.evicted(node, hash(node.key[:HASH_BYTES]), len(node.page_hashes or ()))
            node = parent

    def _order(self, node: TreeNode, place: str, mask: int, kind: str) -> Order:
        tag, world = group_of(node)
        parent = node.parent
        before = parent.page_hashes[-1] if parent is not None and parent.page_hashes else None
        return Order(
            tag, world, place, mask, tuple(node.page_hashes or ()), kind, namespace_of(node), before
        )

    def _count(self, place: str, node: TreeNode) -> None:
        n = len(node.page_hashes or ())
        self.stats.evicted_pages += n
        by = self.stats.evicted_by_place
        by[place] = by.get(place, 0) + n

    # -- figures -------------------------------------------------------------------------

    def residency(self) -> dict[str, dict[str, int]]:
        """Per place: pages whole there, shard bytes held, and whole pages per tenant
        (kept as they change: nothing walks the tree)."""
        return self.places.figures()
