"""The worker side of ``KvFabricConnector``: the rank role inside a vLLM worker.

vLLM's KV blocks are this rank's L1 pool; the node's L2 (shared memory, shared
by the node's engines) and the fabric's L3 lie under it (``vllm_moves``). A
step's loads run before its forward or, once the forward is seen to wait for
each layer (``wait_for_layer_load``), layer by layer on a step thread while the
forward runs; with ``load_async`` they run on a load thread while the engine
steps on. A step's stores are gathered layer by layer as the forward computes
them (``save_kv_layer``) and written to L3 and the node's L2 by a writer thread
while the engine steps on (reported stored once in L3). Each rank reads and
writes only its own shard's keys (the key's suffix is its pipeline stage and
TP rank), so two ranks never share a page — the trap a single file per prompt
falls into at TP=2.

A page that is missing or fails a check is never served: its block and every
later one of that request are reported to vLLM as load errors, and vLLM
recomputes them. A worker whose KV caches the connector cannot serve (a layout
it does not know) stores nothing and reports every load as an error, so the
engine still serves every request, computed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import StoreOptions, open_store
from fabric.engines.vllm_moves import STAGING_BYTES, Fetched, L2Options, PageMoves
from fabric.engines.vllm_pages import (
    STAT_KEYS,
    FabricConnectorStats,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    Placement,
)
from fabric.errors import ConfigError
from fabric.l3.format import Provenance
from fabric.rank.node_l2 import fabric_identity, open_node_l2

log = logging.getLogger(__name__)

# Stores on the writer thread before a step waits for the oldest.
MAX_WRITES_IN_FLIGHT = 2


@dataclass
class StepLoad:
    """One step's synchronous loads, read on the step thread layer by layer: the
    forward waits for each layer's event (``wait_for_layer_load``)."""

    jobs: list[PageLoad]
    events: list[threading.Event]
    waited: set[int] = field(default_factory=set)
    future: Future | None = None


