"""A vLLM worker's writes: its stores of pages to L3 and the node's L2, and its
promotions of pages read from L3 into the node's L2, on one writer thread while
the engine steps on.

The queue holds at most ``MAX_QUEUED_WRITE_BYTES`` of page buffers: past it a
store waits for the oldest write — at most until its step's deadline, and not at
all when that write has run longer than ``timeout_s`` (a wedged store) — and is
otherwise dropped and counted; a promotion is dropped at once. Host memory
stays bounded when L3 is slower than the engine computes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import torch

from fabric.cache.engine_input import StoredRun, part, stored_runs
from fabric.cache.engine_places import Order
from fabric.engines.vllm_moves import STAGING_BYTES, PageMoves
from fabric.engines.vllm_orders import Carried, carry_out, mine

log = logging.getLogger(__name__)

MAX_QUEUED_WRITE_BYTES = 4 * STAGING_BYTES


@dataclass
class SaveChunk:
    """Stores gathered into one page buffer and written together: each part is
    ``(tag, run, block ids, its first row in buffer)``."""

    parts: list[tuple[str, StoredRun, tuple[int, ...], int]]
    buffer: torch.Tensor | None


def pack(saves: list, batch_pages: int) -> list[tuple[list, int]]:
    """A step's stores (``PageSave``s) packed into parts of page buffers of at most
    ``batch_pages`` rows: per buffer, its parts and its rows."""
    out: list[tuple[list, int]] = []
    parts: list = []
    rows = 0
    for job in saves:
        n, at = len(job.run.hashes), 0
        while at < n:
            take = min(n - at, batch_pages - rows)
            parts.append(
                (job.tag, part(job.run, at, at + take), job.block_ids[at : at + take], rows)
            )
            rows, at = rows + take, at + take
            if rows == batch_pages:
                out.append((parts, rows))
                parts, rows = [], 0
    if parts:
        out.append((parts, rows))
    return out


@dataclass
class _Write:
    chunk: SaveChunk | None  # None: a promotion into the node's L2, or orders
    future: Future
    buffer: torch.Tensor | None  # None: orders
    started: float
    promoted: tuple[str, StoredRun] | None = None  # a promotion's pages


class WriteQueue:
    """The writes of one rank (``rank``) of pages ``pages`` moves; what ended is
    collected into ``stored`` (``(tag, rank, run)`` of pages stored in L3) and
    ``ended`` (``(rank, page hash)`` of every store asked for that ended, stored
    or not) — taken with ``take`` — and counted in ``counts``. Safe from any
    thread: stores come from the engine's thread, promotions from load threads."""

    def __init__(
        self, pages: PageMoves, rank: int, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.pages = pages
        self.rank = rank
        self.timeout_s = timeout_s
        self.clock = clock
        self.stored: list[tuple[str, int, StoredRun]] = []
        self.ended: list[tuple[int, bytes]] = []
        self.orders_done = 0  # batches of orders carried out (``take``)
        self.counts: Counter[str] = Counter()
        self._thread: ThreadPoolExecutor | None = None
        self._writes: deque[_Write] = deque()
        self.queued_bytes = 0
        self._lock = threading.Lock()  # the queue, its bytes and what ended

    def start(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-store")

    @property
    def started(self) -> bool:
        return self._thread is not None

    def __len__(self) -> int:
        return len(self._writes)

    def _oldest(self, nbytes: int | None = None) -> _Write | None:
        """The oldest write (while ``nbytes`` more do not fit, if given)."""
        with self._lock:
            if not self._writes:
                return None
            if nbytes is not None and self.queued_bytes + nbytes <= MAX_QUEUED_WRITE_BYTES:
                return None
            return self._writes[0]

    def room(self, nbytes: int, deadline: float) -> bool:
        """Whether ``nbytes`` more fit, waiting for the oldest write until
        ``deadline`` — not at all when it has been writing longer than
        ``timeout_s`` (a wedged store)."""
        self.collect()
        while (oldest := self._oldest(nbytes)) is not None:
            now = self.clock()
            if now - oldest.started > self.timeout_s or now >= deadline:
                return False
            try:
                oldest.future.exception(timeout=deadline - now)
            except FutureTimeout:
                return False
            self.collect()
        return True

    def drop(self, chunk: SaveChunk) -> None:
        """Stores there is no room for: not stored (a later miss), counted."""
        if chunk.buffer is not None:
            self.pages.give(chunk.buffer)
        with self._lock:
            for _, run, _, _ in chunk.parts:
                self.counts["store_dropped_pages"] += len(run.hashes)
                self.ended += [(self.rank, h) for h in run.hashes]

    def skipped(self, run: StoredRun) -> None:
        """A store this rank cannot make (no store, no KV cache it serves)."""
        with self._lock:
            self.ended += [(self.rank, h) for h in run.hashes]

    def take(self) -> tuple[list[tuple[str, int, StoredRun]], list[tuple[int, bytes]], int]:
        """What was stored and what ended since the last call, and how many batches
        of orders were carried out."""
        self.collect()
        with self._lock:
            stored, ended, self.stored, self.ended = self.stored, self.ended, [], []
            done, self.orders_done = self.orders_done, 0
        return stored, ended, done

    def take_counts(self) -> Counter[str]:
        with self._lock:
            counts, self.counts = self.counts, Counter()
        return counts

    def store(self, chunk: SaveChunk) -> None:
        """Store the chunk's pages (its buffer is given back once written)."""
        assert self._thread is not None and chunk.buffer is not None
        future = self._thread.submit(self._store, chunk)
        self._queue(_Write(chunk, future, chunk.buffer, self.clock()))

    def promote(
        self, tag: str, run: StoredRun, keys: list[str], pages: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        """Keep pages read from L3 (``run`` of ``tag``) in the node's L2 too, for the
        node's next reader, reported stored there (the load does not wait for it;
        dropped when the queue is full)."""
        self.collect()
        thread = self._thread
        with self._lock:
            full = self.queued_bytes + buffer.numel() > MAX_QUEUED_WRITE_BYTES
            if thread is None or full:
                self.counts["l2_promotions_dropped"] += len(keys)
        if thread is None or full:
            self.pages.give(buffer)
            return
        future = thread.submit(self._put_l2, keys, pages)
        self._queue(_Write(None, future, buffer, self.clock(), (tag, run)))

    def carry_out(self, orders: list[Order]) -> None:
        """Carry out the fabric's orders for this rank's shards (``vllm_orders``), on
        the writer thread, after the stores queued before them."""
        if not orders:
            return
        todo = mine(orders, self.rank, self.pages.l2_place)
        if todo and self._thread is not None:
            future = self._thread.submit(carry_out, self.pages, todo)
            self._queue(_Write(None, future, None, self.clock()))
        else:  # none of them this rank's: done
            with self._lock:
                self.orders_done += 1

    def _queue(self, write: _Write) -> None:
        with self._lock:
            self._writes.append(write)
            self.queued_bytes += write.buffer.numel() if write.buffer is not None else 0

    def _store(self, chunk: SaveChunk) -> tuple[list[bool], float, list[bool]]:
        """One store call per run of parts under one tag (their rows follow one
        another); per page of the chunk, whether it was stored in L3, and in the
        node's L2."""
        started = time.perf_counter()
        store, provenance, buffer = self.pages.store, self.pages.provenance, chunk.buffer
        assert store is not None and provenance is not None and buffer is not None
        ok: list[bool] = []
        l2: list[bool] = []
        i = 0
        while i < len(chunk.parts):
            tag, first = chunk.parts[i][0], chunk.parts[i][3]
            keys: list[str] = []
            while i < len(chunk.parts) and chunk.parts[i][0] == tag:
                keys += self.pages.keys(tag, chunk.parts[i][1].hashes)
                i += 1
            pages = buffer[first : first + len(keys)]
            kept = self.pages.l2_put(keys, pages, hold=not self.pages.write_through)
            l3 = list(range(len(keys)))
            if kept and not self.pages.write_through:  # L3 later, when the fabric says
                l3 = [k for k, good in enumerate(kept) if not good]
            done = [False] * len(keys)
            try:
                rows = pages[torch.tensor(l3, dtype=torch.long)] if len(l3) < len(keys) else pages
                for k, good in zip(
                    l3, store.store([keys[k] for k in l3], rows.numpy(), provenance), strict=True
                ):
                    done[k] = good
            except Exception as exc:  # a store that fails is a later miss, never fatal
                log.warning("kvfabric connector: storing %d pages failed: %s", len(l3), exc)
            ok += done
            l2 += kept or [False] * len(keys)
        return ok, time.perf_counter() - started, l2

    def _put_l2(self, keys: list[str], pages: torch.Tensor) -> tuple[list[bool], float, list[bool]]:
        started = time.perf_counter()
        kept = self.pages.l2_put(keys, pages)
        return [], time.perf_counter() - started, kept

    def collect(self) -> None:
        """Take the writes the thread finished."""
        while True:
            with self._lock:
                if not self._writes or not self._writes[0].future.done():
                    return
                write = self._writes.popleft()
                self.queued_bytes -= write.buffer.numel() if write.buffer is not None else 0
                self._ended_write(write)
            if write.buffer is not None:
                self.pages.give(write.buffer)

    def _ended_write(self, write: _Write) -> None:
        result = write.future.result()  # (done: it does not wait)
        if isinstance(result, Carried):  # the fabric's orders
            self.stored += [(tag, self.rank, run) for tag, run in result.stored]
            self.counts.update(result.counts)
            self.orders_done += 1
            return
        ok, seconds, l2 = result
        self.counts["l2_stored_pages"] += sum(l2)
        size, place = self.pages.page_bytes, self.pages.l2_place
        if write.chunk is None:  # a promotion into the node's L2
            if write.promoted is not None and place and write.promoted[1].namespace:
                tag, run = write.promoted
                for r in stored_runs(replace(run, place=place, page_bytes=size), l2):
                    self.stored.append((tag, self.rank, r))
            return
        self.counts["store_seconds"] += seconds
        self.counts["stored_pages"] += sum(ok)
        self.counts["store_failed_pages"] += sum(
            not a and not b for a, b in zip(ok, l2, strict=True)
        )
        for tag, run, _, row in write.chunk.parts:
            self.ended += [(self.rank, h) for h in run.hashes]
            rows = slice(row, row + len(run.hashes))
            for r in stored_runs(replace(run, page_bytes=size), ok[rows]):
                self.stored.append((tag, self.rank, r))
            if place and l2:
                for r in stored_runs(replace(run, place=place, page_bytes=size), l2[rows]):
                    self.stored.append((tag, self.rank, r))

    def drain(self, deadline: float) -> bool:
        """Wait for the writes in flight (at most until ``deadline``); whether none is
        left."""
        while (oldest := self._oldest()) is not None:
            try:
                oldest.future.exception(timeout=max(deadline - self.clock(), 0.0))
            except FutureTimeout:
                log.warning(
                    "kvfabric connector: %d stores not done within %.1f s at shutdown; "
                    "left unfinished",
                    len(self._writes), self.timeout_s,
                )  # fmt: skip
                return False
            self.collect()
        return True

    def shutdown(self, wait: bool) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=wait, cancel_futures=True)
            self._thread = None
