"""An L3 of segment files: page shards appended to a few large files in a directory.

One file per page shard (``fabric.l3.file``) costs an open, a read and a close
for every 16 KB a prefetch reads, and a directory entry for every page a backup
writes: a few runs made a quarter of a million files. Here a backup's pages are
appended, in one ``pwritev``, to the writing thread's current segment
(``seg-<writer>-<seq>.kvs``, up to ``segment_bytes``; each thread appends to
segments of its own, so threads write at once and take the lock only to index
what they wrote); a prefetch reads the
pages it wants, straight into the caller's rows, one ``preadv`` for each run of
pages that lie one after another in a segment — as a backup's do.

Each record is ``frame | key | page`` where the frame is ``KVR1``, the key's
length and the page's length, and the page is the format every backend
stores (``fabric.l3.format``: header with the page's own key, checksum and
provenance, then the payload). The index (key -> segment, offset) lives in
memory and is rebuilt by reading the frames when the store opens — no separate
index file to lose or to trust: a frame only says where to look; what is served
is checked against its header exactly as a single page file is (key binding,
checksum, provenance). A writer that dies mid-append leaves a torn last record:
the scan stops there, and nothing ever appends to a segment it did not create
in this process, so a torn tail stays the end. A damaged frame in the middle (a
flipped byte) costs that record only: the scan goes on at the next whole frame
and counts ``segment_corrupt_records``. Several processes may share the
directory: each appends to its own segments and picks up the others' on a miss
(at most once a second).

A deletion (``delete``: the fabric's tree evicted the page) appends a
tombstone naming the record (its key, segment and offset, so a newer copy of
the key stays) to the deleter's segment; every process drops that record from
its index when it scans the tombstone, and a segment with no live record left
but deleted ones, that no writer appended to for ``2 * SEAL_S`` and that this
process has read to its end, is removed by the first process to see it so. A
record superseded by another copy of its key is not dead: which copy is newer
is only a process's scan order.

Files and directories are owner-only (``file_mode``/``dir_mode``) and opened
without following links. With ``max_bytes``, whole segments go, least recently
used first (a read refreshes its segment), and segments are cut at an eighth of
``max_bytes`` (or ``segment_bytes`` if smaller) so that an eviction frees a small
share and what is on disk stays within the cap.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fabric.l3.backend import L3Backend, Location
from fabric.l3.file import open_store_dir
from fabric.l3.format import (
    PREAMBLE,
    Provenance,
    check_key,
    check_read,
    encode_header,
    header_length,
)
from fabric.l3.manifest import Manifest
from fabric.l3.options import SegmentOptions
from fabric.l3.safe_open import READ, open_regular

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<4sHI")  # magic, key length, page length
_MAGIC = b"KVR1"
# A deletion: the record of the frame's key at (segment, offset) is dead.
_DEAD = b"KVX1"
_OFFSET = struct.Struct("<Q")
_SUFFIX = ".kvs"
_MAX_KEY = 128
_IOV = 1020  # iovecs per call, under IOV_MAX (1024 on Linux)
_WRITE_CALL = 1 << 20  # bytes per write call (see _write_calls)
# Bytes per read call: each read's pages are checked while the CPU cache still
# holds them (a checksum over a larger read reads it back from memory).
_READ_CALL = 1 << 20
RESCAN_S = 1.0
# How often, at most, the segments held open are checked for removal by someone
# else (another node's eviction or clear): a removed one is closed, its disk freed.
REAP_S = 1.0
# A writer starts a new segment rather than append to one it left alone this
# long, so a segment untouched for twice as long is done with, and one whose
# every record is dead may be removed by any process.
SEAL_S = 10.0
# Deletions seen before the record they name (kept at most this many).
MAX_GRAVES = 1 << 16


@dataclass(eq=False)
class Segment:
    name: str
    fd: int
    size: int = 0  # bytes of whole records (the scan's or the appends' end)
    file_size: int = 0  # bytes counted in the store's total
    torn_at: int = -1  # where a scan last found a record it could not index
    skipped_at: int = -1  # where a scan last skipped a damaged record
    used: float = 0.0  # last write or read, for eviction
    keys: set[str] = field(default_factory=set)
    appended: float = 0.0  # this writer's last append (monotonic)
    dead: int = 0  # records deleted, and deletions it holds
    tombs: int = 0


@dataclass(frozen=True)
class _Tomb:
    segment: str  # the deleted record's segment and offset
    page: int


def _write_calls(parts: list[Any]) -> Iterator[list[memoryview]]:
    """``parts`` cut into the iovecs of successive ``pwritev`` calls of at most
    ``_WRITE_CALL`` bytes (a part longer than that is split). Larger calls ran
    ~10x slower on a virtual machine (Linux 6.18): ~430 MB/s from 2 MiB a call
    up, ~5 GB/s at 1 MiB and below, into the same page cache."""
    call: list[memoryview] = []
    size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            piece = view[: _WRITE_CALL - size]
            call.append(piece)
            size += len(piece)
            view = view[len(piece) :]
            if size == _WRITE_CALL or len(call) == _IOV:
                yield call
                call, size = [], 0
    if call:
        yield call


@dataclass(frozen=True)
class _Entry:
    segment: Segment
    page: int  # offset of the page (its header) in the segment
    head: int  # bytes of preamble and header before the payload
    payload: int  # bytes of payload


class SegmentBackend(L3Backend):
    name = "segment"
    sees_others = True  # rescans the directory before it evicts

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        options = SegmentOptions.parse(extra, "segment")
        self.root = Path(options.path).expanduser().resolve()
        self.max_bytes = options.max_bytes
        self.fsync = options.fsync
        self.file_mode = int(options.file_mode, 8)
        self.dir_mode = int(options.dir_mode, 8)
        limit = options.segment_bytes
        if self.max_bytes:
            # An eviction frees an eighth of the cap, never more: a cap smaller
            # than a segment would otherwise empty the store at each eviction,
            # or (a segment in use) be passed.
            limit = min(limit, max(self.max_bytes // 8, 1))
        self.segment_bytes = limit
        self.writer = uuid.uuid4().hex[:16]
        self._seq = 0
        self._lock = threading.RLock()  # the index, the segments and their ends
        self._index: dict[str, _Entry] = {}
        self._segments: dict[str, Segment] = {}
        # Each thread appends to a segment of its own, so appends from several
        # threads write at once (only the bookkeeping takes the lock).
        self._appending: dict[int, Segment] = {}
        self._busy: set[Segment] = set()  # being written: never evicted or closed
        self._idle = threading.Condition(self._lock)
        self._bytes = 0
        self._refused: set[str] = set()  # names that are no regular file, said once
        self._graves: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._scanned = 0.0
        self._reaped = 0.0
        self._root_fd, read_only = open_store_dir(self.root, self.dir_mode)
        if read_only is not None:
            self.write_failed(read_only, 0)
        self.manifest = Manifest(self.root, self.file_mode, self.dir_mode)
        with self._lock:
            self._rescan()

    # -- the directory ---------------------------------------------------------------

    def _rescan(self) -> None:
        """Index segments that appeared or grew since the last scan (another
        writer's), and forget those that vanished. Call with the lock held."""
        self._scanned = time.monotonic()
        names = set()
        for entry in os.scandir(self._root_fd):
            if not (entry.name.startswith("seg-") and entry.name.endswith(_SUFFIX)):
                continue
            names.add(entry.name)
            seg = self._segments.get(entry.name)
            if seg is None:
                fd = open_regular(entry.name, self._root_fd)  # never blocks (a FIFO)
                if not isinstance(fd, int):
                    if fd != "miss" and entry.name not in self._refused:  # said once
                        self._refused.add(entry.name)
                        self.count(f"refused_{fd}")
                        log.warning("L3: %s/%s is not a regular file (%s); ignored",
                                    self.root, entry.name[:80], fd)  # fmt: skip
                    continue
                st = os.fstat(fd)
                seg = Segment(entry.name, fd, used=st.st_mtime)
                self._segments[entry.name] = seg
            if seg not in self._appending.values():
                self._scan(seg)
        for name in [n for n in self._segments if n not in names]:
            if self._segments[name] not in self._appending.values():
                self._forget(self._segments[name])

    def _scan(self, seg: Segment) -> None:
        """Index ``seg``'s whole records from where the last scan stopped."""
        end = os.fstat(seg.fd).st_size
        self._bytes += end - seg.file_size
        seg.file_size = end
        at = seg.size
        while at + _FRAME.size <= end:
            frame = self._frame_at(seg, at, end)
            if frame is None:
                # A damaged frame mid-segment costs that record, not the tail: go on
                # at the next whole frame. None after it: a torn (or growing) tail.
                nxt = self._next_frame(seg, at + 1, end)
                if nxt is None:
                    break
                if seg.skipped_at != at:
                    seg.skipped_at = at
                    self.count("segment_corrupt_records")
                    log.warning(
                        "L3: %s: a damaged record at byte %d skipped (%d bytes)",
                        seg.name, at, nxt - at,
                    )  # fmt: skip
                at = nxt
                continue
            key, entry, at = frame
            if isinstance(entry, _Tomb):
                seg.tombs += 1
                self._bury(key, entry)
            elif (seg.name, entry.page) in self._graves:  # deleted before seen here
                del self._graves[(seg.name, entry.page)]
            else:
                self._put(key, entry)
        if at < end and seg.torn_at != at:
            seg.torn_at = at  # counted once (it may be a record another writer is appending)
            self.count("segment_torn_tails")
        seg.size = max(seg.size, at)

    def _frame_at(self, seg: Segment, at: int, end: int) -> tuple[str, _Entry | _Tomb, int] | None:
        """The whole, well-formed record at ``at``: its key, index entry (or the
        deletion it is) and where the next record starts; ``None`` if there is
        none there."""
        head = os.pread(seg.fd, _FRAME.size + _MAX_KEY + PREAMBLE, at)
        if len(head) < _FRAME.size:
            return None
        magic, key_len, page_len = _FRAME.unpack_from(head)
        page = at + _FRAME.size + key_len
        if magic not in (_MAGIC, _DEAD) or key_len > _MAX_KEY or page + page_len > end:
            return None
        try:
            key = check_key(head[_FRAME.size : _FRAME.size + key_len].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        if magic == _DEAD:
            return self._tomb_at(seg, key, page, page_len)
        n = header_length(head[_FRAME.size + key_len :])
        if isinstance(n, str) or PREAMBLE + n > page_len:
            return None
        return key, _Entry(seg, page, PREAMBLE + n, page_len - PREAMBLE - n), page + page_len

    @staticmethod
    def _tomb_at(seg: Segment, key: str, at: int, length: int) -> tuple[str, _Tomb, int] | None:
        body = os.pread(seg.fd, length, at)
        if len(body) != length or not _OFFSET.size < length <= _OFFSET.size + _MAX_KEY:
            return None
        try:
            name = body[_OFFSET.size :].decode("ascii")
        except UnicodeDecodeError:
            return None
        return key, _Tomb(name, _OFFSET.unpack_from(body)[0]), at + length

    def _next_frame(self, seg: Segment, start: int, end: int) -> int | None:
        """The offset of the first whole record at or after ``start``, if any."""
        chunk = 1 << 20
        at = start
        while at + _FRAME.size <= end:
            data = os.pread(seg.fd, min(chunk, end - at) + len(_MAGIC) - 1, at)
            i = data.find(_MAGIC)
            while i >= 0:
                if self._frame_at(seg, at + i, end) is not None:
                    return at + i
                i = data.find(_MAGIC, i + 1)
            at += chunk
        return None

    def _put(self, key: str, entry: _Entry) -> None:
        self.note_stored(key)
        old = self._index.get(key)
        if old is not None:
            # Not counted dead: which copy is newer is only this process's scan order,
            # and another process may take the other one for the current copy.
            old.segment.keys.discard(key)
        self._index[key] = entry
        entry.segment.keys.add(key)

    def _forget(self, seg: Segment) -> None:
        gone = []
        for key in seg.keys:
            if self._index.get(key, None) is not None and self._index[key].segment is seg:
                del self._index[key]
                gone.append(key)
        self.note_removed(gone)
        self._bytes -= seg.file_size
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        del self._segments[seg.name]
        for tid in [t for t, s in self._appending.items() if s is seg]:
            del self._appending[tid]

    def refresh(self) -> bool:
        with self._lock:
            self._rescan()
        return True

    def _refresh_on_miss(self) -> bool:
        """Pick up other writers' pages, at most once per ``RESCAN_S``."""
        with self._lock:
            if time.monotonic() - self._scanned < RESCAN_S:
                return False
            self._rescan()
            return True

    # -- writing ----------------------------------------------------------------------

    def _new_segment(self) -> tuple[Segment, int]:
        """A new segment of this writer's (call with the lock held): the segment,
        whose descriptor only reads, and a descriptor to append with."""
        self._seq += 1
        name = f"seg-{self.writer}-{self._seq:08d}{_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        wfd = os.open(name, flags, self.file_mode, dir_fd=self._root_fd)
        try:
            os.fchmod(wfd, self.file_mode)  # exactly the mode asked for, whatever the umask
            if self.fsync:
                os.fsync(self._root_fd)
            fd = os.open(name, READ, dir_fd=self._root_fd)
        except OSError:
            os.close(wfd)
            raise
        seg = Segment(name, fd, used=time.time())
        self._segments[name] = seg
        return seg, wfd

    def _reopen(self, seg: Segment) -> int | None:
        """A descriptor to append to ``seg`` with, or ``None`` when its name is no
        longer the file this writer made (removed or replaced by someone)."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            wfd = os.open(seg.name, flags, dir_fd=self._root_fd)
        except FileNotFoundError:
            return None
        if os.path.samestat(os.fstat(wfd), os.fstat(seg.fd)):
            return wfd
        os.close(wfd)
        return None

    def set(
        self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance | None = None
    ) -> list[bool]:
        """Append the batch to this writer's segment in one ``pwritev`` (per
        segment); all pages stored or none."""
        self._reap()
        prov = provenance or self.provenance
        records: list[tuple[str, list[Any], int, int]] = []
        for i, key in enumerate(keys):
            check_key(key)
            payload = memoryview(pages[i]).cast("B")
            header = encode_header(payload, prov, key, self.auth)
            kb = key.encode("ascii")
            frame = _FRAME.pack(_MAGIC, len(kb), len(header) + len(payload)) + kb
            records.append((key, [frame, header, payload], len(header), len(payload)))
        if not records:
            return []
        try:
            self._append(records)
        except OSError as exc:
            self.write_failed(exc, len(records))
            return [False] * len(records)
        self.wrote()
        self.count("set_pages", len(records))
        self._evict()
        return [True] * len(records)

    def _append(self, records: list[tuple[str, list[Any], int, int]], pages: bool = True) -> None:
        """Write ``records`` at the end of this thread's segment, then index them.
        Only this thread appends to that segment, so the write needs no lock. The
        descriptor it writes with is closed when the append ends: between appends
        the store holds no file open for writing, so its file system can be
        remounted read-only under a running fabric (writes then fail, reads go on)."""
        size = sum(len(p) for _, parts, _, _ in records for p in parts)
        tid = threading.get_ident()
        wfd = None
        with self._lock:
            seg = self._appending.get(tid)
            if seg is not None and seg.size and seg.size + size > self.segment_bytes:
                seg = None
            if seg is not None and time.monotonic() - seg.appended > SEAL_S:
                seg = None  # left alone long enough to be done with: never appended again
            if seg is not None:
                wfd = self._reopen(seg)
            if wfd is None:
                seg, wfd = self._new_segment()
                self._appending[tid] = seg
            start = at = seg.size
            self._busy.add(seg)
        written = False
        try:
            for chunk in _write_calls([p for _, parts, _, _ in records for p in parts]):
                want = sum(len(p) for p in chunk)
                done = os.pwritev(wfd, chunk, at)
                if done != want:
                    raise OSError(errno.ENOSPC, f"short write ({done} of {want} bytes)")
                at += done
            if self.fsync:
                os.fsync(wfd)
            written = True
        finally:
            with self._lock:
                if written:
                    for key, parts, head, payload in records:
                        page = start + len(parts[0])
                        if pages:
                            self._put(key, _Entry(seg, page, head, payload))
                        start = page + head + payload
                    seg.tombs += 0 if pages else len(records)
                    seg.size = seg.file_size = at
                    seg.used = time.time()
                    seg.appended = time.monotonic()
                    self._bytes += size
                else:
                    # Cut the torn records off, so the segment's end stays a whole
                    # record; if even that fails, never append to it again.
                    try:
                        os.ftruncate(wfd, start)
                    except OSError:
                        if self._appending.get(tid) is seg:
                            del self._appending[tid]
                self._busy.discard(seg)
                self._idle.notify_all()
            os.close(wfd)

    def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys``' records (those this process knows of): dropped from the
        index now, and a tombstone appended for the other processes; how many."""
        self._reap()
        records = []
        with self._lock:
            if any(check_key(key) not in self._index for key in keys):
                self._refresh_on_miss()  # another process's page, written since the last scan
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    continue
                body = _OFFSET.pack(entry.page) + entry.segment.name.encode("ascii")
                kb = key.encode("ascii")
                records.append((key, [_FRAME.pack(_DEAD, len(kb), len(body)) + kb, body], 0, 0))
                self._bury(key, _Tomb(entry.segment.name, entry.page))
        if records:
            try:
                self._append(records, pages=False)
            except OSError as exc:  # the others keep the records: a space leak, never bytes
                self.write_failed(exc, 0)
        self.count("deleted_pages", len(records))
        return len(records)

    def _bury(self, key: str, tomb: _Tomb) -> None:
        """The record ``tomb`` names is dead (call with the lock held)."""
        entry = self._index.get(key)
        if entry is not None and entry.segment.name == tomb.segment and entry.page == tomb.page:
            del self._index[key]
            entry.segment.keys.discard(key)
            entry.segment.dead += 1
            return
        seg = self._segments.get(tomb.segment)
        if seg is None or seg.size <= tomb.page:  # not scanned that far yet: remembered
            self._graves[(tomb.segment, tomb.page)] = None
            while len(self._graves) > MAX_GRAVES:
                self._graves.popitem(last=False)

    def _remove_dead(self) -> None:
        """Remove the segments whose every record is dead and that no writer
        appended to for ``2 * SEAL_S`` (call with the lock held)."""
        now = time.time()
        active = set(self._appending.values())
        for seg in list(self._segments.values()):
            if seg.keys or not (seg.dead or seg.tombs) or seg in self._busy:
                continue
            if seg in active and time.monotonic() - seg.appended <= SEAL_S:
                continue
            try:
                st = os.fstat(seg.fd)
                if now - st.st_mtime < 2 * SEAL_S or st.st_size != seg.size:
                    continue  # written to lately, or since this process read it all
                os.unlink(seg.name, dir_fd=self._root_fd)
            except OSError:
                continue  # gone already, or the store turned read-only
            self._forget(seg)
            self.count("deleted_segments")

    def _quiesce(self) -> None:
        """Wait (lock held) until no append is between its write and its bookkeeping."""
        while self._busy:
            self._idle.wait()

    def _evict(self) -> None:
        if not self.max_bytes:
            return
        # Other writers' segments count too (several storage actors share one
        # store): see them at most once a second, so the cap holds for the store.
        self._refresh_on_miss()
        victims = []
        with self._lock:
            while self._bytes > self.max_bytes:
                candidates = [s for s in self._segments.values() if s not in self._busy]
                if not candidates:
                    break
                old = min(candidates, key=lambda s: s.used)
                victims.append((old.name, len(old.keys)))
                self._forget(old)
        for name, n in victims:
            with contextlib.suppress(OSError):  # gone already, or the store turned read-only
                os.unlink(name, dir_fd=self._root_fd)
            self.count("evicted_pages", n)
            self.count("evicted_segments")

    # -- reading ----------------------------------------------------------------------

    def _locate(self, key: str) -> _Entry | None:
        entry = self._index.get(key)
        if entry is None and self._refresh_on_miss():
            entry = self._index.get(key)
        return entry

    def _exists(self, key: str) -> bool:
        return self._locate(key) is not None

    def locate(self, keys: Sequence[str]) -> list[Location]:
        self._reap()
        out = []
        now = time.time()
        for key in keys:
            entry = self._locate(check_key(key))
            if entry is None:
                break
            entry.segment.used = now  # a read refreshes its segment
            out.append(Location(entry.segment.name, entry.page, entry.head, entry.payload))
        return out

    def _read_rows(
        self, keys: Sequence[str], out: np.ndarray, provenance: Provenance
    ) -> Iterator[str | None]:
        """Each run of pages that follow one another in a segment comes in one
        ``preadv``: headers into small buffers, payloads straight into ``out``."""
        self._reap()
        i, n = 0, len(keys)
        while i < n:
            first = self._locate(keys[i])
            if first is None:
                yield "miss"
                return
            if first.payload != out.shape[1]:
                yield self._odd_length(first, keys[i], out.shape[1], provenance)
                return
            run = [first]
            size = first.head + first.payload
            while i + len(run) < n and len(run) < _IOV // 3:
                nxt = self._index.get(keys[i + len(run)])
                prev = run[-1]
                if (
                    nxt is None
                    or size + nxt.head + nxt.payload > _READ_CALL
                    or nxt.segment is not first.segment
                    or nxt.payload != out.shape[1]
                    or nxt.page - (prev.page + prev.head + prev.payload) > _FRAME.size + _MAX_KEY
                    or nxt.page <= prev.page
                ):
                    break
                run.append(nxt)
                size += nxt.head + nxt.payload
            yield from self._read_run(
                run, keys[i : i + len(run)], out[i : i + len(run)], provenance
            )
            i += len(run)

    def _read_run(
        self, run: list[_Entry], keys: Sequence[str], rows: np.ndarray, provenance: Provenance
    ) -> Iterator[str | None]:
        seg = run[0].segment
        heads = [bytearray(e.head) for e in run]
        iov: list[Any] = []
        end = run[0].page
        for e, head, row in zip(run, heads, rows, strict=True):
            if e.page > end:
                iov.append(bytearray(e.page - end))  # the next record's frame and key
            iov += [head, memoryview(row).cast("B")]
            end = e.page + e.head + e.payload
        if self._gone(seg):
            yield "miss"
            return
        try:
            got = os.preadv(seg.fd, iov, run[0].page)
        except OSError:
            got = 0
        seg.used = time.time()
        for e, key, head, row in zip(run, keys, heads, rows, strict=True):
            mine = min(max(got - (e.page - run[0].page), 0), e.head + e.payload)
            refused = check_read(head, row, mine, provenance, key, self.auth, e.payload)
            yield refused
            if refused is not None:
                return

    def _gone(self, seg: Segment) -> bool:
        """Whether ``seg``'s file was removed (another node's eviction, a clear):
        it is forgotten and its descriptor closed, so its disk is freed, and its
        pages are misses — as for a rank that opens the store itself."""
        try:
            if os.fstat(seg.fd).st_nlink > 0:
                return False
        except OSError:
            pass
        with self._lock:
            if self._segments.get(seg.name) is seg and seg not in self._busy:
                self._forget(seg)
        return True

    def _odd_length(self, entry: _Entry, key: str, want: int, provenance: Provenance) -> str:
        head = os.pread(entry.segment.fd, entry.head, entry.page)
        if len(head) != entry.head:
            return "truncated"
        row = memoryview(bytearray(want))  # (not read: the record is not a page long)
        return check_read(head, row, 0, provenance, key, self.auth, entry.payload) or "truncated"

    def _read(self, key: str) -> bytes | None:
        entry = self._locate(key)
        if entry is None:
            return None
        return os.pread(entry.segment.fd, entry.head + entry.payload, entry.page)

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:  # pragma: no cover
        raise NotImplementedError("SegmentBackend.set appends whole batches")

    # -- the rest ---------------------------------------------------------------------

    def _clear(self) -> None:
        with self._lock:
            self._quiesce()
            for seg in list(self._segments.values()):
                self._forget(seg)
            self._index.clear()
            self._bytes = 0
            for entry in os.scandir(self._root_fd):  # also segments other writers made
                if entry.name.startswith("seg-") and entry.name.endswith(_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=self._root_fd)

    def _reap(self) -> None:
        """Close the segments someone else removed (at most every ``REAP_S``; any
        read, write, lookup of where pages lie or usage query checks): no removed
        segment's disk stays held here past that."""
        now = time.monotonic()
        if now - self._reaped < REAP_S:
            return
        self._reaped = now
        for seg in list(self._segments.values()):
            self._gone(seg)
        with self._lock:
            self._remove_dead()

    def _usage(self) -> dict[str, Any]:
        self._reap()
        with self._lock:
            return {
                "pages": len(self._index),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                "files": len(self._segments),
            }

    def page_keys(self) -> list[str]:
        """Every key the directory holds now, other writers' pages included."""
        with self._lock:
            self._rescan()
            return list(self._index)

    def close(self) -> None:
        with self._lock:
            self._quiesce()
            fds = [s.fd for s in self._segments.values()]
            self._segments.clear()
            self._index.clear()
            self._appending.clear()
        for fd in [*fds, self._root_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)
