"""The worker side of ``KvFabricConnector``: the rank role inside a vLLM worker.

vLLM's KV blocks are this rank's L1 pool; the node's L2 (shared memory, shared
by the node's engines) and the fabric's L3 lie under it (``vllm_moves``). A
step's loads run on a step thread: before the forward, or — once the forward is
seen to wait for each layer (``wait_for_layer_load``) — layer by layer while
the forward runs; with ``load_async`` they run on a load thread while the
engine steps on. A step's stores are gathered layer by layer as the forward
computes them (``save_kv_layer``) and written to the node's L2 and L3 (per the
fabric's write policy) by a writer thread, which also carries out the fabric
tree's orders (``vllm_orders``). Each rank touches only its own shard's keys.

A page that is missing or fails a check is never served: its block and every
later one of that request are reported to vLLM as load errors, and vLLM
recomputes them; every load's outcome (how many pages it loaded) goes to the
scheduler side, which stores nothing computed over a load that failed. No wait
on storage outlasts ``timeout_s``: a load not done by then is given up (its
blocks are load errors, and the thread that was reading it writes no block
again), and stores past the write queue's bound wait for it at most that long,
then are dropped and counted. A worker whose KV caches the connector cannot
serve (a layout it does not know) stores nothing and reports every load as an
error, so the engine still serves every request, computed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from fabric.cache.engine_input import node_place
from fabric.engines.store import StoreOptions, open_store
from fabric.engines.vllm_loading import (
    GIVEN_UP,
    AsyncLoads,
    Outcome,
    StepLoad,
    load_layers,
    load_whole,
)
from fabric.engines.vllm_moves import (
    STAGING_BYTES,
    L2Options,
    PageMoves,
    block_rows,
)
from fabric.engines.vllm_pages import (
    STAT_KEYS,
    FabricConnectorStats,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    Placement,
)
from fabric.engines.vllm_writes import SaveChunk, WriteQueue, pack
from fabric.errors import ConfigError
from fabric.l3.format import Provenance
from fabric.rank.node_l2 import open_node_l2
from fabric.rank.node_l2_mapping import fabric_identity

log = logging.getLogger(__name__)


@dataclass
class StepSave:
    """One step's stores gathered layer by layer as the forward computes them
    (``save_kv_layer``); the rest when the forward is done."""

    chunks: list[SaveChunk]
    gathered: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(
        self,
        placement: Placement,
        layer_names: list[str],
        num_blocks: int,
        block_bytes: int,
        options_store: StoreOptions | None,
        l2: L2Options | None = None,
        timeout_s: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.provenance: Provenance | None = None
        self.placement = placement
        self.layer_names = layer_names
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        self.clock = clock or time.monotonic
        self.pages = PageMoves(placement, block_bytes)
        self.writes = WriteQueue(self.pages, placement.rank, timeout_s, self.clock)
        self.pages.promoter = self.writes.promote
        self._l2_options = l2 or L2Options(max_bytes=0)
        self._configured_store = options_store
        self._broken = ""
        self._load_errors: set[int] = set()
        self._failed: list[tuple[str, int, bytes]] = []
        self.failed_loads: set[str] = set()  # requests a load of which did not load whole
        self._outcomes: list[tuple[int, int, int]] = []  # (rank, load id, pages loaded)
        self._sent: set[str] = set()  # finished requests whose last pages are gathered
        self.stats = FabricConnectorStats()
        # Asynchronous loads: one thread reads them in order while the engine steps.
        self.async_loads = AsyncLoads(self.pages, timeout_s, self.clock)
        # A step's loads: on the step thread, layer by layer once the forward is
        # seen to wait for every layer, else whole before the forward.
        self._stepper: ThreadPoolExecutor | None = None
        self._waits_seen: set[int] = set()
        self._wait_order: list[int] = []  # layers in the order the forward waits for them
        # A thread still in a load that was given up (a wedged store): loads that
        # would queue behind it are recomputed at once instead.
        self._stepper_stuck: Future | None = None
        self._step: StepLoad | None = None
        self._step_save: StepSave | None = None

    @property
    def broken(self) -> str:
        """Why this worker neither loads nor stores (``""``: it serves)."""
        return self._broken

    # -- register_kv_caches -------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], provenance: Provenance) -> None:
        """Take vLLM's KV cache tensors as this rank's pages, of ``provenance``; a
        layout the connector cannot serve turns the worker off (logged: the engine
        computes)."""
        self.provenance = self.pages.provenance = provenance
        try:
            self.pages.layers = [
                block_rows(name, kv_caches.get(name), self.num_blocks, self.block_bytes)
                for name in self.layer_names
            ]
        except ConfigError as exc:
            self._broken = str(exc)
            log.error("kvfabric connector: %s; this worker neither loads nor stores", exc)
            self.pages.layers = []
            return
        self.writes.start()
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-layers")
        o = self._l2_options
        self.pages.l2 = open_node_l2(
            o.directory, fabric_identity(o.fabric, o.ray_namespace), provenance.layout,
            self.placement.suffix, self.pages.page_bytes, o.max_bytes,
        )  # fmt: skip
        self.pages.l2_place = node_place(o.directory) if self.pages.l2 is not None else ""

    def _open(self, options: StoreOptions | None) -> None:
        if options is not None:  # the fabric's: its write policy holds
            self.pages.write_through = options.write_policy == "write_through"
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
        run on the step thread — waited for here, before the forward, or, once the
        forward is known to wait for each layer, layer by layer while it runs."""
        self._finish_step()
        self._open(meta.store)
        self.async_loads.cancel(meta.cancel)  # (the engine's cache was reset)
        sync = []
        for job in meta.loads:
            if job.asynchronous:
                self.async_loads.start(job)
            else:
                sync.append(job)
        if sync:
            if self._stepper is None or _busy(self._stepper_stuck):
                # No KV cache this worker can serve, or the step thread is still in a
                # load given up (a wedged store): recomputed at once, not waited for.
                for job in sync:
                    self._loaded(job, GIVEN_UP)
            else:
                pages = sum(len(job.hashes) for job in sync)
                small = pages * self.pages.page_bytes <= STAGING_BYTES * 4
                layerwise = self._layerwise and small
                events = [threading.Event() for _ in self.pages.layers]
                step = StepLoad(sync, events, self.clock() + self.timeout_s, layerwise)
                work = load_layers if layerwise else load_whole
                step.future = self._stepper.submit(work, self.pages, step)
                self._step = step
                if not layerwise:
                    self._finish_step()  # read before the forward
        self._begin_saves(meta)

    @property
    def _layerwise(self) -> bool:
        return bool(self.pages.layers) and len(self._waits_seen) == len(self.pages.layers)

    def wait_layer(self, name: str) -> None:
        """The forward is about to read layer ``name``: wait until it is loaded (at
        most until the step's deadline: past it, the step's loads are given up)."""
        i = self.layer_index.get(name)
        if i is None:
            return
        if i not in self._waits_seen:
            self._waits_seen.add(i)
            self._wait_order.append(i)
            if self._layerwise:
                log.info(
                    "kvfabric connector: the forward waits for each layer: loads run layer "
                    "by layer from the next step"
                )
        step = self._step
        if step is None:
            return
        if not step.events[i].wait(max(step.deadline - self.clock(), 0.0)):
            self._give_up(step)
        step.waited.add(i)

    def _give_up(self, step: StepLoad) -> None:
        """The step's loads took longer than ``timeout_s``: none of them writes a
        block any more, and all are load errors (vLLM recomputes them)."""
        if step.timed_out:
            return
        step.guard.cancel()
        step.timed_out = True
        self._stepper_stuck = step.future
        for event in step.events:
            event.set()
        self.stats.data["load_timeouts"] += len(step.jobs)
        log.warning(
            "kvfabric connector: a step's loads took longer than %.1f s; recomputed",
            self.timeout_s,
        )

    def _finish_step(self, final: bool = True) -> None:
        """Take the outcome of the step's loads (before the forward, or once it is
        done), waiting at most until the step's deadline. A forward that read a
        layer without waiting for it may have read a block not yet loaded: those
        blocks are all reported failed (vLLM recomputes them) and loads are read
        before the forward from then on. Not ``final`` (vLLM takes the step's
        results before a draft model's forward): layers after the last the forward
        waited for have not run yet."""
        step, self._step = self._step, None
        if step is None or step.future is None:
            return
        try:
            outcomes = step.future.result(timeout=max(step.deadline - self.clock(), 0.0))
        except FutureTimeout:
            self._give_up(step)
            outcomes = [(0, self.timeout_s, 0, False)] * len(step.jobs)
        skipped = self._skipped(step, final) if step.layerwise else []
        if step.timed_out:
            outcomes = [(0, seconds, 0, False) for _, seconds, _, _ in outcomes]
        elif skipped:
            log.warning(
                "kvfabric connector: the forward did not wait for layers %s; their loads "
                "are recomputed and later loads read before the forward",
                skipped[:8],
            )
            self._waits_seen.clear()
            self._wait_order.clear()
            outcomes = [(0, seconds, 0, False) for _, seconds, _, _ in outcomes]
        for job, outcome in zip(step.jobs, outcomes, strict=True):
            self._loaded(job, outcome)

    def _skipped(self, step: StepLoad, final: bool) -> list[int]:
        """The layers the forward passed without waiting for: every one not waited
        for once the step is over (``final``); before that, those before (in the
        order the forward waits) the last one it waited for — layers after it have
        not run yet (a draft model's), and read blocks the finished step filled. A
        forward that waited for none (a replayed graph) waited for none of them."""
        if final or not step.waited:
            return sorted(set(range(len(step.events))) - step.waited)
        waited = [self._wait_order.index(i) for i in step.waited if i in self._wait_order]
        last = max(waited, default=-1)
        return [i for i in self._wait_order[: last + 1] if i not in step.waited]

    def _loaded(self, job: PageLoad, outcome: Outcome) -> None:
        """A load's outcome: reported to the scheduler side, its blocks not loaded are
        load errors, and a page found missing or bad (only then: not a load given
        up) is reported failed, for the fabric to forget."""
        n, seconds, l2, checked = outcome
        rank = self.placement.rank
        self._outcomes.append((rank, job.load_id, n))
        self.stats.data["load_seconds"] += seconds
        self.stats.data["loaded_pages"] += n
        self.stats.data["l2_loaded_pages"] += min(l2, n)
        if n < len(job.hashes):
            self.failed_loads.add(job.req_id)
            self._load_errors.update(job.block_ids[n:])
            if checked:
                self._failed.append((job.tag, rank, job.hashes[n]))
            self.stats.data["load_failed_pages"] += len(job.hashes) - n

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads are done, or given up after
        ``timeout_s`` (their failed blocks join ``load_errors`` in the same step)."""
        self._finish_step(final=False)
        done = set()
        for job, outcome in self.async_loads.finished():
            self._loaded(job, outcome)
            done.add(job.req_id)
        return done

    def finished_sends(self) -> set[str]:
        """Finished requests whose last pages were gathered (vLLM may free their
        blocks: ``get_finished``'s sending side)."""
        sent, self._sent = self._sent, set()
        return sent

    def load_errors(self) -> set[int]:
        self._finish_step(final=False)
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- save_kv_layer, wait_for_save ----------------------------------------------------

    def _begin_saves(self, meta: FabricStepMeta) -> None:
        """Give the step's stores their page buffers (packed: every store of the step
        shares them), so that each layer is gathered as soon as the forward has
        computed it (when the step's pages fit)."""
        self._step_save = None
        pages = sum(len(job.run.hashes) for job in meta.saves)
        if not pages or self.pages.store is None or not self.pages.layers:
            return
        if pages * self.pages.page_bytes > STAGING_BYTES * 4:
            return  # gathered in batches once the forward is done
        chunks = [
            SaveChunk(parts, self.pages.buffer(rows))
            for parts, rows in pack(meta.saves, self.pages.batch_pages)
        ]
        self._step_save = StepSave(chunks)

    def save_layer(self, name: str) -> None:
        """The forward has computed layer ``name``: gather it from the step's blocks."""
        step, i = self._step_save, self.layer_index.get(name)
        if step is None or i is None or i in step.gathered:
            return
        for chunk in step.chunks:
            self._gather(chunk, i)
        step.gathered.add(i)

    def _gather(self, chunk: SaveChunk, layer: int) -> None:
        for _, run, block_ids, row in chunk.parts:
            self.pages.gather_layer(chunk.buffer[row : row + len(run.hashes)], block_ids, layer)

    def save(self, meta: FabricStepMeta) -> None:
        """The forward is done: gather what is not gathered yet; the writer thread
        stores the pages (within the write queue's bound)."""
        self._finish_step()
        self._open(meta.store)
        self.writes.carry_out(meta.orders)
        step, self._step_save = self._step_save, None
        if self.pages.store is None or not self.pages.layers:
            for job in meta.saves:
                self.writes.skipped(job.run)
            for chunk in step.chunks if step is not None else ():
                self.pages.give(chunk.buffer)
            self._sent.update(meta.finished)
            return
        deadline = self.clock() + self.timeout_s
        if step is not None:
            for chunk in step.chunks:
                if not self.writes.room(chunk.buffer.numel(), deadline):
                    self.writes.drop(chunk)
                    continue
                for layer in set(range(len(self.pages.layers))) - step.gathered:
                    self._gather(chunk, layer)
                self.writes.store(chunk)
        else:  # too many pages to hold at once: a buffer at a time
            for parts, rows in pack(meta.saves, self.pages.batch_pages):
                chunk = SaveChunk(parts, self.pages.buffer(rows))
                if not self.writes.room(chunk.buffer.numel(), deadline):
                    self.writes.drop(chunk)
                    continue
                for layer in range(len(self.pages.layers)):
                    self._gather(chunk, layer)
                self.writes.store(chunk)
        self._sent.update(meta.finished)  # their blocks are gathered: vLLM may free them
        self.writes.collect()

    # -- build_connector_worker_meta, get_kv_connector_stats ----------------------------

    def worker_meta(self) -> FabricWorkerMeta | None:
        stored, ended, done = self.writes.take()
        if not (stored or self._failed or ended or self._outcomes or done):
            return None
        meta = FabricWorkerMeta(stored, self._failed, ended, self._outcomes, done)
        self._failed, self._outcomes = [], []
        return meta

    def take_stats(self) -> FabricConnectorStats | None:
        self.stats.data["load_timeouts"] += self.async_loads.timeouts
        self.async_loads.timeouts = 0
        for key, n in self.writes.take_counts().items():
            self.stats.data[key] += n
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, FabricConnectorStats(dict.fromkeys(STAT_KEYS, 0))
        return stats

    def close(self) -> None:
        """Let the stores in flight end (at most ``timeout_s`` in all), stop the
        threads and close the store and the node's L2."""
        step = self._step
        if step is not None:
            step.guard.cancel()
        busy = not self.writes.drain(self.clock() + self.timeout_s)
        busy |= self.async_loads.stop()
        busy |= step is not None and step.future is not None and not step.future.done()
        self.writes.shutdown(wait=not busy)
        if self._stepper is not None:
            self._stepper.shutdown(wait=not busy, cancel_futures=True)
            self._stepper = None
        if busy:
            return  # a thread may still use the store and the region: the process ends them
        if self.pages.store is not None:
            self.pages.store.close()
            self.pages.store = None
        if self.pages.l2 is not None:
            self.pages.l2.close()
            self.pages.l2 = None


def _busy(future: Future | None) -> bool:
    return future is not None and not future.done()
