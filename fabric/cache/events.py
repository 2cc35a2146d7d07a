"""KV events for a KV-aware router: which page hashes are stored where.

The cache appends events as tiers change; ``take_events`` on the cache drains
them. A page moving down a tier is a ``BlockRemoved`` for the upper medium and
(once the copy is confirmed) a ``BlockStored`` for the lower one. Every event
names its namespace (tenant), so a consumer can take only its own; a reset of
L1/L2 is one ``AllBlocksCleared`` per namespace that had pages there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Medium(StrEnum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


@dataclass(frozen=True)
class BlockStored:
    page_hashes: tuple[bytes, ...]
    medium: Medium
    namespace: str


@dataclass(frozen=True)
class BlockRemoved:
    page_hashes: tuple[bytes, ...]
    medium: Medium
    namespace: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page of ``namespace`` left L1 and L2 (L3 keeps its pages)."""

    namespace: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
