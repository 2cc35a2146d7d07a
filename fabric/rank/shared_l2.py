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
namespace length | parent hash | tokens | namespace``. Names keep their
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
and locked shared while a process uses it; ``sweep_stale`` removes files no
process has locked for an hour (a fabric that died without shutting down).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import struct
import time
import zlib
from pathlib import Path

import msgpack

from fabric.cache.keys import chain_hashes
from fabric.rank.index import PageName

MAGIC = b"KVFL2v1\0"
HEADER = 4096
MAX_NAMESPACE = 256
_FIXED = struct.Struct("<BIH32s")  # valid, CRC-32 of the rest, namespace length, parent
SUFFIX = ".l2"
STALE_S = 3600.0


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
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{self.path} is not a regular file of this user")
            fcntl.flock(fd, fcntl.LOCK_SH)
            framed = len(head).to_bytes(4, "little") + head
            self.reattached = st.st_size == size and os.pread(fd, len(framed), 0) == framed
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
        crc = zlib.crc32(len(ns).to_bytes(2, "little") + parent + tokens + ns)
        self.view[at] = 0
        self.view[end : end + tb] = tokens
        self.view[end + tb : end + tb + len(ns)] = ns
        self.view[at : at + _FIXED.size] = _FIXED.pack(0, crc, len(ns), parent)
        self.view[at] = 1

    def names(self) -> dict[int, PageName]:
        """Every slot with a whole, valid record: its name (chain hash recomputed)."""
        out = {}
        for slot in range(self.slots):
            at = self._at(slot)
            valid, crc, ns_len, parent = _FIXED.unpack_from(self.view, at)
            if valid != 1 or ns_len > MAX_NAMESPACE:
                continue
            end = at + _FIXED.size
            tokens = bytes(self.view[end : end + self.token_bytes])
            ns = bytes(self.view[end + self.token_bytes : end + self.token_bytes + ns_len])
            if zlib.crc32(ns_len.to_bytes(2, "little") + parent + tokens + ns) != crc:
                continue  # torn or damaged: not adopted
            try:
                namespace = ns.decode("utf-8")
            except UnicodeDecodeError:
                continue
            chain = chain_hashes(parent, tokens, self.token_bytes)[0]
            out[slot] = PageName(namespace, chain, parent, tokens)
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


def sweep_stale(directory: Path, prefix: str = "kvfabric-", older_s: float = STALE_S) -> int:
    """Remove shared L2 files that no process has open (no lock) and that were not
    touched for ``older_s`` seconds: fabrics that died without shutting down."""
    removed = 0
    now = time.time()
    for path in directory.glob(f"{prefix}*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < older_s:
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
