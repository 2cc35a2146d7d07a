"""The whole fabric in one process, no Ray: a ``CoordinatorCore``, one
``RankWorker`` per rank and a ``StorageService``, stepped by hand. For tests,
and for seeing the data plane work without a cluster. Messages still go
through the wire encoding."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fabric.config import FabricConfig
from fabric.coordinator.core import CoordinatorCore
from fabric.coordinator.publisher import KVEventPublisher
from fabric.coordinator.requests import Lease, RequestResult
from fabric.l3.service import StorageService
from fabric.l3.shards import StorageShards
from fabric.messages import decode, encode
from fabric.rank.mesh import LocalBoard
from fabric.rank.worker import RankWorker
from fabric.topology import Topology


def _storage(config: FabricConfig) -> StorageService | StorageShards:
    """One storage service, or one per ``storage.actors`` used as one."""
    n = config.storage.actors
    if n == 1:
        return StorageService(config)
    return StorageShards([StorageService(config, shard) for shard in range(n)])


class LocalFabric:
    def __init__(
        self,
        config: FabricConfig,
        storage: StorageService | StorageShards | None = None,
        clock: Callable[[], float] = time.monotonic,
        l2_dir: str | Path | None = None,
    ) -> None:
        """``l2_dir``: each rank keeps its L2 in a file there (``fabric.rank.shared_l2``),
        as a Ray rank does in ``/dev/shm``: ``restart_rank`` then finds it."""
        self.config = config
        self.l2_dir = None if l2_dir is None else Path(l2_dir)
        self.clock = clock
        self._owns_storage = storage is None  # closed with the fabric
        self.storage = storage or _storage(config)
        self.board = LocalBoard()  # where a sharded model's ranks form their groups
        self.ranks = [self._rank(i) for i in range(Topology(config.topology).world_size)]
        # The ranks of a sharded model compute together: each on its own thread.
        self._threads = (
            ThreadPoolExecutor(len(self.ranks), thread_name_prefix="kvfabric-rank")
            if any(r.needs_mesh for r in self.ranks)
            else None
        )
        self.core = self._open()
        self.results: dict[str, RequestResult] = {}
        # KV events go to ZMQ after every step when events.endpoint is set.
        self.publisher = (
            KVEventPublisher(config.events, config.cache.page_size)
            if config.events.enabled
            else None
        )

    def _rank(self, index: int) -> RankWorker:
        path = None if self.l2_dir is None else str(self.l2_dir / f"rank-{index}.l2")
        return RankWorker(self.config, index, storage=self.storage, board=self.board, l2_path=path)

    def restart_rank(self, index: int) -> None:
        """As if rank ``index``'s process died and started again on its node: its L1
        and queued work are gone, its L2 too unless it lives in ``l2_dir``. The next
        round shows the new incarnation: the coordinator resets and adopts what
        every rank still holds."""
        self.ranks[index].close()  # its process is gone: so are its sockets
        self.ranks[index] = self._rank(index)

    def _open(self) -> CoordinatorCore:
        """A new coordinator over the ranks as they are: it opens an epoch and
        adopts the L2 pages every rank still holds."""
        core = CoordinatorCore(self.config, self.clock)
        core.start([r.report() for r in self.ranks])
        core.adopt([r.inventory(core.rounds.epoch) for r in self.ranks])
        if self.storage.backend is not None:
            core.storage_attached()
        return core

    def restart_coordinator(self) -> None:
        """As if the coordinator died and came back: a new one, the same ranks
        (their L1 and L2 pages intact), every lease and request of the old one gone."""
        self.core = self._open()
        self.results.clear()

    def step(self, run_ranks: bool = True, lagging: Collection[int] = ()) -> list[RequestResult]:
        """One coordinator step: send a batch, let ranks work (all but the indices
        in ``lagging``; none without ``run_ranks``), reduce their reports and the
        storage service's answers to the hit queries (counts and page hashes)."""
        wire = encode(self.core.next_batch())
        batch_pages = self.config.prefetch.query_batch_pages
        hits = {
            op: self.storage.answer(prev, tokens, batch_pages)
            for op, prev, tokens in self.core.take_queries()
        }
        running = [i for i in range(len(self.ranks)) if run_ranks and i not in lagging]
        for rank in self.ranks:
            rank.accept(decode(wire))  # type: ignore[arg-type]
        if self._threads is not None:
            list(self._threads.map(lambda i: self.ranks[i].run_pending(), running))
        for i in running:
            if self._threads is None:
                self.ranks[i].run_pending()
            self.ranks[i].run_storage_pending()
        reports = [decode(encode(r.report())) for r in self.ranks]
        done = self.core.rounds.on_round(reports, hits)  # type: ignore[arg-type]
        if self.core.rounds.adopt_wanted:  # a rank restarted: take back what all still hold
            self.core.adopt([r.inventory(self.core.rounds.epoch) for r in self.ranks])
        if self.config.cache.kv_events:
            removed = self.storage.take_removed()
            if removed:
                self.core.l3_removed(removed)
        self.results.update((r.request_id, r) for r in done)
        if self.publisher is not None:
            self.publisher.publish(self.core.events.drain())
        return done

    def clear_storage(self) -> bool:
        """Delete every page in L3 (as ``kvfabric storage clear``)."""
        cleared = self.storage.clear()
        self.core.l3_cleared()
        return cleared

    def detach_storage(self, max_steps: int = 100) -> bool:
        """Stop L3 work, let what is in flight end, close the backend."""
        self.core.storage_begin_detach()
        for _ in range(max_steps):
            if self.core.storage_drained():
                break
            self.step()
        if not self.core.storage_drained():
            self.results.update((r.request_id, r) for r in self.core.rounds.reset("storage detach"))
            self.core.storage_force_detach()
        detached = self.storage.detach()
        self.core.l3_cleared()
        return detached

    def attach_storage(self, backend: str, options: dict) -> str:
        outcome = self.storage.attach(backend, options)
        self.core.storage_attached()
        return outcome

    def close(self) -> None:
        """Stop the KV event publisher (if any), after sending what it has queued,
        and the ranks' threads; close their collective groups, and the L3 backend
        when this fabric made its storage service."""
        if self.publisher is not None:
            self.publisher.close()
        if self._threads is not None:
            self._threads.shutdown()
        for rank in self.ranks:
            rank.close(release_l2=True)
        if self._owns_storage:
            self.storage.detach()

    def computed_tokens_by_rank(self) -> dict[str, int]:
        """Tokens each rank has run through its share of the model."""
        return {str(r.shard.rank): r.computed_tokens for r in self.ranks}

    def serve(
        self, tokens: bytes, namespace: str = "default", max_steps: int = 100
    ) -> RequestResult:
        return self._wait(self.core.submit(tokens, namespace), max_steps)

    def append(self, lease: Lease, tokens: bytes, max_steps: int = 100) -> RequestResult:
        """Decode: the KV of ``tokens`` generated after ``lease``'s request."""
        return self._wait(self.core.append(lease, tokens), max_steps)

    def _wait(self, rid: str, max_steps: int) -> RequestResult:
        for _ in range(max_steps):
            self.step()
            if rid in self.results:
                return self.results.pop(rid)
        raise TimeoutError(f"{rid} did not finish in {max_steps} steps")

    def settle(self, max_steps: int = 100) -> None:
        """Step until the coordinator has nothing in flight (backups acked, ...)."""
        for _ in range(max_steps):
            if self.core.idle:
                return
            self.step()
        raise TimeoutError(f"still busy after {max_steps} steps")

    def read_kv(self, lease: Lease) -> list:
        """Every rank's shard of the lease's KV (see ``fabric.rank.model.assemble``)."""
        return [r.read(lease.tokens, list(lease.device_pages)) for r in self.ranks]

    def verify(self, result: RequestResult, tokens: bytes) -> list[bool]:
        """Per rank: does L1 hold exactly the fresh KV of the leased prefix?"""
        lease = result.lease
        assert lease is not None
        cached = tokens[: lease.tokens * 4]
        return [
            r.verify(lease.namespace, cached, list(lease.device_pages))
            and r.verify_parts(lease.namespace, cached, list(lease.sliding), list(lease.mamba))
            for r in self.ranks
        ]
