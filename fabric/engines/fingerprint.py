"""What a checkpoint's bytes are: a digest of a model (or LoRA adapter) directory
that changes whenever anything in it does, so that two engines share KV pages
only when they run the same weights.

A directory's fingerprint covers each top-level regular file (links followed,
as in a Hugging Face snapshot): its name, size and the SHA-256 of its whole
content. Hashing reads every byte once; the digest of a file is then kept in a
per-user cache (``KVFABRIC_CACHE_DIR``, default ``~/.cache/kvfabric``) under the
file's real path, with the device, inode, size, modification and change times it
had. A later start that finds the same stat reuses it; a file rewritten in place
(new weights at the same path) changes its change time, which no user can set
back, so it is hashed anew. Processes of one engine that fingerprint the same
file at once wait for the first (a lock per file), so it is read once.

Nothing here raises on a cache that cannot be written: the digest is computed
and simply not kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# Files hashed at once past this many bytes in total are announced (the first
# start of a large checkpoint reads it all once).
ANNOUNCE_BYTES = 1 << 30
_CHUNK = 8 << 20


def cache_dir() -> Path:
    return Path(os.environ.get("KVFABRIC_CACHE_DIR") or Path.home() / ".cache" / "kvfabric")


def fingerprint(path: str | os.PathLike) -> str:
    """The fingerprint (64 hex digits) of a checkpoint directory, or of a single
    checkpoint file (GGUF); ``FileNotFoundError`` when ``path`` is neither."""
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(
            (p for p in root.iterdir() if not p.name.startswith(".") and p.is_file()),
            key=lambda p: p.name,
        )
    else:
        raise FileNotFoundError(f"checkpoint {str(path)!r} is neither a directory nor a file")
    total = sum(p.stat().st_size for p in files)
    if total >= ANNOUNCE_BYTES:
        log.info(
            "kvfabric: fingerprinting %s (%d files, %.1f GiB); kept for later starts",
            root, len(files), total / (1 << 30),
        )  # fmt: skip
    outer = hashlib.sha256(b"kvfabric/checkpoint\0")
    for p in files:
        size, digest = file_digest(p)
        outer.update(json.dumps([p.name, size, digest]).encode() + b"\0")
    return outer.hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, SHA-256 hex)`` of one file's content, from the cache when the file
    is unchanged since it was hashed."""
    real = path.resolve()
    st = real.stat()
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"{real} is not a regular file")
    identity = _stat_identity(st)
    entry = cache_dir() / "fingerprints" / hashlib.sha256(str(real).encode()).hexdigest()
    cached = _read_entry(entry, identity)
    if cached is not None:
        return st.st_size, cached
    lock = _lock(entry)
    try:
        cached = _read_entry(entry, identity)  # another process hashed it meanwhile
        if cached is not None:
            return st.st_size, cached
        digest = _sha256(real)
        if identity == _stat_identity(real.stat()):  # unchanged while it was read
            _write_entry(entry, identity, digest)
        return st.st_size, digest
    finally:
        if lock is not None:
            os.close(lock)


def _stat_identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _read_entry(entry: Path, identity: list[int]) -> str | None:
    try:
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("stat") != identity:
        return None
    digest = data.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    return digest


def _write_entry(entry: Path, identity: list[int], digest: str) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"stat": identity, "sha256": digest}, f)
        os.replace(tmp, entry)
    except OSError as exc:
        log.debug("kvfabric: fingerprint cache %s not written: %s", entry, exc)


def _lock(entry: Path) -> int | None:
    """An exclusive lock on ``entry``'s lock file (``None``: no cache to lock)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(f"{entry}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        with contextlib.suppress(OSError):
            os.close(fd)
        return None
    return fd
