"""What a storage actor does, without Ray: own the L3 backend, answer hit queries
for every shard at once (MIN over shards), and load or store page batches for
one rank's shard. Bulk bytes are numpy arrays, which Ray's object store moves
without copies; the coordinator never sees them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fabric.config import FabricConfig, StorageConfig
from fabric.errors import ConfigError
from fabric.l3 import make_backend
from fabric.l3.backend import L3Backend
from fabric.l3.format import Provenance, page_key
from fabric.topology import Topology

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def page_geometry(config: FabricConfig) -> tuple[tuple[int, ...], int]:
    """Every shard's page shape ``(2, page_tokens, layers, heads, head_dim)`` and bytes."""
    topo, model = config.topology, config.model
    shape = (
        2,
        config.cache.page_size // topo.cp,
        model.layers // topo.pp,
        model.kv_heads // topo.tp,
        model.head_dim,
    )
    return shape, int(np.prod(shape)) * _ITEMSIZE[model.dtype]


def storage_provenance(config: FabricConfig) -> Provenance:
    """What this fabric's pages are computed for; its ``tag`` is in every page key."""
    shape, _ = page_geometry(config)
    m = config.model
    return Provenance(m.model_id, m.layout, m.dtype, shape, config.cache.page_size)


def backend_spec(storage: StorageConfig) -> tuple[str, dict[str, Any]]:
    """The backend name and its options from the config. The file backend's come
    from ``storage.path`` and its neighbours, overridden by ``storage.options``."""
    options = dict(storage.options)
    if storage.backend == "file":
        options = {
            "path": storage.path,
            "max_bytes": storage.max_bytes,
            "fsync": storage.fsync,
            "file_mode": storage.file_mode,
            "dir_mode": storage.dir_mode,
            **options,
        }
    return storage.backend, options


class StorageService:
    def __init__(self, config: FabricConfig) -> None:
        self.config = config
        topo = Topology(config.topology)
        self.suffixes = [r.suffix for r in topo.ranks]
        _, self.page_bytes = page_geometry(config)
        self.provenance = storage_provenance(config)
        self.model_tag = self.provenance.tag
        self.allowed_modules = config.storage.allowed_modules()
        self.backend: L3Backend | None = None
        self.spec: tuple[str, dict[str, Any]] | None = None
        self._lock = threading.Lock()
        if config.storage.enabled:
            self.attach(*backend_spec(config.storage))

    def key(self, page_hash: bytes, suffix: str) -> str:
        """The L3 key of one shard of one page of this model."""
        return page_key(page_hash, self.model_tag, suffix)

    def attach(self, name: str, extra: Mapping[str, Any]) -> str:
        """Open a backend. The same one again changes nothing; another one is
        refused until ``detach``."""
        spec = (name, dict(extra))
        with self._lock:
            if self.backend is not None:
                if spec == self.spec:
                    return "already attached"
                raise ConfigError(
                    f"storage backend {self.spec[0]!r} is attached; detach it before attaching {name!r}"  # type: ignore[index]
                )
            self.backend = make_backend(
                name, self.provenance, self.page_bytes, extra, self.allowed_modules
            )
            self.spec = spec
        return "attached"

    def detach(self) -> bool:
        with self._lock:
            backend, self.backend, self.spec = self.backend, None, None
        if backend is None:
            return False
        backend.close()
        return True

    def clear(self) -> bool:
        backend = self.backend
        if backend is None:
            return False
        backend.clear()
        return True

    def query(self, page_hashes: Sequence[bytes], batch_pages: int = 128) -> int:
        """Consecutive pages from the first that every shard holds (MIN over shards),
        asked in batches of ``batch_pages``; 0 with no backend."""
        backend = self.backend
        if backend is None:
            return 0
        best = len(page_hashes)
        for suffix in self.suffixes:
            found = 0
            for start in range(0, best, batch_pages):
                keys = [
                    self.key(h, suffix) for h in page_hashes[start : min(start + batch_pages, best)]
                ]
                n = backend.exists(keys)
                found += n
                if n < len(keys):
                    break
            best = min(best, found)
            if best == 0:
                break
        return best

    def load(self, suffix: str, page_hashes: Sequence[bytes]) -> np.ndarray:
        """Verified payloads of the leading pages found, one row each (maybe fewer
        rows than asked: the first miss or refused page ends the batch)."""
        backend = self.backend
        out = np.empty((len(page_hashes), self.page_bytes), dtype=np.uint8)
        if backend is None:
            return out[:0]
        n = backend.get([self.key(h, suffix) for h in page_hashes], out)
        return out[:n]

    def store(self, suffix: str, page_hashes: Sequence[bytes], pages: np.ndarray) -> bool:
        """Store one rank's shard of a backup; ``True`` only if every page was stored."""
        backend = self.backend
        if backend is None or pages.shape != (len(page_hashes), self.page_bytes):
            return False
        return all(backend.set([self.key(h, suffix) for h in page_hashes], pages))

    def stats(self) -> dict[str, Any]:
        backend = self.backend
        return {"attached": backend is not None, **(backend.stats() if backend else {})}
