"""A rank's data plane, without Ray: its L1/L2 pools, the commands it applies in
order, and the counters it reports.

``accept`` takes a step's batch (from the message thread) and queues its
commands; ``run_one``/``run_pending`` execute them (on the transfer thread);
``report`` reads the counters. A command is counted only after its copy has
finished (on GPU: after its stream's event), so a report never claims work
that is not done. Thread-safe: the message thread and the transfer thread
meet only under ``self.lock``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch

from fabric.cache.keys import chain_hashes, namespace_seed
from fabric.config import FabricConfig
from fabric.l3.direct import direct_reads
from fabric.messages import (
    Backup,
    Batch,
    Compute,
    Message,
    Prefetch,
    PrefetchProgress,
    Report,
    Write,
)
from fabric.rank.index import PageIndex
from fabric.rank.mesh import Board, Mesh, MeshError
from fabric.rank.model import within
from fabric.rank.pools import KVPool, RankPools, StatePool, Tiers, pick_device
from fabric.rank.producer import ConstantKV, KVFiller, SyntheticKV, SyntheticStates
from fabric.rank.shared_l2 import SharedL2
from fabric.topology import Shard, Topology, kind_layers

log = logging.getLogger(__name__)


class StorageLink(Protocol):
    """How a rank reaches L3 (a storage actor, or a ``StorageService`` in process)."""

    def load(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> np.ndarray: ...

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool: ...


@dataclass
class Faults:
    """Injected faults for chaos tests: a delay before every command, and op kinds that fail."""

    delay_s: float = 0.0
    fail_writes: bool = False
    fail_computes: bool = False


def collective_timeout(configured_s: float, rank_timeout_s: float) -> float:
    """How long a rank waits in one collective: as configured, but at most half the
    rank timeout. A new epoch's batch waits for the compute in flight, so a rank
    stuck longer in a collective would miss its round and look absent."""
    return min(configured_s, rank_timeout_s / 2)


def mesh_key(epoch: int, incarnations: tuple[str, ...]) -> str:
    """The mesh generation of a batch: its epoch and the ranks it addresses."""
    digest = hashlib.blake2b("/".join(incarnations).encode(), digest_size=6).hexdigest()
    return f"e{epoch}-{digest}"


class RankWorker:
    def __init__(
        self,
        config: FabricConfig,
        index: int,
        filler: KVFiller | None = None,
        storage: StorageLink | None = None,
        board: Board | None = None,
        l2_path: str | None = None,
    ) -> None:
        """``board``: where the ranks of a sharded model meet to form their
        collective groups (``fabric.rank.mesh``); none: no groups can form.
        ``l2_path``: keep L2 (its bytes and its pages' names) in that shared-memory
        file (``fabric.rank.shared_l2``), so a process started again with the same
        path finds it as it was; none: in this process."""
        self.config = config
        self.index = index
        self.shard = Topology(config.topology).shard(index, config.model, config.cache.page_size)
        rank = self.shard.rank
        self.suffix = rank.suffix
        # Prefetches read from a shared L3 directory here, not through Ray
        # (``storage.direct_reads``; fabric.l3.direct).
        self.storage = direct_reads(storage, config)
        self.device = pick_device(config.runtime.device)
        cuda = self.device.type == "cuda"
        cache, model = config.cache, config.model
        host = torch.device("cpu")

        def pools(l1_pages: int, l2_pages: int, layers: int) -> tuple[KVPool, KVPool]:
            # An L1 pool on the device and its L2 pool in (pinned, on GPU) host memory.
            return (
                KVPool(l1_pages, self.shard, model, self.device, layers=layers),
                KVPool(l2_pages, self.shard, model, host, pin_memory=cuda, layers=layers),
            )

        # The pools by component: the full-attention layers' (every layer's, for a
        # full-attention model), and a hybrid model's sliding and mamba ones.
        self.pools = RankPools()
        full = kind_layers(self.shard, model, "full")
        self.shared_l2: SharedL2 | None = None
        if l2_path is None or set(model.components) != {"full"}:
            self.pools.add("full", *pools(cache.device_pages, cache.host_pages, len(full)))
        else:
            # L2 outside this process (a hybrid model's other pools stay inside:
            # without them its pages could not be adopted anyway).
            def shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                numel = math.prod(shape)
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                geometry = {
                    "shape": list(shape),
                    "dtype": str(dtype),
                    "pool_bytes": nbytes,
                    "page_size": cache.page_size,
                    "shard": self.suffix,
                    "layout": model.layout,
                }
                try:
                    self.shared_l2 = SharedL2(
                        l2_path, geometry, cache.host_pages, cache.page_size * 4
                    )
                except OSError as exc:  # too little shared memory, or not ours
                    log.warning("rank %s: L2 in this process, not %s: %s", rank, l2_path, exc)
                    return torch.zeros(shape, dtype=dtype)
                return torch.frombuffer(self.shared_l2.pool, dtype=dtype, count=numel).view(shape)

            l2 = KVPool(
                cache.host_pages, self.shard, model, host, layers=len(full), allocate=shared
            )
            self.pools.add(
                "full",
                KVPool(cache.device_pages, self.shard, model, self.device, layers=len(full)),
                l2,
            )
            if cuda:  # page-locked for the copy engines, as a pinned pool would be
                with contextlib.suppress(Exception):
                    buf = l2.buffer
                    torch.cuda.cudart().cudaHostRegister(
                        buf.data_ptr(), buf.numel() * buf.element_size(), 0
                    )
        self.producer = SyntheticKV(self.shard, model, cache.page_size, full)
        # A hybrid model's other components (``fabric.cache.components``).
        self.state_elems = model.mamba_elems(config.topology.tp)
        if "sliding" in model.components:
            ids = kind_layers(self.shard, model, "sliding")
            self.pools.add(
                "sliding", *pools(cache.sliding_pages, cache.host_sliding_pages, len(ids))
            )
            self.sliding_producer = SyntheticKV(self.shard, model, cache.page_size, ids)
        if "mamba" in model.components:
            ids, elems = kind_layers(self.shard, model, "mamba"), self.state_elems
            self.pools.add(
                "mamba",
                StatePool(cache.mamba_slots, len(ids), elems, self.device),
                StatePool(cache.host_mamba_slots, len(ids), elems, host),
            )
            self.state_producer = SyntheticStates(self.shard, ids, elems)
        if filler is None and model.filler == "constant":
            filler = ConstantKV(self.shard, model, cache.page_size)
        if filler is None and model.filler == "llama":
            # transformers: an optional extra
            from fabric.rank.sharded import ShardedLlamaKV

            filler = ShardedLlamaKV(
                self.shard, model, cache.page_size, config.topology, self.device
            )
        if filler is None and model.filler == "hybrid":
            from fabric.rank.hybrid import HybridKV  # transformers: an optional extra

            filler = HybridKV(
                self.shard, model, cache.page_size, self.state_elems, config.topology.tp
            )

        self.filler: KVFiller = filler or self.producer
        # The collective groups of a sharded model's ranks, one generation at a time.
        self.board = board
        self.world = Topology(config.topology).world_size
        # A filler that computes from the cache (``ShardedLlamaKV``); with more than
        # one rank, it computes with the others over a mesh.
        self.sharded = bool(getattr(self.filler, "needs_mesh", False))
        self.needs_mesh = self.world > 1 and self.sharded
        self.mesh: Mesh | None = None
        self.broken_meshes: set[str] = set()
        self._mesh_key = ""
        self._mesh_of: tuple[int, tuple[str, ...]] | None = None  # what the key names
        # What every L1 and L2 page slot holds: a restarted coordinator adopts L2.
        self.names = PageIndex(cache.page_size, host_store=self.shared_l2)
        # L2 pages a restarted process found named in its shared L2.
        self.l2_kept = len(self.names.host)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.incarnation = uuid.uuid4().hex
        self.faults = Faults()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.idle = threading.Condition(self.lock)
        # Bumped (and ``news`` notified) whenever the report would change: a
        # command done, prefetch progress, a new epoch (``wait_for_news``).
        self.news = threading.Condition(self.lock)
        self.news_seq = 0
        self.copying = False
        self.storing = False  # the storage thread runs a command
        self.epoch = 0
        self._reset_counters()
        # Bytes this rank copied, by direction, since it started (never reset):
        # what its actor's repr and Ray metrics show.
        l1 = self.l1
        self.page_bytes = l1.nbytes // max(1, l1.num_pages)
        self.moved_bytes = dict.fromkeys(
            ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host"), 0
        )
        # (direction, seconds) of each finished copy (a merged L1<->L2 group, a
        # backup, a prefetch batch), for a latency histogram; the oldest go first.
        self.transfer_seconds: deque[tuple[str, float]] = deque(maxlen=4096)

    @property
    def l1(self) -> KVPool:
        """The full-attention layers' L1 pool (what a filler computes into)."""
        return cast(KVPool, self.pools["full"].device)

    @property
    def sliding(self) -> KVPool | None:
        """A hybrid model's L1 pool of sliding-window pages, if it has one."""
        return cast("KVPool | None", self.pools.device("sliding"))

    @property
    def states(self) -> StatePool | None:
        """A hybrid model's L1 pool of mamba states, if it has one."""
        return cast("StatePool | None", self.pools.device("mamba"))

    def _reset_counters(self) -> None:
        self.queue: deque[Message] = deque()
        self.storage_queue: deque[Message] = deque()
        self.last_cmd_id = 0
        self.computes_done = self.writes_done = self.loads_done = self.backups_done = 0
        self.failed: list[int] = []
        # op_id -> [completed_tokens, finished, terminated], from the first batch on
        self.prefetch: dict[int, list] = {}
        self.prefetch_ops: set[int] = set()
        self.stopping: set[int] = set()
        # The mesh generation each queued compute runs in (from its batch).
        self.mesh_keys: dict[int, str] = {}

    # -- message thread --------------------------------------------------------------

    def accept(self, batch: Batch) -> None:
        """Queue a batch's commands. A newer epoch starts counting afresh; an older
        one is ignored; a command id seen before is not applied again."""
        with self.lock:
            if batch.epoch < self.epoch:
                return
            self._open_epoch(batch.epoch)
            addressed = self.index < len(batch.incarnations) and (
                batch.incarnations[self.index] == self.incarnation
            )
            if addressed and self.needs_mesh and self._mesh_of != (batch.epoch, batch.incarnations):
                self._mesh_of = (batch.epoch, batch.incarnations)
                self._mesh_key = mesh_key(batch.epoch, batch.incarnations)
            for cmd in batch.commands if addressed else ():
                if cmd.cmd_id <= self.last_cmd_id:  # type: ignore[attr-defined]
                    continue
                self.last_cmd_id = cmd.cmd_id  # type: ignore[attr-defined]
                if isinstance(cmd, Compute) and self.needs_mesh:
                    self.mesh_keys[cmd.cmd_id] = self._mesh_key
                if isinstance(cmd, Prefetch):
                    self.prefetch_ops.add(cmd.op_id)
                    self.storage_queue.append(cmd)
                elif isinstance(cmd, Backup):
                    self.storage_queue.append(cmd)
                else:
                    self.queue.append(cmd)
            if batch.acked:
                self.failed = [c for c in self.failed if c > batch.acked]
            self.stopping.update(op for op in batch.stop if op in self.prefetch_ops)
            for op in batch.forget:
                self.prefetch.pop(op, None)
                self.prefetch_ops.discard(op)
                self.stopping.discard(op)
            self.ready.notify_all()

    def inventory(self, epoch: int) -> list[tuple[int, str, bytes, bytes, bytes]]:
        """The named L2 slots (``PageIndex.entries``) for a new coordinator opening
        ``epoch``: first the epoch is opened as a batch of it would (the old
        epoch's queued commands dropped, its copy in flight finished), so nothing
        changes the slots after they are listed."""
        with self.lock:
            self._open_epoch(epoch)
            return self.names.entries()

    def _announce(self) -> None:
        """Under the lock: the report changed."""
        self.news_seq += 1
        self.news.notify_all()

    def wait_for_news(self, timeout: float, since: int | None = None) -> None:
        """Return once the report has changed since ``since`` (a ``news_seq`` read
        earlier; default: now), once this rank has nothing in flight, or after
        ``timeout`` seconds: a round's reply then carries what finished rather
        than the same report again."""
        deadline = time.monotonic() + timeout
        with self.lock:
            seen = self.news_seq if since is None else since
            while self.news_seq == seen and (
                self.queue or self.storage_queue or self.copying or self.storing
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.news.wait(left)

    def _open_epoch(self, epoch: int) -> None:
        """Under the lock: a newer ``epoch`` starts counting afresh. Pages of the old
        epoch may already belong to new data: the copy in flight finishes first
        (the storage thread checks the epoch before it writes), and the old
        epoch's queued commands are dropped."""
        if epoch > self.epoch:
            self.epoch = epoch
            while self.copying:
                self.idle.wait()
            self._reset_counters()
            self.broken_meshes.clear()  # keys name their epoch: none comes back
            self._announce()

    def report(self) -> Report:
        with self.lock:
            return Report(
                self.index,
                self.incarnation,
                self.epoch,
                self.computes_done,
                self.writes_done,
                self.loads_done,
                tuple(self.failed),
                self.backups_done,
                tuple(PrefetchProgress(op, c, f, t) for op, (c, f, t) in self.prefetch.items()),
            )

    # -- transfer thread -------------------------------------------------------------

    def run_pending(self) -> int:
        """Apply every queued command now (tests and single-thread use)."""
        n = 0
        while self.run_one(block=False):
            n += 1
        return n

    def run_one(self, block: bool = True, timeout: float | None = None) -> bool:
        """Apply the next command — with any copies of the same kind queued right
        behind it, merged into one copy — and count them once finished."""
        with self.lock:
            if block and not self.queue:
                self.ready.wait(timeout)
            if not self.queue:
                return False
            group, epoch = [self.queue.popleft()], self.epoch
            if not isinstance(group[0], Compute):
                while self.queue and type(self.queue[0]) is type(group[0]):
                    group.append(self.queue.popleft())
            self.copying = True
        started = time.perf_counter()
        try:
            ok = self._apply(group)
        finally:
            with self.lock:
                self.copying = False
                self.idle.notify_all()
        with self.lock:
            if epoch != self.epoch:
                return True  # a reset arrived meanwhile; these belong to the old epoch
            self._announce()
            for cmd in group:
                if not ok:
                    self.failed.append(cmd.cmd_id)  # type: ignore[attr-defined]
                if isinstance(cmd, Compute):
                    self.computes_done += 1
                elif isinstance(cmd, Write):
                    self.writes_done += 1
                    if ok:
                        self.moved_bytes["device_to_host"] += len(cmd.host_pages) * self.page_bytes
                else:
                    self.loads_done += 1
                    if ok:
                        self.moved_bytes["host_to_device"] += len(cmd.host_pages) * self.page_bytes  # type: ignore[union-attr]
            if ok and not isinstance(group[0], Compute):
                direction = "device_to_host" if isinstance(group[0], Write) else "host_to_device"
                self.transfer_seconds.append((direction, time.perf_counter() - started))
        return True

    def _apply(self, group: list[Message]) -> bool:
        first = group[0]
        try:
            if self.faults.delay_s:
                time.sleep(self.faults.delay_s)
            if isinstance(first, Compute):
                self.names.forget_device(first.pages)
                if self.sharded:
                    return self._sharded_compute(first)
                if self.faults.fail_computes:
                    return False
                self.filler.fill(
                    self.l1,
                    first.namespace,
                    first.prev_hash,
                    first.tokens,
                    first.start_token,
                    list(first.pages),
                    first.prefix,
                    list(first.prefix_pages),
                )
                self._store_parts(first)
                if first.pages:
                    self.names.computed(
                        first.namespace, first.prev_hash, first.tokens, list(first.pages)
                    )
            else:
                names = self.names
                if isinstance(first, Write):
                    device = [p for c in group for p in c.device_pages]  # type: ignore[attr-defined]
                    host = [p for c in group for p in c.host_pages]  # type: ignore[attr-defined]
                    names.forget_host(host)
                    if self.faults.fail_writes:
                        return False
                    self._copy(self.pools["full"], device, host, to_host=True)
                    names.copied(names.device, device, names.host, host)
                else:
                    host = [p for c in group for p in c.host_pages]  # type: ignore[attr-defined]
                    device = [p for c in group for p in c.device_pages]  # type: ignore[attr-defined]
                    names.forget_device(device)
                    self._copy(self.pools["full"], host, device, to_host=False)
                    names.copied(names.host, host, names.device, device)
                self._copy_parts(group, isinstance(first, Write))
            if self.stream is not None:
                torch.cuda.current_stream(self.device).synchronize()
            return True
        except Exception:
            log.exception(
                "rank %s: %s of commands %s failed",
                self.shard.rank,
                type(first).__name__,
                [c.cmd_id for c in group],  # type: ignore[attr-defined]
            )
            return False

    def _sharded_compute(self, cmd: Compute) -> bool:
        """A compute that the ranks of a sharded model run together, in the mesh
        generation of its batch. Any failure breaks the generation for this rank:
        it never takes part in it again, so its peers fail their operations
        (connection closed, or timeout) rather than pair with another compute's
        data; the failed compute resets the epoch, and the next one's batches
        name a new generation."""
        with self.lock:
            key = self.mesh_keys.pop(cmd.cmd_id, self._mesh_key)
        try:
            if key in self.broken_meshes:
                raise MeshError(f"mesh {key} broke earlier in this epoch")
            if self.faults.fail_computes:
                raise MeshError("injected compute failure")
            if cmd.tokens:
                mesh = self._mesh(key) if self.needs_mesh else None
                self.filler.attach(mesh)  # type: ignore[attr-defined]
            self.filler.fill(
                self.l1,
                cmd.namespace,
                cmd.prev_hash,
                cmd.tokens,
                cmd.start_token,
                list(cmd.pages),
                cmd.prefix,
                list(cmd.prefix_pages),
                cmd.keep,
            )
        except Exception as exc:
            self._break_mesh(key)
            if isinstance(exc, MeshError):
                log.warning("rank %s: compute %d failed: %s", self.shard.rank, cmd.cmd_id, exc)
                return False
            raise
        if cmd.pages:
            self.names.computed(cmd.namespace, cmd.prev_hash, cmd.tokens, list(cmd.pages))
        return True

    def _mesh(self, key: str) -> Mesh:
        """The mesh generation ``key``, formed (with every other rank) on first use."""
        if self.mesh is not None and self.mesh.key == key:
            return self.mesh
        if self.mesh is not None:
            self.mesh.close()
            self.mesh = None
        if self.board is None:
            raise MeshError("a sharded model's rank has no board to meet its peers on")
        runtime = self.config.runtime
        self.mesh = Mesh(
            self.board,
            key,
            self.config.topology,
            self.index,
            self.device,
            collective_timeout(runtime.collective_timeout_s, runtime.rank_timeout_s),
        )
        return self.mesh

    def _break_mesh(self, key: str) -> None:
        if not self.needs_mesh:
            return
        self.broken_meshes.add(key)
        if self.mesh is not None and self.mesh.key == key:
            self.mesh.close()
            self.mesh = None

    def close(self, release_l2: bool = False) -> None:
        """Release what this rank holds outside its pools: its collective groups
        (their sockets; its peers' operations in them fail); with ``release_l2``
        its shared L2 file too (the fabric is shutting down: nothing will come
        back for it)."""
        if self.mesh is not None:
            self.mesh.close()
            self.mesh = None
        if release_l2 and self.shared_l2 is not None:
            self.shared_l2.close(unlink=True)
            self.shared_l2 = None

    @property
    def computed_tokens(self) -> int:
        """Tokens this rank has run through its share of the model (or made)."""
        return int(getattr(self.filler, "computed_tokens", 0))

    # -- storage thread ---------------------------------------------------------------

    def run_storage_pending(self) -> int:
        n = 0
        while self.run_storage_one(block=False):
            n += 1
        return n

    def run_storage_one(self, block: bool = True, timeout: float | None = None) -> bool:
        """Run the next backup or prefetch. A prefetch moves in batches, reporting
        cumulative progress after each, and stops at the first missing or refused
        page, on a failure, or when the coordinator stops it."""
        with self.lock:
            if block and not self.storage_queue:
                self.ready.wait(timeout)
            if not self.storage_queue:
                return False
            cmd, epoch = self.storage_queue.popleft(), self.epoch
            self.storing = True
        try:
            self._run_storage(cmd, epoch)
        finally:
            with self.lock:
                self.storing = False
                self._announce()
        return True

    def _run_storage(self, cmd: Message, epoch: int) -> None:
        if isinstance(cmd, Backup):
            started = time.perf_counter()
            ok = self._backup(cmd, epoch)
            with self.lock:
                if ok:
                    self.moved_bytes["host_to_storage"] += len(cmd.host_pages) * self.page_bytes
                    self.transfer_seconds.append(("host_to_storage", time.perf_counter() - started))
                if epoch == self.epoch:
                    self.backups_done += 1
                    if not ok:
                        self.failed.append(cmd.cmd_id)
            return
        assert isinstance(cmd, Prefetch)
        self._prefetch(cmd, epoch)

    def _backup(self, cmd: Backup, epoch: int) -> bool:
        if self.storage is None:
            return False
        try:
            with self.lock:  # read the pages only while they are still this epoch's
                if epoch != self.epoch:
                    return False
                pools = self.pools
                rows = pools["full"].host.rows(cmd.host_pages) if cmd.host_pages else None
                sliding = states = None
                if cmd.sliding_pages:
                    sliding = pools["sliding"].host.rows(cmd.sliding_pages)
                if cmd.mamba_slots:
                    states = pools["mamba"].host.rows(cmd.mamba_slots)
            link, ok = self.storage, True
            if rows is not None:
                ok = bool(link.store(self.suffix, list(cmd.page_hashes), rows))
            if ok and sliding is not None:
                ok = bool(link.store(self.suffix, list(cmd.sliding_hashes), sliding, "sliding"))
            if ok and states is not None:
                ok = bool(link.store(self.suffix, list(cmd.mamba_hashes), states, "mamba"))
            return ok
        except Exception:
            log.exception("rank %s: backup command %d failed", self.shard.rank, cmd.cmd_id)
            return False

    def _prefetch_parts(self, cmd: Prefetch, epoch: int) -> bool:
        """Load a hybrid prefetch's components into L2 (before its pages: no progress
        is reported without them); ``False`` if any is missing or refused."""
        try:
            if self.storage is None:
                raise RuntimeError("no storage link")
            sliding = states = None
            if cmd.sliding_pages:
                sliding = self.storage.load(self.suffix, list(cmd.sliding_hashes), "sliding")
                if len(sliding) < len(cmd.sliding_pages):
                    return False
            if cmd.mamba_slots:
                states = self.storage.load(self.suffix, list(cmd.mamba_hashes), "mamba")
                if len(states) < len(cmd.mamba_slots):
                    return False
            with self.lock:  # write the slots only while they are still this op's
                if epoch != self.epoch or cmd.op_id not in self.prefetch_ops:
                    return False
                if sliding is not None:
                    self.pools["sliding"].host.put_rows(cmd.sliding_pages, sliding)
                if states is not None:
                    self.pools["mamba"].host.put_rows(cmd.mamba_slots, states)
            return True
        except Exception:
            log.exception("rank %s: prefetch %d lost its components", self.shard.rank, cmd.op_id)
            return False

    def _prefetch(self, cmd: Prefetch, epoch: int) -> None:
        batch = self.config.storage.transfer_batch_pages
        plan = getattr(self.storage, "plan", None)
        if plan is not None and len(cmd.page_hashes) > batch:
            try:  # direct reads: where every page lies, in one call
                plan(self.suffix, list(cmd.page_hashes))
            except Exception:
                log.warning("rank %s: prefetch %d not planned", self.shard.rank, cmd.op_id)
        done, terminated = 0, False
        total = len(cmd.page_hashes)
        if (cmd.sliding_pages or cmd.mamba_slots) and not self._prefetch_parts(cmd, epoch):
            total, terminated = 0, True
        while done < total:
            with self.lock:
                if epoch != self.epoch:
                    return
                if cmd.op_id in self.stopping:
                    terminated = True
                    break
            want = list(cmd.page_hashes[done : done + batch])
            try:
                if self.storage is None:
                    raise RuntimeError("no storage link")
                if self.faults.delay_s:
                    time.sleep(self.faults.delay_s)
                started = time.perf_counter()
                rows = self.storage.load(self.suffix, want)
                got = len(rows)
                with self.lock:  # write the pages only while they are still this op's
                    if epoch != self.epoch:
                        return
                    if got:
                        slots = cmd.host_pages[done : done + got]
                        self.names.forget_host(slots)
                        self.pools["full"].host.put_rows(slots, rows)
                        if cmd.tokens:
                            self.names.prefetched(cmd, done, got)
                        self.moved_bytes["storage_to_host"] += got * self.page_bytes
                        self.transfer_seconds.append(
                            ("storage_to_host", time.perf_counter() - started)
                        )
            except Exception:
                log.exception(
                    "rank %s: prefetch %d failed after %d pages", self.shard.rank, cmd.op_id, done
                )
                got, terminated = 0, True
            done += got
            with self.lock:
                if epoch != self.epoch or cmd.op_id not in self.prefetch_ops:
                    return
                entry = self.prefetch.setdefault(cmd.op_id, [0, False, False])
                entry[0] = done * self.config.cache.page_size
                self._announce()
            if got < len(want):
                terminated = terminated or done < total
                break
        with self.lock:
            if epoch == self.epoch and cmd.op_id in self.prefetch_ops:
                entry = self.prefetch.setdefault(
                    cmd.op_id, [done * self.config.cache.page_size, False, False]
                )
                entry[1], entry[2] = True, terminated

    def _copy(self, tiers: Tiers, src: list[int], dst: list[int], to_host: bool) -> None:
        """One component's copy L1 -> L2 (``to_host``) or L2 -> L1, on the copy stream
        where there is one."""
        if self.stream is None:
            tiers.copy(src, dst, to_host)
            return
        with torch.cuda.stream(self.stream):
            tiers.copy(src, dst, to_host)
        self.stream.synchronize()

    # -- checks ----------------------------------------------------------------------

    def verify(self, namespace: str, tokens: bytes, pages: list[int]) -> bool:
        """Whether L1 ``pages`` hold this shard's KV of the packed prefix ``tokens``
        (one page per page of it, the last maybe partial) as a fresh computation
        by this rank's filler gives it (within its ``tolerance``)."""
        seed = namespace_seed(namespace)
        dtype = self.l1.buffer.dtype
        positions, expected = self.filler.expected(seed, tokens, 0, dtype)
        if positions.numel() == 0:
            return True
        page_idx, offsets = self.filler.locate(positions, 0, pages)
        actual = self.l1.read_tokens(page_idx.to(self.device), offsets.to(self.device)).cpu()
        if not self.filler.tolerance:
            return bool(torch.equal(actual, expected))
        return within(actual, expected, self.filler.tolerance, getattr(self.filler, "rtol", 0.0))

    def _copy_parts(self, group: list[Message], to_host: bool) -> None:
        """A hybrid model's sliding pages and mamba states of a group of writes
        (L1 -> L2) or loads (L2 -> L1)."""
        s_src = [p for c in group for p in c.sliding_src]  # type: ignore[attr-defined]
        s_dst = [p for c in group for p in c.sliding_dst]  # type: ignore[attr-defined]
        m_src = [p for c in group for p in c.mamba_src]  # type: ignore[attr-defined]
        m_dst = [p for c in group for p in c.mamba_dst]  # type: ignore[attr-defined]
        for component, src, dst in (("sliding", s_src, s_dst), ("mamba", m_src, m_dst)):
            if src:
                self._copy(self.pools[component], src, dst, to_host)

    def _store_parts(self, cmd: Compute) -> None:
        """Store a hybrid compute's other components: each sliding page's KV of the
        sliding layers, each mamba state (a model filler computes them; else
        synthetic: checkable like the full KV)."""
        store = getattr(self.filler, "store_parts", None)
        if store is not None:
            store(self.sliding, self.states, cmd)
            return
        for part in cmd.sliding:
            assert self.sliding is not None, "sliding parts for a model without sliding layers"
            positions, values = self.sliding_producer.expected(
                part.prev_hash,
                part.tokens,
                part.page * self.config.cache.page_size,
                self.sliding.buffer.dtype,
            )
            start = part.page * self.config.cache.page_size
            page_idx, offsets = self.sliding_producer.locate(positions, start, [part.pool_page])
            self.sliding.write_tokens(page_idx.to(self.device), offsets.to(self.device), values)
        for part in cmd.mamba:
            assert self.states is not None, "mamba parts for a model without mamba layers"
            self.states.buffer[part.slot] = self.state_producer.state(part.chain_hash)

    def verify_parts(
        self,
        namespace: str,
        tokens: bytes,
        sliding: list[tuple[int, int]],
        mamba: list[tuple[int, int]],
    ) -> bool:
        """Whether this rank's sliding pages ``(key page, pool page)`` and mamba slots
        ``(end page, slot)`` hold exactly the components of the packed prefix
        ``tokens`` (synthetic components only)."""
        ps = self.config.cache.page_size
        pb = ps * 4
        last = max([k + 1 for k, _ in sliding] + [e for e, _ in mamba] + [0])
        seed = namespace_seed(namespace)
        chain = [seed, *chain_hashes(seed, tokens[: last * pb], pb)]
        for k, pool_page in sliding:
            assert self.sliding is not None
            positions, want = self.sliding_producer.expected(
                chain[k], tokens[k * pb : (k + 1) * pb], k * ps, self.sliding.buffer.dtype
            )
            page_idx, offsets = self.sliding_producer.locate(positions, k * ps, [pool_page])
            got = self.sliding.read_tokens(page_idx.to(self.device), offsets.to(self.device))
            if not torch.equal(got.cpu(), want):
                return False
        for end, slot in mamba:
            assert self.states is not None
            if not torch.equal(
                self.states.buffer[slot].cpu(), self.state_producer.state(chain[end])
            ):
                return False
        return True

    def read_parts(
        self, sliding: list[tuple[int, int]], mamba: list[tuple[int, int]]
    ) -> tuple[Shard, torch.Tensor | None, torch.Tensor | None]:
        """This rank's shard of a hybrid prefix's other components: the sliding
        layers' KV of the ``(key page, pool page)`` pages, ``(2, T, layers, heads,
        head_dim)`` over its positions of those pages in order, and the mamba
        states of the ``(end page, slot)`` slots, ``(n, layers, elems)``; on CPU."""
        ps = self.config.cache.page_size
        kv = states = None
        if sliding and self.sliding is not None:
            positions = torch.cat(
                [self.producer.positions(k * ps, (k + 1) * ps) for k, _ in sliding]
            )
            keys = [k for k, _ in sliding]
            pool_pages = [p for _, p in sliding]
            page_idx = torch.tensor(pool_pages)[
                torch.searchsorted(torch.tensor(keys), positions // ps)
            ]
            offsets = positions % ps - self.shard.cp_rank * self.shard.page_tokens
            kv = self.sliding.read_tokens(page_idx.to(self.device), offsets.to(self.device))
            kv = kv.cpu().clone()
        if mamba and self.states is not None:
            states = self.states.buffer[[slot for _, slot in mamba]].cpu().clone()
        return self.shard, kv, states

    def read(self, tokens: int, pages: list[int]) -> tuple[Shard, torch.Tensor]:
        """This rank's shard of the KV of the first ``tokens`` positions held in L1
        ``pages``: ``(2, T, layers, heads, head_dim)`` over its positions, on CPU."""
        positions = self.producer.positions(0, tokens)
        page_idx, offsets = self.producer.locate(positions, 0, pages)
        values = self.l1.read_tokens(page_idx.to(self.device), offsets.to(self.device))
        return self.shard, values.cpu().clone()
