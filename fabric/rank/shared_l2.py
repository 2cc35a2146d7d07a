"""A rank's L2 outside its process: the pool's bytes and its slots' names in one
file of the node's shared memory (``/dev/shm``), which outlives the process.

A rank that dies (SIGKILL, a crash, ``ray.kill``) and is started again on the
same node opens the same file and finds its L2 as it was: the restarted
coordinator's adoption (``CoordinatorCore.adopt``) then takes back every page
all ranks still name alike, as after its own restart, instead of every rank's
L2 being dropped because one rank's was. A rank started on another node finds
no file and starts empty, as before.

Layout: a header (magic, then the msgpack geometry: pool shape and dtype, page
size, slots — a file of another geometry is not reused), one fixed record per
L2 slot, then the pool's bytes (page aligned). A record is ``valid | CRC-32 |
page CRC-32 | namespace length | parent hash | tokens | namespace``: the page's
own checksum over its bytes in the pool (its K and V, every layer, wherever the
layout puts them), taken when the slot is named. Adoption checks every named
page against it, and the rank checks the pages it backs up to L3 and a sample
of those it loads into L1 (``verify``): any process of the node's user can
write the file, so a page changed behind the rank is dropped — never served,
never copied into L3 under a fresh checksum. Names keep their
discipline (``fabric.rank.index``): a slot's record is cleared before anything
writes the slot and written — fields first, ``valid`` last — once the write
finished, so a process killed mid-copy leaves that slot unnamed, and a record
killed mid-write fails its CRC: either way the slot is not adopted. The chain
hash is recomputed from parent and tokens when read, and adoption checks it
again against every other rank's name.

Why a file in ``/dev/shm`` rather than Ray's object store: an object is
immutable and owned by the process that put it (its owner's death loses it);
a shared-memory file is mutable in place — copies go straight into it — and
belongs to the node. The file is owner-only, opened without following links,
and locked shared while a process uses it; one of another owner is refused (L2
stays in the process), one whose mode lets others in is repaired to 0600 and
started empty (anyone may have written it), with one log line; ``sweep_stale`` removes files no
process has locked for an hour (a fabric that died without shutting down).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import stat
import struct
import time
import zlib
from collections.abc import Collection
from pathlib import Path

import msgpack

from fabric.cache.keys import chain_hashes
from fabric.l3.format import checksum
from fabric.rank.index import PageName

log = logging.getLogger(__name__)

MAGIC = b"KVFL2v2\0"
HEADER = 4096
MAX_NAMESPACE = 256
# valid, CRC-32 of the rest, the page's CRC-32, namespace length, parent
_FIXED = struct.Struct("<BIIH32s")
SUFFIX = ".l2"
# Of the pages a rank loads from L2 into L1, every this many is checked against
# its checksum (every page backed up to L3 is; a restarted rank checks every page
# it adopts). The cost: bench/shared_l2_checks.py.
L2_CHECK_EVERY = 8


class CorruptL2(RuntimeError):
    """A shared L2 page changed outside the rank (it fails its checksum)."""


STALE_S = 3600.0


def owned(fd: int, path: Path) -> os.stat_result:
    """``fd``'s stat when it is a regular file of this user; ``PermissionError``
    (naming its owner and mode) otherwise."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} is not a regular file of this user (uid {st.st_uid}, "
            f"mode {stat.filemode(st.st_mode)}): refused"
        )
    return st


def shm_dir() -> Path | None:
    """The node's shared memory, where there is one (Linux)."""
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else None


