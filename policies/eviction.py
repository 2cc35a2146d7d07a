"""Eviction order strategies, shared by L1 (device) and L2 (host) eviction.

A strategy maps a node to a sort key; the node with the smallest key is evicted
first. Keys end with the node id so that ties break the same way every run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from policies.registry import unknown_name


class EvictableNode(Protocol):
    id: int
    last_access: float
    created: float
    hit_count: int
    priority: int


class EvictionPolicy:
    """Base strategy: subclasses set ``name`` and override ``key``. ``monotone``
    says a node's key never decreases over its life (accesses and hits only
    raise it), which lets eviction keep one heap instead of rebuilding it."""

    name = ""
    monotone = True
    # Whether the policy wants ``admitted``/``evicted`` calls (a tree skips naming
    # a node's content for policies that keep no history).
    remembers = False

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        raise NotImplementedError

    def host_order(self) -> Callable[[EvictableNode], tuple[Any, ...]]:
        """The key L2 eviction orders by (by default L1's)."""
        return self.key

    def bind(self, capacity_tokens: int) -> None:
        """The size of the tier the policy orders (L1 tokens)."""

    def admitted(self, node: EvictableNode, name: Hashable) -> None:
        """``node`` (whose content starts with ``name``) got L1 pages."""

    def evicted(self, node: EvictableNode, name: Hashable, tokens: int) -> None:
        """``node`` lost its ``tokens`` L1 tokens."""


class LRU(EvictionPolicy):
    name = "lru"

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.last_access, node.id)


class MRU(EvictionPolicy):
    name = "mru"
    monotone = False

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (-node.last_access, -node.id)


class LFU(EvictionPolicy):
    name = "lfu"

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.hit_count, node.last_access, node.id)


class FIFO(EvictionPolicy):
    name = "fifo"

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.created, node.id)


class FILO(EvictionPolicy):
    name = "filo"

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (-node.created, -node.id)


class Priority(EvictionPolicy):
    """Lowest request priority first; LRU among equals."""

    name = "priority"

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.priority, node.last_access, node.id)


class SLRU(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than ``protected_hits`` times (the probation
    segment) go before the protected segment; LRU within each segment."""

    name = "slru"
    protected_hits = 2

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.hit_count >= self.protected_hits, node.last_access, node.id)


class TwoQ(EvictionPolicy):
    """2Q (Johnson and Shasha, VLDB '94) on the tree's leaves, with a long ghost.

    A node used by one request only (``hit_count`` 1) is on probation; one used
    again, or whose content comes back while the ghost still remembers it, is
    protected. Probation leaves go first, least recently used first; protected
    ones after, in LRU order. The ghost remembers the first page of every node
    that left L1, for ``ghost_factor`` times L1's tokens: a prompt's blocks that
    were evicted before their second use are protected when they return, so one
    pass over many single-use prompts (a scan) cannot flush what is reused.
    """

    name = "2q"
    remembers = True
    ghost_factor = 4

    def __init__(self) -> None:
        self.ghost: OrderedDict[Hashable, int] = OrderedDict()
        self.ghost_tokens = 0
        self.ghost_capacity = 0

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.hit_count >= 2, node.last_access, node.id)

    def host_order(self) -> Callable[[EvictableNode], tuple[Any, ...]]:
        return LRU().key

    def bind(self, capacity_tokens: int) -> None:
        self.ghost_capacity = self.ghost_factor * capacity_tokens

    def admitted(self, node: EvictableNode, name: Hashable) -> None:
        tokens = self.ghost.pop(name, None)
        if tokens is not None:
            self.ghost_tokens -= tokens
            node.hit_count += 1

    def evicted(self, node: EvictableNode, name: Hashable, tokens: int) -> None:
        ghost = self.ghost
        old = ghost.pop(name, None)
        if old is not None:
            self.ghost_tokens -= old
        ghost[name] = tokens
        self.ghost_tokens += tokens
        while self.ghost_tokens > self.ghost_capacity and ghost:
            self.ghost_tokens -= ghost.popitem(last=False)[1]


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRU, MRU, LFU, FIFO, FILO, Priority, SLRU, TwoQ)
}


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A new strategy object for ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return EVICTION_POLICIES[name]()
    except (KeyError, TypeError):
        raise unknown_name("eviction policy", name, EVICTION_POLICIES) from None
