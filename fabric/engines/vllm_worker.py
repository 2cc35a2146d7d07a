"""The worker side of ``KvFabricConnector``: the rank role inside a vLLM worker.

vLLM's KV blocks are this rank's L1 pool. Before a step's forward the worker
reads the pages the scheduler named from L3 — checked as every L3 read is (the
header binds the page's full key, its checksum and provenance) — straight into
the blocks, one ``index_copy_`` per layer; after the forward it gathers the
blocks the step completed, one ``index_select`` per layer straight into a page
buffer, and a writer thread appends them to its own segment files while the
engine steps on (the pages are reported stored once written). Page buffers are
kept and reused: no step pays for fresh memory. Each rank reads and writes only its own shard's keys
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
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.engines.vllm_pages import (
    STAT_KEYS,
    FabricConnectorStats,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    Placement,
)
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key

log = logging.getLogger(__name__)

# Bytes of pages one load or store stages at once (at least one page).
STAGING_BYTES = 64 << 20
# Stores on the writer thread before a step waits for the oldest.
MAX_WRITES_IN_FLIGHT = 2


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
        self._ended: list[bytes] = []  # pages whose store ended since the last report
        self.stats = FabricConnectorStats()
        # Asynchronous loads: one thread reads them in order while the engine steps.
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, tuple[PageLoad, Future]] = {}
        # Stores: one thread writes them in order; each holds its page buffer.
        self._writer: ThreadPoolExecutor | None = None
        self._writes: deque[tuple[StoredRun, Future, torch.Tensor]] = deque()
        self._free: list[torch.Tensor] = []  # page buffers not in use
        self._buffers = threading.Lock()

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
        """Read the step's pages into their blocks (the synchronous ones now, before
        the forward; the asynchronous ones on the load thread)."""
        self._open(meta.store)
        for job in meta.loads:
            if job.asynchronous:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-load")
                self._loading[job.req_id] = (job, self._loader.submit(self._timed_load, job))
            else:
                self._loaded(job, self._timed_load(job))

    def _timed_load(self, job: PageLoad) -> tuple[int, float]:
        started = time.perf_counter()
        try:
            n = self._load_one(job.hashes, job.block_ids)
        except Exception as exc:  # a load that fails is recomputed, never fatal
            log.warning("kvfabric connector: loading %d pages failed: %s", len(job.hashes), exc)
            n = 0
        return n, time.perf_counter() - started

    def _loaded(self, job: PageLoad, outcome: tuple[int, float]) -> None:
        n, seconds = outcome
        self.stats.data["load_seconds"] += seconds
        self.stats.data["loaded_pages"] += n
        if n < len(job.hashes):
            self._load_errors.update(job.block_ids[n:])
            self._failed.append(job.hashes[n])
            self.stats.data["load_failed_pages"] += len(job.hashes) - n

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads are done (their failed blocks join
        ``load_errors`` in the same step)."""
        done = {rid for rid, (_, future) in self._loading.items() if future.done()}
        for rid in done:
            job, future = self._loading.pop(rid)
            self._loaded(job, future.result())
        return done

    @property
    def batch_pages(self) -> int:
        return max(1, STAGING_BYTES // max(self.page_bytes, 1))

    def _buffer(self) -> torch.Tensor:
        """A page buffer (``batch_pages`` rows of ``page_bytes``) to fill; give it
        back with ``_give``. Safe from the load thread."""
        with self._buffers:
            if self._free:
                return self._free.pop()
        return torch.empty((self.batch_pages, self.page_bytes), dtype=torch.uint8)

    def _give(self, buffer: torch.Tensor) -> None:
        with self._buffers:
            self._free.append(buffer)

    def _load_one(self, hashes: tuple[bytes, ...], block_ids: tuple[int, ...]) -> int:
        """Read the leading pages into their blocks, a batch at a time; how many."""
        if self.store is None or not self.layers:
            return 0
        buffer = self._buffer()
        try:
            done = 0
            for start in range(0, len(hashes), self.batch_pages):
                end = min(start + self.batch_pages, len(hashes))
                out = buffer[: end - start].numpy()
                n = self.store.load(self._keys(hashes[start:end]), out, self.provenance)
                self._scatter(buffer[:n], block_ids[start : start + n])
                done += n
                if n < end - start:
                    break
            return done
        finally:
            self._give(buffer)

    def _scatter(self, pages: torch.Tensor, block_ids: tuple[int, ...]) -> None:
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, rows in enumerate(self.layers):
            part = pages[:, layer * self.block_bytes : (layer + 1) * self.block_bytes]
            part = part.view(rows.dtype).to(rows.device, non_blocking=True)
            rows.index_copy_(0, index.to(rows.device), part)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- wait_for_save ----------------------------------------------------------------

    def save(self, meta: FabricStepMeta) -> None:
        """Gather the blocks the step completed into page buffers; the writer
        thread stores them."""
        self._open(meta.store)
        if self.store is None or not self.layers:
            self._ended += [h for job in meta.saves for h in job.run.hashes]  # skipped
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-store")
        for job in meta.saves:
            hashes = job.run.hashes
            for start in range(0, len(hashes), self.batch_pages):
                end = min(start + self.batch_pages, len(hashes))
                while len(self._writes) >= MAX_WRITES_IN_FLIGHT:
                    self._written(wait=True)
                buffer = self._buffer()
                self._gather(buffer[: end - start], job.block_ids[start:end])
                parent = hashes[start - 1] if start else job.run.parent
                run = StoredRun(job.run.namespace, parent, hashes[start:end])
                future = self._writer.submit(self._write, run, buffer[: end - start])
                self._writes.append((run, future, buffer))

    def _gather(self, pages: torch.Tensor, block_ids: tuple[int, ...]) -> None:
        """Copy the blocks' every layer into ``pages`` (one page a row)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, rows in enumerate(self.layers):
            part = pages[:, layer * self.block_bytes : (layer + 1) * self.block_bytes]
            part = part.view(rows.dtype)
            if rows.device.type == "cpu":
                torch.index_select(rows, 0, index, out=part)
            else:
                part.copy_(rows.index_select(0, index.to(rows.device)))

    def _write(self, run: StoredRun, pages: torch.Tensor) -> tuple[list[bool], float]:
        started = time.perf_counter()
        assert self.store is not None
        try:
            ok = self.store.store(self._keys(run.hashes), pages.numpy(), self.provenance)
        except Exception as exc:  # a store that fails is a later miss, never fatal
            log.warning("kvfabric connector: storing %d pages failed: %s", len(run.hashes), exc)
            ok = [False] * len(run.hashes)
        return ok, time.perf_counter() - started

    def _written(self, wait: bool = False) -> None:
        """Take the stores the writer finished (the oldest, at least, if ``wait``)."""
        while self._writes and (wait or self._writes[0][1].done()):
            run, future, buffer = self._writes.popleft()
            ok, seconds = future.result()
            self._give(buffer)
            wait = False
            self._ended += run.hashes
            self.stats.data["store_seconds"] += seconds
            self.stats.data["stored_pages"] += sum(ok)
            self.stats.data["store_failed_pages"] += len(ok) - sum(ok)
            self._stored += _stored_runs(run, ok)

    # -- build_connector_worker_meta, get_kv_connector_stats ----------------------------

    def worker_meta(self) -> FabricWorkerMeta | None:
        self._written()
        if not self._stored and not self._failed and not self._ended:
            return None
        rank = self.placement.rank
        meta = FabricWorkerMeta(
            {rank: self._stored} if self._stored else {},
            {rank: self._failed} if self._failed else {},
            {rank: self._ended} if self._ended else {},
        )
        self._stored, self._failed, self._ended = [], [], []
        return meta

    def take_stats(self) -> FabricConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, FabricConnectorStats(dict.fromkeys(STAT_KEYS, 0))
        return stats

    def close(self) -> None:
        while self._writes:
            self._written(wait=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.store is not None:
            self.store.close()
            self.store = None


def _stored_runs(run: StoredRun, ok: list[bool]) -> list[StoredRun]:
    """The runs of consecutive pages of ``run`` that were stored."""
    runs, start = [], None
    for i, good in enumerate([*ok, False]):
        if good and start is None:
            start = i
        elif not good and start is not None:
            parent = run.hashes[start - 1] if start else run.parent
            runs.append(StoredRun(run.namespace, parent, run.hashes[start:i]))
            start = None
    return runs
