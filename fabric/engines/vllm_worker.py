"""The worker side of ``KvFabricConnector``: the rank role inside a vLLM worker.

vLLM's KV blocks are this rank's L1 pool. Before a step's forward the worker
reads the pages the scheduler named from L3 — checked as every L3 read is (the
header binds the page's full key, its checksum and provenance) — straight into
the blocks, one ``index_copy_`` per layer; after the forward it gathers the
blocks the step completed, one ``index_select`` per layer, and appends them to
its own segment files. Each rank reads and writes only its own shard's keys
(the key's suffix is its pipeline stage and TP rank), so two ranks never share
a page — the trap a single file per prompt falls into at TP=2.

A page that is missing or fails a check is never copied into a block: its block
and every later one of that request are reported to vLLM as load errors, and
vLLM recomputes them. A worker whose KV caches the connector cannot serve (a
layout it does not know) stores nothing and reports every load as an error, so
the engine still serves every request, computed.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.engines.vllm_pages import (
    STAT_KEYS,
    FabricConnectorStats,
    FabricStepMeta,
    FabricWorkerMeta,
    Placement,
)
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self,
        provenance: Provenance,
        placement: Placement,
        layer_names: list[str],
        num_blocks: int,
        block_bytes: int,
        options_store: StoreOptions | None,
    ) -> None:
        self.provenance = provenance
        self.placement = placement
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.layers: list[torch.Tensor] = []
        self.store: PageStore | None = None
        self._configured_store = options_store
        self._broken = ""
        self._load_errors: set[int] = set()
        self._stored: list[StoredRun] = []
        self._failed: list[bytes] = []
        self.stats = FabricConnectorStats()

    # -- register_kv_caches -------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV cache tensors as this rank's pages; a layout the connector
        cannot serve turns the worker off (logged: the engine computes)."""
        try:
            self.layers = [self._block_rows(name, kv_caches.get(name)) for name in self.layer_names]
        except ConfigError as exc:
            self._broken = str(exc)
            log.error("kvfabric connector: %s; this worker neither loads nor stores", exc)
            self.layers = []

    def _block_rows(self, name: str, kv: torch.Tensor | None) -> torch.Tensor:
        """``kv`` viewed as one row of bytes-worth of elements per block."""
        if not isinstance(kv, torch.Tensor):
            raise ConfigError(f"layer {name!r} has no KV cache tensor (got {type(kv).__name__})")
        if kv.shape[0] % self.num_blocks or not kv.is_contiguous():
            raise ConfigError(
                f"layer {name!r}: KV cache of shape {tuple(kv.shape)} (contiguous: "
                f"{kv.is_contiguous()}) does not hold {self.num_blocks} blocks at dimension 0"
            )
        rows = kv.view(self.num_blocks, -1)
        row_bytes = rows.shape[1] * kv.element_size()
        if row_bytes != self.block_bytes:
            raise ConfigError(
                f"layer {name!r}: a block holds {row_bytes} bytes, but the KV cache spec "
                f"declares {self.block_bytes} (heads per rank x block size x K and V head "
                f"sizes x dtype size): the declared geometry is not this rank's pool"
            )
        return rows

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * len(self.layers)

    def _open(self, options: StoreOptions | None) -> None:
        if self.store is not None or self._broken:
            return
        options = self._configured_store or options
        if options is None:
            return
        try:
            self.store = open_store(options, "vllm")
        except Exception as exc:
            self._broken = f"the L3 store at {options.path!r} cannot be opened ({exc})"
            log.error("kvfabric connector: %s; this worker neither loads nor stores", self._broken)

    def _keys(self, hashes: tuple[bytes, ...]) -> list[str]:
        tag, suffix = self.provenance.tag, self.placement.suffix
        return [page_key(h, tag, suffix) for h in hashes]

    # -- start_load_kv ----------------------------------------------------------------

    def load(self, meta: FabricStepMeta) -> None:
        """Read the step's pages into their blocks before the forward."""
        self._open(meta.store)
        self._load_errors.clear()
        for job in meta.loads:
            started = time.perf_counter()
            n = self._load_one(job.hashes, job.block_ids)
            self.stats.data["load_seconds"] += time.perf_counter() - started
            self.stats.data["loaded_pages"] += n
            if n < len(job.hashes):
                self._load_errors.update(job.block_ids[n:])
                self._failed.append(job.hashes[n])
                self.stats.data["load_failed_pages"] += len(job.hashes) - n

    def _load_one(self, hashes: tuple[bytes, ...], block_ids: tuple[int, ...]) -> int:
        if self.store is None or not self.layers:
            return 0
        out = np.empty((len(hashes), self.page_bytes), dtype=np.uint8)
        n = self.store.load(self._keys(hashes), out, self.provenance)
        if n:
            pages = torch.from_numpy(out[:n])
            index = torch.tensor(block_ids[:n], dtype=torch.long)
            for layer, rows in enumerate(self.layers):
                part = pages[:, layer * self.block_bytes : (layer + 1) * self.block_bytes]
                part = part.view(rows.dtype).to(rows.device, non_blocking=True)
                rows.index_copy_(0, index.to(rows.device), part)
        return n

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- wait_for_save ----------------------------------------------------------------

    def save(self, meta: FabricStepMeta) -> None:
        """Store the blocks the step completed as this rank's pages."""
        self._open(meta.store)
        if self.store is None or not self.layers:
            return
        for job in meta.saves:
            started = time.perf_counter()
            index = torch.tensor(job.block_ids, dtype=torch.long)
            gathered = [
                rows.index_select(0, index.to(rows.device)).cpu().view(torch.uint8)
                for rows in self.layers
            ]
            pages = torch.cat(gathered, dim=1).numpy()
            ok = self.store.store(self._keys(job.run.hashes), pages, self.provenance)
            self.stats.data["store_seconds"] += time.perf_counter() - started
            stored = sum(ok)
            self.stats.data["stored_pages"] += stored
            self.stats.data["store_failed_pages"] += len(ok) - stored
            # Only the leading pages stored can be whole: a chain has no gaps.
            lead = ok.index(False) if False in ok else len(ok)
            if lead:
                self._stored.append(
                    StoredRun(job.run.namespace, job.run.parent, job.run.hashes[:lead])
                )

    # -- build_connector_worker_meta, get_kv_connector_stats ----------------------------

    def worker_meta(self) -> FabricWorkerMeta | None:
        if not self._stored and not self._failed:
            return None
        rank = self.placement.rank
        meta = FabricWorkerMeta(
            {rank: self._stored} if self._stored else {},
            {rank: self._failed} if self._failed else {},
        )
        self._stored, self._failed = [], []
        return meta

    def take_stats(self) -> FabricConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, FabricConnectorStats(dict.fromkeys(STAT_KEYS, 0))
        return stats

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
