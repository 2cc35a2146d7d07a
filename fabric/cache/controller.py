"""The controller boundary: the cache decides, a controller moves bytes.

The cache allocates slots from the controller's two allocators and queues
transfers on it; it never waits. What finished comes back as one
``Completions`` per step — in the fabric, the result of one consensus round
(MIN over ranks for counts, MAX for terminate flags); in one process, from the
``InProcessController`` below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from fabric.cache.allocator import PagedAllocator


@dataclass(frozen=True)
class PartCopy:
    """A hybrid model's other components moving with a write (L1 -> L2) or a load
    (L2 -> L1), all or none with its pages: sliding pages ``sliding_src`` to
    ``sliding_dst`` and mamba state slots ``mamba_src`` to ``mamba_dst``."""

    sliding_src: tuple[int, ...] = ()
    sliding_dst: tuple[int, ...] = ()
    mamba_src: tuple[int, ...] = ()
    mamba_dst: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sliding_src or self.mamba_src)


@dataclass(frozen=True)
class StorageParts:
    """A hybrid model's other components moving with a backup (L2 -> L3) or a
    prefetch (L3 -> L2), all or none with its pages: L2 sliding pages
    ``sliding_pages`` stored under the chain hashes ``sliding_hashes`` of the
    pages they belong to, and L2 mamba slots ``mamba_slots`` under the chain
    hashes ``mamba_hashes`` of the pages whose end holds the state."""

    sliding_pages: tuple[int, ...] = ()
    sliding_hashes: tuple[bytes, ...] = ()
    mamba_slots: tuple[int, ...] = ()
    mamba_hashes: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sliding_pages or self.mamba_slots)


class HitAnswer(NamedTuple):
    """The answer to a hit query (``Controller.query_storage``): ``pages``, how many
    leading pages L3 holds, and ``hashes``, the chain hashes of every page asked
    about, computed by whoever answered (``()`` when it could not answer)."""

    pages: int
    hashes: Sequence[bytes] = ()


def as_answer(answer: object) -> HitAnswer:
    """A hit query's answer from another process as a ``HitAnswer``: a
    ``(pages, hashes)`` pair, or a bare page count (no hashes); anything else
    finds nothing. The hashes themselves are checked where they are used
    (``L3Transfers.complete_query``)."""
    if isinstance(answer, tuple) and len(answer) == 2:
        pages, hashes = answer
        if type(pages) is int and isinstance(hashes, (list, tuple)):
            return HitAnswer(pages, hashes)
    elif type(answer) is int:
        return HitAnswer(answer)
    return HitAnswer(0)


@dataclass(frozen=True)
class Completions:
    """What every rank has finished since the last step.

    Counts commit that many of the oldest queued operations of each kind;
    ``failed_*`` name the op ids among them that failed (for computes, which
    the cache does not queue, the command ids). Prefetch entries are keyed by
    op id: ``prefetch_hits`` answers the hit query (the number of consecutive
    pages found in L3, and the pages' hashes), ``prefetch_progress`` the
    cumulative completed tokens, ``prefetch_terminated`` the ops some rank
    stopped, ``prefetch_released`` the stopped ops whose host slots no rank
    will write any more.
    """

    writes: int = 0
    failed_writes: frozenset[int] = frozenset()
    loads: int = 0
    failed_loads: frozenset[int] = frozenset()
    computes: int = 0
    failed_computes: frozenset[int] = frozenset()
    backups: int = 0
    failed_backups: frozenset[int] = frozenset()
    prefetch_hits: Mapping[int, HitAnswer] = field(default_factory=dict)
    prefetch_progress: Mapping[int, int] = field(default_factory=dict)
    prefetch_terminated: frozenset[int] = frozenset()
    prefetch_released: frozenset[int] = frozenset()


class Controller(ABC):
    """Owns the L1 (``device``) and L2 (``host``) allocators and queues transfers.

    Every queue method is called once per operation, in the order the cache
    wants it done; the controller must report completions of each kind in
    that same order.
    """

    device: PagedAllocator
    host: PagedAllocator
    # The most pages one prefetch may carry (a message limit); ``None``: no limit.
    max_prefetch_pages: int | None = None

    @abstractmethod
    def write(
        self,
        op_id: int,
        device_pages: Sequence[int],
        host_pages: Sequence[int],
        parts: PartCopy | None = None,
    ) -> None:
        """Copy device pages to host pages (L1 -> L2), and ``parts`` with them."""

    @abstractmethod
    def load(
        self,
        op_id: int,
        host_pages: Sequence[int],
        device_pages: Sequence[int],
        parts: PartCopy | None = None,
    ) -> None:
        """Copy host pages to device pages (L2 -> L1), and ``parts`` with them."""

    @abstractmethod
    def backup(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
    ) -> None:
        """Store host pages in L3 under their page hashes, and ``parts`` with them."""

    @abstractmethod
    def query_storage(self, op_id: int, prev: bytes, tokens: bytes) -> None:
        """Count how many leading pages of the packed ``tokens`` (whole pages) L3
        holds for every shard; for a hybrid model, the deepest end among them where
        L3 holds every component. The answerer hashes the pages (the chain from
        ``prev``, ``fabric.cache.keys.chain_hashes``) and answers with the hashes
        (``HitAnswer``): the cache keeps them, so pages are hashed outside the
        cache's process (in a fabric, the storage actor's)."""

    @abstractmethod
    def prefetch(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
        names: tuple[str, bytes, bytes] | None = None,
    ) -> None:
        """Read pages from L3 into host pages, reporting cumulative progress; with
        ``parts``, those first (no progress is reported until they are in).
        ``names``: the pages' namespace, the chain hash before them and their
        packed tokens, which ranks keep (``fabric.rank.index``)."""

    @abstractmethod
    def stop_prefetch(self, op_id: int) -> None:
        """Stop a prefetch; its op id is reported in ``prefetch_released`` once no
        rank writes its host pages any more."""

    @abstractmethod
    def take_completions(self) -> Completions:
        """What finished since the last call (one consensus round)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every queued operation and free both pools."""
