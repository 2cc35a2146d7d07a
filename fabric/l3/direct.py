"""A rank reads its prefetches from L3 itself: no page crosses Ray.

Through the storage actor, a prefetch batch is read and checked there, then
shipped to the rank (a copy into Ray's object store, one out of it). When L3 is
a directory every rank's node sees (``file`` or ``segment`` on a shared path),
the rank asks the storage actor only *where* the pages lie
(``StorageService.locate``: one small reply, the actor keeps the one index) and
reads them itself, straight into its rows, with the checks every backend makes
(the key the page was stored under, its provenance, its checksum or tag). The
storage actor still counts every page read and every refusal
(``read_elsewhere``).

What a rank cannot read itself — no backend, Redis, a root this node does not
have, an auth key it cannot read — goes through the storage actor as before. A
file that vanished or was cut short is a miss (a short prefetch); a page that
fails a check is refused, and the batch ends there, as in ``L3Backend.get``.
Every page read here passes the one check the storage actor's reads pass
(``fabric.l3.format.check_read``), and every outcome — a page served, a miss, a
refusal and its reason — is counted in the store's figures as its own reads
count them. The common page passes ``fabric.l3.format.FastCheck`` (a few byte
compares and its checksum, no header decoded) and anything else gets the full
check, which names the refusal.

Speed (bench/datapath.py): reads are 1 MiB calls (``fabric.l3.run_reads``:
checked while the CPU cache holds them), two threads take alternate calls (a
read from the page cache is a kernel copy made with the GIL released; one,
in file order, when the page cache lacks the load's first page: the kernel's
readahead keeps the disk busy then), and pages go into rows the
caller keeps (``out``), so a warm read runs at the raw one-file read's speed.

Files are opened without following links, never blocking on a FIFO
(``fabric.l3.safe_open``), and closed once the batch is read: a segment another
node evicts or clears is never held open here (its disk is freed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np

from fabric.config import FabricConfig
from fabric.l3.auth import PageAuth
from fabric.l3.backend import Location
from fabric.l3.format import FastCheck, Provenance, fast_check
from fabric.l3.run_reads import cold, read_run, rows_for
from fabric.l3.run_reads import runs as runs_of
from fabric.l3.safe_open import open_regular
from fabric.l3.service import component_provenances, provenance_bytes

log = logging.getLogger(__name__)

_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
# Reads in flight at once: a read from the page cache is a copy the kernel makes
# with the GIL released, so two threads copy (and checksum) side by side.
READERS = 2
# Reads in flight when the page cache does not hold a load's first page: one,
# in file order, so that the kernel sees a sequential reader and reads ahead
# (``read_ahead_kb``) while this thread checks what came. Several readers taking
# alternate runs look random to readahead, and each read then waits on the disk
# (2 cores, a virtual disk with 8 MiB readahead: 0.65-0.93 of a raw one-file
# read with eight readers, 0.89-0.99 with one, bench/datapath.py).
COLD_READERS = 1


class StorageLink(Protocol):
    """The rank's way to the storage actor (or a ``StorageService`` in one process)."""

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> Any: ...

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool: ...

    def locate(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> tuple[str, list[Location]] | None: ...

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None: ...


class DirectReads:
    """A storage link whose ``load`` reads the pages itself where it can."""

    def __init__(self, link: StorageLink, config: FabricConfig) -> None:
        self.link = link
        self.shapes = component_provenances(config)
        self.auth: PageAuth | None = None
        self.usable = True
        if config.storage.auth_key_file:
            try:
                self.auth = PageAuth.from_file(config.storage.auth_key_file)
            except Exception as exc:  # not on this node: the storage actor reads
                log.warning("L3 direct reads off: the auth key is not readable here (%s)", exc)
                self.usable = False
        self._lock = threading.Lock()
        self._root: str | None = None
        self._root_fd: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        # The last prefetch's pages and where they lie (``plan``).
        # (suffix, component, hashes, first index of each hash, where they lie)
        self._planned: tuple[str, str, list[bytes], dict[bytes, int], Any] | None = None
        # Pages this rank read itself and through the storage actor, and refusals.
        self.direct_pages = 0
        self.relayed_pages = 0
        self.refused: dict[str, int] = {}

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        return self.link.store(suffix, page_hashes, pages, component)

    def row_bytes(self, suffix: str, component: str = "full") -> int:
        """The bytes of one page of ``component`` on shard ``suffix`` (a row of ``load``)."""
        return provenance_bytes(self.shapes[component, suffix])

    def plan(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> None:
        """Ask where all of a prefetch's pages lie in one call; the loads of its
        batches then use the answer (one round trip a prefetch, not a batch)."""
        if self.usable:
            where = self.link.locate(suffix, page_hashes, component)
            first = {h: i for i, h in reversed(list(enumerate(page_hashes)))}
            self._planned = (suffix, component, list(page_hashes), first, where)

    def _where(
        self, suffix: str, page_hashes: list[bytes], component: str
    ) -> tuple[str, list[Location]] | None:
        planned = self._planned
        if planned is not None and planned[:2] == (suffix, component) and planned[4] is not None:
            hashes, first, (root, locs) = planned[2], planned[3], planned[4]
            start = first.get(page_hashes[0]) if page_hashes else None
            if start is not None and hashes[start : start + len(page_hashes)] == page_hashes:
                return root, locs[start : start + len(page_hashes)]
        return self.link.locate(suffix, page_hashes, component)

    def load(
        self,
        suffix: str,
        page_hashes: list[bytes],
        component: str = "full",
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Verified payloads of the leading pages found (fewer rows than asked: the
        first miss or refusal ends the batch), as ``StorageService.load``: rows
        of ``out`` when given (a page a row, read into it in place: a buffer the
        caller keeps saves touching new memory on every read), else new ones."""
        where = self._where(suffix, page_hashes, component) if self.usable else None
        if where is None or not self._open_root(where[0]):
            rows = self.link.load(suffix, page_hashes, component)
            self.relayed_pages += len(rows)
            if out is not None and len(rows):  # the caller's rows, as from a read here
                out = rows_for(out, len(rows), rows.shape[1])
                out[:] = rows
                rows = out
            return rows
        prov = self.shapes[component, suffix]
        located = where[1][: len(page_hashes)]
        out = rows_for(out, len(located), provenance_bytes(prov))
        tag = prov.tag
        keys = [f"{h.hex()}.{tag}.{suffix}" for h in page_hashes[: len(located)]]  # page_key
        n, refused = 0, None
        fast = fast_check(prov, out.shape[1], self.auth)
        files: dict[str, int | str] = {}  # this load's open files, closed at its end
        try:
            runs = []
            for start, end in runs_of(located, out.shape[1]):
                name = located[start].file
                if name not in files:
                    files[name] = self._open(name)
                runs.append((located[start:end], keys[start:end], out[start:end]))
            for served, refused in self._read_runs(runs, prov, fast, files):
                n += served
                if refused is not None:
                    break
        finally:
            for fd in files.values():
                if isinstance(fd, int):
                    os.close(fd)
        self.direct_pages += n
        if refused == "miss":  # the directory may have been made anew: open it again next time
            self.close()
        elif refused is not None:
            self.refused[refused] = self.refused.get(refused, 0) + 1
        self.link.read_elsewhere(n, refused)
        return out[:n]

    def _read_runs(
        self,
        runs: list[tuple],
        prov: Provenance,
        fast: FastCheck,
        files: dict[str, int | str],
    ) -> list[tuple[int, str | None]]:
        """Each run's outcome (``_read_run``), in order, up to the first run with
        a refusal: ``READERS`` threads (``COLD_READERS`` for a cold load; this
        one among them) take every one of that many runs in turn, and none
        starts a run past a refusal already seen."""
        stop = [len(runs)]
        readers = COLD_READERS if runs and cold(runs[0][0][0], files) else READERS

        def read(first: int) -> dict[int, tuple[int, str | None]]:
            done = {}
            for i in range(first, len(runs), readers):
                if i > stop[0]:
                    break
                try:
                    done[i] = read_run(*runs[i], prov, fast, files, self.auth)
                except BaseException:
                    stop[0] = -1  # every thread stops: the load ends with this
                    raise
                if done[i][1] is not None:
                    stop[0] = min(stop[0], i)
            return done

        others = []
        if readers > 1 and len(runs) > 1:
            with self._lock:
                if self._pool is None:
                    most = max(READERS, COLD_READERS) - 1
                    self._pool = ThreadPoolExecutor(most, thread_name_prefix="kvfabric-l3")
                others = [self._pool.submit(read, k) for k in range(1, readers)]
        try:
            done = read(0)
        finally:  # no thread reads into ``runs`` once the load returns or raises
            wait(others)
        for other in others:
            done.update(other.result())
        return [done[i] for i in range(min(stop[0] + 1, len(runs)))]

    def _open_root(self, root: str) -> bool:
        """The store's directory, opened here once; ``False`` if this node lacks it."""
        with self._lock:
            if root == self._root:
                return self._root_fd is not None
            self._close()
            self._root = root
            try:
                self._root_fd = os.open(root, _DIR)
            except OSError as exc:
                log.warning("L3 direct reads off for %s: not a directory here (%s)", root, exc)
                self._root_fd = None
            return self._root_fd is not None

    def _open(self, name: str) -> int | str:
        """A read descriptor of ``name`` (``file`` or ``dir/file`` under the root,
        no link followed), which the caller closes; or why not
        (``fabric.l3.safe_open``: ``miss`` for a file that is gone)."""
        assert self._root_fd is not None
        parent, _, base = name.rpartition("/")
        if not parent:
            return open_regular(base, self._root_fd)
        if "/" in parent or parent in (".", ".."):
            return "not_regular"
        try:
            dir_fd = os.open(parent, _DIR, dir_fd=self._root_fd)
        except OSError:
            return "miss"
        try:
            return open_regular(base, dir_fd)
        finally:
            os.close(dir_fd)

    def _close(self) -> None:
        if self._root_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._root_fd)
        self._root_fd = None

    def close(self) -> None:
        with self._lock:
            self._close()
            self._root = None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def direct_reads(link: Any, config: FabricConfig) -> Any:
    """``link`` wrapped in ``DirectReads`` when ``storage.direct_reads`` is on and
    the link can say where pages lie; else ``link`` as it is."""
    if link is None or not config.storage.direct_reads or not hasattr(link, "locate"):
        return link
    return DirectReads(link, config)
