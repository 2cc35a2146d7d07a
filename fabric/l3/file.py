"""The default L3: one file per page shard in a directory (local disk or NFS).

``<dir>/<first two hex digits>/<key>.kv``. Every file and directory is created
owner-only (``file_mode`` / ``dir_mode``, 0600 / 0700 by default, whatever the
umask): a tenant's KV is nobody else's to read. Nothing below the configured
directory is reached through a symbolic link — each subdirectory is opened once
without following links and every file is opened relative to it with
``O_NOFOLLOW`` — so a link planted in the store is a counted refusal, never a
way to serve or overwrite another file. Writes go to a temporary file in the
same directory and are renamed into place (atomic on POSIX, also over NFS);
``fsync`` is optional; temporary files left by a crashed writer are swept when
the store opens. With ``max_bytes`` set, the least recently used pages go first
when the directory outgrows it (recency is this process's view, seeded from
modification times when the store opens).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fabric.errors import ConfigError
from fabric.l3.backend import L3Backend, Location
from fabric.l3.format import (
    PREAMBLE,
    Provenance,
    check_key,
    check_read,
    header_length,
)
from fabric.l3.manifest import Manifest
from fabric.l3.options import FileOptions
from fabric.l3.safe_open import open_regular

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP = ".tmp"
# A temporary file this old is a crashed writer's, not one in progress elsewhere.
STALE_TMP_S = 60.0
_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


def open_store_dir(root: Path, dir_mode: int) -> tuple[int, OSError | None]:
    """A descriptor of the store's directory, made if missing, and why it takes no
    writes (a probe file is created and removed): ``None`` when it does, the error
    of a read-only file system (its pages are served, nothing is stored until it
    is writable again). Any other failure is a ``ConfigError`` naming the path."""
    where = f"storage path {str(root)!r}"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=dir_mode)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be used: {exc.strerror or exc}; set storage.path to a "
            "writable directory (or storage.backend=none)"
        ) from None
    probe = f".probe-{uuid.uuid4().hex}{_TMP}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return fd, exc
        os.close(fd)
        raise ConfigError(f"{where} is not writable: {exc.strerror or exc}") from None
    return fd, None


class FileBackend(L3Backend):
    name = "file"

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        options = FileOptions.parse(extra, "file")
        self.root = Path(options.path).expanduser().resolve()
        self.max_bytes = options.max_bytes
        self.fsync = options.fsync
        self.file_mode = int(options.file_mode, 8)
        self.dir_mode = int(options.dir_mode, 8)
        self._root_fd, read_only = open_store_dir(self.root, self.dir_mode)
        if read_only is not None:
            self.write_failed(read_only, 0)
        self.manifest = Manifest(self.root, self.file_mode, self.dir_mode)
        self._index_lock = threading.Lock()
        self._dirs: dict[str, int] = {}
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._load_index()

    def _load_index(self) -> None:
        entries, now = [], time.time()
        for entry in os.scandir(self._root_fd):
            if len(entry.name) != 2 or not entry.is_dir(follow_symlinks=False):
                continue
            fd = self._dir(entry.name, create=False)
            if fd is None:
                continue
            for item in os.scandir(fd):
                st = item.stat(follow_symlinks=False)
                if item.name.endswith(_TMP):
                    if now - st.st_mtime > STALE_TMP_S:
                        self._unlink(fd, item.name)
                        self.count("swept_temp_files")
                elif item.name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode):
                    entries.append((st.st_mtime, item.name[: -len(_SUFFIX)], st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._bytes += size

    def keep_only(self, owns: Callable[[str], bool]) -> None:
        with self._index_lock:
            for key in [k for k in self._index if not owns(k)]:
                self._bytes -= self._index.pop(key)

    def _dir(self, prefix: str, create: bool) -> int | None:
        """The open subdirectory for keys starting ``prefix``; ``None`` when it is
        missing (and not to be created) or is not a real directory."""
        fd = self._dirs.get(prefix)
        if fd is not None:
            return fd
        with self._index_lock:
            fd = self._dirs.get(prefix)
            if fd is not None:
                return fd
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(prefix, self.dir_mode, dir_fd=self._root_fd)
            try:
                fd = os.open(prefix, _DIR, dir_fd=self._root_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    self.count("refused_symlink")
                    log.warning("L3: %s/%s is not a directory; ignored", self.root, prefix)
                return None
            self._dirs[prefix] = fd
            return fd

    @staticmethod
    def _unlink(dir_fd: int, name: str) -> None:
        # Gone already, or a store turned read-only: nothing to do here.
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)

    def _read(self, key: str) -> bytes | None:
        fd = self._open(key)
        if not isinstance(fd, int):
            if fd != "miss":
                self.count(f"refused_{fd}")
            return None
        with open(fd, "rb") as f:
            data = f.read()
        self._touch(key)
        return data

    def _open(self, key: str) -> int | str:
        """A read descriptor of ``key``'s file, or why not: ``miss``, ``symlink``,
        ``not_regular`` (never blocks: ``fabric.l3.safe_open``)."""
        dir_fd = self._dir(key[:2], create=False)
        if dir_fd is None:
            return "miss"
        return open_regular(f"{key}{_SUFFIX}", dir_fd)

    def _read_into(self, key: str, row: np.ndarray, provenance: Provenance) -> str | None:
        # The payload goes from the file straight into the caller's row: no copy.
        fd = self._open(key)
        if not isinstance(fd, int):
            return fd
        with open(fd, "rb") as f:
            preamble = f.read(PREAMBLE)
            n = header_length(preamble)
            if isinstance(n, str):
                return n
            head = preamble + f.read(n)
            if len(head) != PREAMBLE + n:
                return "truncated"
            got = len(head) + (f.readinto(memoryview(row).cast("B")) or 0) + len(f.read(1))
        refused = check_read(head, row, got, provenance, key, self.auth)
        if refused is not None:
            return refused
        self._touch(key)
        return None

    def _touch(self, key: str) -> None:
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)

    def _exists(self, key: str) -> bool:
        dir_fd = self._dir(key[:2], create=False)
        if dir_fd is None:
            return False
        try:
            st = os.stat(f"{key}{_SUFFIX}", dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if stat.S_ISLNK(st.st_mode):
            self.count("refused_symlink")
        return stat.S_ISREG(st.st_mode)

    def locate(self, keys: Sequence[str]) -> list[Location]:
        out = []
        for key in keys:
            if not self._exists(check_key(key)):
                break
            self._touch(key)
            out.append(Location(f"{key[:2]}/{key}{_SUFFIX}", 0, 0, 0))
        return out

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        dir_fd = self._dir(key[:2], create=True)
        if dir_fd is None:
            raise OSError(errno.ENOTDIR, f"{key[:2]} is not a directory")
        tmp = f".{key}.{uuid.uuid4().hex}{_TMP}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(tmp, flags, self.file_mode, dir_fd=dir_fd)
        try:
            os.fchmod(fd, self.file_mode)  # exactly the mode asked for, whatever the umask
            with open(fd, "wb", closefd=True) as f:
                for part in parts:
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, f"{key}{_SUFFIX}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            if self.fsync:
                os.fsync(dir_fd)
        except OSError:
            self._unlink(dir_fd, tmp)
            raise
        self._account(key, sum(len(p) for p in parts))

    def _account(self, key: str, size: int) -> None:
        victims = []
        self.note_stored(key)
        with self._index_lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
            while self.max_bytes and self._bytes > self.max_bytes and len(self._index) > 1:
                old, old_size = self._index.popitem(last=False)
                self._bytes -= old_size
                victims.append(old)
        self.note_removed(victims)
        for old in victims:
            dir_fd = self._dir(old[:2], create=False)
            if dir_fd is not None:
                self._unlink(dir_fd, f"{old}{_SUFFIX}")
            self.count("evicted_pages")

    def delete(self, keys: Sequence[str]) -> int:
        """Remove the files of ``keys``; how many there were."""
        gone = 0
        for key in keys:
            check_key(key)
            with self._index_lock:
                self._bytes -= self._index.pop(key, 0)
            dir_fd = self._dir(key[:2], create=False)
            if dir_fd is None:
                continue
            try:
                os.unlink(f"{key}{_SUFFIX}", dir_fd=dir_fd)
                gone += 1
            except FileNotFoundError:
                pass
        self.count("deleted_pages", gone)
        return gone

    def _clear(self) -> None:
        with self._index_lock:
            self._index.clear()
            self._bytes = 0
        for entry in os.scandir(self._root_fd):  # also directories other writers made
            dir_fd = self._dir(entry.name, create=False) if len(entry.name) == 2 else None
            for item in os.scandir(dir_fd) if dir_fd is not None else ():
                if item.name.endswith(_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):  # read-only: raised
                        os.unlink(item.name, dir_fd=dir_fd)

    def _usage(self) -> dict[str, Any]:
        with self._index_lock:
            return {"pages": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}

    def page_keys(self) -> list[str]:
        """Every key the directory holds now, other writers' pages included."""
        keys = []
        for entry in os.scandir(self._root_fd):
            dir_fd = self._dir(entry.name, create=False) if len(entry.name) == 2 else None
            for item in os.scandir(dir_fd) if dir_fd is not None else ():
                if item.name.endswith(_SUFFIX) and item.is_file(follow_symlinks=False):
                    keys.append(item.name[: -len(_SUFFIX)])
        return keys

    def close(self) -> None:
        with self._index_lock:
            fds, self._dirs = list(self._dirs.values()), {}
        for fd in [*fds, self._root_fd]:
            os.close(fd)
