"""What ``HiCache`` hands across its boundary, and its operation records."""

from __future__ import annotations

from dataclasses import dataclass, field

from fabric.cache.node import TreeNode


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a key.

    ``device_pages``: L1 page indices of the device-resident prefix
    (``device_tokens`` long). ``host_tokens``: the L2-only tail after it.
    ``last_device_node``: the deepest matched node on device (root if none);
    ``last_host_node``: the deepest matched node with a finished host copy
    (root if none) — pass it to ``load_back`` when ``host_tokens > 0``.
    """

    device_pages: tuple[int, ...]
    device_tokens: int
    host_tokens: int
    last_device_node: TreeNode
    last_host_node: TreeNode

    @property
    def matched_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


@dataclass(frozen=True)
class InsertResult:
    """``cached_tokens`` were on device already; the caller's pages for them were
    freed (``duplicate_pages``). ``last_node`` ends the inserted key."""

    cached_tokens: int
    duplicate_pages: tuple[int, ...]
    last_node: TreeNode


@dataclass(frozen=True)
class LoadBack:
    """A queued L2 -> L1 load of ``tokens``; ``node`` stays locked until the load
    completes."""

    op_id: int
    tokens: int
    device_pages: tuple[int, ...]
    node: TreeNode


@dataclass(frozen=True)
class PinResult:
    pinned_tokens: int
    reason: str | None


@dataclass(frozen=True)
class TierSizes:
    """One tier's tokens: ``free + evictable + protected == capacity``."""

    capacity: int
    free: int
    evictable: int
    protected: int


@dataclass(eq=False)
class WriteOp:
    """An in-flight L1 -> L2 copy of ``nodes`` (ancestors first; splits append).
    ``lock_node`` holds one lock for the whole path; ``orphan_pages`` are host
    pages already taken from their nodes, freed when the copy completes."""

    op_id: int
    nodes: list[TreeNode]
    lock_node: TreeNode
    evict_after: bool
    orphan_pages: list[int] = field(default_factory=list)


@dataclass
class CacheStats:
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    written_tokens: int = 0
    failed_write_tokens: int = 0
    loaded_back_tokens: int = 0
