"""KV events for a KV-aware router: which page hashes are stored where.

The cache appends events as tiers change; ``take_events`` on the cache drains
them. A page moving down a tier is a ``BlockRemoved`` for the upper medium and
(once the copy is confirmed) a ``BlockStored`` for the lower one. Every event
names its namespace (tenant), so a consumer can take only its own; a reset of
L1/L2 is one ``AllBlocksCleared`` per namespace that had pages there.
Events are ``msgspec`` structs: ``msgspec.msgpack.encode(events)`` is a compact
feed for a router, and ``decode(data, type=list[KVEvent])`` reads it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """``page_hashes`` left ``medium``."""

    page_hashes: tuple[bytes, ...]
    medium: Medium
    namespace: str


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    """Every page of ``namespace`` left L1 and L2 (L3 keeps its pages)."""

    namespace: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """The queue of KV events one cache appends to (nothing when disabled). Tier
    moves report the node; ``page_hashes`` gives a node's hashes on demand, so
    nothing is hashed while events are off."""

    def __init__(self, page_hashes: Callable[[TreeNode], list[bytes]], enabled: bool) -> None:
        self.page_hashes = page_hashes
        self.enabled = enabled
        self._events: list[KVEvent] = []

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
        hashes: tuple[bytes, ...],
        medium: Medium,
        namespace: str,
        parent_hash: bytes | None,
        tokens: bytes,
    ) -> None:
        if self.enabled:
            self._events.append(BlockStored(hashes, medium, namespace, parent_hash, tokens))

    def cleared(self, namespaces: Iterable[str]) -> None:
        if self.enabled:
            self._events.extend(AllBlocksCleared(ns) for ns in namespaces)

    def take(self) -> list[KVEvent]:
        """Drain the queued events, oldest first."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
