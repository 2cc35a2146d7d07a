"""What the engine tree (``fabric.cache.engine_tree``) would serve a trace, with no
engine and no bytes: ``kvfabric simulate --engine-pages`` and
``bench/engine_tiers.py``'s prediction.

Each request is one engine's (request ``i`` goes to engine ``i % engines``,
engine ``e`` on node ``e % nodes``), its prompt one page per hash id, served
as the connector serves it with vLLM's own prefix cache empty: a lookup of
every page before the last token's (its node's L2 and L3; under
``best_effort`` its node's L2 only), the pages found loaded (those from L3
kept in the node's L2 too), the rest computed and stored (``write_through``:
in the node's L2 and L3; otherwise in the node's L2, L3 by the tree's orders),
and every order the tree gives carried out at once, as the workers would.

``flat_lru`` replays the same requests through the index kvfabric had before
the tree (``FlatIndex``): an LRU of pages per place, a lookup refreshing the
pages it matched from the first on — so a prefix's first page is always older
than the pages after it and leaves first — at the same capacities.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fabric.cache.engine_input import L3, StoredRun, stored_runs
from fabric.cache.engine_places import BACKUP, MOVE, PREFETCH
from fabric.cache.engine_tree import EngineTree

TAG = "0123456789abcdef"
LEASE_S = 60.0  # a request's lease on its matched pages, released once they are loaded
NAMESPACE = "vllm"


@dataclass(frozen=True)
class EngineSetup:
    """The engines and the fabric's tiers the trace is replayed on."""

    page_bytes: int  # one page of one rank
    l2_bytes: int  # each node's L2 regions (their engines' l2_bytes; 0: no node L2)
    l3_bytes: int  # storage.max_bytes (0: no cap)
    engines: int = 2
    nodes: int = 1
    eviction_policy: str = "a2q"
    write_policy: str = "write_through"
    stop_policy: str = "timeout"


@dataclass
class EngineReplay:
    requests: int = 0
    asked_pages: int = 0  # pages a lookup could serve (every page before the last token's)
    hit_pages: dict[str, int] = field(default_factory=lambda: {"l2": 0, "l3": 0})
    l3_pages_written: int = 0  # pages L3 newly held (a page stored again not counted)
    per_request: list[tuple[int, int]] = field(default_factory=list)  # (l2, l3) hits

    def hit_rate(self, tier: str | None = None) -> float:
        hits = self.hit_pages[tier] if tier else sum(self.hit_pages.values())
        return hits / max(self.asked_pages, 1)


def chains(hash_ids: Sequence[Sequence[int]]) -> list[list[bytes]]:
    """Each request's pages, a chain hash per hash id (a shared leading run of ids
    is a shared prefix)."""
    out = []
    for ids in hash_ids:
        prev, chain = NAMESPACE.encode(), []
        for i in ids:
            prev = hashlib.sha256(prev + i.to_bytes(8, "little", signed=True)).digest()
            chain.append(prev)
        out.append(chain)
    return out


def node_l2_of(engine: int, setup: EngineSetup) -> str:
    return f"l2@node{engine % setup.nodes}" if setup.l2_bytes else ""


def replay(
    hash_ids: Sequence[Sequence[int]],
    setup: EngineSetup,
    flat_lru: bool = False,
    progress: Callable[[int], None] | None = None,
) -> EngineReplay:
    """Serve the requests (each a list of hash ids) in order; what they hit."""
    index = FlatIndex(setup) if flat_lru else TreeIndex(setup)
    out = EngineReplay()
    for i, chain in enumerate(chains(hash_ids)):
        place = node_l2_of(i % setup.engines, setup)
        asked = chain[: max(len(chain) - 1, 0)]
        l2, l3 = index.lookup(asked, place, f"r{i}")
        out.requests += 1
        out.asked_pages += len(asked)
        out.hit_pages["l2"] += l2
        out.hit_pages["l3"] += l3
        out.per_request.append((l2, l3))
        out.l3_pages_written += index.serve(chain, l2, l3, place, f"r{i}")
        if progress is not None:
            progress(1)
    return out


