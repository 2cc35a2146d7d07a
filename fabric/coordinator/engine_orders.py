"""Evictions of engine pages waiting for an engine to carry them out.

The tree decides what leaves a place (``fabric.cache.engine_tree``); only an
engine's workers can delete a page's shards there: they know its keys (the
tag, the rank's shard) and, for a node's L2, they are on the node. So each
``Order`` waits here for the next lookup or report of an engine of its tag and
world that can reach the place (any, for L3; one on the node, for a node's
L2), and goes back with that call's reply. At most ``max_pages`` pages wait; past that
the oldest are let go, counted: their shards stay where they are until the
store's own bound or a later store of theirs, and the tree no longer counts them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from fabric.cache.engine_input import L3, StoredRun
from fabric.cache.engine_places import DELETE, Order

# Pages of drops handed to one engine per reply (a step's worth of deletes).
MAX_PAGES_PER_REPLY = 1 << 14


class PendingOrders:
    def __init__(self, max_pages: int = 1 << 20) -> None:
        self.max_pages = max_pages
        self.pages = 0
        self.let_go = 0  # pages dropped past the bound, never carried out
        self._queues: OrderedDict[tuple[str, int, str], deque[Order]] = OrderedDict()

    def add(self, drops: Iterable[Order]) -> None:
        for drop in drops:
            self._queues.setdefault((drop.tag, drop.world, drop.place), deque()).append(drop)
            self.pages += len(drop.hashes)
        while self.pages > self.max_pages and self._queues:
            key, queue = next(iter(self._queues.items()))
            self.pages -= len(queue[0].hashes)
            self.let_go += len(queue.popleft().hashes)
            if not queue:
                del self._queues[key]

    def stored_again(
        self, tag: str, world: int, reports: Mapping[int, Sequence[StoredRun]]
    ) -> None:
        """Ranks stored pages anew: a delete of their shards there still waiting (a
        page forgotten when a load of it failed, stored again since) is called off
        for them — carried out after the new store, it would delete good pages the
        tree counts."""
        for rank, runs in reports.items():
            for run in runs:
                queue = self._queues.get((tag, world, run.place))
                if not queue:
                    continue
                again, bit = set(run.hashes), 1 << rank
                kept: deque[Order] = deque()
                for order in queue:
                    hit = order.kind == DELETE and order.mask & bit and again & set(order.hashes)
                    if not hit:
                        kept.append(order)
                        continue
                    rest = tuple(h for h in order.hashes if h not in again)
                    if rest:
                        kept.append(replace(order, hashes=rest))
                    if order.mask & ~bit:
                        anew = tuple(h for h in order.hashes if h in again)
                        kept.append(replace(order, mask=order.mask & ~bit, hashes=anew))
                self.pages += sum(len(o.hashes) for o in kept) - sum(len(o.hashes) for o in queue)
                key = (tag, world, run.place)
                if kept:
                    self._queues[key] = kept
                else:
                    del self._queues[key]

    def take(self, tag: str, world: int, place: str) -> list[Order]:
        """The drops an engine of ``tag`` and ``world`` on ``place`` (its node's L2
        place, or ``""``) carries out: L3's and its node's, oldest first."""
        out: list[Order] = []
        budget = MAX_PAGES_PER_REPLY
        for where in (L3, place) if place else (L3,):
            queue = self._queues.get((tag, world, where))
            while queue and budget > 0:
                drop = queue.popleft()
                out.append(drop)
                budget -= len(drop.hashes)
                self.pages -= len(drop.hashes)
            if queue is not None and not queue:
                del self._queues[(tag, world, where)]
        return out

    def clear(self) -> None:
        self._queues.clear()
        self.pages = 0

    def __len__(self) -> int:
        return self.pages
