"""kvfabric as an SGLang HiCache storage backend (SGLang 0.5.20's ``dynamic`` backend).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvfabric",
        "module_path": "fabric.engines.sglang", "class_name": "KvFabricStorage",
        "interface_v1": 1, "path": "/data/kvfabric-l3"}'

SGLang builds the class as ``KvFabricStorage(storage_config, {})`` in each
scheduler (one per TP/PP/CP rank) and hands it the host KV pool with
``register_mem_pool_host``. It names each page by its storage chain hash (64
hex digits, the same on every rank); this backend adds the model tag of the
pages' provenance and the rank's shard (``fabric.engines.keys``), and moves
pages between SGLang's host pool and a kvfabric store (``fabric.engines.store``:
``path`` for a directory, or ``fabric`` for a running fabric over Ray).

Pages of SGLang's MHA host pool are stored in kvfabric's page format, ``(2,
page tokens, layers, heads, head dim)`` whatever the pool's layout, under the
provenance a kvfabric fabric gives its own pages (model id, layout, dtype, shard
shape, page size): a fabric with the same model, layout, dtype and TP split,
serving namespace ``sglang`` (or ``sglang:<extra key>``), reads the pages this
backend writes and the other way round. Every other pool (MLA, Mamba, the v2
interface's extra pools) is stored as SGLang's own flat page, under a component
of its own, shared between SGLang workers only.

A page that is missing, corrupt, truncated or written for another key, model,
layout, dtype or shard is a miss (the prefetch is shorter), never bytes in the
pool; a write that fails is ``False``; nothing raises into SGLang's threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from fabric.engines.keys import PageNamer, check_tenant, sglang_hash, shard_suffix, tenant_hash
from fabric.engines.store import PageStore, StoreOptions, open_store, parse_options
from fabric.errors import ConfigError
from fabric.l3.format import Provenance

log = logging.getLogger(__name__)

# Keys of SGLang's own in the extra config (the dynamic loader's and its knobs).
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)


class SGLangOptions(StoreOptions):
    """This backend's keys in ``--hicache-storage-backend-extra-config``."""

    namespace: str = Field("", description="a kvfabric tenant, or empty for SGLang's own keys")
    model_id: str = Field("", description="the model's id in page keys (default: SGLang's)")
    kv_heads: int = Field(0, ge=0, description="the model's KV heads, an integer >= 0")
    clear_store: bool = Field(False, description="true or false")


def parse_sglang_options(extra: dict[str, Any] | None) -> SGLangOptions:
    """Our keys of SGLang's extra config, validated; SGLang's own keys are left to it."""
    extra = dict(extra or {})
    ours = {k: v for k, v in extra.items() if k in SGLangOptions.model_fields}
    unknown = sorted(set(extra) - set(ours) - SGLANG_KEYS)
    if unknown:
        log.warning("kvfabric SGLang backend: extra config keys %s are not its own", unknown)
    options = parse_options(SGLangOptions, ours, "kvfabric SGLang backend")
    if options.namespace:
        check_tenant(options.namespace)
    return options


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# An MHA pool's page as SGLang lays it out, axis by axis (``k`` is K or V, then
# tokens, layers, heads, head dim): what ``get_data_page`` gives per layout, the
# single page axis of the page-major layouts dropped.
_NATIVE = {
    "layer_first": "kLTHD",
    "page_first": "kTLHD",
    "page_first_direct": "kLTHD",
    "page_head": "kHTLD",
}
_CANONICAL = "kTLHD"
# From a run of an MHA pool's pages (``PoolPages._run``) to ``(n, 2, T, L, H, D)``.
_TO_PAGES = {
    "layer_first": (2, 0, 3, 1, 4, 5),
    "page_first": (1, 0, 2, 3, 4, 5),
    "page_first_direct": (1, 0, 3, 2, 4, 5),
    "page_head": (1, 0, 3, 4, 2, 5),
}
_FROM_PAGES = {k: tuple(v.index(i) for i in range(6)) for k, v in _TO_PAGES.items()}


