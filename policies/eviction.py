"""Eviction order strategies, shared by L1 (device) and L2 (host) eviction.

A strategy maps a node to a sort key; the node with the smallest key is evicted
first. Keys end with the node id so that ties break the same way every run.
"""

from __future__ import annotations

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

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        raise NotImplementedError


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


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRU, MRU, LFU, FIFO, FILO, Priority, SLRU)
}


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A new strategy object for ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return EVICTION_POLICIES[name]()
    except (KeyError, TypeError):
        raise unknown_name("eviction policy", name, EVICTION_POLICIES) from None
