"""A rank's data plane, without Ray: its pools (``fabric.rank.build``), the
commands it applies in order, and the counters it reports.

``accept`` takes a step's batch (from the message thread) and queues its
commands; ``run_one``/``run_pending`` execute the computes and L1 <-> L2 copies
(on the transfer thread), ``storage_io.run_one`` the backups and prefetches (on
the storage thread, ``fabric.rank.storage_io``); ``report`` reads the counters.
A command is counted only after its copy has finished (on GPU: after its
stream's event), so a report never claims work that is not done. The threads
meet only in the ledger (``fabric.rank.ledger``), under its lock.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import cast

import torch

from fabric.cache.keys import namespace_seed
from fabric.config import FabricConfig
from fabric.l3.direct import DirectReads, direct_reads
from fabric.messages import (
    Batch,
    Command,
    Compute,
    Load,
    Report,
    Write,
)
from fabric.rank.build import build_filler, build_pools
from fabric.rank.index import PageIndex
from fabric.rank.ledger import Ledger, run_all
from fabric.rank.mesh import Board, Mesh, MeshError
from fabric.rank.model import within
from fabric.rank.parts import Parts
from fabric.rank.pools import KVPool, Tiers, pick_device
from fabric.rank.producer import KVFiller
from fabric.rank.shared_l2 import L2_CHECK_EVERY
from fabric.rank.storage_io import StorageIO, StorageLink
from fabric.topology import Shard, Topology

log = logging.getLogger(__name__)


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
        self.suffix = self.shard.rank.suffix
        self.device = pick_device(config.runtime.device)
        self.pools, self.shared_l2 = build_pools(config, self.shard, self.device, l2_path)
        self.filler, self.producer = build_filler(config, self.shard, self.pools, filler)
        self.parts = Parts(self.shard, config, self.pools, self.device, self.filler)
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
        self.names = PageIndex(config.cache.page_size, host_store=self.shared_l2)
        # L2 pages a restarted process found named in its shared L2.
        self.l2_kept = len(self.names.host)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.incarnation = uuid.uuid4().hex
        self.faults = Faults()
        self.ledger = Ledger(self.l1.nbytes // max(1, self.l1.num_pages))
        # Prefetches read from a shared L3 directory here, not through Ray
        # (``storage.direct_reads``; fabric.l3.direct).
        self.storage_io = StorageIO(
            self.ledger,
            self.pools,
            self.names,
            direct_reads(storage, config),
            config,
            self.faults,
            str(self.shard.rank),
            self.suffix,
            self.check_host if self.shared_l2 is not None else None,
        )

    @property
    def l1(self) -> KVPool:
        """The full-attention layers' L1 pool (what a filler computes into)."""
        return cast(KVPool, self.pools["full"].device)

    # -- message thread --------------------------------------------------------------

    def accept(self, batch: Batch) -> int:
        """Queue a batch's commands: how many were new. A newer epoch starts
        counting afresh; an older one is ignored; a command id seen before is not
        applied again."""
        ledger = self.ledger
        queued = 0
        with ledger.lock:
            if batch.epoch < ledger.epoch:
                return 0
            self._open_epoch(batch.epoch)
            addressed = self.index < len(batch.incarnations) and (
                batch.incarnations[self.index] == self.incarnation
            )
            if addressed and self.needs_mesh and self._mesh_of != (batch.epoch, batch.incarnations):
                self._mesh_of = (batch.epoch, batch.incarnations)
                self._mesh_key = mesh_key(batch.epoch, batch.incarnations)
            for cmd in batch.commands if addressed else ():
                if cmd.cmd_id <= ledger.last_cmd_id:
                    continue
                queued += 1
                if isinstance(cmd, Compute) and self.needs_mesh:
                    ledger.mesh_keys[cmd.cmd_id] = self._mesh_key
                ledger.enqueue(cmd)
            if batch.acked:
                ledger.failed = [c for c in ledger.failed if c > batch.acked]
            ledger.stopping.update(op for op in batch.stop if op in ledger.prefetch_ops)
            for op in batch.forget:
                ledger.prefetch.pop(op, None)
                ledger.prefetch_ops.discard(op)
                ledger.stopping.discard(op)
            ledger.ready.notify_all()
        return queued

    def inventory(self, epoch: int) -> list[tuple[int, str, bytes, bytes, bytes]]:
        """The named L2 slots (``PageIndex.entries``) for a new coordinator opening
        ``epoch``: first the epoch is opened as a batch of it would (the old
        epoch's queued commands dropped, its copy in flight finished), so nothing
        changes the slots after they are listed."""
        with self.ledger.lock:
            self._open_epoch(epoch)
            return self.names.entries()

    def _open_epoch(self, epoch: int) -> None:
        """Under the lock: a newer ``epoch`` starts counting afresh
        (``Ledger.open_epoch``); mesh generations name their epoch, so none of the
        broken ones comes back."""
        if self.ledger.open_epoch(epoch):
            self.broken_meshes.clear()

    def report(self) -> Report:
        return self.ledger.report(self.index, self.incarnation)

    # -- transfer thread -------------------------------------------------------------

    def run_pending(self) -> int:
        """Apply every queued command now (tests and single-thread use)."""
        return run_all(self.run_one)

    def run_one(self, block: bool = True, timeout: float | None = None) -> bool:
        """Apply the next command — with any copies of the same kind queued right
        behind it, merged into one copy — and count them once finished."""
        ledger = self.ledger
        with ledger.lock:
            if block and not ledger.queue:
                ledger.ready.wait(timeout)
            if not ledger.queue:
                return False
            group, epoch = [ledger.queue.popleft()], ledger.epoch
            if not isinstance(group[0], Compute):
                while ledger.queue and type(ledger.queue[0]) is type(group[0]):
                    group.append(ledger.queue.popleft())
            ledger.copying = True
        started = time.perf_counter()
        try:
            ok = self._apply(group)
        finally:
            with ledger.lock:
                ledger.copying = False
                if epoch == ledger.epoch and isinstance(group[0], (Compute, Load)):
                    ledger.awaited -= len(group)  # done or failed: nothing waits on it now
                ledger.idle.notify_all()
        with ledger.lock:
            if epoch != ledger.epoch:
                return True  # a reset arrived meanwhile; these belong to the old epoch
            ledger.announce()
            if not ok:
                ledger.failed.extend(cmd.cmd_id for cmd in group)
            first = group[0]
            if isinstance(first, Compute):
                ledger.computes_done += 1
                return True
            if isinstance(first, Write):
                ledger.writes_done += len(group)
            else:
                ledger.loads_done += len(group)
            if ok:
                pages = sum(len(c.host_pages) for c in cast("list[Write | Load]", group))
                direction = "device_to_host" if isinstance(first, Write) else "host_to_device"
                ledger.moved(direction, pages, started)
        return True

    def _apply(self, group: list[Command]) -> bool:
        first = group[0]
        try:
            if self.faults.delay_s:
                time.sleep(self.faults.delay_s)
            if isinstance(first, Compute):
                return self._compute(first)
            copies = cast("list[Write] | list[Load]", group)
            if isinstance(first, Write) and self.faults.fail_writes:
                self.names.forget_host([p for c in copies for p in c.host_pages])
                return False
            self._move(copies, isinstance(first, Write))
            return True
        except Exception:
            log.exception(
                "rank %s: %s of commands %s failed",
                self.shard.rank,
                type(first).__name__,
                [c.cmd_id for c in group],
            )
            return False

    def _compute(self, cmd: Compute) -> bool:
        self.names.forget_device(cmd.pages)
        if self.sharded:
            return self._sharded_compute(cmd)
        if self.faults.fail_computes:
            return False
        self._fill(cmd)
        self.parts.store(self.filler, cmd)
        if cmd.pages:
            self.names.computed(cmd.namespace, cmd.prev_hash, cmd.tokens, list(cmd.pages))
        self._synchronize()
        return True

    def _fill(self, cmd: Compute) -> None:
        """The filler computes (or makes) a compute's KV into L1; a rank that keeps
        a page's first ``cmd.keep`` tokens computes only those after them. A filler
        that computes from the cache where it can (``compute``) goes first."""
        compute = getattr(self.filler, "compute", None)
        if compute is not None and compute(self.l1, cmd):
            return
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

    def _move(self, group: list[Write] | list[Load], to_host: bool) -> None:
        """A group of writes (L1 -> L2, ``to_host``) or loads (L2 -> L1) as one copy
        per component; the destination slots' old names go first, the new ones
        once the copy is done."""
        names = self.names
        device = [p for c in group for p in c.device_pages]
        host = [p for c in group for p in c.host_pages]
        if not to_host and self.shared_l2 is not None:
            self.check_host(host, L2_CHECK_EVERY)
        (names.forget_host if to_host else names.forget_device)(host if to_host else device)
        src, dst = (device, host) if to_host else (host, device)
        self._copy(self.pools["full"], src, dst, to_host)
        if to_host and self.shared_l2 is not None:
            self._synchronize()  # the pages' checksums are taken as they are named
        if to_host:
            names.copied(names.device, device, names.host, host)
        else:
            names.copied(names.host, host, names.device, device)
        for component, part_src, part_dst in (
            (
                "sliding",
                [p for c in group for p in c.sliding_src],
                [p for c in group for p in c.sliding_dst],
            ),
            (
                "mamba",
                [p for c in group for p in c.mamba_src],
                [p for c in group for p in c.mamba_dst],
            ),
        ):
            if part_src:
                self._copy(self.pools[component], part_src, part_dst, to_host)
        self._synchronize()

    def check_host(self, slots: list[int], every: int) -> None:
        """Fail the command (``CorruptL2``) when a shared L2 page it reads is corrupt."""
        assert self.shared_l2 is not None
        self.shared_l2.refuse_corrupt(slots, every, self.names.forget_host, self.shard.rank)

    def _synchronize(self) -> None:
        """On a GPU: wait until the work queued on the current stream is done."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def _sharded_compute(self, cmd: Compute) -> bool:
        """A compute that the ranks of a sharded model run together, in the mesh
        generation of its batch. Any failure breaks the generation for this rank:
        it never takes part in it again, so its peers fail their operations
        (connection closed, or timeout) rather than pair with another compute's
        data; the failed compute resets the epoch, and the next one's batches
        name a new generation."""
        with self.ledger.lock:
            key = self.ledger.mesh_keys.pop(cmd.cmd_id, self._mesh_key)
        try:
            if key in self.broken_meshes:
                raise MeshError(f"mesh {key} broke earlier in this epoch")
            if self.faults.fail_computes:
                raise MeshError("injected compute failure")
            if cmd.tokens:
                mesh = self._mesh(key) if self.needs_mesh else None
                self.filler.attach(mesh)  # type: ignore[attr-defined]
            self._fill(cmd)
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
        (their sockets; its peers' operations in them fail), the L3 directory its
        own reads hold open; with ``release_l2``
        its shared L2 file too (the fabric is shutting down: nothing will come
        back for it)."""
        if self.mesh is not None:
            self.mesh.close()
            self.mesh = None
        if isinstance(self.storage_io.link, DirectReads):  # the store's directory it holds
            self.storage_io.link.close()
        if release_l2 and self.shared_l2 is not None:
            self.shared_l2.close(unlink=True)
            self.shared_l2 = None

    @property
    def computed_tokens(self) -> int:
        """Tokens this rank has run through its share of the model (or made)."""
        return int(getattr(self.filler, "computed_tokens", 0))

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
        by this rank's filler gives it (within its ``tolerance`` and ``rtol``)."""
        seed = namespace_seed(namespace)
        dtype = self.l1.buffer.dtype
        positions, expected = self.filler.expected(seed, tokens, 0, dtype)
        if positions.numel() == 0:
            return True
        page_idx, offsets = self.filler.locate(positions, 0, pages)
        actual = self.l1.read_tokens(page_idx.to(self.device), offsets.to(self.device)).cpu()
        atol, rtol = self.filler.tolerance, self.filler.rtol
        if not (atol or rtol):
            return bool(torch.equal(actual, expected))
        return within(actual, expected, atol, rtol)

    def read(self, tokens: int, pages: list[int]) -> tuple[Shard, torch.Tensor]:
        """This rank's shard of the KV of the first ``tokens`` positions held in L1
        ``pages``: ``(2, T, layers, heads, head_dim)`` over its positions, on CPU."""
        positions = self.producer.positions(0, tokens)
        page_idx, offsets = self.producer.locate(positions, 0, pages)
        values = self.l1.read_tokens(page_idx.to(self.device), offsets.to(self.device))
        return self.shard, values.cpu().clone()
