"""A controller for tests, benches and the core-only demo: no bytes, only
bookkeeping, and an in-memory stand-in for L3."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fabric.cache.allocator import PagedAllocator
from fabric.cache.controller import Completions, Controller


@dataclass
class _Queued:
    op_id: int
    host_pages: tuple[int, ...] = ()
    page_hashes: tuple[bytes, ...] = ()


class InProcessController(Controller):
    """A controller for tests and the core-only demo: no bytes, only bookkeeping.

    With ``immediate=True`` every queued operation is reported finished at the
    next ``take_completions``; otherwise nothing is, and the test tells the
    cache of completions itself (``HiCache.complete_writes`` and the rest).
    ``storage`` stands in for L3: the set of page hashes that backups stored.
    """

    def __init__(
        self, device_pages: int, host_pages: int, page_size: int, immediate: bool = True
    ) -> None:
        self.device = PagedAllocator(device_pages, page_size, "L1 device pool")
        self.host = PagedAllocator(host_pages, page_size, "L2 host pool")
        self.page_size = page_size
        self.immediate = immediate
        self.storage: set[bytes] = set()
        self.reset_queues()

    def reset_queues(self) -> None:
        self.writes: list[int] = []
        self.loads: list[int] = []
        self.backups: list[_Queued] = []
        self.queries: list[_Queued] = []
        self.prefetches: dict[int, _Queued] = {}
        self.stopped: list[int] = []

    def write(self, op_id: int, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.writes.append(op_id)

    def load(self, op_id: int, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self.loads.append(op_id)

    def backup(self, op_id: int, host_pages: Sequence[int], page_hashes: Sequence[bytes]) -> None:
        self.backups.append(_Queued(op_id, tuple(host_pages), tuple(page_hashes)))

    def query_storage(self, op_id: int, page_hashes: Sequence[bytes]) -> None:
        self.queries.append(_Queued(op_id, (), tuple(page_hashes)))

    def prefetch(self, op_id: int, host_pages: Sequence[int], page_hashes: Sequence[bytes]) -> None:
        self.prefetches[op_id] = _Queued(op_id, tuple(host_pages), tuple(page_hashes))

    def stop_prefetch(self, op_id: int) -> None:
        self.prefetches.pop(op_id, None)
        self.stopped.append(op_id)

    def hit_pages(self, page_hashes: Sequence[bytes]) -> int:
        n = 0
        for h in page_hashes:
            if h not in self.storage:
                break
            n += 1
        return n

    def take_completions(self) -> Completions:
        if not self.immediate:
            return Completions()
        for b in self.backups:
            self.storage.update(b.page_hashes)
        done = Completions(
            writes=len(self.writes),
            loads=len(self.loads),
            backups=len(self.backups),
            prefetch_hits={q.op_id: self.hit_pages(q.page_hashes) for q in self.queries},
            prefetch_progress={
                op: len(q.host_pages) * self.page_size for op, q in self.prefetches.items()
            },
            prefetch_released=frozenset(self.stopped),
        )
        self.reset_queues()
        return done

    def reset(self) -> None:
        self.device.reset()
        self.host.reset()
        self.reset_queues()
