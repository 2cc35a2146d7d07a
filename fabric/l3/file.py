"""The default L3: one file per page shard in a directory (local disk or NFS).

``<dir>/<first two hex digits>/<key>.kv``. Writes go to a temporary file in the
same directory and are renamed into place (atomic on POSIX, also over NFS);
``fsync`` is optional. With ``max_bytes`` set, the least recently used pages go
first when the directory outgrows it (recency is this process's view, seeded
from file modification times at start-up).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fabric.l3.backend import L3Backend
from fabric.l3.codec import PREAMBLE, Provenance, check_header, checksum, header_length

_SUFFIX = ".kv"


class FileBackend(L3Backend):
    name = "file"

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        self.root = Path(extra.get("path", "kvfabric-l3")).resolve()
        self.max_bytes = int(extra.get("max_bytes", 0))
        self.fsync = bool(extra.get("fsync", False))
        self.root.mkdir(parents=True, exist_ok=True)
        self._index_lock = threading.Lock()
        self._dirs: set[str] = set()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        entries = []
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, path.name[: -len(_SUFFIX)], st.st_size))
        for _, key, size in sorted(entries):
            self._index[key] = size
            self._bytes += size

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def _read(self, key: str) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except OSError:
            return None
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)
        return data

    def _read_into(self, key: str, row: np.ndarray) -> str | None:
        # The payload goes from the file straight into the caller's row: no copy.
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except OSError:
            return "miss"
        with f:
            n = header_length(f.read(PREAMBLE))
            if isinstance(n, str):
                return n
            raw = f.read(n)
            if len(raw) != n:
                return "truncated"
            header = check_header(raw, self.provenance, self.page_bytes)
            if isinstance(header, str):
                return header
            if f.readinto(memoryview(row).cast("B")) != self.page_bytes or f.read(1):
                return "truncated"
        if header.get("sum") != checksum(row):
            return "checksum"
        with self._index_lock:
            if key in self._index:
                self._index.move_to_end(key)
        return None

    def _exists(self, key: str) -> bool:
        return self._path(key).exists()

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        path = self._path(key)
        if key[:2] not in self._dirs:
            path.parent.mkdir(exist_ok=True)
            self._dirs.add(key[:2])
        tmp = path.parent / f".{key}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if self.fsync:
                dir_fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._account(key, sum(len(p) for p in parts))

    def _account(self, key: str, size: int) -> None:
        victims = []
        with self._index_lock:
            self._bytes += size - self._index.pop(key, 0)
            self._index[key] = size
            while self.max_bytes and self._bytes > self.max_bytes and len(self._index) > 1:
                old, old_size = self._index.popitem(last=False)
                self._bytes -= old_size
                victims.append(old)
        for old in victims:
            self._path(old).unlink(missing_ok=True)
            self.count("evicted_pages")

    def _clear(self) -> None:
        with self._index_lock:
            keys = list(self._index)
            self._index.clear()
            self._bytes = 0
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        for path in self.root.glob(f"??/*{_SUFFIX}"):
            path.unlink(missing_ok=True)
        self._dirs.clear()

    def _usage(self) -> dict[str, Any]:
        with self._index_lock:
            return {"pages": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}
