"""Where an engine page lives, for the tree (``fabric.cache.engine_tree``): per
place, the ranks whose shard is there, the bytes each place holds, and the
leaf sets eviction takes from, in the eviction policy's order.

A node is a leaf *of a place* when it is there and no child of it is: a place
gives up a page only after every page that follows it there, so a prefix it
keeps is always whole from its first page. L3 orders by the policy's key, a
node's L2 by its ``host_order`` (as the fabric's own L1 and L2 do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from fabric.cache.engine_input import L1_AT, L2_AT, L3
from fabric.cache.events import BlockStored, Medium
from fabric.cache.leaves import LeafQueue
from fabric.cache.node import TreeNode
from policies import EvictionPolicy

# What an ``Order`` asks of the ranks that hold a page in its place.
DELETE = "delete"  # delete their shards there (the tree evicted the page)
BACKUP = "backup"  # copy them from that node's L2 into L3 (the write policy wants it there)
MOVE = "move"  # copy them into L3, then delete them from L2 (write-back: the page leaves L2)
PREFETCH = "prefetch"  # read them from L3 into that node's L2 (a lookup found them in L3 only)


@dataclass(frozen=True)
class Order:
    """What the tree asks of the ranks in ``mask`` for the pages ``hashes`` of the
    engine ``tag``, ``world`` in ``place`` (``kind``: ``DELETE``, ``BACKUP``,
    ``MOVE``, or ``PREFETCH`` into ``place``). A copy's pages follow ``parent`` in
    ``namespace``'s chain."""

    tag: str
    world: int
    place: str
    mask: int
    hashes: tuple[bytes, ...]
    kind: str = DELETE
    namespace: str = ""
    parent: bytes | None = None


def _count_child(parent: TreeNode, place: str, delta: int) -> None:
    if parent.children_in is None:
        parent.children_in = {}
    n = parent.children_in.get(place, 0) + delta
    if n:
        parent.children_in[place] = n
    else:
        parent.children_in.pop(place, None)


def medium_of(place: str) -> Medium:
    if place == L3:
        return Medium.STORAGE
    return Medium.DEVICE if place.startswith(L1_AT) else Medium.HOST


def ranks_of(mask: int) -> Iterator[int]:
    rank = 0
    while mask:
        if mask & 1:
            yield rank
        mask >>= 1
        rank += 1