class TreeIndex:
    """The engine tree, its orders carried out at once."""

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self.tree = EngineTree(
            setup.eviction_policy,
            1 << 22,
            {L3: setup.l3_bytes},
            setup.write_policy,
        )
        self.now = 0.0
        for node in range(setup.nodes):
            if setup.l2_bytes:
                self.tree.declare(f"l2@node{node}", TAG, setup.l2_bytes)

    def lookup(self, asked: list[bytes], place: str, name: str) -> tuple[int, int]:
        """The request's hit in its node's L2 and in L3, leased under ``name`` (as the
        connector leases it until its pages are loaded)."""
        self.now += 1.0
        stats = self.tree.stats
        before = stats.l2_hit_pages
        best_effort = self.setup.stop_policy == "best_effort"
        (hit,) = self.tree.lookup(
            TAG, 1, [asked], [name], LEASE_S, self.now, place, l2_only=best_effort
        )
        l2 = stats.l2_hit_pages - before
        return l2, hit - l2

    def serve(self, chain: list[bytes], l2: int, l3: int, place: str, name: str) -> int:
        """The request's loads (its lease then ends) and stores, then the orders;
        pages L3 newly holds."""
        self.tree.release([name])
        hit = l2 + l3
        before = self.tree.stats.whole_by_place.get(L3, 0)
        runs: list[StoredRun] = []
        size = self.setup.page_bytes
        if place and l3:  # read from L3: kept in the node's L2 too
            runs += self._l3_loaded(chain, hit, place)
        if hit < len(chain):
            parent = chain[hit - 1] if hit else None
            computed = tuple(chain[hit:])
            if place:
                runs.append(StoredRun(NAMESPACE, parent, computed, place, size))
            if not place or self.setup.write_policy == "write_through":
                runs.append(StoredRun(NAMESPACE, parent, computed, L3, size))
        orders = self._report(runs)
        for _ in range(64):  # what the orders store may evict more
            if not orders:
                break
            runs = []
            for order in orders:
                if order.kind in (BACKUP, MOVE):
                    runs.append(StoredRun(NAMESPACE, order.parent, order.hashes, L3, size))
                elif order.kind == PREFETCH:
                    runs.append(StoredRun(NAMESPACE, order.parent, order.hashes, order.place, size))
            orders = self._report(runs)
        return self.tree.stats.whole_by_place.get(L3, 0) - before

    def _l3_loaded(self, chain: list[bytes], hit: int, place: str) -> list[StoredRun]:
        """The pages of the hit its node's L2 lacked (read from L3), as runs there."""
        lacked = []
        for page in chain[:hit]:
            node = self.tree.where.get((TAG, 1, page))
            lacked.append(node is None or (node.places or {}).get(place, 0) != 1)
        hits = StoredRun(NAMESPACE, None, tuple(chain[:hit]), place, self.setup.page_bytes)
        return stored_runs(hits, lacked)

    def _report(self, runs: list[StoredRun]) -> list:
        if not runs:
            return self.tree.take_orders()
        self.now += 1e-3
        _, orders = self.tree.report(TAG, 1, {0: runs}, now=self.now)
        return orders


class FlatIndex:
    """The index before the tree: an LRU of pages per place (capacity in pages), a
    lookup refreshing each page it matched in chain order."""

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self.places: dict[str, OrderedDict[bytes, None]] = {}
        self.hits: dict[bytes, int] = {}  # lookups that found a page (selective write-through)

    def _cap(self, place: str) -> int:
        size = self.setup.page_bytes
        cap = self.setup.l3_bytes if place == L3 else self.setup.l2_bytes // 2
        return cap // size if cap else 1 << 62

    def _lru(self, place: str) -> OrderedDict[bytes, None]:
        return self.places.setdefault(place, OrderedDict())

    def lookup(self, asked: list[bytes], place: str, name: str = "") -> tuple[int, int]:
        l2 = self._lru(place) if place else OrderedDict()
        l3 = self._lru(L3)
        only_l2 = self.setup.stop_policy == "best_effort" and bool(place)
        hits = [0, 0]
        for page in asked:
            if page in l2:
                l2.move_to_end(page)
                hits[0] += 1
                self.hits[page] = self.hits.get(page, 0) + 1
            elif page in l3 and not only_l2:
                l3.move_to_end(page)
                hits[1] += 1
            else:
                break
        return hits[0], hits[1]

    def serve(self, chain: list[bytes], l2: int, l3: int, place: str, name: str = "") -> int:
        hit, written = l2 + l3, 0
        if place:
            self._store(place, chain)  # (what was read from L3 kept in L2 too)
        if not place or self.setup.write_policy == "write_through":
            written += self._store(L3, chain[hit:])
        elif self.setup.write_policy == "write_back":
            for page in self._evict(place):  # a page leaving L2 goes to L3 first
                written += self._store(L3, [page])
        else:  # write_through_selective: a page found twice is copied to L3
            written += self._store(L3, [p for p in chain[:l2] if self.hits.get(p) == 2])
        return written

    def _store(self, place: str, pages: list[bytes]) -> int:
        """Store ``pages`` in ``place``; how many it did not hold."""
        lru, new = self._lru(place), 0
        for page in pages:
            new += page not in lru
            lru[page] = None
            lru.move_to_end(page)
        if place == L3 or self.setup.write_policy != "write_back":
            self._evict(place)
        return new

    def _evict(self, place: str) -> list[bytes]:
        lru, cap, gone = self._lru(place), self._cap(place), []
        while len(lru) > cap:
            gone.append(lru.popitem(last=False)[0])
        return gone
