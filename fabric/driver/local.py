"""The whole fabric in one process, no Ray: a ``CoordinatorCore``, one
``RankWorker`` per rank and a ``StorageService``, stepped by hand. For tests,
and for seeing the data plane work without a cluster. Messages still go
through the wire encoding, and the coordinator's step is the Ray actor's
(``CoordinatorDriver``), over the ranks in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fabric.cache.keys import pack_tokens
from fabric.config import FabricConfig
from fabric.coordinator.commands import Answer, Query
from fabric.coordinator.core import CoordinatorCore
from fabric.coordinator.driver import CoordinatorDriver, Replies
from fabric.coordinator.publisher import KVEventPublisher
from fabric.coordinator.requests import Lease, RequestResult
from fabric.l3.service import StorageService
from fabric.l3.shards import StorageShards
from fabric.messages import Report, decode, encode
from fabric.rank.mesh import LocalBoard
from fabric.rank.worker import RankWorker
from fabric.topology import Topology


def _storage(config: FabricConfig) -> StorageService | StorageShards:
    """One storage service, or one per ``storage.actors`` used as one."""
    n = config.storage.actors
    if n == 1:
        return StorageService(config)
    return StorageShards([StorageService(config, shard) for shard in range(n)])


class LocalRanks:
    """The ranks of a ``LocalFabric`` as a ``RankGroup``: a round runs each rank's
    commands here (those in ``lagging`` or, without ``run``, none, take the batch
    but do not work), and every rank reports."""

    def __init__(self, fabric: LocalFabric) -> None:
        self.fabric = fabric
        self.run = True
        self.lagging: Collection[int] = ()

    async def reports(self) -> list[Report]:
        return [r.report() for r in self.fabric.ranks]

    async def inventories(self, epoch: int) -> list[Any]:
        return [r.inventory(epoch) for r in self.fabric.ranks]

    async def round(self, batch: bytes) -> Replies:
        ranks, threads = self.fabric.ranks, self.fabric.threads
        running = [i for i in range(len(ranks)) if self.run and i not in self.lagging]
        for rank in ranks:
            rank.accept(decode(batch))  # type: ignore[arg-type]
        if threads is not None:
            list(threads.map(lambda i: ranks[i].run_pending(), running))
        for i in running:
            if threads is None:
                ranks[i].run_pending()
            ranks[i].storage_io.run_pending()
        return Replies([encode(r.report()) for r in ranks], [None] * len(ranks))

    def restart(self, index: int) -> None:
        self.fabric.restart_rank(index)


class LocalStorage:
    """A ``LocalFabric``'s storage as a ``StorageLink``: answered at once."""

    def __init__(self, storage: StorageService | StorageShards, batch_pages: int) -> None:
        self.storage = storage
        self.batch_pages = batch_pages

    def query(self, queries: list[Query]) -> asyncio.Future[Mapping[int, Answer]]:
        answers = {
            op: self.storage.answer(prev, tokens, self.batch_pages) for op, prev, tokens in queries
        }
        done: asyncio.Future[Mapping[int, Answer]] = asyncio.get_running_loop().create_future()
        done.set_result(answers)
        return done


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
        self.threads = (
            ThreadPoolExecutor(len(self.ranks), thread_name_prefix="kvfabric-rank")
            if any(r.needs_mesh for r in self.ranks)
            else None
        )
        self.results: dict[str, RequestResult] = {}
        self._delivered: list[RequestResult] = []
        # KV events go to ZMQ after every step when events.endpoint is set.
        self.publisher = (
            KVEventPublisher(config.events, config.cache.page_size)
            if config.events.enabled
            else None
        )
        self.group = LocalRanks(self)
        self._loop = asyncio.new_event_loop()
        self.driver = self._open()
        self.core = self.driver.core

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

    def _open(self) -> CoordinatorDriver:
        """A new coordinator over the ranks as they are: it opens an epoch and
        adopts the L2 pages every rank still holds."""
        driver = CoordinatorDriver(
            CoordinatorCore(self.config, self.clock),
            self.group,
            LocalStorage(self.storage, self.config.prefetch.query_batch_pages),
            self._deliver,
            self.publisher.publish if self.publisher is not None else None,
            self._take_removed,
            skip_idle_rounds=False,
        )
        self._loop.run_until_complete(driver.start(self.storage.backend is not None))
        return driver

    def restart_coordinator(self) -> None:
        """As if the coordinator died and came back: a new one, the same ranks
        (their L1 and L2 pages intact), every lease and request of the old one gone."""
        self.results.clear()
        self.driver = self._open()
        self.core = self.driver.core

    def _take_removed(self) -> None:
        if self.config.cache.kv_events:
            removed = self.storage.take_removed()
            if removed:
                self.core.l3_removed(removed)

    def step(self, run_ranks: bool = True, lagging: Collection[int] = ()) -> list[RequestResult]:
        """One coordinator step: send a batch, let ranks work (all but the indices
        in ``lagging``; none without ``run_ranks``), reduce their reports and the
        storage service's answers to the hit queries (counts and page hashes).
        Returns the results delivered in the step."""
        self.group.run, self.group.lagging = run_ranks, lagging
        self._delivered: list[RequestResult] = []
        self._loop.run_until_complete(self.driver.step())
        return self._delivered

    def _deliver(self, results: list[RequestResult]) -> None:
        self._delivered.extend(results)
        self.results.update((r.request_id, r) for r in results)

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
        if self.threads is not None:
            self.threads.shutdown()
        self._loop.close()
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

    def read_parts(self, lease: Lease) -> list:
        """Every rank's shard of the lease's other components (a hybrid model's)."""
        return [r.parts.read(list(lease.sliding), list(lease.mamba)) for r in self.ranks]

    def verify(self, result: RequestResult, tokens: bytes) -> list[bool]:
        """Per rank: does L1 hold exactly the fresh KV of the leased prefix?"""
        lease = result.lease
        assert lease is not None
        cached = tokens[: lease.tokens * 4]
        return [
            r.verify(lease.namespace, cached, list(lease.device_pages))
            and r.parts.verify(lease.namespace, cached, list(lease.sliding), list(lease.mamba))
            for r in self.ranks
        ]


class LocalClient:
    """A ``LocalFabric`` behind the calls a driver makes on a ``Fabric`` client
    (``submit`` of token ids, ``append``, ``release``, ``read_kv``, ...): what
    ``fabric.tools.chat.converse`` drives, in one process."""

    def __init__(self, fabric: LocalFabric) -> None:
        self.f = fabric

    def submit(self, tokens: Sequence[int]) -> RequestResult:
        return self.f.serve(pack_tokens(tokens))

    def append(self, lease: Lease, tokens: Sequence[int]) -> RequestResult:
        return self.f.append(lease, pack_tokens(tokens))

    def release(self, lease: Lease, session: str | None = None) -> bool:
        return self.f.core.release(lease, session)

    def end_session(self, session: str) -> bool:
        return self.f.core.end_session(session)

    def read_kv(self, lease: Lease) -> list:
        return self.f.read_kv(lease)

    def read_parts(self, lease: Lease) -> list:
        return self.f.read_parts(lease)

    def computed_tokens_by_rank(self) -> dict[str, int]:
        return self.f.computed_tokens_by_rank()