class Places:
    def __init__(self, policy: EvictionPolicy, capacity: dict[str, int]) -> None:
        self.policy = policy
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        policy = self.policy
        self.leaves: dict[str, LeafQueue] = {}
        self.used: dict[str, int] = {}  # shard bytes held, per place
        self.whole: dict[str, dict[str, int]] = {}  # whole pages, per place and tenant
        # Childless nodes, for the tree's own bound (``index_pages``).
        self.ends = LeafQueue(policy.key, policy.monotone, lambda: policy.version)

    def queue(self, place: str) -> LeafQueue:
        queue = self.leaves.get(place)
        if queue is None:
            policy = self.policy
            order = policy.key if place == L3 else policy.host_order()
            queue = self.leaves[place] = LeafQueue(order, policy.monotone, lambda: policy.version)
        return queue

    def cap(self, place: str) -> int:
        """``place``'s capacity in bytes (0: none but the tree's own bound)."""
        cap = self.capacity.get(place, 0)
        if not cap and place.startswith(L2_AT):
            cap = self.capacity.get(L2_AT, 0)
        return cap

    # -- membership ----------------------------------------------------------------------

    def refresh(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of its places' leaf sets and of ``ends``."""
        if node.parent is None:  # the root
            return
        below = node.children_in or {}
        for place in node.places or ():
            queue = self.queue(place)
            if below.get(place):
                queue.discard(node)
            else:
                queue.add(node)
        if node.children:
            self.ends.discard(node)
        else:
            self.ends.add(node)

    def add(self, node: TreeNode, place: str, bit: int, full: int, size: int) -> bool:
        """Rank ``bit``'s shards of ``node`` (``size`` bytes a page) are in ``place``
        now; whether that made the node whole there."""
        assert node.places is not None and node.parent is not None
        old = node.places.get(place, 0)
        if old & bit:
            return False
        node.places[place] = old | bit
        pages = len(node.page_hashes or ())
        self.used[place] = self.used.get(place, 0) + size * pages
        if not old:
            _count_child(node.parent, place, 1)
            self.refresh(node)
            self.refresh(node.parent)
        if old | bit != full:
            return False
        self._count_whole(node, place, pages)
        return True

    def _count_whole(self, node: TreeNode, place: str, pages: int) -> None:
        tenants = self.whole.setdefault(place, {})
        tenant = tenant_of(node)
        tenants[tenant] = tenants.get(tenant, 0) + pages
        if not tenants[tenant]:
            del tenants[tenant]

    def remove(self, node: TreeNode, place: str, sizes: dict[int, int]) -> int:
        """``node`` leaves ``place``; the ranks that had it there."""
        assert node.places is not None and node.parent is not None
        mask = node.places.pop(place, 0)
        if mask:
            _count_child(node.parent, place, -1)
        pages = len(node.page_hashes or ())
        size = sum(sizes.get(rank, 0) for rank in ranks_of(mask))
        self.used[place] = max(0, self.used.get(place, 0) - size * pages)
        if mask == (1 << group_of(node)[1]) - 1:
            self._count_whole(node, place, -pages)
        self.queue(place).discard(node)
        self.refresh(node.parent)
        return mask

    def recount(
        self, nodes: Iterable[TreeNode], sizes: dict[tuple[str, int], dict[int, int]]
    ) -> None:
        """The bytes each place holds, counted anew (a rank's page size became known
        after pages of it were counted at 0)."""
        used: dict[str, int] = {}
        for node in nodes:
            rank_bytes = sizes.get(group_of(node), {})
            pages = len(node.page_hashes or ())
            for place, mask in (node.places or {}).items():
                size = sum(rank_bytes.get(rank, 0) for rank in ranks_of(mask))
                used[place] = used.get(place, 0) + size * pages
        self.used = used

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` was cut from ``lower`` with the same places (its parent's counts
        stay: one child there for another), ``lower`` its one child."""
        upper.children_in = dict.fromkeys(upper.places or (), 1)
        self.refresh(upper)
        self.refresh(lower)

    def detach(self, node: TreeNode) -> None:
        for queue in self.leaves.values():
            queue.discard(node)
        self.ends.discard(node)

    @staticmethod
    def lock(node: TreeNode, delta: int) -> None:
        """Hold (+1) or let go (-1) ``node`` and its ancestors: a held node is not evicted."""
        while node.parent is not None:
            node.lock_ref += delta
            assert node.lock_ref >= 0
            node = node.parent

    # -- eviction ------------------------------------------------------------------------

    def over(self) -> list[str]:
        """Places holding more than their capacity."""
        return [p for p, used in self.used.items() if 0 < self.cap(p) < used]

    def victims(self, place: str, room: int = 0) -> Iterator[TreeNode]:
        """Leaves of ``place`` to evict, in policy order, while it holds more than
        its capacity less ``room`` bytes (the caller makes each leave before the
        next is asked for)."""
        cap = self.cap(place) - room
        return self._take(self.queue(place), lambda: self.used.get(place, 0) > cap)

    def ends_victims(self, more: Callable[[], bool]) -> Iterator[TreeNode]:
        """Childless nodes to evict, in policy order, while ``more()``."""
        return self._take(self.ends, more)

    @staticmethod
    def _take(queue: LeafQueue, more: Callable[[], bool]) -> Iterator[TreeNode]:
        queue.begin()
        kept = []
        try:
            while more():
                node = queue.pop()
                if node is None:
                    break
                if node.lock_ref:
                    kept.append(node)
                    continue
                yield node
        finally:
            for node in kept:
                queue.requeue(node)

    # -- figures -------------------------------------------------------------------------

    def figures(self) -> dict[str, dict]:
        """Per place: whole pages, shard bytes held, and whole pages per tenant."""
        places = set(self.used) | set(self.whole)
        return {
            p: {
                "pages": sum(self.whole.get(p, {}).values()),
                "bytes": self.used.get(p, 0),
                "tenants": dict(self.whole.get(p, {})),
            }
            for p in sorted(places)
        }


class Whole:
    """The pages a run made whole in its place, as ``BlockStored`` events: one per
    run of consecutive pages."""

    def __init__(self, namespace: str, place: str, parent: bytes | None) -> None:
        self.namespace, self.place, self.parent = namespace, place, parent
        self.events: list[BlockStored] = []

    def add(self, node: TreeNode) -> None:
        hashes = tuple(node.page_hashes or ())
        parent = node.parent.page_hashes[-1] if node.parent and node.parent.page_hashes else None
        last = self.events[-1] if self.events else None
        if last is not None and last.page_hashes[-1] == parent:
            hashes, parent = last.page_hashes + hashes, last.parent_hash
            self.events.pop()
        self.events.append(
            BlockStored(
                hashes, medium_of(self.place), self.namespace, parent, place=event_place(self.place)
            )
        )


def group_of(node: TreeNode) -> tuple[str, int]:
    tag, world, _ = node.namespace.split("/", 2)
    return tag, int(world)


def tenant_of(node: TreeNode) -> str:
    """The tenant of an engine node: its namespace before any ``/`` (a request's
    salt or adapter is not a tenant)."""
    return namespace_of(node).split("/", 1)[0]


def namespace_of(node: TreeNode) -> str:
    return node.namespace.split("/", 2)[2]


def event_place(place: str) -> str:
    """An event's place: the node of an L2, the replica of an L1 (L3 is one place:
    none named)."""
    return place[len(L2_AT) :] if place.startswith((L2_AT, L1_AT)) else ""


def place_of(medium: Medium, place: str) -> str:
    """The place an event's medium and place name (``event_place``'s inverse)."""
    if medium is Medium.STORAGE:
        return L3
    return (L1_AT if medium is Medium.DEVICE else L2_AT) + place


def hit_point(
    where: dict,
    world: int,
    chain: Sequence[bytes],
    n: int,
    needs: Sequence[tuple[str, int]],
    full: int,
    place: str,
    l2_only: bool,
    now: float,
) -> tuple[int, list[TreeNode]]:
    """A hybrid engine's hit point: the deepest ``p <= n`` (the chain's match) at
    which each component group of ``needs``, ``(tag, before)``, holds whole (in
    ``place``, or in L3 unless ``l2_only``) its pages of the ``before`` pages
    before ``p`` (its window; 1: a state at the hit point; 0: every page) — each
    a page of its own (a ``StoredRun`` without a parent), as the Unified cache's
    components; the pages they lack are tombstones. With it, the component
    nodes that serve it (0 and none: no such point)."""
    seen: dict[tuple[str, int], TreeNode | None] = {}

    def page(tag: str, j: int) -> TreeNode | None:
        key = (tag, j)
        if key not in seen:
            node = where.get((tag, world, chain[j]))
            places = (node.places or {}) if node is not None else {}
            ok = node is not None and (
                (bool(place) and places.get(place, 0) == full)
                or (not l2_only and places.get(L3, 0) == full)
            )
            seen[key] = node if ok else None
        return seen[key]

    for tag, before in needs:  # every page: the point is at most its leading run
        if before == 0:
            lead = 0
            while lead < n and page(tag, lead) is not None:
                lead += 1
            n = lead
    for p in range(n, 0, -1):
        nodes = []
        for tag, before in needs:
            lo = 0 if before == 0 else max(p - before, 0)
            got = [page(tag, j) for j in range(lo, p)]
            if any(x is None for x in got):
                break
            nodes += got
        else:
            for node in nodes:
                node.last_access = now
                node.hit_count += 1
            return p, list({id(x): x for x in nodes}.values())  # type: ignore[misc]
    return 0, []
