"""A hybrid model's non-base cache components in the tree: sliding-window KV and
mamba states (the unified radix cache of the reference, in kvfabric's design).

Full attention is the base component: a node's ``device_value`` (its pages, as
for any model). The others live beside it on the same nodes:

- ``sliding``: KV of the sliding-window layers for a *tail* of the node — its
  last ``len(node.sliding)`` pages, at most ``window_pages`` (the pages of the
  ``window - 1`` tokens before a position; a match ending at the node needs no
  more, one ending in a child needs at most that much of this node's tail);
- ``mamba``: one state slot holding the recurrent state at the node's end.

A prefix is usable only where every component can serve it (``valid_end``):
the mamba state at exactly its end, and sliding tails covering the window
before it without a gap (walking up through parents' tails). A node whose
component is absent while its full pages are there is a *tombstone*: it still
serves longer matches through it, not as an end.

Each component has its own L1 pool, LRU order and locks. A lock taken at a
match end protects the mamba state there and the sliding tails of the window
before it only (``sliding_locks`` keeps, per node, how many locks still need
how many pages from that node upward, so a split divides them exactly).
Evicting a component makes a tombstone; a device leaf left with a component
missing can serve nothing and is removed (demoted to L2 or deleted), and so on
up the tree (``prune``). Removing a node's full pages takes its components with
it (``drop``).

L2 holds components too: a write to L2 copies a node's components with its
pages (``to_host``), a load-back brings them to L1 (``to_device``), and an L2
node deleted takes its components (``drop_host``). A hybrid match may end at an
L2 node whose components are valid there. Each component's L2 pool has its own
eviction order (``host_sliding_lru``, ``host_mamba_lru``): it holds exactly the
nodes whose value of that component is in L2 only (not in L1 as well), and a
component short of L2 room evicts from it alone (``evict_host``), leaving an L2
tombstone; the node's full pages stay. Backups, prefetch anchors, pins and
locks (``host_ref``, ``lock_ref``) protect an L2 component as they protect its
pages. L3 keeps components too: a backup copies a node's L2 components, a
prefetch brings those of the end it reads for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from fabric.cache.allocator import PagedAllocator, Pages, as_pages
from fabric.cache.leaves import LeafQueue
from fabric.cache.node import TreeNode
from fabric.cache.results import TierSizes
from policies import EvictionPolicy


@dataclass
class PartFill:
    """What a fill must write besides full-attention KV: sliding-window KV for key
    pages ``sliding_at`` (page indices of the request's key) into pages ``sliding``
    of the sliding pool, and the mamba state after key page ``mamba_at[i] - 1``
    (a node end the fill computes through) into slot ``mamba[i]``."""

    sliding_at: list[int] = field(default_factory=list)
    sliding: Pages = field(default_factory=as_pages)
    mamba_at: list[int] = field(default_factory=list)
    mamba: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.sliding_at and not self.mamba


@dataclass
class ComponentStats:
    """Counters of the non-base components (they survive resets)."""

    sliding_evicted_pages: int = 0
    mamba_evicted_states: int = 0
    # Evicted from L2 alone (their node's full pages stayed there).
    host_sliding_evicted_pages: int = 0
    host_mamba_evicted_states: int = 0
    tombstones_removed: int = 0
    sliding_alloc_failures: int = 0
    mamba_alloc_failures: int = 0
    truncated_matches: int = 0
    # Checkpoint ends (``checkpoint_pages``) given a mamba state, and those that
    # found no free slot (checkpoints never evict).
    checkpoints_saved: int = 0
    checkpoints_skipped: int = 0
    # Over requests' admission matches (L1 and L2): the prompt tokens each
    # component alone could have served (``full``, ``sliding``, ``mamba``) and
    # those all of them together could (``all``).
    match_tokens: dict[str, int] = field(default_factory=dict)


class Components:
    """The sliding and mamba components of one tree. ``remove(node)`` takes a dead
    device leaf's full pages away (demotes or deletes it; ``False`` when it must
    stay for now)."""

    def __init__(
        self,
        components: tuple[str, ...],
        page_size: int,
        window_pages: int,
        sliding_pages: int,
        mamba_slots: int,
        eviction: EvictionPolicy,
        host_sliding_pages: int = 0,
        host_mamba_slots: int = 0,
        checkpoint_pages: int = 0,
    ) -> None:
        self.sliding = "sliding" in components
        self.mamba = "mamba" in components
        self.page_size = page_size
        self.window_pages = window_pages if self.sliding else 0
        self.sliding_pool = PagedAllocator(
            sliding_pages if self.sliding else 0, page_size, "L1 sliding"
        )
        self.mamba_pool = PagedAllocator(mamba_slots if self.mamba else 0, 1, "L1 mamba")
        self.host_sliding_pool = PagedAllocator(
            host_sliding_pages if self.sliding else 0, page_size, "L2 sliding"
        )
        self.host_mamba_pool = PagedAllocator(host_mamba_slots if self.mamba else 0, 1, "L2 mamba")
        self.eviction = eviction
        # Mamba states inside filled prefixes, every this many pages (0: off).
        self.checkpoint_pages = checkpoint_pages if self.mamba else 0
        self.stats = ComponentStats()
        self.remove: Callable[[TreeNode], bool] = lambda node: False
        self.root: TreeNode | None = None
        self.clear(None)

    def clear(self, root: TreeNode | None) -> None:
        """Forget every value (the tree was cleared) and empty the pools."""
        self.root = root
        for pool in (
            self.sliding_pool,
            self.mamba_pool,
            self.host_sliding_pool,
            self.host_mamba_pool,
        ):
            pool.reset()
        policy = self.eviction
        queue = lambda: LeafQueue(policy.key, policy.monotone, lambda: policy.version)  # noqa: E731
        self.sliding_lru, self.mamba_lru = queue(), queue()
        self.host_sliding_lru, self.host_mamba_lru = queue(), queue()

    # -- validity ------------------------------------------------------------------

    def complete(self, node: TreeNode) -> bool:
        """Every component has a value on ``node`` itself (not a tombstone)."""
        return (not self.mamba or node.mamba is not None) and (
            not self.sliding or node.sliding is not None
        )

    def valid_end(self, node: TreeNode, pages: Callable[[TreeNode], int]) -> bool:
        """A prefix ending at ``node`` can be served: the mamba state at its end and
        sliding tails covering the window before it — each node's L1 values where
        it is on device, its L2 values where it is in L2 only (a load-back brings
        those chains to L1 with their components)."""
        if node is self.root:
            return True
        return self._state_at(node) and self._window_before(node, pages)

    def _state_at(self, node: TreeNode) -> bool:
        """The mamba state at ``node``'s end is there (or the model has none)."""
        if not self.mamba:
            return True
        return (node.mamba if node.device_value is not None else node.host_mamba) is not None

    def _window_before(self, node: TreeNode, pages: Callable[[TreeNode], int]) -> bool:
        """The sliding tails covering the window before ``node``'s end are there."""
        need, x = self.window_pages, node
        while need > 0 and x is not self.root:
            n = pages(x)
            tail = x.sliding if x.device_value is not None else x.host_sliding
            have = 0 if tail is None else len(tail)
            if have < min(n, need):
                return False
            need -= n
            x = x.parent  # type: ignore[assignment]
        return True

    def count_match(self, path: list[TreeNode], pages: Callable[[TreeNode], int]) -> None:
        """Count one request's admission match along ``path`` (the nodes of its
        cached prefix, L1 or L2): the tokens each component alone could serve
        there — the deepest end where it is valid — and those every component
        together serves (``ComponentStats.match_tokens``)."""
        depth, ends = 0, []
        for node in path:
            depth += pages(node)
            ends.append(depth)
        tokens = self.stats.match_tokens

        def deepest(ok: Callable[[TreeNode], bool]) -> int:
            i = len(path)
            while i and not ok(path[i - 1]):
                i -= 1
            return ends[i - 1] * self.page_size if i else 0

        tokens["full"] = tokens.get("full", 0) + (ends[-1] * self.page_size if ends else 0)
        if self.sliding:
            got = deepest(lambda n: self._window_before(n, pages))
            tokens["sliding"] = tokens.get("sliding", 0) + got
        if self.mamba:
            tokens["mamba"] = tokens.get("mamba", 0) + deepest(self._state_at)
        tokens["all"] = tokens.get("all", 0) + deepest(lambda n: self.valid_end(n, pages))

    # -- structure -----------------------------------------------------------------

    def on_split(self, upper: TreeNode, lower: TreeNode, lower_pages: int) -> None:
        """``lower`` (the node that was split) keeps its last ``lower_pages`` pages;
        the parts of its sliding tails (L1 and L2) and of its sliding locks reaching
        above them move to ``upper``. The mamba states stay with ``lower`` (they are
        at the same end)."""
        tail = lower.sliding
        if tail is not None and len(tail) > lower_pages:
            cut = len(tail) - lower_pages
            upper.sliding, lower.sliding = tail[:cut], tail[cut:]
        tail = lower.host_sliding
        if tail is not None and len(tail) > lower_pages:
            cut = len(tail) - lower_pages
            upper.host_sliding, lower.host_sliding = tail[:cut], tail[cut:]
        locks = lower.sliding_locks
        if locks:
            moved = {r - lower_pages: c for r, c in locks.items() if r > lower_pages}
            upper.sliding_locks = moved or None
        self.refresh(upper)
        self.refresh(lower)

    def refresh(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of the four component eviction queues: L1's
        (unlocked values) and L2's (values in L2 only)."""
        for queue, member in (
            (self.sliding_lru, node.sliding is not None and not node.sliding_locks),
            (self.mamba_lru, node.mamba is not None and node.part_ref == 0),
            (self.host_sliding_lru, node.host_sliding is not None and node.sliding is None),
            (self.host_mamba_lru, node.host_mamba is not None and node.mamba is None),
        ):
            if member:
                queue.add(node)
            else:
                queue.discard(node)

    def drop(self, node: TreeNode) -> None:
        """Free every component value of ``node`` (its full pages are leaving L1)."""
        assert not node.sliding_locks and node.part_ref == 0, node
        if node.sliding is not None:
            self.sliding_pool.release(node.sliding)
            node.sliding = None
        if node.mamba is not None:
            self.mamba_pool.release((node.mamba,))
            node.mamba = None
        self.refresh(node)  # what it has in L2 is there only now

    # -- L2 ------------------------------------------------------------------------

    def to_host(self, node: TreeNode, copy: list[list[int]]) -> None:
        """``node``'s L1 components get L2 copies (its full pages are in L2 or being
        written): L2 slots are taken now, evicting L2-only values of the same
        component if short (never on ``node``'s path), and the copies added to
        ``copy`` (sliding src, dst, mamba src, dst). A pool without room even then
        leaves that component out of L2."""
        if node.sliding is not None and node.host_sliding is None:
            n = len(node.sliding)
            got = self._alloc(self.host_sliding_pool, n, self.evict_host_sliding, node)
            if got is not None:
                node.host_sliding = got
                copy[0].extend(node.sliding)
                copy[1].extend(got)
        if node.mamba is not None and node.host_mamba is None:
            got = self._alloc(self.host_mamba_pool, 1, self.evict_host_mamba, node)
            if got is not None:
                node.host_mamba = got[0]
                copy[2].append(node.mamba)
                copy[3].append(got[0])

    def drop_host(self, node: TreeNode) -> None:
        """Free ``node``'s L2 components (its L2 pages are going)."""
        if node.host_sliding is not None:
            self.host_sliding_pool.release(node.host_sliding)
            node.host_sliding = None
        if node.host_mamba is not None:
            self.host_mamba_pool.release((node.host_mamba,))
            node.host_mamba = None
        self.refresh(node)

    def drop_host_slots(self, node: TreeNode, sliding: Collection[int], mamba: Collection[int]):
        """Take from ``node`` the L2 components that hold any of ``sliding`` / ``mamba``
        (a copy into them failed: they hold nothing), back to their pools."""
        if node.host_sliding is not None and set(sliding) & set(node.host_sliding):
            self.host_sliding_pool.release(node.host_sliding)
            node.host_sliding = None
        if node.host_mamba is not None and node.host_mamba in mamba:
            self.host_mamba_pool.release((node.host_mamba,))
            node.host_mamba = None
        self.refresh(node)

    def to_device(self, node: TreeNode, copy: list[list[int]]) -> None:
        """``node`` (just loaded back to L1, locked) gets its L2 components in L1,
        evicting other components if short; the copies go to ``copy``."""
        if node.host_sliding is not None and node.sliding is None:
            got = self._alloc(self.sliding_pool, len(node.host_sliding), self.evict_sliding, node)
            if got is not None:
                node.sliding = got
                copy[0].extend(node.host_sliding)
                copy[1].extend(got)
        if node.host_mamba is not None and node.mamba is None:
            got = self._alloc(self.mamba_pool, 1, self.evict_mamba, node)
            if got is not None:
                node.mamba = got[0]
                copy[2].append(node.host_mamba)
                copy[3].append(got[0])
        self.refresh(node)  # what it had in L2 only is in L1 as well now

    # -- locks ---------------------------------------------------------------------

    def lock(self, node: TreeNode, pages: Callable[[TreeNode], int]) -> None:
        """Protect what a match ending at ``node`` needs: the mamba state there and the
        sliding tails of the window before it."""
        if node is self.root:
            return
        node.part_ref += 1
        self.mamba_lru.discard(node)
        need, x = self.window_pages, node
        while need > 0 and x is not self.root:
            locks = x.sliding_locks
            if locks is None:
                locks = x.sliding_locks = {}
            locks[need] = locks.get(need, 0) + 1
            self.sliding_lru.discard(x)
            need -= pages(x)
            x = x.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode, pages: Callable[[TreeNode], int]) -> None:
        """Undo one ``lock(node)`` (the same walk: splits since moved its counts exactly)."""
        if node is self.root:
            return
        node.part_ref -= 1
        self.refresh(node)
        need, x = self.window_pages, node
        while need > 0 and x is not self.root:
            locks = x.sliding_locks
            assert locks and locks.get(need), (x, need, locks)
            if locks[need] == 1:
                del locks[need]
                if not locks:
                    x.sliding_locks = None
            else:
                locks[need] -= 1
            self.refresh(x)
            need -= pages(x)
            x = x.parent  # type: ignore[assignment]

    # -- filling -------------------------------------------------------------------

    def checkpoints(self, start_page: int, end_page: int) -> list[int]:
        """The checkpoint ends strictly inside pages ``(start_page, end_page)``, deepest
        first."""
        k = self.checkpoint_pages
        if not k:
            return []
        return list(range((end_page - 1) // k * k, start_page, -k))

    def fill(
        self,
        node: TreeNode,
        end_page: int,
        pages: Callable[[TreeNode], int],
        out: PartFill | None = None,
        checkpoint: bool = False,
    ) -> PartFill:
        """Give the prefix ending at ``node`` (page ``end_page`` of the key) every
        component it lacks, evicting other component values if a pool is short: the
        mamba state at its end and the sliding tails of the window before it. A
        ``checkpoint`` end takes free slots only (it is an extra: it never evicts).
        What cannot be allocated stays missing (a tombstone); returns (adds to
        ``out``) what the caller's KV fill must write."""
        out = PartFill() if out is None else out
        if node is self.root:
            return out
        evict_mamba, evict_sliding = self.evict_mamba, self.evict_sliding
        if checkpoint:
            evict_mamba = evict_sliding = lambda n, keep: 0
        if self.mamba and node.mamba is None:
            slot = self._alloc(self.mamba_pool, 1, evict_mamba, node)
            if checkpoint:
                self.stats.checkpoints_skipped += slot is None
                self.stats.checkpoints_saved += slot is not None
            if slot is None:
                self.stats.mamba_alloc_failures += not checkpoint
            else:
                node.mamba = slot[0]
                out.mamba_at.append(end_page)
                out.mamba.append(slot[0])
                self.refresh(node)
        need, x, end = self.window_pages, node, end_page
        while need > 0 and x is not self.root:
            n = pages(x)
            want = min(n, need)
            have = 0 if x.sliding is None else len(x.sliding)
            if have < want:
                got = self._alloc(self.sliding_pool, want - have, evict_sliding, node)
                if got is None:
                    self.stats.sliding_alloc_failures += not checkpoint
                    break
                x.sliding = got if x.sliding is None else got + x.sliding
                out.sliding_at.extend(range(end - want, end - have))
                out.sliding.extend(got)
                self.refresh(x)
            need -= n
            end -= n
            x = x.parent  # type: ignore[assignment]
        return out

    def _alloc(
        self,
        pool: PagedAllocator,
        n: int,
        evict: Callable[[int, TreeNode | None], int],
        keep: TreeNode,
    ) -> Pages | None:
        if n > pool.num_pages:
            return None
        got = pool.alloc(n)
        if got is None:
            evict(n - pool.available_pages, keep)
            got = pool.alloc(n)
        return got

    def held(
        self, node: TreeNode, pages: Callable[[TreeNode], int], end_page: int
    ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The components a prefix ending at ``node`` (page ``end_page`` of its key)
        has: sliding-pool pages of the window before it as ``(key page, pool
        page)``, and its mamba state as ``(end page, slot)`` — those present."""
        sliding: list[tuple[int, int]] = []
        if node is self.root:
            return (), ()
        first, x, end = end_page - self.window_pages, node, end_page
        while end > first and x is not self.root:
            tail = x.sliding
            if tail is not None:
                start = end - len(tail)
                sliding.extend((start + i, p) for i, p in enumerate(tail) if start + i >= first)
            end -= pages(x)
            x = x.parent  # type: ignore[assignment]
        mamba = ((end_page, node.mamba),) if node.mamba is not None else ()
        return tuple(sorted(sliding)), mamba

    # -- eviction ------------------------------------------------------------------

    def evict_sliding(self, num_pages: int, keep: TreeNode | None = None) -> int:
        """Free at least ``num_pages`` of the sliding pool if possible, unlocked tails
        in policy order (``keep``'s path is spared: it is being filled). Returns
        pages freed."""
        return self._evict(self.sliding_lru, num_pages, keep, self._evict_tail)

    def evict_mamba(self, num_states: int, keep: TreeNode | None = None) -> int:
        """Free at least ``num_states`` mamba slots if possible, in policy order."""
        return self._evict(self.mamba_lru, num_states, keep, self._evict_state)

    def _evict(
        self, queue: LeafQueue, n: int, keep: TreeNode | None, one, host: bool = False
    ) -> int:
        spared = set()
        x = keep
        while x is not None:
            spared.add(x)
            x = x.parent
        queue.begin()
        kept, freed = [], 0
        while freed < n:
            node = queue.pop()
            if node is None:
                break
            if node in spared or (host and (node.host_ref or node.lock_ref)):
                kept.append(node)
                continue
            freed += one(node)
            if not host:  # an L2 tombstone still serves longer matches from L2
                self.prune(node, spared)
        for node in kept:
            queue.requeue(node)
        return freed

    def _evict_tail(self, node: TreeNode) -> int:
        tail = node.sliding
        assert tail is not None and not node.sliding_locks
        self.sliding_pool.release(tail)
        node.sliding = None
        self.refresh(node)  # an L2 copy of the tail is the only one now
        self.stats.sliding_evicted_pages += len(tail)
        return len(tail)

    def _evict_state(self, node: TreeNode) -> int:
        assert node.mamba is not None and node.part_ref == 0
        self.mamba_pool.release((node.mamba,))
        node.mamba = None
        self.refresh(node)
        self.stats.mamba_evicted_states += 1
        return 1

    def evict_host(self, component: str, n: int, keep: TreeNode | None = None) -> int:
        """Free at least ``n`` of ``component``'s L2 pool (``sliding`` pages or
        ``mamba`` states) from values held in L2 only, in policy order, never one
        protected (``host_ref``, ``lock_ref``) or on ``keep``'s path; their nodes'
        full pages stay (L2 tombstones). Returns what was freed."""
        if component == "sliding":
            return self.evict_host_sliding(n, keep)
        if component == "mamba":
            return self.evict_host_mamba(n, keep)
        raise ValueError(f"component {component!r} is refused: allowed are sliding, mamba")

    def evict_host_sliding(self, num_pages: int, keep: TreeNode | None = None) -> int:
        return self._evict(self.host_sliding_lru, num_pages, keep, self._evict_host_tail, True)

    def evict_host_mamba(self, num_states: int, keep: TreeNode | None = None) -> int:
        return self._evict(self.host_mamba_lru, num_states, keep, self._evict_host_state, True)

    def _evict_host_tail(self, node: TreeNode) -> int:
        tail = node.host_sliding
        assert tail is not None and node.sliding is None
        self.host_sliding_pool.release(tail)
        node.host_sliding = None
        self.refresh(node)
        self.stats.host_sliding_evicted_pages += len(tail)
        return len(tail)

    def _evict_host_state(self, node: TreeNode) -> int:
        assert node.host_mamba is not None and node.mamba is None
        self.host_mamba_pool.release((node.host_mamba,))
        node.host_mamba = None
        self.refresh(node)
        self.stats.host_mamba_evicted_states += 1
        return 1

    def prune(self, node: TreeNode, spared: Collection[TreeNode] = ()) -> None:
        """Remove ``node`` if it is a dead device leaf (on device, unlocked, no child on
        device, a component missing: it can serve nothing), then its parent if that
        became one, and so on up the tree — never one of ``spared`` (the path being
        filled: its components are on their way)."""
        while (
            node is not self.root
            and node not in spared
            and node.device_value is not None
            and node.lock_ref == 0
            and node.device_children == 0
            and not self.complete(node)
        ):
            parent = node.parent
            if not self.remove(node):
                return
            self.stats.tombstones_removed += 1
            node = parent  # type: ignore[assignment]

    # -- sizes and checks ------------------------------------------------------------

    def sizes(self, nodes: list[TreeNode]) -> dict[str, TierSizes]:
        """Per component: capacity, available, evictable and protected (sliding in
        tokens, mamba in states)."""
        out = {}
        if self.sliding:
            owned = locked = 0
            for node in nodes:
                if node.sliding is not None:
                    owned += len(node.sliding)
                    locked += len(node.sliding) if node.sliding_locks else 0
            ps = self.page_size
            out["sliding"] = TierSizes(
                self.sliding_pool.capacity_tokens,
                self.sliding_pool.available_pages * ps,
                (owned - locked) * ps,
                locked * ps,
            )
        if self.mamba:
            owned = sum(1 for n in nodes if n.mamba is not None)
            locked = sum(1 for n in nodes if n.mamba is not None and n.part_ref)
            out["mamba"] = TierSizes(
                self.mamba_pool.num_pages,
                self.mamba_pool.available_pages,
                owned - locked,
                locked,
            )
        return out

    def violations(
        self,
        nodes: list[TreeNode],
        pages: Callable[[TreeNode], int],
        in_flight: tuple[list[int], list[int]] = ([], []),
    ) -> list[str]:
        """What is wrong with the components (for ``check_integrity``);
        ``in_flight``: the L2 sliding pages and mamba slots prefetches hold."""
        return [
            *self._pool_violations(nodes, in_flight),
            *self._node_violations(nodes, pages),
            *self._lock_violations(nodes, pages),
        ]

    def _pool_violations(
        self, nodes: list[TreeNode], in_flight: tuple[list[int], list[int]]
    ) -> list[str]:
        """Each pool: its own accounting, and every slot owned once, by a node or a
        prefetch, none of them free."""
        out: list[str] = []
        for pool, name, owned in (
            (self.sliding_pool, "sliding", [p for n in nodes if n.sliding for p in n.sliding]),
            (self.mamba_pool, "mamba", [n.mamba for n in nodes if n.mamba is not None]),
            (
                self.host_sliding_pool,
                "L2 sliding",
                [p for n in nodes if n.host_sliding for p in n.host_sliding] + in_flight[0],
            ),
            (
                self.host_mamba_pool,
                "L2 mamba",
                [n.host_mamba for n in nodes if n.host_mamba is not None] + in_flight[1],
            ),
        ):
            out += pool.violations()
            if len(set(owned)) != len(owned):
                out.append(f"{name}: a slot is owned twice")
            if any(pool.is_free(p) for p in owned):
                out.append(f"{name}: a slot owned by a node is free")
            if pool.available_pages + len(owned) != pool.num_pages:
                out.append(
                    f"{name}: {pool.available_pages} free + {len(owned)} owned != "
                    f"{pool.num_pages} slots"
                )
        return out

    def _node_violations(
        self, nodes: list[TreeNode], pages: Callable[[TreeNode], int]
    ) -> list[str]:
        """Each node: components only with their full pages in the same tier, a
        sliding tail within the window, queue membership as its locks say."""
        out: list[str] = []
        for node in nodes:
            if (node.sliding is not None or node.mamba is not None) and node.device_value is None:
                out.append(f"{node}: a component without the full pages on device")
            if (node.host_sliding is not None or node.host_mamba is not None) and (
                node.host_value is None
            ):
                out.append(f"{node}: an L2 component without the full pages in L2")
            for tail in (node.sliding, node.host_sliding):
                if tail is not None and not 0 < len(tail) <= min(pages(node), self.window_pages):
                    out.append(f"{node}: a sliding tail of {len(tail)} pages")
            want_s = node.sliding is not None and not node.sliding_locks
            if want_s != (node in self.sliding_lru):
                out.append(f"{node}: sliding queue membership is {not want_s}")
            want_m = node.mamba is not None and node.part_ref == 0
            if want_m != (node in self.mamba_lru):
                out.append(f"{node}: mamba queue membership is {not want_m}")
            # The reference's invariant: an L2-only value is in its component's L2
            # queue and nowhere else; one also in L1 is not in it.
            for name, queue, host, device in (
                ("sliding", self.host_sliding_lru, node.host_sliding, node.sliding),
                ("mamba", self.host_mamba_lru, node.host_mamba, node.mamba),
            ):
                want_h = host is not None and device is None
                if want_h != (node in queue):
                    out.append(f"{node}: L2 {name} queue membership is {not want_h}")
        present = set(nodes)
        for queue, name in (
            (self.sliding_lru, "sliding"),
            (self.mamba_lru, "mamba"),
            (self.host_sliding_lru, "L2 sliding"),
            (self.host_mamba_lru, "L2 mamba"),
        ):
            if len(queue.queued()) != len(queue):
                out.append(f"{name} queue: a member has no heap entry")
            stale = [n for n in queue if n not in present]
            if stale:
                out.append(f"{name} queue: {len(stale)} node(s) no longer in the tree")
        return out

    def _lock_violations(
        self, nodes: list[TreeNode], pages: Callable[[TreeNode], int]
    ) -> list[str]:
        """A component lock goes with a full lock at the same node (writes and loads
        take full locks alone); the sliding counts follow from the part_refs."""
        out: list[str] = []
        want: dict[TreeNode, dict[int, int]] = {}
        for node in nodes:
            direct = node.lock_ref - sum(c.lock_ref for c in node.children.values())
            if not 0 <= node.part_ref <= direct:
                out.append(f"{node}: part_ref={node.part_ref}, {direct} full locks taken there")
            need, x = self.window_pages, node
            while node.part_ref and need > 0 and x is not self.root:
                counts = want.setdefault(x, {})
                counts[need] = counts.get(need, 0) + node.part_ref
                need -= pages(x)
                x = x.parent  # type: ignore[assignment]
        for node in nodes:
            if (node.sliding_locks or {}) != want.get(node, {}):
                out.append(
                    f"{node}: sliding_locks={node.sliding_locks}, recomputed {want.get(node)}"
                )
        return out
