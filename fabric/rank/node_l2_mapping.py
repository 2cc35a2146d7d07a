"""A node L2 region's file as a process maps it (``fabric.rank.node_l2``): its
layout, one mapping per file and process shared by every ``NodeL2`` on it (so
two engines in one process share its set locks), the geometry header, and
emptying it without ever moving a slot's ``seq`` back.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
import threading
from pathlib import Path

import msgpack
import torch

from fabric.rank.shared_l2 import SUFFIX

MAGIC = b"KVFEL2v2"
HEADER = 4096
# seq, stamp (ms), pinned until (ms), CRC-32 of the page, key digest
RECORD = struct.Struct("<QQQI16s4x")
SEQ = struct.Struct("<Q")
STAMP = struct.Struct("<Q")  # at 8: stamp; at 16: pinned until


class Mapping:
    """One region file as this process maps it: every ``NodeL2`` of the process on
    the same file shares it (its descriptor, its mapping and its set locks), so
    two engines in one process never interleave a record, and one closing never
    drops the other's byte-range locks (POSIX drops them at any close)."""

    def __init__(self, path: Path, fd: int, geometry: dict) -> None:
        self.path, self.fd, self.geometry = path, fd, geometry
        self.slots, self.ways = geometry["slots"], geometry["ways"]
        self.page_bytes = geometry["page_bytes"]
        self.pool_at = pool_at(self.slots)
        self.mm = mmap.mmap(fd, self.pool_at + self.slots * self.page_bytes)
        self.view = memoryview(self.mm)
        self.pool = torch.frombuffer(
            self.mm, dtype=torch.uint8, offset=self.pool_at, count=self.slots * self.page_bytes
        ).view(self.slots, self.page_bytes)
        self.locks = [threading.Lock() for _ in range(64)]
        self.users = 1


MAPPED: dict[tuple[int, int], Mapping] = {}
MAPPED_LOCK = threading.Lock()
# Held while a region is attached, detached or swept, so that no thread of the
# process opens (and closes) a descriptor of a file another maps in between.
ATTACH_LOCK = threading.RLock()


def pool_at(slots: int) -> int:
    return -(-(HEADER + slots * RECORD.size) // mmap.PAGESIZE) * mmap.PAGESIZE


def same(found: dict, want: dict) -> bool:
    return all(found.get(k) == want[k] for k in want if k != "slots")


def geometry(fd: int) -> dict | None:
    """The file's geometry, or ``None`` when it has none that holds together."""
    head = os.pread(fd, HEADER, 0)
    size = int.from_bytes(head[:4], "little")
    if len(head) < 4 + size or size > HEADER - 4 or head[4:12] != MAGIC:
        return None
    try:
        found = msgpack.unpackb(head[12 : 4 + size])
    except Exception:
        return None
    if not isinstance(found, dict):
        return None
    slots, ways, page = found.get("slots"), found.get("ways"), found.get("page_bytes")
    if not all(isinstance(v, int) and v > 0 for v in (slots, ways, page)) or slots % ways:
        return None
    if os.fstat(fd).st_size != pool_at(slots) + slots * page:
        return None
    return found


def empty(fd: int, geometry: dict) -> None:
    """Empty every slot, set by set under its lock; each slot's ``seq`` moves on
    (never back), so no reader's (slot, seq) matches again."""
    slots, ways = geometry["slots"], geometry["ways"]
    for first in range(0, slots, ways):
        start, length = HEADER + first * RECORD.size, ways * RECORD.size
        fcntl.lockf(fd, fcntl.LOCK_EX, length, start)
        try:
            records = bytearray(os.pread(fd, length, start))
            for i in range(ways):
                seq = SEQ.unpack_from(records, i * RECORD.size)[0]
                RECORD.pack_into(records, i * RECORD.size, (seq | 1) + 1, 0, 0, 0, bytes(16))
            os.pwrite(fd, bytes(records), start)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, length, start)


# -- names -----------------------------------------------------------------------------

PREFIX = "kvfabric-engine-"


def digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def fabric_identity(name: str, ray_namespace: str) -> str:
    """What names a fabric's regions: engines of two fabrics never share one."""
    return f"{name}|{ray_namespace}"


def part(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def owner_prefix() -> str:
    return f"{PREFIX}{os.getuid()}-"


def region_name(identity: str, layout: str, suffix: str) -> str:
    """The file name of one engine shard's region: this user's, for the fabric
    ``identity``, pages of ``layout`` (the rank's page identity) and shard ``suffix``."""
    return f"{owner_prefix()}{part(identity)}-{part(layout)}-{suffix}{SUFFIX}"


def mapped_files() -> set[tuple[int, int]]:
    """The region files this process maps (device, inode): never opened to sweep."""
    with MAPPED_LOCK:
        return set(MAPPED)


def remove_regions(directory: Path, identity: str) -> int:
    """Remove this user's regions of the fabric ``identity`` in ``directory`` that no
    engine uses (the fabric is shutting down); how many. A region an engine still
    has open stays (its last user removes it)."""
    from fabric.rank.shared_l2 import sweep_stale

    prefix = f"{owner_prefix()}{part(identity)}-"
    with ATTACH_LOCK:
        return sweep_stale(directory, prefix, older_s=0.0, keep=mapped_files())
