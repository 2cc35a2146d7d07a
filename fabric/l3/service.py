"""What a storage actor does, without Ray: own the L3 backend, answer hit queries
for every shard at once (MIN over shards), and load or store page batches for
one rank's shard. Bulk bytes are numpy arrays, which Ray's object store moves
without copies; the coordinator never sees them.

A hybrid model (``fabric.cache.components``) stores its other components as
pages of their own shape and provenance beside the full-attention pages: a
``sliding`` page is a page's KV of the shard's sliding-window layers, under the
page's chain hash; a ``mamba`` page is the shard's states at a page end, under
the chain hash of the page it ends. Each component's provenance (and so the tag
in its keys) names the component and its shard shape, so one never passes for
another and no index is needed to find them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fabric.cache.controller import HitAnswer
from fabric.cache.keys import TOKEN_BYTES, chain_hashes
from fabric.config import FabricConfig, StorageConfig
from fabric.errors import ConfigError
from fabric.l3 import make_backend
from fabric.l3.auth import PageAuth
from fabric.l3.backend import L3Backend, Location
from fabric.l3.format import Provenance, page_key
from fabric.l3.shards import ShardAnswer, ShareQuery, key_owner
from fabric.topology import Shard, Topology, kind_layers

# Bytes per element of the dtypes pages may hold (engines' pages too: vLLM blocks
# are stored as bytes, fp8 KV caches have one byte an element).
_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


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


def component_shape(config: FabricConfig, shard: Shard, component: str) -> tuple[int, ...]:
    """One page's shape on ``shard`` for ``component``: ``(2, page_tokens, layers,
    heads, head_dim)`` over the shard's layers of that kind (every layer's, for
    ``full`` in a full-attention model), or ``(layers, elems)`` float32 mamba
    states (the shard's share of each of its mamba layers' state)."""
    model, topo = config.model, config.topology
    layers = len(kind_layers(shard, model, component))
    if component == "mamba":
        return (layers, model.mamba_elems(topo.tp))
    return (2, shard.page_tokens, layers, model.kv_heads // topo.tp, model.head_dim)


def component_provenances(config: FabricConfig) -> dict[tuple[str, str], Provenance]:
    """The provenance of every ``(component, shard suffix)`` page this fabric stores."""
    topo, m = Topology(config.topology), config.model
    out = {}
    for shard in (topo.shard(i, m, config.cache.page_size) for i in range(topo.world_size)):
        for component in m.components:
            dtype = "float32" if component == "mamba" else m.dtype
            shape = component_shape(config, shard, component)
            out[component, shard.rank.suffix] = Provenance(
                m.model_id, m.layout, dtype, shape, config.cache.page_size, component
            )
    return out


def provenance_bytes(provenance: Provenance) -> int:
    """One page's payload bytes; ``ValueError`` naming a dtype of unknown size."""
    size = _ITEMSIZE.get(provenance.dtype)
    if size is None:
        raise ValueError(
            f"page dtype {provenance.dtype!r} is refused: allowed is one of {sorted(_ITEMSIZE)}"
        )
    return int(np.prod(provenance.shard_shape)) * size


