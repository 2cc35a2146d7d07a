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
Files are opened without following links, never blocking on a FIFO
(``fabric.l3.safe_open``); open segments are kept (a few, least recently used
first out) since a prefetch reads runs of pages from one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from fabric.config import FabricConfig
from fabric.l3.auth import PageAuth
from fabric.l3.backend import Location
from fabric.l3.format import PREAMBLE, Provenance, check_header, check_payload, header_length
from fabric.l3.format import page_key as make_key
from fabric.l3.safe_open import open_regular
from fabric.l3.service import component_provenances, provenance_bytes

log = logging.getLogger(__name__)

_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_OPEN_FILES = 16  # segment descriptors kept open


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
        self._files: OrderedDict[str, int] = OrderedDict()
        # Pages this rank read itself and through the storage actor, and refusals.
        self.direct_pages = 0
        self.relayed_pages = 0
        self.refused: dict[str, int] = {}

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        return self.link.store(suffix, page_hashes, pages, component)

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> np.ndarray:
        """Verified payloads of the leading pages found (fewer rows than asked: the
        first miss or refusal ends the batch), as ``StorageService.load``."""
        where = self.link.locate(suffix, page_hashes, component) if self.usable else None
        if where is None or not self._open_root(where[0]):
            rows = self.link.load(suffix, page_hashes, component)
            self.relayed_pages += len(rows)
            return rows
        prov = self.shapes[component, suffix]
        located = where[1][: len(page_hashes)]
        out = np.empty((len(located), provenance_bytes(prov)), dtype=np.uint8)
        n, refused = 0, None
        for loc, h, row in zip(located, page_hashes, out, strict=False):
            refused = self._read(loc, make_key(h, prov.tag, suffix), row, prov)
            if refused is not None:
                break
            n += 1
        self.direct_pages += n
        if refused is not None and refused != "miss":
            self.refused[refused] = self.refused.get(refused, 0) + 1
        self.link.read_elsewhere(n, refused)
        return out[:n]

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
        no link followed), or why not (``fabric.l3.safe_open``)."""
        assert self._root_fd is not None
        with self._lock:
            fd = self._files.get(name)
            if fd is not None:
                self._files.move_to_end(name)
                return os.dup(fd)
        parent, _, base = name.rpartition("/")
        if not parent:
            got = open_regular(base, self._root_fd)
        else:
            if "/" in parent or parent in ("", ".", ".."):
                return "not_regular"
            try:
                dir_fd = os.open(parent, _DIR, dir_fd=self._root_fd)
            except OSError:
                return "miss"
            try:
                got = open_regular(base, dir_fd)
            finally:
                os.close(dir_fd)
        if not isinstance(got, int) or parent:
            return got  # a page file is read once: not kept
        with self._lock:
            self._files[name] = got
            while len(self._files) > _OPEN_FILES:
                _, old = self._files.popitem(last=False)
                os.close(old)
            return os.dup(got)

    def _read(self, loc: Location, key: str, row: np.ndarray, prov: Provenance) -> str | None:
        """Read and check one page into ``row``: ``None`` when served, else why not."""
        fd = self._open(loc.file)
        if not isinstance(fd, int):
            return fd
        try:
            head_len = loc.head
            if head_len <= 0:  # a whole file: its preamble says how long its header is
                n = header_length(os.pread(fd, PREAMBLE, loc.offset))
                if isinstance(n, str):
                    return n
                head_len = PREAMBLE + n
            elif loc.payload != row.nbytes:
                return "length"
            head = bytearray(head_len)
            got = os.preadv(fd, [head, memoryview(row).cast("B")], loc.offset)
            if got < head_len + row.nbytes:
                return "truncated"
            if loc.head <= 0 and os.fstat(fd).st_size != loc.offset + got:
                return "truncated"  # a page file longer than a page
        except OSError:
            return "miss"
        finally:
            os.close(fd)
        n = header_length(head)
        if isinstance(n, str) or PREAMBLE + n != head_len:
            return "format"
        header = check_header(memoryview(head)[PREAMBLE:], prov, row.nbytes, key)
        if isinstance(header, str):
            return header
        return check_payload(header, row, prov, key, self.auth)

    def _close(self) -> None:
        for fd in [*self._files.values(), *([self._root_fd] if self._root_fd is not None else [])]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files.clear()
        self._root_fd = None

    def close(self) -> None:
        with self._lock:
            self._close()
            self._root = None


def direct_reads(link: Any, config: FabricConfig) -> Any:
    """``link`` wrapped in ``DirectReads`` when ``storage.direct_reads`` is on and
    the link can say where pages lie; else ``link`` as it is."""
    if link is None or not config.storage.direct_reads or not hasattr(link, "locate"):
        return link
    return DirectReads(link, config)