class SharedL2:
    def __init__(self, path: str | os.PathLike, geometry: dict, slots: int, token_bytes: int):
        """Open (or make) the file at ``path`` for ``slots`` L2 pages of
        ``geometry["pool_bytes"]`` bytes in all, ``token_bytes`` of tokens a page."""
        self.path = Path(path)
        self.slots, self.token_bytes = slots, token_bytes
        self.record = -(-(_FIXED.size + token_bytes + MAX_NAMESPACE) // 8) * 8
        head = MAGIC + msgpack.packb(
            {**geometry, "slots": slots, "token_bytes": token_bytes}, use_bin_type=True
        )
        if len(head) + 4 > HEADER:
            raise ValueError(f"shared L2 geometry too large ({len(head)} bytes)")
        self.names_at = HEADER
        self.pool_at = -(-(HEADER + slots * self.record) // mmap.PAGESIZE) * mmap.PAGESIZE
        size = self.pool_at + int(geometry["pool_bytes"])
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            st = owned(fd, self.path)
            exposed = st.st_mode & 0o077
            if exposed:
                os.fchmod(fd, 0o600)
                log.warning(
                    "shared L2 %s had mode %s (others could write it): repaired to 0600 "
                    "and started empty", self.path, stat.filemode(st.st_mode),
                )  # fmt: skip
            fcntl.flock(fd, fcntl.LOCK_SH)
            framed = len(head).to_bytes(4, "little") + head
            self.reattached = (
                not exposed and st.st_size == size and os.pread(fd, len(framed), 0) == framed
            )
            if not self.reattached:  # new, or of another geometry: start empty
                os.ftruncate(fd, 0)
                # Reserve every page now: a shared memory too small fails here
                # (ENOSPC), not later as a SIGBUS on a page first touched.
                os.posix_fallocate(fd, 0, size)
                os.pwrite(fd, framed, 0)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if not getattr(self, "reattached", True):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)  # a half-made file is no one's
            os.close(fd)
            raise
        self.fd = fd
        self.view = memoryview(self.mm)
        self._spans = _page_spans(geometry, slots)
        self.corrupt_pages = 0  # named pages whose bytes failed their checksum
        self.bad: set[int] = set()  # slots found corrupt since they were last named
        self._reads = 0  # pages ``check`` was asked about (its sample's clock)

    def page_crc(self, slot: int) -> int:
        """The CRC-32 of slot ``slot``'s bytes in the pool, as they are now."""
        crc, pool = 0, self.pool_at
        for offset, length in self._spans(slot):
            crc = checksum(self.view[pool + offset : pool + offset + length], crc)
        return crc

    def verify(self, slot: int) -> bool:
        """Whether the page named in slot ``slot`` still has the bytes it was named
        with (an unnamed slot has none to check: ``True``)."""
        at = self._at(slot)
        valid, _, page_crc, _, _ = _FIXED.unpack_from(self.view, at)
        if valid != 1 or self.page_crc(slot) == page_crc:
            return True
        self.corrupt_pages += 1
        self.bad.add(slot)
        return False

    def refuse_corrupt(self, slots: list[int], every: int, forget, rank: object) -> None:
        """Raise ``CorruptL2`` (the command fails: the coordinator recomputes) when a
        page about to be read is corrupt (``check``); ``forget`` drops the bad
        slots' names first, so they are never adopted either."""
        bad = self.check(slots, every)
        if bad:
            forget(bad)
            raise CorruptL2(
                f"rank {rank}: shared L2 pages in slots {sorted(set(bad))[:8]} failed "
                f"their checksum (changed outside the rank); dropped"
            )

    def check(self, slots: list[int], every: int = 1) -> list[int]:
        """The slots among ``slots`` about to be read that hold a corrupt page: any
        found corrupt before, and those of a sample (every ``every``-th page asked
        about, 1: all) whose bytes fail their checksum now."""
        bad = [s for s in slots if s in self.bad]
        for slot in slots:
            self._reads += 1
            if self._reads % every == 0 and slot not in self.bad and not self.verify(slot):
                bad.append(slot)
        return bad

    @property
    def pool(self) -> memoryview:
        """The pool's bytes (a ``KVPool`` is a tensor over them)."""
        return self.view[self.pool_at :]

    def _at(self, slot: int) -> int:
        return self.names_at + slot * self.record

    def drop(self, slot: int) -> None:
        """Slot ``slot`` holds no named page (cleared before anything writes it)."""
        self.view[self._at(slot)] = 0

    def put(self, slot: int, namespace: str, parent: bytes, tokens: bytes) -> None:
        """Name slot ``slot`` (its bytes are written): fields first, ``valid`` last."""
        ns = namespace.encode("utf-8")
        if len(ns) > MAX_NAMESPACE or len(tokens) != self.token_bytes or len(parent) != 32:
            self.drop(slot)  # not representable: the slot is simply not kept
            return
        at = self._at(slot)
        end, tb = at + _FIXED.size, self.token_bytes
        self.view[at] = 0
        self.bad.discard(slot)  # written anew
        page_crc = self.page_crc(slot)
        crc = zlib.crc32(_signed(page_crc, len(ns), parent) + tokens + ns)
        self.view[end : end + tb] = tokens
        self.view[end + tb : end + tb + len(ns)] = ns
        self.view[at : at + _FIXED.size] = _FIXED.pack(0, crc, page_crc, len(ns), parent)
        self.view[at] = 1

    def names(self) -> dict[int, PageName]:
        """Every slot with a whole, valid record and a page whose bytes match its
        checksum: its name (chain hash recomputed). A page that fails is unnamed
        (counted in ``corrupt_pages``, logged once)."""
        out = {}
        for slot in range(self.slots):
            at = self._at(slot)
            valid, crc, page_crc, ns_len, parent = _FIXED.unpack_from(self.view, at)
            if valid != 1 or ns_len > MAX_NAMESPACE:
                continue
            end = at + _FIXED.size
            tokens = bytes(self.view[end : end + self.token_bytes])
            ns = bytes(self.view[end + self.token_bytes : end + self.token_bytes + ns_len])
            if zlib.crc32(_signed(page_crc, ns_len, parent) + tokens + ns) != crc:
                continue  # torn or damaged: not adopted
            if not self.verify(slot):
                self.drop(slot)
                continue
            try:
                namespace = ns.decode("utf-8")
            except UnicodeDecodeError:
                continue
            chain = chain_hashes(parent, tokens, self.token_bytes)[0]
            out[slot] = PageName(namespace, chain, parent, tokens)
        if self.corrupt_pages:
            log.warning(
                "shared L2 %s: %d named pages failed their checksum; dropped (recomputed)",
                self.path, self.corrupt_pages,
            )  # fmt: skip
        return out

    def close(self, unlink: bool = False) -> None:
        """Stop using the file; with ``unlink``, remove it (the fabric is shutting
        down: nothing will come back for it). Tensors over the pool keep the
        mapping alive until they go."""
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(BufferError, ValueError):  # a tensor still uses it
            self.view.release()
            self.mm.close()  # the lock goes with the last reference to the file


def _signed(page_crc: int, ns_len: int, parent: bytes) -> bytes:
    """The fixed fields a record's CRC covers besides its tokens and namespace."""
    return page_crc.to_bytes(4, "little") + ns_len.to_bytes(2, "little") + parent


def _page_spans(geometry: dict, slots: int):
    """``spans(slot)``: the (offset, length) byte ranges of a page in the pool, in
    the pool's layout (K and V apart; every layer apart when layers come first);
    a geometry without a layout holds its pages one after another."""
    pool_bytes = int(geometry["pool_bytes"])
    shape = [int(n) for n in geometry.get("shape", [])]
    layout = geometry.get("layout")
    if not shape or layout not in ("page_first_direct", "page_first", "layer_first"):
        size = pool_bytes // max(slots, 1)
        return lambda slot: [(slot * size, size)]
    item = pool_bytes // math.prod(shape)
    if layout == "page_first_direct":  # (2, pages, layers, page tokens, heads, dim)
        page = math.prod(shape[2:]) * item
        return lambda slot: [((kv * slots + slot) * page, page) for kv in (0, 1)]
    if layout == "page_first":  # (2, pages * page tokens, layers, heads, dim)
        tokens = shape[1] // slots
        row = math.prod(shape[2:]) * item
        return lambda slot: [((kv * shape[1] + slot * tokens) * row, tokens * row) for kv in (0, 1)]
    tokens, row = shape[2] // slots, math.prod(shape[3:]) * item  # layer_first
    layers = shape[1]
    return lambda slot: [
        (((kv * layers + layer) * shape[2] + slot * tokens) * row, tokens * row)
        for kv in (0, 1)
        for layer in range(layers)
    ]


def sweep_stale(
    directory: Path,
    prefix: str = "kvfabric-",
    older_s: float = STALE_S,
    keep: Collection[tuple[int, int]] = (),
) -> int:
    """Remove this user's shared L2 files that no process has open (no lock) and
    that were not touched for ``older_s`` seconds: fabrics that died without
    shutting down (with ``older_s`` 0: every one no process uses). Files in
    ``keep`` (device, inode: the caller's own) are not even opened."""
    removed = 0
    now = time.time()
    for path in directory.glob(f"{prefix}*{SUFFIX}"):
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in keep:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.getuid()
                or now - st.st_mtime < older_s
            ):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live rank holds it
            path.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    return removed