class PoolPages:
    """How one host pool's pages become rows of bytes and back. An MHA pool's
    pages are kvfabric's page format ``(2, T, layers, heads, head_dim)``; any
    other pool's are its own flat data page."""

    provenance: Provenance
    namer: PageNamer

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._scratch = threading.local()
        self.page_size = getattr(pool, "page_size", 1) or 1
        self.dtype = pool.dtype
        self.canonical = type(pool) is MHATokenToKVPoolHost and pool.layout in _NATIVE
        if self.canonical:
            layers, heads, dim = pool.layer_num, pool.head_num, pool.head_dim
            self.shape = (2, self.page_size, layers, heads, dim)
            native = _NATIVE[pool.layout]
            sizes = dict(zip(_CANONICAL, self.shape, strict=True))
            self.native_shape = tuple(sizes[a] for a in native)
            self.to_canonical = tuple(native.index(a) for a in _CANONICAL)
            self.to_native = tuple(_CANONICAL.index(a) for a in native)
        else:
            self.shape = (pool.get_dummy_flat_data_page().numel(),)
        self.row_bytes = int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()

    def named(self, provenance: Provenance, suffix: str) -> PoolPages:
        """These pages under ``provenance``, for the shard ``suffix``."""
        self.provenance, self.namer = provenance, PageNamer(provenance, suffix)
        return self

    def rows(self, n: int) -> np.ndarray:
        """Room for ``n`` pages, reused by this thread's next call (a fresh array
        of a batch's size costs as much in page faults as the batch's read)."""
        buf = getattr(self._scratch, "rows", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.rows = np.empty((n, self.row_bytes), dtype=np.uint8)
        return buf[:n]

    def as_pages(self, rows: np.ndarray) -> torch.Tensor:
        """``rows`` (uint8) as ``(n, *shape)`` of the pool's dtype, sharing memory."""
        return torch.from_numpy(rows).view(self.dtype).view(len(rows), *self.shape)

    # -- whole runs of pages by host index (the v1 interface) ------------------------

    def gather(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        """The ``n`` pages that start at ``host_indices[0]``, ``[page_size]``, ... as rows."""
        rows = self.rows(n)
        if not self.canonical:
            for i in range(n):
                page = self.pool.get_data_page(int(host_indices[i * self.page_size]), flat=True)
                rows[i] = page.contiguous().view(torch.uint8).numpy()
            return rows
        pages = self.as_pages(rows)
        to_pages = _TO_PAGES[self.pool.layout]
        for i, j, first in self._runs(host_indices, n):
            pages[i:j].copy_(self._run(first, j - i).permute(to_pages))
        return rows

    def scatter(self, host_indices: torch.Tensor, rows: np.ndarray) -> None:
        """Write ``rows`` into the pages that start at ``host_indices[0]``, ... ."""
        n = len(rows)
        if n == 0:
            return
        pages = self.as_pages(rows)
        if not self.canonical:
            for i in range(n):
                self.pool.set_from_flat_data_page(int(host_indices[i * self.page_size]), pages[i])
            return
        to_pool = _FROM_PAGES[self.pool.layout]
        for i, j, first in self._runs(host_indices, n):
            self._run(first, j - i).copy_(pages[i:j].permute(to_pool))

    def _runs(self, host_indices: torch.Tensor, n: int) -> list[tuple[int, int, int]]:
        """Pages ``[i, j)`` whose slots follow one another from slot ``first``: one
        strided copy each, not a gather and a scatter per page."""
        t = self.page_size
        starts = host_indices[: n * t : t].tolist()
        runs, i = [], 0
        for j in range(1, n + 1):
            if j == n or starts[j] != starts[j - 1] + t:
                runs.append((i, j, starts[i]))
                i = j
        return runs

    def _run(self, first: int, n: int) -> torch.Tensor:
        """The pool's view of ``n`` pages from slot ``first``, with a page axis."""
        kv, t, layout = self.pool.kv_buffer, self.page_size, self.pool.layout
        if layout == "layer_first":
            return kv[:, :, first : first + n * t].unflatten(2, (n, t))  # (2, L, n, T, H, D)
        if layout == "page_first":
            return kv[:, first : first + n * t].unflatten(1, (n, t))  # (2, n, T, L, H, D)
        return kv[:, first // t : first // t + n]  # (2, n, L, T, H, D) or (2, n, H, T, L, D)

    # -- single flat pages (the generic interface) -----------------------------------

    def from_flat(self, flat: torch.Tensor) -> np.ndarray:
        """One of SGLang's flat data pages as a row."""
        page = flat.contiguous()
        if self.canonical:
            page = page.view(self.native_shape).permute(self.to_canonical).contiguous()
        return page.view(torch.uint8).reshape(-1).numpy()

    def into_flat(self, row: np.ndarray, target: torch.Tensor) -> torch.Tensor:
        """A row into ``target``, one of SGLang's flat data pages; returns it."""
        page = torch.from_numpy(row).view(self.dtype)
        if self.canonical:
            page = page.view(self.shape).permute(self.to_native)
        target.view(self.native_shape if self.canonical else (-1,)).copy_(
            page if self.canonical else page.view(-1)
        )
        return target


class KvFabricStorage(HiCacheStorage):
    """An SGLang ``HiCacheStorage`` over a kvfabric store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.options = parse_sglang_options(storage_config.extra_config)
        self.config = storage_config
        self.model_id = self.options.model_id or (storage_config.model_name or "")
        if not self.model_id:
            raise ConfigError(
                "kvfabric SGLang backend: no model id (SGLang passed no model name); "
                "set model_id in the extra config"
            )
        self.store: PageStore = open_store(self.options, "sglang")
        self.pools: dict[str, PoolPages] = {}
        self._metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()

    # -- registration: the pools' page formats and keys ------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pools[PoolName.KV] = self._pages(mem_pool_host, PoolName.KV)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.pools[str(host_pool_name)] = self._pages(host_pool, str(host_pool_name))

    def _pages(self, pool: Any, name: str) -> PoolPages:
        cfg = self.config
        layout = pool.layout
        if cfg.attn_cp_size > 1:
            layout += f"+cp{cfg.attn_cp_size}"
        device_pool = getattr(pool, "device_pool", None)
        start = getattr(device_pool, "start_layer", None)
        layers = getattr(pool, "layer_num", None)
        if cfg.pp_size > 1 and start is not None and layers and start != cfg.pp_rank * layers:
            layout += f"+layers{start}-{start + layers}"
        tp = 0 if cfg.is_mla_model else self._head_group(pool)
        pages = PoolPages(pool)
        component = "full" if pages.canonical and name == PoolName.KV else f"sglang-{name}"
        if component != "full" and cfg.is_mla_model:
            component += "-mla"
        provenance = Provenance(
            self.model_id, layout, _dtype_name(pool.dtype), pages.shape, pages.page_size, component
        )
        return pages.named(provenance, shard_suffix(cfg.pp_rank, cfg.attn_cp_rank, tp))

    def _head_group(self, pool: Any) -> int:
        """The shard part of this rank's key: its TP rank, or the index of the KV
        head it holds when heads are replicated over ranks (``kv_heads`` < TP)."""
        cfg = self.config
        heads = getattr(pool, "head_num", None)
        if cfg.tp_size == 1 or heads is None:
            return cfg.tp_rank
        total = self.options.kv_heads
        if not total:
            if heads == 1:
                raise ConfigError(
                    f"kvfabric SGLang backend: each of {cfg.tp_size} TP ranks holds one KV "
                    "head, which may be replicated over ranks; set kv_heads (the model's "
                    "number of KV heads) in the extra config"
                )
            return cfg.tp_rank
        if total % cfg.tp_size and cfg.tp_size % total:
            raise ConfigError(
                f"kv_heads={total} is refused: with {cfg.tp_size} TP ranks allowed is a "
                "multiple of the TP size, or a divisor of it"
            )
        per_rank = max(1, total // cfg.tp_size)  # SGLang's heads per rank
        if heads != per_rank:
            # The declared count is not this pool's: two ranks holding different
            # heads would share a key (or one head be split under two).
            raise ConfigError(
                f"kv_heads={total} at TP {cfg.tp_size} means {per_rank} KV heads per rank, "
                f"but this rank's host pool holds {heads}: the declared geometry is not the "
                f"pool's (kv_heads is the model's KV head count, before the TP split)"
            )
        if total >= cfg.tp_size:
            return cfg.tp_rank
        return cfg.tp_rank // (cfg.tp_size // total)

    # -- keys ------------------------------------------------------------------------

    def _keys(self, pages: PoolPages, keys: Sequence[str]) -> list[str]:
        """Full L3 keys for SGLang's page keys, up to the first that is not a page
        key (neither it nor a page after it can be in the store)."""
        out: list[str] = []
        for key in keys:
            h = sglang_hash(key)
            if h is None:
                return out
            out.append(
                pages.namer.key(
                    tenant_hash(self.options.namespace, h) if self.options.namespace else h
                )
            )
        return out

    def _kv(self) -> PoolPages:
        pages = self.pools.get(PoolName.KV)
        if pages is None:
            raise RuntimeError("kvfabric SGLang backend: no host pool registered")
        return pages

    # -- existence ---------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self.store.exists(self._keys(self._kv(), keys))

    # -- the v1 interface (host indices) -----------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get(self._kv(), keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._set(self._kv(), keys, host_indices)

    def _keys_for_slots(
        self, pages: PoolPages, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[str] | None:
        """Full keys for ``keys``; ``None`` (logged) when ``host_indices`` is too short
        to hold their pages."""
        full = self._keys(pages, keys)
        if len(host_indices) < len(full) * pages.page_size:
            log.error(
                "kvfabric SGLang backend: %d host indices for %d pages",
                len(host_indices),
                len(full),
            )
            return None
        return full

    def _get(self, pages: PoolPages, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        full = self._keys_for_slots(pages, keys, host_indices)
        if full is None:
            return [False] * len(keys)
        start = time.perf_counter()
        rows = pages.rows(len(full))
        n = self.store.load(full, rows, pages.provenance)
        pages.scatter(host_indices, rows[:n])
        self._note("prefetch", n, n * pages.row_bytes, time.perf_counter() - start)
        return [True] * n + [False] * (len(keys) - n)

    def _set(self, pages: PoolPages, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        full = self._keys_for_slots(pages, keys, host_indices)
        if full is None:
            return [False] * len(keys)
        start = time.perf_counter()
        present = self.store.present(full)
        missing = [i for i, p in enumerate(present) if not p]
        ok = [True] * len(full) + [False] * (len(keys) - len(full))
        if missing:
            t = pages.page_size
            index = torch.cat([host_indices[i * t : (i + 1) * t] for i in missing])
            rows = pages.gather(index, len(missing))
            stored = self.store.store([full[i] for i in missing], rows, pages.provenance)
            for i, good in zip(missing, stored, strict=True):
                ok[i] = good
            self._note(
                "backup", sum(stored), sum(stored) * pages.row_bytes, time.perf_counter() - start
            )
        return ok

    # -- the generic interface (flat pages) --------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        pages = self._kv()
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            targets = [pages.pool.get_dummy_flat_data_page() for _ in keys]
        full = self._keys(pages, keys)
        start = time.perf_counter()
        rows = pages.rows(len(full))
        n = self.store.load(full, rows, pages.provenance)
        out: list[torch.Tensor | None] = [pages.into_flat(rows[i], targets[i]) for i in range(n)]
        self._note("prefetch", n, n * pages.row_bytes, time.perf_counter() - start)
        return out + [None] * (len(keys) - n)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        pages = self._kv()
        values = list(values or [])
        full = self._keys(pages, keys)
        if len(full) != len(keys) or len(values) != len(keys):
            return False
        start = time.perf_counter()
        present = self.store.present(full)
        missing = [i for i, p in enumerate(present) if not p]
        if not missing:
            return True
        rows = pages.rows(len(missing))
        for j, i in enumerate(missing):
            rows[j] = pages.from_flat(values[i])
        stored = self.store.store([full[i] for i in missing], rows, pages.provenance)
        self._note(
            "backup", sum(stored), sum(stored) * pages.row_bytes, time.perf_counter() - start
        )
        return all(stored)

    # -- the v2 interface (a hybrid model's pools) -------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        final = kv_pages
        for transfer in pool_transfers or []:
            if final == 0:
                break
            pages = self.pools.get(str(transfer.name))
            full = self._keys(pages, keys[:kv_pages]) if pages is not None else []
            present = self.store.present(full)
            present += [False] * (kv_pages - len(present))
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
            else:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                boundary = next(
                    (
                        end
                        for end in range(kv_pages, 0, -1)
                        if all(present[max(0, end - window) : end])
                    ),
                    0,
                )
            if boundary:
                hits[str(transfer.name)] = boundary
            final = min(final, boundary)
        return PoolTransferResult(final, hits)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self._get)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self._set)

    def _v2(self, transfers: list[PoolTransfer], move: Any) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name, keys = str(transfer.name), list(transfer.keys or [])
            pages = self.pools.get(name)
            indices = transfer.host_indices
            if pages is None or indices is None or indices.numel() != len(keys) * pages.page_size:
                log.error(
                    "kvfabric SGLang backend: pool %s: no pool or %s indices for %d pages",
                    name,
                    None if indices is None else indices.numel(),
                    len(keys),
                )
                results[name] = [False] * len(keys)
                continue
            results[name] = move(pages, keys, indices)
        return results

    # -- the rest ----------------------------------------------------------------------

    def clear(self) -> bool:
        """Delete every page of the store — every engine's and every fabric's — only
        where ``clear_store`` is set; else refuse (``False``) and say so."""
        if not self.options.clear_store:
            log.warning(
                "kvfabric SGLang backend: clear refused: the store is shared; set "
                "clear_store in the extra config to let SGLang clear it"
            )
            return False
        return self.store.clear()

    def _note(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not pages:
            return
        with self._metrics_lock:
            m = self._metrics
            (m.prefetch_pgs if kind == "prefetch" else m.backup_pgs).append(pages)
            gbps = nbytes / max(seconds, 1e-9) / 1e9
            (m.prefetch_bandwidth if kind == "prefetch" else m.backup_bandwidth).append(gbps)

    def get_stats(self) -> StorageMetrics:
        """The batches since the last call (pages and GB/s each), for SGLang's metrics."""
        with self._metrics_lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics

    def close(self) -> None:
        self.store.close()