def backend_spec(storage: StorageConfig) -> tuple[str, dict[str, Any]]:
    """The backend name and its options from the config. The file and segment
    backends' come from ``storage.path`` and its neighbours, overridden by
    ``storage.options``."""
    options = dict(storage.options)
    if storage.backend in ("file", "segment"):
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
    def __init__(self, config: FabricConfig, shard: int = 0) -> None:
        """``shard``: which of the ``storage.actors`` storage actors this is (the
        pages it owns, ``fabric.l3.shards``); every one opens the same backend."""
        if not 0 <= shard < config.storage.actors:
            raise ConfigError(
                f"storage shard {shard} is refused: allowed is 0..{config.storage.actors - 1} "
                f"(storage.actors={config.storage.actors})"
            )
        self.config = config
        self.shard, self.shards = shard, config.storage.actors
        topo = Topology(config.topology)
        self.suffixes = [r.suffix for r in topo.ranks]
        _, self.page_bytes = page_geometry(config)
        self.key_page_bytes = config.cache.page_size * TOKEN_BYTES  # a page of packed tokens
        self.provenance = storage_provenance(config)
        self.model_tag = self.provenance.tag
        self.allowed_modules = config.storage.allowed_modules()
        self.shapes = component_provenances(config)
        model = config.model
        self.parts = tuple(c for c in model.components if c != "full")
        # The sliding pages a served end needs before it.
        self.window_pages = model.window_pages(config.cache.page_size)
        self.backend: L3Backend | None = None
        self.spec: tuple[str, dict[str, Any]] | None = None
        # Authenticated pages when a secret is configured (fabric.l3.auth).
        self.auth = (
            PageAuth.from_file(config.storage.auth_key_file)
            if config.storage.auth_key_file
            else None
        )
        self._lock = threading.Lock()
        if config.storage.enabled:
            self.attach(*backend_spec(config.storage))

    def key(self, page_hash: bytes, suffix: str, component: str = "full") -> str:
        """The L3 key of one shard of one page (of ``component``) of this model."""
        return page_key(page_hash, self.shapes[component, suffix].tag, suffix)

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
        if (
            self.shards > 1
            and not self.backend.sees_others
            and getattr(self.backend, "max_bytes", 0)
        ):
            # It counts only its own pages: each actor keeps its share of the cap.
            self.backend.max_bytes = max(1, self.backend.max_bytes // self.shards)  # type: ignore[attr-defined]
        if self.shards > 1 and not self.backend.sees_others:
            shard, shards = self.shard, self.shards
            self.backend.keep_only(lambda key: key_owner(key, shards) == shard)
        self.backend.track_removals = self.config.cache.kv_events
        self.backend.auth = self.auth
        for prov in self.shapes.values():
            self.backend.record_writer(prov, "kvfabric")
        return "attached"

    def detach(self) -> bool:
        with self._lock:
            backend, self.backend, self.spec = self.backend, None, None
        if backend is None:
            return False
        backend.close()
        return True

    def take_removed(self) -> list[bytes]:
        """Chain hashes of this model's pages that left the store since the last
        call (evicted, or deleted by another process) — a page is gone once any
        shard's key is: for the KV events a router indexes L3 by."""
        backend = self.backend
        if backend is None:
            return []
        tags = {self.shapes["full", suffix].tag for suffix in self.suffixes}
        out: dict[bytes, None] = {}
        for key in backend.take_removed():
            page, _, rest = key.partition(".")
            tag = rest.rpartition(".")[0]
            if tag in tags:
                with contextlib.suppress(ValueError):
                    out[bytes.fromhex(page)] = None
        return list(out)

    def clear(self) -> bool:
        backend = self.backend
        if backend is None:
            return False
        backend.clear()
        return True

    def answer(self, prev: bytes, tokens: bytes, batch_pages: int = 128) -> HitAnswer:
        """A coordinator's hit query: the chain hashes of the pages packed in
        ``tokens`` (whole pages, from the chain hash ``prev``) — hashed here, in
        the storage actor's process, so the coordinator does not — and how many
        of them ``query`` finds."""
        hashes = chain_hashes(prev, tokens, self.key_page_bytes)
        return HitAnswer(self.query(hashes, batch_pages), hashes)

    def query(self, page_hashes: Sequence[bytes], batch_pages: int = 128) -> int:
        """Consecutive pages from the first that every shard holds (MIN over shards),
        asked in batches of ``batch_pages``; 0 with no backend. For a hybrid model,
        the deepest of those page ends that every shard can serve with every
        component: the mamba state at the end, and the sliding pages of the window
        before it (those the query's pages reach)."""
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
        if not self.parts:
            return best
        end = best
        while end > 0 and not self._parts_at(backend, page_hashes, end):
            end -= 1
        return end

    def hashes(self, prev: bytes, tokens: bytes) -> list[bytes]:
        """The chain hashes of the whole pages packed in ``tokens``, from ``prev``."""
        return chain_hashes(prev, tokens, self.key_page_bytes)

    def held(self, items: Sequence[ShareQuery], batch_pages: int = 128) -> dict[int, ShardAnswer]:
        """This storage actor's share of hit queries over several
        (``fabric.l3.shards``): per ``(op id, hashes, positions, pages)`` — the
        chain hashes of the pages it owns, hashed by the actor that leads the
        query, and their positions — the first position whose page some rank's
        shard lacks and (hybrid) the positions whose components every rank's
        shard holds."""
        return {op: self._held_share(h, pos, total, batch_pages) for op, h, pos, total in items}

    def _held_share(
        self, hashes: Sequence[bytes], pos: Sequence[int], total: int, batch_pages: int
    ) -> ShardAnswer:
        backend = self.backend
        if backend is None:
            return ShardAnswer(0)
        found = len(pos)  # how many of this actor's positions every rank's shard holds
        for suffix in self.suffixes:
            for start in range(0, found, batch_pages):
                chunk = hashes[start : min(start + batch_pages, found)]
                n = backend.exists([self.key(h, suffix) for h in chunk])
                if n < len(chunk):
                    found = start + n
                    break
        full = pos[found] if found < len(pos) else total
        held = {part: self._held(backend, hashes[:found], pos[:found], part) for part in self.parts}
        return ShardAnswer(full, held.get("mamba", ()), held.get("sliding", ()))

    def _held(
        self, backend: L3Backend, hashes: Sequence[bytes], pos: Sequence[int], component: str
    ) -> list[int]:
        """The positions in ``pos`` (of the pages ``hashes``) whose ``component``
        page every rank's shard holds."""
        keep = list(range(len(pos)))
        for suffix in self.suffixes:
            if not keep:
                break
            there = backend.present([self.key(hashes[i], suffix, component) for i in keep])
            keep = [i for i, ok in zip(keep, there, strict=True) if ok]
        return [pos[i] for i in keep]

    def _parts_at(self, backend: L3Backend, page_hashes: Sequence[bytes], end: int) -> bool:
        """Every shard holds the components of the end after ``end`` pages."""
        for suffix in self.suffixes:
            if "mamba" in self.parts and not backend.exists(
                [self.key(page_hashes[end - 1], suffix, "mamba")]
            ):
                return False
            if "sliding" in self.parts:
                window = page_hashes[max(0, end - self.window_pages) : end]
                keys = [self.key(h, suffix, "sliding") for h in window]
                if backend.exists(keys) < len(keys):
                    return False
        return True

    def load(
        self, suffix: str, page_hashes: Sequence[bytes], component: str = "full"
    ) -> np.ndarray:
        """Verified payloads of the leading pages (of ``component``) found, one row
        each (maybe fewer rows than asked: the first miss or refused page ends the
        batch)."""
        backend = self.backend
        prov = self.shapes[component, suffix]
        out = np.empty((len(page_hashes), provenance_bytes(prov)), dtype=np.uint8)
        if backend is None:
            return out[:0]
        keys = [self.key(h, suffix, component) for h in page_hashes]
        n = backend.get(keys, out, prov)
        return out[:n]

    def locate(
        self, suffix: str, page_hashes: Sequence[bytes], component: str = "full"
    ) -> tuple[str, list[Location]] | None:
        """Where the leading pages (of ``component``) found lie — the store's root
        and a ``Location`` each — for a rank that reads them itself
        (``fabric.l3.direct``); ``None`` with no backend, or one whose pages are
        not files."""
        backend = self.backend
        if backend is None or (component, suffix) not in self.shapes:
            return None
        tag = self.shapes[component, suffix].tag
        where = backend.locate([f"{h.hex()}.{tag}.{suffix}" for h in page_hashes])  # page_key
        if where is None:
            return None
        return str(backend.root), where  # type: ignore[attr-defined]

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None:
        """Count pages a rank read itself, and why it refused the next one (if it
        did): the store's figures stay whole."""
        backend = self.backend
        if backend is not None:
            backend.count("get_pages", pages)
            backend.count("direct_pages", pages)
            if refused is not None:
                backend.refuse(refused)

    def store(
        self,
        suffix: str,
        page_hashes: Sequence[bytes],
        pages: np.ndarray,
        component: str = "full",
    ) -> bool:
        """Store one rank's shard of a backup (pages of ``component``); ``True`` only
        if every page was stored."""
        backend = self.backend
        prov = self.shapes.get((component, suffix))
        if (
            backend is None
            or prov is None
            or pages.shape != (len(page_hashes), provenance_bytes(prov))
        ):
            return False
        keys = [self.key(h, suffix, component) for h in page_hashes]
        return all(backend.set(keys, pages, prov))

    def stats(self) -> dict[str, Any]:
        backend = self.backend
        return {"attached": backend is not None, **(backend.stats() if backend else {})}

    def usage_by_writer(self) -> list[dict[str, Any]]:
        """Pages per model tag and the engines that wrote them (``[]`` with no backend)."""
        backend = self.backend
        return backend.usage_by_writer() if backend is not None else []

    # -- pages an engine names by full key (``fabric.engines``) -----------------------

    def engine_exists(self, keys: Sequence[str]) -> list[bool]:
        """Per full page key, whether the store holds it (unverified); all ``False``
        with no backend."""
        backend = self.backend
        if backend is None:
            return [False] * len(keys)
        return backend.present(keys)

    def engine_load(self, keys: Sequence[str], provenance: Provenance) -> np.ndarray:
        """Verified payloads of the leading pages found (pages of ``provenance``, one
        row each; fewer rows than keys when a page is missing — after looking again
        for another writer's — or refused)."""
        backend = self.backend
        out = np.empty((len(keys), provenance_bytes(provenance)), dtype=np.uint8)
        if backend is None:
            return out[:0]
        return out[: backend.get_fresh(keys, out, provenance)]

    def engine_delete(self, keys: Sequence[str]) -> int:
        """Delete an engine's pages by full key (the fabric's tree evicted them);
        how many were here (0 with no backend, or one that cannot delete)."""
        backend = self.backend
        if backend is None:
            return 0
        try:
            return backend.delete(keys)
        except NotImplementedError:
            return 0

    def engine_store(
        self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance, writer: str
    ) -> list[bool]:
        """Store an engine's pages of ``provenance`` under their full keys; per page,
        whether it was stored."""
        backend = self.backend
        if backend is None or pages.shape != (len(keys), provenance_bytes(provenance)):
            return [False] * len(keys)
        backend.record_writer(provenance, writer)
        return backend.set(keys, pages, provenance)
