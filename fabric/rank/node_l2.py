"""The node's L2 for engine pages: one shared-memory file per engine shard, which
every engine process on the node attached to the same fabric reads and writes.

An engine that computed a prefix leaves its pages here as well as in L3; the
next engine on the node (another process, a Ray Serve replica) copies them from
shared memory straight into its KV blocks, without a file read. Engines on
other nodes read L3.

Layout: a header (magic, then the msgpack geometry: page size, slots, ways,
the layout and rank suffix its pages belong to), one fixed record per slot,
then the pages (page aligned). A record is ``seq | stamp | pinned until |
CRC-32 of the page | key digest``. The table is set-associative: a page's key
picks its set (``ways`` slots); a store replaces the least recently used way
that no reader holds.

Names and life: a region's file name carries its owner's uid, the fabric, the
rank's page layout and its shard, so two users never share or squat a name.
The file is sparse: memory is reserved for a slot's page (``fallocate``) when
the slot is first written, so a region grows as pages come, up to its
``l2_bytes``, and a full shared memory costs a page not kept, never a fault.
Every process using a region holds a shared lock on it; the last one to close
it removes it, and an opener first removes this user's regions no process holds
(engines that died).

Leases: a reader pins the slots it found until it has copied them (``find``
with ``pin_ms``, ``unpin``); a store never replaces a pinned slot (when every
way of the set is pinned, the page is simply not kept). A pin is a time, not a
count, so a reader that dies holds nothing for long. A page stored here only
(write-back: not in L3 yet) is held the same way (``put``'s ``hold_ms``) until
it is copied to L3 (``release``) or removed, so the region never replaces a
page the fabric has nowhere else.

Concurrency, across processes and threads, without a lock on reads: a writer
holds its set's lock — a byte-range lock across processes and a thread lock
within one, both shared by every opener of the file in the process (one
mapping per file and process) — makes ``seq`` odd, writes the page, its
checksum and key, and makes ``seq`` even again. A reader takes a slot only
when ``seq`` is even and the key matches, checks the page's checksum in place,
copies it into the engine's blocks, and reads ``seq`` again: a slot rewritten
meanwhile is a failed load (recomputed by the engine), never bytes. ``seq``
only grows, emptied slots included, so a (slot, seq) a reader holds never
matches again once the slot changed. A writer killed mid-write leaves ``seq``
odd: the slot is empty to readers and the next writer takes it.

Trust: the file is made owner-only and opened without following links. One
found with another owner is refused; one whose mode lets others write is
repaired (mode 0600) and emptied, since anything in it may have been written by
anyone; one of another geometry is made anew if no process uses it, else not
used. Every page read is checked against its checksum. Nothing here raises
into the engine: a region that cannot be used is logged once and the engine
runs on L3 alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgpack
import torch

from fabric.l3.format import checksum
from fabric.rank.node_l2_mapping import (
    ATTACH_LOCK,
    HEADER,
    MAGIC,
    MAPPED,
    MAPPED_LOCK,
    Mapping,
    digest,
    empty,
    geometry,
    mapped_files,
    owner_prefix,
    pool_at,
    region_name,
    same,
)
from fabric.rank.node_l2_mapping import RECORD as _RECORD
from fabric.rank.node_l2_mapping import SEQ as _SEQ
from fabric.rank.node_l2_mapping import STAMP as _STAMP
from fabric.rank.node_l2_mapping import remove_regions as remove_regions
from fabric.rank.shared_l2 import owned, shm_dir, sweep_stale

log = logging.getLogger(__name__)
WAYS = 8


_NO_NAME = bytes(16)  # a removed slot's key digest
Found = tuple[int, int, int, int]  # slot, seq, crc, pinned until (ms)


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000  # node-wide clock: every process agrees


class NodeL2:
    """One engine shard's pages in the node's shared memory (see the module)."""

    def __init__(self, path: Path, page_bytes: int, slots: int, layout: str, suffix: str) -> None:
        if page_bytes <= 0 or slots < WAYS:
            raise ValueError(f"a region needs page_bytes > 0 and >= {WAYS} slots")
        self.path = path
        want = {"page_bytes": page_bytes, "slots": slots - slots % WAYS, "ways": WAYS,
                "layout": layout, "suffix": suffix}  # fmt: skip
        with ATTACH_LOCK:
            self._map = self._attach(want)
        self.page_bytes = page_bytes
        self.slots, self.ways = self._map.slots, self._map.ways
        self.sets = self.slots // self.ways
        self.pool_at = self._map.pool_at
        self.view = self._map.view
        self.pool = self._map.pool
        self.fd = self._map.fd
        self.counters = {
            "refused": 0, "stored": 0, "replaced": 0, "pinned_full": 0, "no_space": 0,
            "removed": 0,
        }  # fmt: skip

    def _attach(self, want: dict) -> Mapping:
        """This process's mapping of the region at ``path``: shared with an opener of
        the same file in this process, else the file checked and taken (or made),
        held with a shared lock for life. A file removed by its last user while it
        was opened here is opened anew."""
        for _ in range(4):
            mapped = self._mapped(want)
            if mapped is not None:
                return mapped
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                st = owned(fd, self.path)
                with MAPPED_LOCK:
                    mapping = MAPPED.get((st.st_dev, st.st_ino))
                    if mapping is not None:
                        if not same(mapping.geometry, want):
                            raise OSError(
                                f"{self.path} is in use with another geometry "
                                f"({mapping.geometry}); not used"
                            )
                        mapping.users += 1
                        os.close(fd)
                        return mapping
                taken = self._take(fd, st, want)
                if taken is None:  # removed meanwhile, or made anew: open again
                    os.close(fd)
                    continue
                mapping = Mapping(self.path, fd, taken)
                with MAPPED_LOCK:
                    MAPPED[(st.st_dev, st.st_ino)] = mapping
                return mapping
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
        raise OSError(f"{self.path} kept changing while it was opened; not used")

    def _mapped(self, want: dict) -> Mapping | None:
        """This process's mapping of the file at ``path``, taken without opening it
        again: closing a second descriptor would drop every byte-range lock this
        process holds on the file (POSIX), a writer's mid-record included."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        with MAPPED_LOCK:
            mapping = MAPPED.get((st.st_dev, st.st_ino))
            if mapping is None:
                return None
            if not same(mapping.geometry, want):
                raise OSError(
                    f"{self.path} is in use with another geometry ({mapping.geometry}); not used"
                )
            mapping.users += 1
            return mapping

    def _take(self, fd: int, st: os.stat_result, want: dict) -> dict | None:
        """Lock the file (shared, for life) and take its geometry, making the region
        when the file is new; ``None`` when the path no longer names this file (its
        last user removed it) or it was removed to be made anew."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError:
            fcntl.flock(fd, fcntl.LOCK_SH)
            alone = False
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        found = geometry(fd)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning(
                "node L2 %s had mode %s (others could write it): repaired to 0600 and emptied",
                self.path, stat.filemode(st.st_mode),
            )  # fmt: skip
            if found is not None:
                empty(fd, found)
        if found is not None and same(found, want):
            if alone:
                fcntl.flock(fd, fcntl.LOCK_SH)
            return found
        if not alone:
            raise OSError(f"{self.path} is in use with another geometry ({found}); not used")
        if st.st_size:  # another geometry, or none that holds together: made anew
            os.unlink(self.path)
            return None
        size = pool_at(want["slots"]) + want["slots"] * want["page_bytes"]
        try:
            os.ftruncate(fd, size)  # sparse: a slot's page is reserved when first written
            os.posix_fallocate(fd, 0, pool_at(want["slots"]))  # the records, now
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        head = MAGIC + msgpack.packb(want)
        os.pwrite(fd, len(head).to_bytes(4, "little") + head, 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return want

    # -- reads ------------------------------------------------------------------------

    def _set(self, key_digest: bytes) -> int:
        return int.from_bytes(key_digest[:8], "little") % self.sets

    def _record_at(self, slot: int) -> int:
        return HEADER + slot * _RECORD.size

    def find(self, keys: Sequence[str], pin_ms: int = 0) -> list[Found | None]:
        """Per key, ``(slot, seq, crc, pinned until)`` where the region names it,
        else ``None`` (a name only: ``check`` checks the bytes); with ``pin_ms``,
        each slot found is pinned that long (``unpin`` once copied)."""
        out: list[Found | None] = []
        view, now = self.view, _now_ms()
        until = now + pin_ms if pin_ms > 0 else 0
        for key in keys:
            d = digest(key)
            first = self._set(d) * self.ways
            found = None
            for slot in range(first, first + self.ways):
                at = self._record_at(slot)
                seq, _, pinned, crc, name = _RECORD.unpack_from(view, at)
                if name == d and seq and not seq & 1:
                    _STAMP.pack_into(view, at + 8, now)
                    mine = until > pinned  # (a longer pin or hold is another's: kept)
                    if mine:
                        _STAMP.pack_into(view, at + 16, until)
                    found = (slot, seq, crc, until if mine else 0)
                    break
            out.append(found)
        return out

    def unpin(self, founds: Sequence[Found]) -> None:
        """The reader is done with these slots: a pin it set ends (one a later
        reader extended stays)."""
        view = self.view
        for slot, _, _, until in founds:
            at = self._record_at(slot) + 16
            if _STAMP.unpack_from(view, at)[0] == until:
                _STAMP.pack_into(view, at, 0)

    def check(self, found: Found) -> bool:
        """Whether the slot still holds the page ``find`` named, its checksum whole."""
        slot, _, crc, _ = found
        at = self.pool_at + slot * self.page_bytes
        if checksum(self.view[at : at + self.page_bytes]) != crc:
            self.counters["refused"] += 1
            return False
        return self.unchanged(found)

    def unchanged(self, found: Found) -> bool:
        """Whether nothing rewrote the slot since ``find`` (read after copying)."""
        slot, seq, _, _ = found
        return _SEQ.unpack_from(self.view, self._record_at(slot))[0] == seq

    # -- writes -----------------------------------------------------------------------

    def put(self, keys: Sequence[str], pages: torch.Tensor, hold_ms: int = 0) -> list[bool]:
        """Store ``pages`` (one uint8 row of ``page_bytes`` a key), held ``hold_ms``
        (not replaced until then, or ``release``); per key, whether the region
        holds it now (a key already here is left as it is)."""
        kept = []
        for key, page in zip(keys, pages, strict=True):
            try:
                kept.append(self._put_one(digest(key), page, hold_ms))
            except OSError as exc:  # a lock refused: the page is simply not kept here
                log.warning("node L2 %s: store failed: %s", self.path, exc)
                break
        return kept + [False] * (len(keys) - len(kept))

    def release(self, keys: Sequence[str]) -> None:
        """The pages of ``keys`` are in L3 now: the region may replace them again."""
        for found in self.find(keys):
            if found is not None:
                _STAMP.pack_into(self.view, self._record_at(found[0]) + 16, 0)

    def remove(self, keys: Sequence[str]) -> int:
        """Empty the slots holding ``keys`` (the fabric evicted them); how many held
        one. A reader copying one sees its ``seq`` move and fails the load."""
        removed = 0
        view = self.view
        for key in keys:
            d = digest(key)
            n = self._set(d)
            with self._locked(n):
                for slot in range(n * self.ways, (n + 1) * self.ways):
                    at = self._record_at(slot)
                    seq, _, _, _, name = _RECORD.unpack_from(view, at)
                    if name == d and seq and not seq & 1:
                        # seq only grows: even again, and no name, is an empty slot
                        _RECORD.pack_into(view, at, seq + 2, 0, 0, 0, _NO_NAME)
                        removed += 1
                        break
        self.counters["removed"] += removed
        return removed

    @contextlib.contextmanager
    def _locked(self, n: int) -> Iterator[None]:
        """Set ``n``'s lock: its records' byte range across processes, a thread
        lock within this one."""
        start, length = self._record_at(n * self.ways), self.ways * _RECORD.size
        with self._map.locks[n % len(self._map.locks)]:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, length, start)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, length, start)

    def _put_one(self, d: bytes, page: torch.Tensor, hold_ms: int = 0) -> bool:
        n = self._set(d)
        first = n * self.ways
        view = self.view
        with self._locked(n):
            victim, oldest, now = first, None, _now_ms()
            for slot in range(first, first + self.ways):
                seq, stamp, pinned, _, name = _RECORD.unpack_from(view, self._record_at(slot))
                if name == d and seq and not seq & 1:
                    return True  # already here (the same key is the same bytes)
                if pinned > now and seq and not seq & 1:
                    continue  # a reader is copying it
                # Empty, torn or removed: taken first.
                age = -1 if not seq or seq & 1 or name == _NO_NAME else stamp
                if oldest is None or age < oldest:
                    victim, oldest = slot, age
            if oldest is None:
                self.counters["pinned_full"] += 1
                return False
            at = self._record_at(victim)
            seq = _SEQ.unpack_from(view, at)[0]
            if not seq:  # never written: reserve its page first
                try:
                    os.posix_fallocate(
                        self.fd, self.pool_at + victim * self.page_bytes, self.page_bytes
                    )
                except OSError:
                    self.counters["no_space"] += 1
                    return False
            if oldest >= 0:
                self.counters["replaced"] += 1
            writing = seq if seq & 1 else seq + 1
            _SEQ.pack_into(view, at, writing)  # odd: readers keep off
            self.pool[victim].copy_(page)
            crc = checksum(view[self.pool_at + victim * self.page_bytes :][: self.page_bytes])
            now = _now_ms()
            _RECORD.pack_into(view, at, writing, now, now + hold_ms if hold_ms else 0, crc, d)
            _SEQ.pack_into(view, at, writing + 1)  # even: whole
        self.counters["stored"] += 1
        return True

    def close(self) -> None:
        """Stop using the region; the last user on the node removes it."""
        with ATTACH_LOCK:
            self._detach()

    def _detach(self) -> None:
        mapping, self._map = self._map, None  # type: ignore[assignment]
        if mapping is None:
            return
        self.pool = self.view = None  # type: ignore[assignment]
        with MAPPED_LOCK:
            mapping.users -= 1
            if mapping.users:
                return
            st = os.fstat(mapping.fd)
            MAPPED.pop((st.st_dev, st.st_ino), None)
        mapping.pool = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError, ValueError):  # a tensor still uses it
            mapping.view.release()
            mapping.mm.close()
        try:
            fcntl.flock(mapping.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            now = os.stat(mapping.path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(mapping.path)  # no other user: the region goes
        except OSError:
            pass  # another process uses it, or it is gone already
        finally:
            with contextlib.suppress(OSError):
                os.close(mapping.fd)


def open_node_l2(
    directory: str, identity: str, layout: str, suffix: str, page_bytes: int, max_bytes: int
) -> NodeL2 | None:
    """The region for this shard, or ``None`` (logged) where there is none to use:
    ``max_bytes`` 0, no shared memory, too small for a set of pages, refused.
    This user's regions no process uses (engines that died) are removed first."""
    if max_bytes <= 0:
        return None
    where = Path(directory) if directory else shm_dir()
    if where is None:
        log.info("node L2: no shared memory (/dev/shm) on this node; engines use L3 alone")
        return None
    slots = max_bytes // page_bytes
    if slots < WAYS:
        log.warning(
            "node L2: l2_bytes=%d holds fewer than %d pages of %d bytes; not used",
            max_bytes, WAYS, page_bytes,
        )  # fmt: skip
        return None
    path = where / region_name(identity, layout, suffix)
    try:
        with ATTACH_LOCK:
            with contextlib.suppress(OSError):
                sweep_stale(where, owner_prefix(), older_s=0.0, keep=mapped_files())
            return NodeL2(path, page_bytes, slots, layout, suffix)
    except OSError as exc:
        why = "shared memory is full" if exc.errno == errno.ENOSPC else str(exc)
        log.error("node L2 %s: %s; engines on this node use L3 alone", path, why)
        return None
