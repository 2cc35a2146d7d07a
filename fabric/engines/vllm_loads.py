"""The loads and stores an engine's workers run, as the connector's scheduler
side keeps them until every rank has reported them, and the leases its lookups
hold meanwhile.

A load's outcome is known a step or more after the forward that used its
blocks: each rank reports, per load, how many of its leading pages it loaded
(``FabricWorkerMeta.loaded``), and the outcome is the MIN over ranks. Until it
is known, the blocks of a synchronous load are *pending*: any request whose
blocks include one (the loading request, or another sharing the block through
vLLM's prefix cache) depends on the load and stores nothing, since what it
computed may rest on a stale block. Nothing here knows of requests beyond their
ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class LoadRecord:
    """One load, until every rank reported it."""

    load_id: int
    req_id: str
    start: int  # the request's first page it loads
    pages: int
    block_ids: tuple[int, ...]
    since: float
    reports: dict[int, int] = field(default_factory=dict)  # rank -> pages loaded
    waiters: set[str] = field(default_factory=set)  # requests that depend on it

    @property
    def loaded(self) -> int:
        """The leading pages every rank loaded."""
        return min(self.reports.values(), default=0)

    @property
    def failed(self) -> bool:
        return self.loaded < self.pages


class LoadBook:
    def __init__(self, world: int) -> None:
        self.world = world
        self.loads: dict[int, LoadRecord] = {}
        self._next = 0
        self._pending_blocks: dict[int, int] = {}  # block -> its synchronous load
        # Blocks that hold KV a failed load left stale, or KV computed over such a
        # block, until a request computes them anew, from their first token to
        # their last (vLLM keeps them in its prefix cache meanwhile, under
        # ``recompute``); and how far into each a request has computed it anew.
        self.poisoned: set[int] = set()
        self._renewed: dict[int, int] = {}

    def open(
        self, req_id: str, start: int, block_ids: tuple[int, ...], synchronous: bool, now: float
    ) -> int:
        """A new load of ``block_ids`` (the request's pages from ``start``); its id.
        A synchronous load's blocks are pending until it is reported."""
        load_id, self._next = self._next, self._next + 1
        self.loads[load_id] = LoadRecord(load_id, req_id, start, len(block_ids), block_ids, now)
        self.clean(block_ids)  # the load writes them anew
        if synchronous:
            for block in block_ids:
                self._pending_blocks[block] = load_id
        self.loads[load_id].waiters.add(req_id)
        return load_id

    def depend(self, req_id: str, block_ids: Iterable[int]) -> set[int]:
        """The loads whose pending blocks are among ``block_ids``; ``req_id`` is told
        of their outcome (it is one of their waiters)."""
        if not self._pending_blocks:
            return set()
        found = {self._pending_blocks[b] for b in block_ids if b in self._pending_blocks}
        for load_id in found:
            self.loads[load_id].waiters.add(req_id)
        return found

    def report(self, rank: int, load_id: int, pages: int) -> LoadRecord | None:
        """Rank ``rank`` loaded ``pages`` of the load; the load, closed, once every
        rank has reported it (else ``None``)."""
        record = self.loads.get(load_id)
        if record is None:
            return None
        record.reports[rank] = min(pages, record.reports.get(rank, pages))
        if len(record.reports) < self.world:
            return None
        return self._close(load_id)

    def stalled(self, now: float, after_s: float) -> list[LoadRecord]:
        """The loads not every rank reported within ``after_s``, closed."""
        late = [i for i, record in self.loads.items() if now - record.since > after_s]
        return [self._close(i) for i in late]

    def _close(self, load_id: int) -> LoadRecord:
        record = self.loads.pop(load_id)
        for block in record.block_ids:
            if self._pending_blocks.get(block) == load_id:
                del self._pending_blocks[block]
        return record

    @property
    def pending_blocks(self) -> int:
        return len(self._pending_blocks)

    def poison(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            self.poisoned.add(block)
            self._renewed.pop(block, None)

    def clean(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            self.poisoned.discard(block)
            self._renewed.pop(block, None)

    def recompute(
        self, block_ids: list[int], computed_before: int, computed_after: int, block_size: int
    ) -> tuple[set[int], set[int]]:
        """A request's step computes tokens ``[computed_before, computed_after)``:
        of its poisoned blocks, those it computes anew from their first token (or
        from where its last step stopped in them), and of those the ones whose
        last token it reaches — ``(renewing, renewed)``. Call it for every request
        of a step before ``settle``."""
        renewing: set[int] = set()
        renewed: set[int] = set()
        if not self.poisoned:
            return renewing, renewed
        first = computed_before // block_size
        last = -(-computed_after // block_size)
        for page in range(first, min(last, len(block_ids))):
            block = block_ids[page]
            if block not in self.poisoned:
                continue
            start = page * block_size
            if computed_before > start and computed_before - start != self._renewed.get(block):
                continue  # computed from the middle: its start stays stale
            renewing.add(block)
            if computed_after >= start + block_size:
                renewed.add(block)
            else:
                self._renewed[block] = computed_after - start
        return renewing, renewed

    def taint(
        self, block_ids: list[int], computed: int, first_computed: int, block_size: int,
        renewing: set[int],
    ) -> bool:  # fmt: skip
        """Whether a request that has computed ``computed`` tokens (its own from
        ``first_computed`` on) uses a poisoned block as computed; if so, the blocks
        it wrote itself from that page on are poisoned too (vLLM may hand them to
        others from its prefix cache)."""
        page = self.relies_on_poisoned(block_ids, computed, block_size, renewing)
        if page is None:
            return False
        own = max(page, first_computed // block_size)
        self.poison(b for b in block_ids[own:] if b not in renewing)
        return True

    def relies_on_poisoned(
        self, block_ids: list[int], computed_before: int, block_size: int, renewing: set[int]
    ) -> int | None:
        """The first page a request uses as computed whose block is poisoned and not
        being computed anew by it (``renewing``); ``None`` when there is none."""
        if not self.poisoned:
            return None
        for page, block in enumerate(block_ids[: -(-computed_before // block_size)]):
            if block in self.poisoned and block not in renewing:
                return page
        return None


class StoresInFlight:
    """Pages the workers were asked to store, until every rank reported each store
    ended (a request whose tokens have one waits for it, so it loads the page
    rather than computing it again). Past ``stall_s`` without any store ending,
    they are given up (a worker that will never report)."""

    def __init__(self, world: int, stall_s: float, clock: Callable[[], float]) -> None:
        self.world = world
        self.stall_s = stall_s
        self.clock = clock
        self._left: dict[bytes, int] = {}  # page hash -> ranks yet to report
        self._progress = 0.0

    def add(self, hashes: Iterable[bytes]) -> None:
        if not self._left:
            self._progress = self.clock()
        for page_hash in hashes:
            self._left[page_hash] = self._left.get(page_hash, 0) + self.world

    def ended(self, hashes: Iterable[bytes]) -> None:
        """One rank's stores of ``hashes`` ended."""
        self._progress = self.clock()
        for page_hash in hashes:
            left = self._left.get(page_hash, 0) - 1
            if left > 0:
                self._left[page_hash] = left
            else:
                self._left.pop(page_hash, None)

    def any_of(self, hashes: Iterable[bytes]) -> bool:
        return bool(self._left) and any(h in self._left for h in hashes)

    def pending(self) -> bool:
        if self._left and self.clock() - self._progress > self.stall_s:
            log.warning(
                "kvfabric connector: %d page stores not reported in %.0f s; not waiting for them",
                len(self._left), self.stall_s,
            )  # fmt: skip
            self._left.clear()
        return bool(self._left)


class Leases:
    """The leases this engine's lookups hold on the pages they matched, by request,
    until the pages are loaded; their names, and those to release."""

    def __init__(self, limit: int) -> None:
        self.engine = os.urandom(6).hex()
        self.limit = limit
        self._held: set[str] = set()
        self._ended: list[str] = []

    def name(self, req_id: str) -> str:
        return f"{self.engine}/{req_id}"

    def hold(self, req_ids: Iterable[str]) -> None:
        self._held.update(req_ids)

    def end(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            if rid in self._held:
                self._held.discard(rid)
                self._ended.append(self.name(rid))
        if len(self._ended) > self.limit:  # a fabric away for long: they expire there
            del self._ended[: len(self._ended) - self.limit]

    def take_ended(self) -> list[str]:
        ended, self._ended = self._ended, []
        return ended


class LoadOutcomes:
    """Mixed into the connector's ``SchedulerSide``: what a load's outcome does to
    the requests it touched (their save cursors, the blocks it left stale)."""

    tracked: dict[str, Any]
    _finishing: dict[str, Any]
    loads: LoadBook
    leases: Leases
    block_size: int

    def _resolve(self, record: LoadRecord, abandoned: bool = False) -> None:
        """Every rank reported the load (or it was given up on): where it failed, the
        request's save cursor goes back to vLLM's rollback (its first page that
        failed); the requests that waited for it store again — but a finished
        one, which vLLM does not roll back, stores nothing computed over a
        failed load."""
        state = self._state(record.req_id)
        if state is not None:
            state.async_loading = False
            if record.failed:
                bad = record.start + record.loaded
                state.fabric_pages = min(state.fabric_pages or 0, bad)
                state.saved_pages = min(state.saved_pages, bad)
        if record.failed:
            self._poison(record)
        for rid in record.waiters:
            waiter = self._state(rid)
            if waiter is not None:
                waiter.waiting_on.discard(record.load_id)
                waiter.no_save |= abandoned or (record.failed and rid in self._finishing)
        self.leases.end([record.req_id])

    def _state(self, rid: str) -> Any:
        return self.tracked.get(rid) or self._finishing.get(rid)

    def _check_poisoned(self, state: Any, computed: int, renewing: set[int]) -> None:
        """A request that uses a poisoned block as computed stores nothing."""
        first = state.first_computed or 0
        if self.loads.taint(state.block_ids, computed, first, self.block_size, renewing):
            state.no_save = True

    def _poison(self, record: LoadRecord) -> None:
        """A load failed: its blocks from the first that failed on, and the blocks of
        every request that waited for it from the first it shares on, may hold
        stale KV until computed anew (vLLM keeps them in its prefix cache)."""
        stale = set(record.block_ids[record.loaded :])
        self.loads.poison(stale)
        for rid in record.waiters:
            waiter = self._state(rid)
            if waiter is None:
                continue
            hit = next((i for i, b in enumerate(waiter.block_ids) if b in stale), None)
            if hit is not None:
                self.loads.poison(waiter.block_ids[hit:])
