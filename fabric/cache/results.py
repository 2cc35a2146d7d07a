"""What ``HiCache`` hands across its boundary, and its operation records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated

from fabric.cache.allocator import Pages
from fabric.cache.node import TreeNode
from fabric.errors import InvalidInput
from fabric.observe.histogram import TOKENS, Histogram
from fabric.observe.series import Series

# Where KV moves between tiers (metrics label them so).
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host")


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us per request
class MatchResult:
    """The cached prefix of a key.

    ``device_pages``: L1 page indices of the device-resident prefix
    (``device_tokens`` long). ``host_tokens``: the L2-only tail after it.
    ``last_device_node``: the deepest matched node on device (root if none);
    ``last_host_node``: the deepest matched node with a finished host copy
    (root if none) — pass it to ``LoadBacks.load_back`` when ``host_tokens > 0``.
    """

    device_pages: Pages
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
    device_pages: Pages
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


TRANSFER_HELP = "Tokens of KV copied between tiers, by direction (completed copies)."


def transfer_series(direction: str) -> Series:
    """A counter of tokens copied in ``direction`` (one series for every direction)."""
    return Series("kvfabric_transfer_tokens", "counter", TRANSFER_HELP, (("direction", direction),))


def _evicted(tier: str) -> Series:
    return Series(
        "kvfabric_evicted_tokens",
        "counter",
        "Tokens whose KV was evicted from a tier (device: L1, host: L2).",
        (("tier", tier),),
    )


@dataclass
class CacheStats:
    """The cache's counters (they survive resets). A field annotated with a
    ``Series`` is a Prometheus series too (``fabric.observe.series``)."""

    device_evicted_tokens: Annotated[int, _evicted("device")] = 0
    host_evicted_tokens: Annotated[int, _evicted("host")] = 0
    written_tokens: Annotated[int, transfer_series("device_to_host")] = 0
    failed_write_tokens: Annotated[
        int,
        Series(
            "kvfabric_failed_write_tokens",
            "counter",
            "Tokens whose L1 -> L2 write-through failed on some rank (they stay L1-only).",
        ),
    ] = 0
    loaded_back_tokens: Annotated[int, transfer_series("host_to_device")] = 0
    # Tokens per transfer, by direction (one observation per op).
    transfer_sizes: Annotated[
        dict[str, Histogram],
        Series(
            "kvfabric_transfer_size_tokens",
            "histogram",
            "Tokens moved by one transfer operation, by direction.",
            by="direction",
            keys=DIRECTIONS,
        ),
    ] = field(default_factory=lambda: {d: Histogram(TOKENS) for d in DIRECTIONS}, repr=False)


def check_count(kind: str, n: int, pending: int) -> None:
    """Refuse a completion count that is not an int in ``[0, pending]``."""
    if not isinstance(n, int) or not 0 <= n <= pending:
        raise InvalidInput(f"{n!r} {kind} completed but {pending} are pending")


@dataclass
class TierTokens:
    """Prompt tokens by where they came from: L1 hits, L2 hits, L3 hits (prefetched
    and loaded back), and computed. The one tally every harness and the
    coordinator keep."""

    device: int = 0
    host: int = 0
    storage: int = 0
    computed: int = 0

    def add(self, device: int, host: int, storage: int, computed: int) -> None:
        self.device += device
        self.host += host
        self.storage += storage
        self.computed += computed

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
