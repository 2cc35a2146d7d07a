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
    # Bumped whenever keys may have decreased (an adaptive policy changed its
    # mind): an eviction queue built earlier must be rebuilt.
    version = 0

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


class AdaptiveTwoQ(EvictionPolicy):
    """2Q whose split between recency and frequency is learned, ARC-style.

    ARC (Megiddo and Modha, FAST '03) keeps a recency list T1 and a frequency
    list T2 and moves its target between them on ghost hits: a page that comes
    back after leaving T1 says T1 was too small; one that comes back after
    leaving T2 says T2 was. On the tree's leaves that target is a time
    ``credit``: a protected leaf (used by two requests or more, or back from
    the ghost) is ordered as if last used ``credit`` later, probation leaves at
    their own time, least recently used first. ``credit`` 0 is LRU; an
    unbounded one is 2Q. It starts at 0 and moves by an eighth of the recent victims'
    age per ghost hit, times ARC's ratio (the rarer kind of ghost hit moves it
    further): up when a protected leaf comes back (keep the frequent longer),
    down when a probation leaf does (give newcomers longer).
    The ghost remembers the first page of every leaf that left L1 and whether
    it was protected then, for ``ghost_factor`` times L1's tokens.
    """

    name = "a2q"
    remembers = True
    ghost_factor = 4
    # An eighth: a half (the first setting) gained 0.9 points more on the Mooncake
    # trace at 2M but lost 1.0 to LRU on short churning chats (docs/running.md).
    step = 0.125

    def __init__(self) -> None:
        self.ghost: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()
        self.ghost_kind = {False: 0, True: 0}  # ghost tokens by: was it protected
        self.ghost_capacity = 0
        self.credit = 0.0
        self.now = 0.0  # the latest access seen
        self.victim_age = 0.0  # the recent victims' age (since their last use), averaged

    @property
    def ghost_tokens(self) -> int:
        return self.ghost_kind[False] + self.ghost_kind[True]

    def key(self, node: EvictableNode) -> tuple[Any, ...]:
        credit = self.credit if node.hit_count >= 2 else 0.0
        return (node.last_access + credit, node.id)

    def host_order(self) -> Callable[[EvictableNode], tuple[Any, ...]]:
        return LRU().key

    def bind(self, capacity_tokens: int) -> None:
        self.ghost_capacity = self.ghost_factor * capacity_tokens

    def admitted(self, node: EvictableNode, name: Hashable) -> None:
        self.now = max(self.now, node.last_access)
        entry = self.ghost.pop(name, None)
        if entry is None:
            return
        tokens, was_protected = entry
        self.ghost_kind[was_protected] -= tokens
        node.hit_count += 1
        # As ARC's: the rarer kind of ghost hit moves the target further.
        mine, other = self.ghost_kind[was_protected] + tokens, self.ghost_kind[not was_protected]
        move = self.step * self.victim_age * max(1.0, other / max(1, mine))
        if was_protected:
            self.credit += move  # keys only grow: the eviction queue stays exact
        elif self.credit > 0:
            self.credit = max(0.0, self.credit - move)
            self.version += 1

    def evicted(self, node: EvictableNode, name: Hashable, tokens: int) -> None:
        self.now = max(self.now, node.last_access)
        self.victim_age += 0.05 * (self.now - node.last_access - self.victim_age)
        ghost, kind = self.ghost, self.ghost_kind
        old = ghost.pop(name, None)
        if old is not None:
            kind[old[1]] -= old[0]
        protected = node.hit_count >= 2
        ghost[name] = (tokens, protected)
        kind[protected] += tokens
        while self.ghost_tokens > self.ghost_capacity and ghost:
            gone, was = ghost.popitem(last=False)[1]
            kind[was] -= gone


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRU, MRU, LFU, FIFO, FILO, Priority, SLRU, TwoQ, AdaptiveTwoQ)
}


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A new strategy object for ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return EVICTION_POLICIES[name]()
    except (KeyError, TypeError):
        raise unknown_name("eviction policy", name, EVICTION_POLICIES) from None
