"""KV events for a KV-aware router: which page hashes are stored where.

The cache appends events as tiers change; ``take_events`` on the cache drains
them. A page moving down a tier is a ``BlockRemoved`` for the upper medium and
(once the copy is confirmed) a ``BlockStored`` for the lower one. Every event
names its namespace (tenant), so a consumer can take only its own.

What a subscriber that applies every event in order ends with is exactly the
fabric's inventory: the L1 and L2 pages of the tree, and the L3 pages the fabric
knows its store holds (``EventLog.l3``: pages it backed up, or that a hit query
found there, less what the store reports evicted or deleted). So a reset is a
``BlockRemoved`` per node and tier it dropped (L3 keeps its pages), ``storage
clear`` or ``detach`` a ``BlockRemoved`` of every L3 page it knew, and only a
new event log — a coordinator that starts, knowing nothing — is an
``AllBlocksCleared`` (namespace ``""``: every namespace, every medium).
Events are ``msgspec`` structs: ``msgspec.msgpack.encode(events)`` is a compact
feed for a router, and ``decode(data, type=list[KVEvent])`` reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum

import msgspec

from fabric.cache.node import TreeNode


class Medium(StrEnum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    """``page_hashes`` (one per page, in order) are now in ``medium``: the pages of
    ``tokens`` (packed uint32, as in the tree), which follow the page hashed
    ``parent_hash`` (``None``: they start the namespace's chain)."""

    page_hashes: tuple[bytes, ...]
    medium: Medium
    namespace: str
    parent_hash: bytes | None = None
    tokens: bytes = b""
    place: str = ""  # which node's host memory (engine pages in a node's L2), or none
    # An engine's own names of the pages (and of the parent), where its connector
    # told them: what a router indexing the engine's own events knows them by.
    engine_hashes: tuple[bytes, ...] = ()
    engine_parent: bytes | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """``page_hashes`` left ``medium`` (on the node ``place``, when named)."""

    page_hashes: tuple[bytes, ...]
    medium: Medium
    namespace: str
    place: str = ""
    engine_hashes: tuple[bytes, ...] = ()  # as ``BlockStored``'s


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """Every page of ``namespace`` (``""``: of every namespace) left every medium."""

    namespace: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """The queue of KV events one cache appends to (nothing when disabled). Tier
    moves report the node; ``page_hashes`` gives a node's hashes on demand, so
    nothing is hashed while events are off. ``l3`` is the fabric's view of its
    store (chain hash -> namespace), kept only while events are on."""

    def __init__(
        self,
        page_hashes: Callable[[TreeNode], list[bytes]],
        enabled: bool,
        page_bytes: int = 0,
    ) -> None:
        self.page_hashes = page_hashes
        self.enabled = enabled
        self.page_bytes = page_bytes  # one page of packed tokens
        self.l3: dict[bytes, str] = {}
        # Bumped by every clear or detach: what was asked of, or written to, the
        # store before it is not announced after it.
        self.l3_generation = 0
        # When each page not announced was last reported gone (a tick of removals):
        # an operation begun before that must not announce it. Pruned when no
        # L3 operation is in flight (``forget_removals``).
        self.removal_tick = 0
        self._gone_at: dict[bytes, int] = {}
        self._events: list[KVEvent] = []
        if enabled:  # whatever a subscriber heard from an earlier log is gone
            self._events.append(AllBlocksCleared(""))

    def stored(self, node: TreeNode, medium: Medium) -> None:
        if self.enabled:
            hashes = tuple(self.page_hashes(node))  # hashes the path first
            parent = node.parent
            prev = parent.page_hashes[-1] if parent is not None and parent.page_hashes else None
            self._events.append(BlockStored(hashes, medium, node.namespace, prev, node.key))

    def removed(self, node: TreeNode, medium: Medium) -> None:
        if self.enabled:
            self._events.append(BlockRemoved(tuple(self.page_hashes(node)), medium, node.namespace))

    def stored_hashes(
        self,
        hashes: Sequence[bytes],
        medium: Medium,
        namespace: str,
        parent_hash: bytes | None,
        tokens: bytes,
        since: int = 1 << 62,
    ) -> None:
        """Pages known by their hashes (an L3 backup or hit). In L3 only the pages
        not already known there are announced, one event per run of them, each
        after the page before it — and none that the store reported gone after
        the operation began (``since``: its ``removal_tick`` then)."""
        if not self.enabled:
            return
        if medium is not Medium.STORAGE:
            self._events.append(BlockStored(tuple(hashes), medium, namespace, parent_hash, tokens))
            return
        pb, run = self.page_bytes, -1
        gone = self._gone_at
        for i in range(len(hashes) + 1):
            new = (
                i < len(hashes)
                and hashes[i] not in self.l3
                and gone.get(hashes[i], -1) < since  # not reported gone since it began
            )
            if new and run < 0:
                run = i
            elif not new and run >= 0:
                parent = parent_hash if run == 0 else hashes[run - 1]
                self._events.append(
                    BlockStored(
                        tuple(hashes[run:i]), medium, namespace, parent, tokens[run * pb : i * pb]
                    )
                )
                for h in hashes[run:i]:
                    self.l3[h] = namespace
                run = -1

    def l3_removed(self, hashes: Iterable[bytes]) -> None:
        """The store no longer holds these pages (those the fabric knew of go)."""
        if not self.enabled:
            return
        by_ns: dict[str, list[bytes]] = {}
        self.removal_tick += 1
        for h in hashes:
            ns = self.l3.pop(h, None)
            if ns is not None:
                by_ns.setdefault(ns, []).append(h)
            else:  # gone before anything announced it: an operation in flight may
                self._gone_at[h] = self.removal_tick
        for ns, gone in by_ns.items():
            self._events.append(BlockRemoved(tuple(gone), Medium.STORAGE, ns))

    def forget_removals(self) -> None:
        """No L3 operation is in flight: no announcement can race a removal."""
        self._gone_at.clear()

    def l3_cleared(self) -> None:
        """The store was emptied or let go: every L3 page the fabric knew is gone."""
        self.l3_generation += 1
        self.l3_removed(list(self.l3))

    def take(self) -> list[KVEvent]:
        """Drain the queued events, oldest first."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
