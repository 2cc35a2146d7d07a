"""The rank actor: owns one ``RankWorker``, its transfer thread and its storage thread."""

from __future__ import annotations

import gc
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from actors.ray_metrics import RankMetrics, node_ip
from fabric.config import FabricConfig
from fabric.l3.shards import ShardedLink
from fabric.messages import Batch, InvalidMessage, decode, encode
from fabric.rank.mesh import poll
from fabric.rank.node_l2 import remove_regions
from fabric.rank.node_l2_mapping import fabric_identity
from fabric.rank.shared_l2 import SUFFIX, shm_dir, sweep_stale
from fabric.rank.worker import RankWorker
from fabric.round_sockets import RoundServer, ray_tls

log = logging.getLogger(__name__)


class StorageActorLink:
    """A rank's way to the storage actor: blocking calls, made only from the rank's
    storage thread. A dead or restarting actor raises, which ends the operation."""

    def __init__(self, name: str, namespace: str, timeout_s: float, handle: Any = None) -> None:
        """The actor named ``name`` (looked up on first use), or ``handle``."""
        self.name, self.namespace, self.timeout_s = name, namespace, timeout_s
        self._handle = handle

    def _actor(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> np.ndarray:
        return ray.get(
            self._actor().load.remote(suffix, page_hashes, component), timeout=self.timeout_s
        )

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        return ray.get(
            self._actor().store.remote(suffix, page_hashes, pages, component),
            timeout=self.timeout_s,
        )

    def locate(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> tuple[str, list] | None:
        return ray.get(
            self._actor().locate.remote(suffix, page_hashes, component), timeout=self.timeout_s
        )

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None:
        self._actor().read_elsewhere.remote(pages, refused)  # a count: not waited for

    def start(self, method: str, *args: Any) -> Callable[[], Any]:
        """Send ``method(*args)`` now; the returned call waits for its answer (a
        ``ShardedLink`` sends to every storage actor before it waits)."""
        ref = getattr(self._actor(), method).remote(*args)
        return lambda: ray.get(ref, timeout=self.timeout_s)


class RayBoard:
    """Where a sharded model's ranks meet (``fabric.rank.mesh.Board``): Ray's
    key-value store (the GCS), under the fabric's name, as Ray's own collective
    library rendezvous."""

    def __init__(self, fabric: str, namespace: str) -> None:
        self.prefix = f"kvfabric/{fabric}/mesh/"
        self.namespace = namespace

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def post(self, key: str, address: str) -> None:
        """Post a new generation's address; older generations' go (a rank 0 that
        died never dropped its own)."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=self.namespace)
        internal_kv._internal_kv_put(self.prefix + key, address, namespace=self.namespace)

    def read(self, key: str, timeout_s: float) -> str:
        from ray.experimental import internal_kv

        def get(k: str) -> str:
            value = internal_kv._internal_kv_get(self.prefix + k, namespace=self.namespace)
            return value.decode() if value else ""

        return poll(get, key, timeout_s)

    def drop(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix + key, namespace=self.namespace)


class RankActor:
    """One per (pp, cp, tp). ``step`` is the only message the coordinator sends per
    step: it queues the batch and answers with all counters at once. Copies run
    on a transfer thread, L3 traffic on a storage thread."""

    def __init__(
        self,
        config: dict,
        index: int,
        storage_names: list[str] | str | None = None,
        instance: str = "",
    ) -> None:
        """``storage_names``: the storage actors' (one name: one actor; several: its
        pages go to their owners, ``fabric.l3.shards``). ``instance``: the launch
        this rank belongs to (the same for every start of it): its shared L2 file
        is that launch's and this rank's."""
        self.config = FabricConfig.from_dict(config)
        self.max_bytes = self.config.runtime.max_message_bytes
        runtime = self.config.runtime
        if isinstance(storage_names, str):
            storage_names = [storage_names]
        links = [
            StorageActorLink(name, runtime.ray_namespace, runtime.rank_timeout_s)
            for name in storage_names or ()
        ]
        link: StorageActorLink | ShardedLink | None = None
        if len(links) == 1:
            link = links[0]
        elif links:
            link = ShardedLink(links)
        board = RayBoard(runtime.name, runtime.ray_namespace)
        self.worker = RankWorker(
            self.config, index, storage=link, board=board, l2_path=self._l2_path(index, instance)
        )
        if self.worker.l2_kept:
            log.warning(
                "rank %d: found its L2 in shared memory (%d named pages)",
                index,
                self.worker.l2_kept,
            )
        self.metrics = RankMetrics(self.config.runtime.name, str(self.worker.shard.rank))
        self._bad_report: bytes | None = None
        self._duplicate = False
        self._reply_delay_s = 0.0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(run,), name=name, daemon=True)
            for name, run in (
                ("kv-transfers", self.worker.run_one),
                ("kv-storage", self.worker.storage_io.run_one),
            )
        ]
        self._threads.append(
            threading.Thread(target=self._feed_metrics, name="ray-metrics", daemon=True)
        )
        for thread in self._threads:
            thread.start()
        self.rounds: RoundServer | None = None
        if runtime.round_transport == "zmq" and not ray_tls():  # fabric.round_sockets
            host = ray.util.get_node_ip_address()
            self.rounds = RoundServer(self.step, host, self.max_bytes)

    def _feed_metrics(self) -> None:
        """Ray's metrics from this rank's transfer counters, each second."""
        while not self._stop.wait(1.0):
            try:
                times = self.worker.ledger.transfer_seconds
                taken = [times.popleft() for _ in range(len(times))]
                self.metrics.update(dict(self.worker.ledger.moved_bytes), taken)
            except Exception:  # metrics never cost the rank anything else
                log.warning("Ray metrics not updated", exc_info=True)

    def _loop(self, run_one: Callable[..., bool]) -> None:
        while not self._stop.is_set():
            run_one(block=True, timeout=0.1)

    def step(self, batch: bytes) -> bytes:
        """Queue a step's commands; return this rank's report (msgpack) once it has
        news — a command done, prefetch progress — or nothing in flight, or after
        ``runtime.round_wait_s``. A step that brought commands waits up to
        ``runtime.round_settle_s`` past its first news for the computes and loads
        still queued."""
        message = decode(batch, self.max_bytes)
        if not isinstance(message, Batch):
            raise InvalidMessage(f"a rank takes Batch messages, got {type(message).__name__}")
        seen = self.worker.ledger.news_seq  # what finishes from here on is news for this reply
        queued = self.worker.accept(message)
        if self._duplicate:  # chaos: the same message delivered twice
            self.worker.accept(message)
        runtime = self.config.runtime
        self.worker.ledger.wait_for_news(
            runtime.round_wait_s, since=seen, settle_s=runtime.round_settle_s if queued else 0.0
        )
        if self._reply_delay_s:
            time.sleep(self._reply_delay_s)
        if self._bad_report is not None:
            return self._bad_report
        return encode(self.worker.report())

    def describe(self) -> str:
        """This actor's role and live figures, in one line (`kvfabric status`)."""
        worker = getattr(self, "worker", None)
        if worker is None:
            return "kvfabric rank (starting)"
        moved = {k: v >> 20 for k, v in worker.ledger.moved_bytes.items()}
        return (
            f"kvfabric rank {worker.shard.rank} of {self.config.runtime.name} on "
            f"{worker.device}: epoch {worker.ledger.epoch}, moved MiB L1>L2 {moved['device_to_host']} "
            f"L2>L1 {moved['host_to_device']} L2>L3 {moved['host_to_storage']} "
            f"L3>L2 {moved['storage_to_host']}"
        )

    def __repr__(self) -> str:
        """What the Ray dashboard shows for this actor: Ray reads the repr once, as
        the actor starts, so it holds only what does not change (role, shard,
        node). The moving figures are in Ray's metrics and `kvfabric status`."""
        worker = getattr(self, "worker", None)
        if worker is None:
            return "kvfabric rank (starting)"
        return (
            f"kvfabric rank {worker.shard.rank} of {self.config.runtime.name} on "
            f"{worker.device}, node {node_ip()}"
        )

    def round_endpoint(self) -> tuple[str, bytes]:
        """Where this rank serves socket rounds, and the secret each must carry
        (``runtime.round_transport = "zmq"``); raises when it serves none."""
        if self.rounds is None:
            raise RuntimeError("this rank serves no socket rounds (runtime.round_transport=ray)")
        if self.rounds.failed is not None:  # the coordinator names it as the rank's absence
            raise RuntimeError(f"this rank's round socket failed: {self.rounds.failed}")
        return self.rounds.endpoint, self.rounds.secret

    def ping(self) -> None:
        """A no-op, for measuring the bare cost of a call."""

    def leave_graphs(self) -> int:
        """Close the channels of any compiled-graph loop still running in this actor
        (``runtime.compiled_rounds``): one whose coordinator died cannot be torn down
        by anyone else, and an actor can be in one graph at a time. The coordinator
        calls this before it compiles; the loop's read fails and it ends. Returns
        how many graph tasks were closed."""
        try:
            from ray.dag.compiled_dag_node import ExecutableTask
        except ImportError:  # pragma: no cover - a Ray without compiled graphs
            return 0
        closed = 0
        for obj in gc.get_objects():
            if isinstance(obj, ExecutableTask):
                try:
                    obj.cancel()
                    closed += 1
                except Exception:  # already closed
                    log.debug("graph task already closed", exc_info=True)
        return closed

    def report(self) -> bytes:
        return encode(self.worker.report())

    def inventory(self, epoch: int) -> list[tuple[int, str, bytes, bytes, bytes]]:
        """The L2 pages this rank holds, named, for a new coordinator opening ``epoch``."""
        return self.worker.inventory(epoch)

    def verify(
        self,
        namespace: str,
        tokens: bytes,
        pages: list[int],
        sliding: Sequence[tuple[int, int]] = (),
        mamba: Sequence[tuple[int, int]] = (),
        epoch: int | None = None,
    ) -> bool | None:
        """The full KV in ``pages`` and a hybrid model's ``sliding`` / ``mamba`` parts;
        ``None`` when this rank is not in ``epoch`` (the lease's) any more."""
        worker = self.worker
        if epoch is not None and epoch != worker.ledger.epoch:
            return None
        return worker.verify(namespace, tokens, pages) and worker.parts.verify(
            namespace, tokens, list(sliding), list(mamba)
        )

    def read(self, tokens: int, pages: list[int]) -> tuple:
        """This rank's shard of the KV of ``tokens`` positions held in L1 ``pages``."""
        return self.worker.read(tokens, pages)

    def read_parts(self, sliding: list, mamba: list) -> tuple:
        """This rank's shard of a hybrid prefix's sliding pages and mamba states."""
        return self.worker.parts.read(sliding, mamba)

    def set_faults(
        self,
        delay_s: float = 0.0,
        fail_writes: bool = False,
        fail_computes: bool = False,
        bad_report: bytes | None = None,
        duplicate: bool = False,
        reply_delay_s: float = 0.0,
    ) -> None:
        """Chaos hook: delay every command and L3 batch, fail every write or compute,
        answer every step with ``bad_report`` instead of a report, take every
        step's message twice (``duplicate``), or answer every step
        ``reply_delay_s`` late."""
        self._reply_delay_s = reply_delay_s
        self.worker.faults.delay_s = delay_s
        self.worker.faults.fail_writes = fail_writes
        self.worker.faults.fail_computes = fail_computes
        self._bad_report = bad_report
        self._duplicate = duplicate

    def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id (for chaos: signals, node loss)."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def info(self) -> dict:
        w = self.worker
        return {
            "index": w.index,
            "rank": str(w.shard.rank),
            "incarnation": w.incarnation,
            "device": str(w.device),
            "l1_bytes": w.l1.nbytes,
            "l2_bytes": w.pools["full"].host.nbytes,
            "pid": os.getpid(),
            "computed_tokens": w.computed_tokens,
        }

    def _l2_path(self, index: int, instance: str) -> str | None:
        """This rank's shared L2 file on this node (``cache.host_memory=shared``),
        or none: L2 in this process."""
        where = shm_dir()
        if self.config.cache.host_memory != "shared" or not instance or where is None:
            return None
        sweep_stale(where)  # files of fabrics that died without shutting down
        rt = self.config.runtime
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{rt.ray_namespace}-{rt.name}")
        return str(where / f"kvfabric-{safe}-{instance}-{index}{SUFFIX}")

    def shutdown(self, release_l2: bool = False) -> None:
        """Stop; with ``release_l2``, remove the shared L2 file (the fabric is going),
        and the node L2 regions of the fabric's engines that none uses now."""
        self._stop.set()
        if self.rounds is not None:
            self.rounds.close()
        self.worker.close(release_l2=release_l2)
        where = shm_dir()
        if release_l2 and where is not None:
            rt = self.config.runtime
            remove_regions(where, fabric_identity(rt.name, rt.ray_namespace))
