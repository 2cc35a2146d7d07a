"""kvfabric as a secondary tier of vLLM's offloading connector (vLLM 0.33).

    vllm serve ... --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "KvFabricTier",
          "module_path": "fabric.engines.vllm", "path": "/data/kvfabric-l3"}]}}'

vLLM's ``SecondaryTierFactory`` builds ``KvFabricTier(offloading_spec,
primary_kv_view, tier_type, backpressure_detector, **options)`` in the
scheduler. Stores copy chunks out of the primary (CPU) tier's memory into a
kvfabric store, loads copy them back into the slots vLLM names; both run on
this tier's I/O threads, and ``get_finished_jobs`` reports them. Lookups run
on vLLM's own ``AsyncLookupManager`` (a miss may rescan the store's directory,
or ask a fabric over Ray): never on the scheduler's thread.

A vLLM offload key (block hash and 4-byte group index) becomes an L3 key
through ``fabric.engines.keys.vllm_hash`` (the tenant's domain, the whole key
hashed), under a provenance whose layout names everything that makes a chunk's
bytes what they are — model, dtype, chunk size, blocks per chunk, KV cache
groups and their layers, the TP/PP/PCP/DCP split, the canonical layout — so
chunks are shared between vLLM workers exactly when those agree. A chunk that
is missing, corrupt or written for another key or configuration is a failed
load (vLLM recomputes it), never bytes it takes for a hit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from fabric.engines.keys import PageNamer, check_tenant, shard_suffix, vllm_hash
from fabric.engines.store import PageStore, StoreOptions, open_store, parse_options
from fabric.errors import ConfigError
from fabric.l3.format import Provenance

log = logging.getLogger(__name__)


class VllmOptions(StoreOptions):
    """This tier's keys in its ``secondary_tiers`` entry (beside ``type`` and
    ``module_path``)."""

    namespace: str = Field("", description="a kvfabric tenant, or empty")
    io_threads: int = Field(4, ge=1, le=64, description="an integer in 1..64")
    enable_kv_events: bool = Field(False, description="true or false")
    locality: Literal["LOCAL", "REMOTE"] | None = Field(None, description="LOCAL, REMOTE or none")


def chunk_provenance(spec: Any, chunk_bytes: int) -> tuple[Provenance, str]:
    """The provenance of this worker's chunks and its shard suffix, from vLLM's
    normalized offloading config (``spec.config``)."""
    config = spec.config
    parallel = config.parallel
    agnostic = parallel.is_parallelism_agnostic or config.replicated_layout
    identity = {
        "chunk_bytes": chunk_bytes,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "dtype": str(config.model.dtype),
        "groups": [
            [g.tokens_per_block, list(g.layer_names), g.sliding_window_size_in_chunks]
            for g in config.groups
        ],
        "split": [1, 1, 1, 1]
        if agnostic
        else [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "replicated": bool(config.replicated_layout),
        "canonical": config.kv_cache_layout if config.canonical_layout else None,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    provenance = Provenance(
        config.model.name,
        f"vllm/{digest}",
        "uint8",
        (chunk_bytes,),
        config.cache.tokens_per_hash * config.cache.blocks_per_chunk,
        "vllm",
    )
    return provenance, shard_suffix(0, 0, 0 if agnostic else parallel.rank)


class _Lookups(AsyncLookupManager):
    def __init__(self, tier: KvFabricTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.store.present(self._tier.l3_keys(keys))


class KvFabricTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over a kvfabric store (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options: VllmOptions = parse_options(VllmOptions, options, "kvfabric vLLM tier")
        if self.options.namespace:
            check_tenant(self.options.namespace)
        self.locality = Locality(self.options.locality) if self.options.locality else None
        self.events: list[OffloadingEvent] | None = None
        if (
            self.options.enable_kv_events
            and offloading_spec.kv_events_config.enable_kv_cache_events
        ):
            self.events = []
        chunk = self.block_size_bytes
        config = offloading_spec.config
        declared = config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk
        if config.worker_kv_bytes_per_block > 0 and chunk < declared:
            # A chunk of the primary view cannot hold what the spec says one holds.
            raise ConfigError(
                f"kvfabric vLLM tier: a chunk of the primary KV view is {chunk} bytes, but "
                f"the offloading spec declares {config.worker_kv_bytes_per_block} bytes a "
                f"block x {config.cache.blocks_per_chunk} blocks = {declared}: the declared "
                "geometry is not the pool's"
            )
        self.primary = np.asarray(primary_kv_view).view(np.uint8).reshape(-1, chunk)
        provenance, suffix = chunk_provenance(offloading_spec, chunk)
        self.provenance = provenance
        self.namer = PageNamer(provenance, suffix)
        self.store: PageStore = open_store(self.options, "vllm")
        self._pool = ThreadPoolExecutor(self.options.io_threads, thread_name_prefix="kvfabric-vllm")
        self._jobs: dict[JobId, Future] = {}
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        # A failed load's keys, marked missing on the scheduler's thread.
        self._misses: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._lookups = _Lookups(self, tier_type)

    def l3_keys(self, keys: Iterable[OffloadKey]) -> list[str]:
        namespace = self.options.namespace
        return [self.namer.key(vllm_hash(namespace, key)) for key in keys]

    # -- lookups -----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    # -- jobs --------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._load)

    def _submit(self, job: TransferJob, run: Any) -> None:
        keys, chunks = list(job.keys), np.asarray(job.chunk_ids, dtype=np.int64)
        future = self._pool.submit(self._timed, job.job_id, run, keys, chunks)
        with self._lock:
            self._jobs[job.job_id] = future

    def _timed(self, job_id: JobId, run: Any, keys: list[OffloadKey], chunks: np.ndarray) -> None:
        start = time.perf_counter()
        try:
            result = run(job_id, keys, chunks)
        except Exception as exc:  # a job always ends with a result, never an exception
            log.warning("kvfabric vLLM tier: job %s failed: %s", job_id, exc)
            result = JobResult(job_id=job_id, success=False)
        result.transfer_time = time.perf_counter() - start
        self._finished.put(result)

    def _store(self, job_id: JobId, keys: list[OffloadKey], chunks: np.ndarray) -> JobResult:
        if len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        full = self.l3_keys(keys)
        present = self.store.present(full)
        todo = [i for i, p in enumerate(present) if not p]
        stored = [True] * len(keys)
        if todo:
            rows = [self.primary[c] for c in chunks[todo]]  # views: no copy before the write
            for i, ok in zip(
                todo, self.store.store([full[i] for i in todo], rows, self.provenance), strict=True
            ):
                stored[i] = ok
        if self.events is not None:
            done = [k for k, ok in zip(keys, stored, strict=True) if ok]
            if done:
                with self._lock:
                    self.events.append(
                        OffloadingEvent(
                            keys=done, medium=self.medium, removed=False, locality=self.locality
                        )
                    )
        return JobResult(
            job_id=job_id, success=all(stored), transfer_bytes=len(todo) * self.block_size_bytes
        )

    def _load(self, job_id: JobId, keys: list[OffloadKey], chunks: np.ndarray) -> JobResult:
        if len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        full = self.l3_keys(keys)
        if len(chunks) and np.array_equal(chunks, np.arange(chunks[0], chunks[0] + len(chunks))):
            n = self.store.load(
                full, self.primary[chunks[0] : chunks[0] + len(chunks)], self.provenance
            )
        else:
            rows = np.empty((len(keys), self.block_size_bytes), dtype=np.uint8)
            n = self.store.load(full, rows, self.provenance)
            self.primary[chunks[:n]] = rows[:n]
        if n < len(keys):
            self._misses.put(keys[n:])
            return JobResult(
                job_id=job_id,
                success=False,
                successful_keys=tuple(keys[:n]) if n else None,
                transfer_bytes=n * self.block_size_bytes,
            )
        return JobResult(job_id=job_id, success=True, transfer_bytes=n * self.block_size_bytes)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        while True:  # a failed load's keys are misses from now on (scheduler thread)
            try:
                self._lookups.mark_miss(self._misses.get_nowait())
            except queue.Empty:
                break
        results = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._jobs.pop(result.job_id, None)
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs) or not self._finished.empty()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        with self._lock:
            events, self.events = self.events, []
        return events

    def drain_jobs(self) -> None:
        with self._lock:
            futures = list(self._jobs.values())
        wait(futures)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()
