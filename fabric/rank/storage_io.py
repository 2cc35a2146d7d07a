"""A rank's backups (L2 -> L3) and prefetches (L3 -> L2), run one at a time by
its storage thread, apart from the L1 <-> L2 copies of its transfer thread.

Every write into L2 happens under the ledger's lock and only while the command
still belongs to the epoch (and a prefetch to the ops) it came in: a reset or a
stop meanwhile leaves the slots to their new owners.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from fabric.config import FabricConfig
from fabric.messages import Backup, Command, Prefetch
from fabric.rank.index import PageIndex
from fabric.rank.ledger import Ledger, run_all
from fabric.rank.pools import RankPools

log = logging.getLogger(__name__)


class StorageLink(Protocol):
    """How a rank reaches L3 (a storage actor, or a ``StorageService`` in process)."""

    def load(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> np.ndarray: ...

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool: ...


class StorageIO:
    def __init__(
        self,
        ledger: Ledger,
        pools: RankPools,
        names: PageIndex,
        link: StorageLink | None,
        config: FabricConfig,
        faults,
        rank: str,
        suffix: str,
        check_host: Callable[[list[int], int], None] | None = None,
    ) -> None:
        """``faults``: the rank's injected faults (``fabric.rank.worker.Faults``),
        read before every prefetch batch; ``rank``: its name in logs; ``suffix``:
        its shard's name in L3 keys; ``check_host(slots, every)``: raises when an
        L2 page about to be read is corrupt (a shared L2: ``RankWorker.check_host``)."""
        self.ledger, self.pools, self.names, self.link = ledger, pools, names, link
        self.check_host = check_host
        self.batch_pages = config.storage.transfer_batch_pages
        self.page_size = config.cache.page_size
        self.faults, self.rank, self.suffix = faults, rank, suffix
        self._staging: np.ndarray | None = None  # (``_load``; one storage thread)

    def run_pending(self) -> int:
        """Run every queued backup and prefetch now (tests and single-thread use)."""
        return run_all(self.run_one)

    def run_one(self, block: bool = True, timeout: float | None = None) -> bool:
        """Run the next backup or prefetch. A prefetch moves in batches, reporting
        cumulative progress after each, and stops at the first missing or refused
        page, on a failure, or when the coordinator stops it."""
        ledger = self.ledger
        with ledger.lock:
            if block and not ledger.storage_queue:
                ledger.ready.wait(timeout)
            if not ledger.storage_queue:
                return False
            cmd, epoch = ledger.storage_queue.popleft(), ledger.epoch
            ledger.storing = True
        try:
            self._run(cmd, epoch)
        finally:
            with ledger.lock:
                ledger.storing = False
                ledger.announce()
        return True

    def _run(self, cmd: Command, epoch: int) -> None:
        if isinstance(cmd, Prefetch):
            self._prefetch(cmd, epoch)
            return
        assert isinstance(cmd, Backup)
        started = time.perf_counter()
        ok = self._backup(cmd, epoch)
        ledger = self.ledger
        with ledger.lock:
            if ok:
                ledger.moved("host_to_storage", len(cmd.host_pages), started)
            if epoch == ledger.epoch:
                ledger.backups_done += 1
                if not ok:
                    ledger.failed.append(cmd.cmd_id)

    def _backup(self, cmd: Backup, epoch: int) -> bool:
        if self.link is None:
            return False
        try:
            with self.ledger.lock:  # read the pages only while they are still this epoch's
                if epoch != self.ledger.epoch:
                    return False
                pools = self.pools
                if self.check_host is not None:  # never copied into L3 under a fresh checksum
                    self.check_host(list(cmd.host_pages), 1)
                rows = pools["full"].host.rows(cmd.host_pages) if cmd.host_pages else None
                sliding = states = None
                if cmd.sliding_pages:
                    sliding = pools["sliding"].host.rows(cmd.sliding_pages)
                if cmd.mamba_slots:
                    states = pools["mamba"].host.rows(cmd.mamba_slots)
            link, ok = self.link, True
            if rows is not None:
                ok = bool(link.store(self.suffix, list(cmd.page_hashes), rows))
            if ok and sliding is not None:
                ok = bool(link.store(self.suffix, list(cmd.sliding_hashes), sliding, "sliding"))
            if ok and states is not None:
                ok = bool(link.store(self.suffix, list(cmd.mamba_hashes), states, "mamba"))
            return ok
        except Exception:
            log.exception("rank %s: backup command %d failed", self.rank, cmd.cmd_id)
            return False

    def _current(self, cmd: Prefetch, epoch: int) -> bool:
        """Under the lock: ``cmd`` still belongs to this epoch and its op is live."""
        return epoch == self.ledger.epoch and cmd.op_id in self.ledger.prefetch_ops

    def _prefetch_parts(self, cmd: Prefetch, epoch: int) -> bool:
        """Load a hybrid prefetch's components into L2 (before its pages: no progress
        is reported without them); ``False`` if any is missing or refused."""
        try:
            if self.link is None:
                raise RuntimeError("no storage link")
            sliding = states = None
            if cmd.sliding_pages:
                sliding = self.link.load(self.suffix, list(cmd.sliding_hashes), "sliding")
                if len(sliding) < len(cmd.sliding_pages):
                    return False
            if cmd.mamba_slots:
                states = self.link.load(self.suffix, list(cmd.mamba_hashes), "mamba")
                if len(states) < len(cmd.mamba_slots):
                    return False
            with self.ledger.lock:  # write the slots only while they are still this op's
                if not self._current(cmd, epoch):
                    return False
                if sliding is not None:
                    self.pools["sliding"].host.put_rows(cmd.sliding_pages, sliding)
                if states is not None:
                    self.pools["mamba"].host.put_rows(cmd.mamba_slots, states)
            return True
        except Exception:
            log.exception("rank %s: prefetch %d lost its components", self.rank, cmd.op_id)
            return False

    def _prefetch(self, cmd: Prefetch, epoch: int) -> None:
        plan = getattr(self.link, "plan", None)
        if plan is not None and len(cmd.page_hashes) > self.batch_pages:
            try:  # direct reads: where every page lies, in one call
                plan(self.suffix, list(cmd.page_hashes))
            except Exception:
                log.warning("rank %s: prefetch %d not planned", self.rank, cmd.op_id)
        done, terminated = 0, False
        total = len(cmd.page_hashes)
        if (cmd.sliding_pages or cmd.mamba_slots) and not self._prefetch_parts(cmd, epoch):
            total, terminated = 0, True
        ledger = self.ledger
        while done < total:
            with ledger.lock:
                if epoch != ledger.epoch:
                    return
                if cmd.op_id in ledger.stopping:
                    terminated = True
                    break
            want = list(cmd.page_hashes[done : done + self.batch_pages])
            got = self._prefetch_batch(cmd, epoch, done, want)
            if got is None:
                return  # a reset: the slots are no longer this op's
            if got < 0:
                got, terminated = 0, True
            done += got
            with ledger.lock:
                if not self._current(cmd, epoch):
                    return
                ledger.progress(cmd.op_id, 0)[0] = done * self.page_size
                ledger.announce()
            if got < len(want):
                terminated = terminated or done < total
                break
        with ledger.lock:
            if self._current(cmd, epoch):
                entry = ledger.progress(cmd.op_id, done * self.page_size)
                entry[1], entry[2] = True, terminated

    def _load(self, want: list[bytes]) -> np.ndarray:
        """``want``'s leading pages found; into this rank's staging rows when its
        link reads into rows it is given (``fabric.l3.direct``): memory touched
        once, not on every batch."""
        row_bytes = getattr(self.link, "row_bytes", None)
        if row_bytes is None:
            return self.link.load(self.suffix, want)
        if self._staging is None:
            self._staging = np.zeros((self.batch_pages, row_bytes(self.suffix)), np.uint8)
        return self.link.load(self.suffix, want, out=self._staging)

    def _prefetch_batch(
        self, cmd: Prefetch, epoch: int, done: int, want: list[bytes]
    ) -> int | None:
        """Read ``want`` (the pages after the first ``done``) into their L2 slots:
        how many came, in order; -1 on a failure; ``None`` if the epoch ended."""
        try:
            if self.link is None:
                raise RuntimeError("no storage link")
            if self.faults.delay_s:
                time.sleep(self.faults.delay_s)
            started = time.perf_counter()
            rows = self._load(want)
            got = len(rows)
            with self.ledger.lock:  # write the pages only while they are still this op's
                if epoch != self.ledger.epoch:
                    return None
                if got:
                    slots = cmd.host_pages[done : done + got]
                    self.names.forget_host(slots)
                    self.pools["full"].host.put_rows(slots, rows)
                    if cmd.tokens:
                        self.names.prefetched(cmd, done, got)
                    self.ledger.moved("storage_to_host", got, started)
            return got
        except Exception:
            log.exception("rank %s: prefetch %d failed after %d pages", self.rank, cmd.op_id, done)
            return -1
