"""An evictable-leaf set with a lazily kept min-heap in eviction-policy order.

Rebuilding a heap of every leaf on each eviction costs O(leaves) per call; here
a leaf is pushed once when it joins the set, and stale entries (left the set,
or their key moved) are dropped or re-pushed when they reach the top. That is
exact for policies whose keys only grow over a node's life (LRU, LFU, FIFO,
FILO, priority, SLRU); for the others (MRU: an access lowers the key) the heap
is rebuilt at the start of each eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from fabric.cache.node import TreeNode

_COMPACT_SLACK = 64


class LeafQueue:
    def __init__(
        self,
        key: Callable[[TreeNode], tuple[Any, ...]],
        monotone: bool,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        """``version()``: a number that changes when keys may have decreased (an
        adaptive policy's ``version``); the heap is rebuilt at the next ``begin``."""
        self.key = key
        self.monotone = monotone
        self.version = version
        self._seen = version()
        self.members: set[TreeNode] = set()
        self._heap: list[tuple[tuple[Any, ...], TreeNode]] = []

    def add(self, node: TreeNode) -> None:
        if node not in self.members:
            self.members.add(node)
            heapq.heappush(self._heap, (self.key(node), node))

    def discard(self, node: TreeNode) -> None:
        self.members.discard(node)

    def __contains__(self, node: object) -> bool:
        return node in self.members

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.members)

    def begin(self) -> None:
        """Call before a run of ``pop``: rebuilds the heap when it cannot be trusted
        (non-monotone keys) or has gathered too many stale entries."""
        version = self.version()
        if (
            not self.monotone
            or version != self._seen
            or len(self._heap) > 2 * len(self.members) + _COMPACT_SLACK
        ):
            self._heap = [(self.key(n), n) for n in self.members]
            heapq.heapify(self._heap)
            self._seen = version

    def pop(self) -> TreeNode | None:
        """The member with the smallest key, its heap entry removed (it stays a
        member: ``requeue`` it if the caller does not evict it). ``None`` when empty."""
        heap, key = self._heap, self.key
        while heap:
            stored, node = heap[0]
            if node not in self.members:
                heapq.heappop(heap)
                continue
            current = key(node)
            if current != stored:
                heapq.heapreplace(heap, (current, node))
                continue
            heapq.heappop(heap)
            return node
        return None

    def requeue(self, node: TreeNode) -> None:
        """Give a popped node that stays a member its heap entry back."""
        if node in self.members:
            heapq.heappush(self._heap, (self.key(node), node))

    def queued(self) -> set[TreeNode]:
        """Members that have a heap entry (for integrity checks)."""
        return {n for _, n in self._heap if n in self.members}