@dataclass
class StepSave:
    """One step's stores gathered layer by layer as the forward computes them
    (``save_kv_layer``); the rest when the forward is done."""

    jobs: list[tuple[StoredRun, tuple[int, ...], torch.Tensor]]
    gathered: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(
        self,
        provenance: Provenance,
        placement: Placement,
        layer_names: list[str],
        num_blocks: int,
        block_bytes: int,
        options_store: StoreOptions | None,
        l2: L2Options | None = None,
    ) -> None:
        self.provenance = provenance
        self.placement = placement
        self.layer_names = layer_names
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.pages = PageMoves(provenance, placement, block_bytes)
        self.pages.promoter = self._promote_later
        self._l2_options = l2 or L2Options(max_bytes=0)
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
        # A step's loads layer by layer: once the forward is seen to wait for every
        # layer, the step thread reads while the forward runs up to its first layer.
        self._stepper: ThreadPoolExecutor | None = None
        self._waits_seen: set[int] = set()
        self._step: StepLoad | None = None
        self._step_save: StepSave | None = None
        # Stores: one thread writes them in order; each holds its page buffer.
        self._writer: ThreadPoolExecutor | None = None
        self._writes: deque[tuple[StoredRun | None, Future, torch.Tensor]] = deque()

    # -- register_kv_caches -------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV cache tensors as this rank's pages; a layout the connector
        cannot serve turns the worker off (logged: the engine computes)."""
        try:
            self.pages.layers = [
                self._block_rows(name, kv_caches.get(name)) for name in self.layer_names
            ]
        except ConfigError as exc:
            self._broken = str(exc)
            log.error("kvfabric connector: %s; this worker neither loads nor stores", exc)
            self.pages.layers = []
            return
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-store")
        o = self._l2_options
        self.pages.l2 = open_node_l2(
            o.directory, fabric_identity(o.fabric, o.ray_namespace), self.provenance.tag,
            self.placement.suffix, self.pages.page_bytes, o.max_bytes,
        )  # fmt: skip

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

    def _open(self, options: StoreOptions | None) -> None:
        if self.pages.store is not None or self._broken:
            return
        options = self._configured_store or options
        if options is None:
            return
        try:
            self.pages.store = open_store(options, "vllm")
        except Exception as exc:
            self._broken = f"the L3 store at {options.path!r} cannot be opened ({exc})"
            log.error("kvfabric connector: %s; this worker neither loads nor stores", self._broken)

    # -- start_load_kv, wait_for_layer_load ---------------------------------------------

    def load(self, meta: FabricStepMeta) -> None:
        """Start the step: its asynchronous loads go to the load thread; its others
        are read before the forward, or — once the forward is known to wait for
        each layer — on the step thread, layer by layer, while the forward runs."""
        self._finish_step()
        self._open(meta.store)
        sync = []
        for job in meta.loads:
            if job.asynchronous:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-load")
                self._loading[job.req_id] = (job, self._loader.submit(self._timed_load, job))
            else:
                sync.append(job)
        pages = sum(len(job.hashes) for job in sync)
        if sync and self._layerwise and pages * self.pages.page_bytes <= STAGING_BYTES * 4:
            if self._stepper is None:
                self._stepper = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-layers")
            step = StepLoad(sync, [threading.Event() for _ in self.pages.layers])
            step.future = self._stepper.submit(self._load_layers, step)
            self._step = step
        else:
            for job in sync:
                self._loaded(job, self._timed_load(job))
        self._begin_saves(meta)

    @property
    def _layerwise(self) -> bool:
        return bool(self.pages.layers) and len(self._waits_seen) == len(self.pages.layers)

    def wait_layer(self, name: str) -> None:
        """The forward is about to read layer ``name``: wait until it is loaded."""
        i = self.layer_index.get(name)
        if i is None:
            return
        if i not in self._waits_seen:
            self._waits_seen.add(i)
            if self._layerwise:
                log.info(
                    "kvfabric connector: the forward waits for each layer: loads run layer "
                    "by layer from the next step"
                )
        step = self._step
        if step is not None:
            step.events[i].wait()
            step.waited.add(i)

    def _load_layers(self, step: StepLoad) -> list[tuple[int, float, int]]:
        started = time.perf_counter()
        fetched: list[Fetched] = []
        try:
            fetched = [self.pages.fetch(job.hashes, job.block_ids) for job in step.jobs]
            for layer, event in enumerate(step.events):
                for f in fetched:
                    self.pages.scatter_layer(f, layer)
                event.set()
            done = [(self.pages.settle(f), f.l2) for f in fetched]
        except Exception as exc:  # a load that fails is recomputed, never fatal
            log.warning("kvfabric connector: loading a step's pages failed: %s", exc)
            done = [(0, 0)] * len(step.jobs)
        finally:
            for event in step.events:
                event.set()  # a forward never waits on a load that failed
            for f in fetched:
                self.pages.release(f)
        seconds = time.perf_counter() - started
        return [(n, seconds / len(step.jobs), l2) for n, l2 in done]

    def _finish_step(self) -> None:
        """Take the outcome of the step's layer-by-layer loads (once the forward is
        done). A forward that read a layer without waiting for it may have read a
        block not yet loaded: those blocks are all reported failed (vLLM recomputes
        them) and loads are read before the forward from then on."""
        step, self._step = self._step, None
        if step is None or step.future is None:
            return
        outcomes = step.future.result()
        if len(step.waited) < len(step.events):
            log.warning(
                "kvfabric connector: the forward did not wait for layers %s; their loads "
                "are recomputed and later loads read before the forward",
                sorted(set(range(len(step.events))) - step.waited)[:8],
            )
            self._waits_seen.clear()
            outcomes = [(0, seconds, 0) for _, seconds, _ in outcomes]
        for job, outcome in zip(step.jobs, outcomes, strict=True):
            self._loaded(job, outcome)

    def _timed_load(self, job: PageLoad) -> tuple[int, float, int]:
        started = time.perf_counter()
        try:
            n, l2 = self.pages.load_one(job.hashes, job.block_ids)
        except Exception as exc:  # a load that fails is recomputed, never fatal
            log.warning("kvfabric connector: loading %d pages failed: %s", len(job.hashes), exc)
            n, l2 = 0, 0
        return n, time.perf_counter() - started, l2

    def _loaded(self, job: PageLoad, outcome: tuple[int, float, int]) -> None:
        n, seconds, l2 = outcome
        self.stats.data["load_seconds"] += seconds
        self.stats.data["loaded_pages"] += n
        self.stats.data["l2_loaded_pages"] += min(l2, n)
        if n < len(job.hashes):
            self._load_errors.update(job.block_ids[n:])
            self._failed.append(job.hashes[n])
            self.stats.data["load_failed_pages"] += len(job.hashes) - n

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads are done (their failed blocks join
        ``load_errors`` in the same step)."""
        self._finish_step()
        done = {rid for rid, (_, future) in self._loading.items() if future.done()}
        for rid in done:
            job, future = self._loading.pop(rid)
            self._loaded(job, future.result())
        return done

    def _promote_later(self, keys: list[str], pages: torch.Tensor, buffer: torch.Tensor) -> None:
        """Keep pages read from L3 in the node's L2 too, for the node's next reader
        (on the writer thread: the load does not wait for it)."""
        if self._writer is None:
            self.pages.give(buffer)
            return
        self._writes.append((None, self._writer.submit(self._put_l2, keys, pages), buffer))

    def _put_l2(self, keys: list[str], pages: torch.Tensor) -> tuple[list[bool], float, int]:
        started = time.perf_counter()
        kept = self.pages.l2_put(keys, pages)
        return [], time.perf_counter() - started, kept

    def load_errors(self) -> set[int]:
        self._finish_step()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save_kv_layer, wait_for_save ----------------------------------------------------

    def _begin_saves(self, meta: FabricStepMeta) -> None:
        """Give the step's stores their page buffers, so that each layer is gathered
        as soon as the forward has computed it (when the step's pages fit)."""
        self._step_save = None
        pages = sum(len(job.run.hashes) for job in meta.saves)
        if not pages or self.pages.store is None or not self.pages.layers:
            return
        if pages * self.pages.page_bytes > STAGING_BYTES * 4:
            return  # gathered in batches once the forward is done
        jobs = []
        for job in meta.saves:
            for start in range(0, len(job.run.hashes), self.pages.batch_pages):
                end = min(start + self.pages.batch_pages, len(job.run.hashes))
                hashes = job.run.hashes
                parent = hashes[start - 1] if start else job.run.parent
                run = StoredRun(job.run.namespace, parent, hashes[start:end])
                jobs.append((run, job.block_ids[start:end], self.pages.buffer()))
        self._step_save = StepSave(jobs)

    def save_layer(self, name: str) -> None:
        """The forward has computed layer ``name``: gather it from the step's blocks."""
        step, i = self._step_save, self.layer_index.get(name)
        if step is None or i is None or i in step.gathered:
            return
        for run, block_ids, buffer in step.jobs:
            self.pages.gather_layer(buffer[: len(run.hashes)], block_ids, i)
        step.gathered.add(i)

    def save(self, meta: FabricStepMeta) -> None:
        """The forward is done: gather what is not gathered yet; the writer thread
        stores the pages."""
        self._finish_step()
        self._open(meta.store)
        step, self._step_save = self._step_save, None
        if self.pages.store is None or not self.pages.layers:
            self._ended += [h for job in meta.saves for h in job.run.hashes]  # skipped
            if step is not None:
                for _, _, buffer in step.jobs:
                    self.pages.give(buffer)
            return
        writer = self._writer
        assert writer is not None
        if step is not None:
            for run, block_ids, buffer in step.jobs:
                for layer in range(len(self.pages.layers)):
                    if layer not in step.gathered:
                        self.pages.gather_layer(buffer[: len(run.hashes)], block_ids, layer)
                pages = buffer[: len(run.hashes)]
                self._writes.append((run, writer.submit(self._write, run, pages), buffer))
            self._written()
            return
        for job in meta.saves:
            hashes = job.run.hashes
            for start in range(0, len(hashes), self.pages.batch_pages):
                end = min(start + self.pages.batch_pages, len(hashes))
                while len(self._writes) >= MAX_WRITES_IN_FLIGHT:
                    self._written(wait=True)
                buffer = self.pages.buffer()
                for layer in range(len(self.pages.layers)):
                    self.pages.gather_layer(buffer[: end - start], job.block_ids[start:end], layer)
                parent = hashes[start - 1] if start else job.run.parent
                run = StoredRun(job.run.namespace, parent, hashes[start:end])
                future = writer.submit(self._write, run, buffer[: end - start])
                self._writes.append((run, future, buffer))

    def _write(self, run: StoredRun, pages: torch.Tensor) -> tuple[list[bool], float, int]:
        started = time.perf_counter()
        assert self.pages.store is not None
        keys = self.pages.keys(run.hashes)
        try:
            ok = self.pages.store.store(keys, pages.numpy(), self.provenance)
        except Exception as exc:  # a store that fails is a later miss, never fatal
            log.warning("kvfabric connector: storing %d pages failed: %s", len(run.hashes), exc)
            ok = [False] * len(run.hashes)
        l2 = self.pages.l2_put(keys, pages) if self.pages.l2 is not None else 0
        return ok, time.perf_counter() - started, l2

    def _written(self, wait: bool = False) -> None:
        """Take the stores the writer finished (the oldest, at least, if ``wait``)."""
        while self._writes and (wait or self._writes[0][1].done()):
            run, future, buffer = self._writes.popleft()
            ok, seconds, l2 = future.result()
            self.pages.give(buffer)
            wait = False
            self.stats.data["l2_stored_pages"] += l2
            if run is None:  # a promotion into the node's L2
                continue
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
        for pool in (self._loader, self._stepper):
            if pool is not None:
                pool.shutdown(wait=True)
        self._loader = self._stepper = None
        if self.pages.store is not None:
            self.pages.store.close()
            self.pages.store = None
        if self.pages.l2 is not None:
            self.pages.l2.close()
            self.pages.l2 = None


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
