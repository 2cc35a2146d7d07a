"""The ranks' collective groups: how the ranks of a TP x PP split talk while they
compute, without Ray.

A :class:`Mesh` is one generation of process groups over every rank: the world
group (pipeline sends and receives between stages), this rank's tensor-parallel
group (all-reduces inside a stage) and its context-parallel group (all-gathers
of attention's queries and partial results between the ranks that hold the
other positions). Gloo on CPU, NCCL on CUDA, both
built directly on a ``TCPStore`` — not ``torch.distributed``'s process-wide
default group — so a rank can drop a broken generation and form the next one in
the same process.

A generation is named by a key every rank derives from the same batch (its epoch
and the incarnations it is addressed to), so the ranks of one batch meet in one
generation and a restarted rank's new incarnation starts a new one. The world's
first rank hosts the store and posts its address on a :class:`Board` (Ray's
key-value store in a cluster, a dictionary in one process); the others read it
there. Every collective has a timeout; a rank that failed anything in a
generation never takes part in it again (see ``RankWorker``), so its peers
time out or see the connection close rather than pair with the wrong data.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fabric.config import TopologyConfig
from fabric.errors import FabricError
from fabric.topology import Topology


class MeshError(FabricError):
    """A collective group could not be formed, or one of its operations failed."""


class Board(Protocol):
    """Where the first rank posts the address of a generation's store."""

    def host(self) -> str:
        """The address the other ranks reach this process at."""

    def post(self, key: str, address: str) -> None: ...

    def read(self, key: str, timeout_s: float) -> str:
        """The address posted under ``key``; ``MeshError`` after ``timeout_s``."""

    def drop(self, key: str) -> None: ...


class LocalBoard:
    """A board for ranks in one process (``LocalFabric``, tests)."""

    def __init__(self) -> None:
        self._posted: dict[str, str] = {}
        self._changed = threading.Condition()

    def host(self) -> str:
        return "127.0.0.1"

    def post(self, key: str, address: str) -> None:
        with self._changed:
            self._posted[key] = address
            self._changed.notify_all()

    def read(self, key: str, timeout_s: float) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._posted, timeout_s):
                raise MeshError(f"no rank posted the store of mesh {key} within {timeout_s} s")
            return self._posted[key]

    def drop(self, key: str) -> None:
        with self._changed:
            self._posted.pop(key, None)


def poll(read, key: str, timeout_s: float, interval_s: float = 0.02) -> str:
    """``read(key)`` until it gives an address (for boards without a wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        address = read(key)
        if address:
            return address
        if time.monotonic() >= deadline:
            raise MeshError(f"no rank posted the store of mesh {key} within {timeout_s} s")
        time.sleep(interval_s)


class Mesh:
    """One generation of this rank's collective groups (see the module docstring)."""

    def __init__(
        self,
        board: Board,
        key: str,
        topology: TopologyConfig,
        index: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.key = key
        self.board = board
        self.closed = False
        # Finished operations and the seconds spent in them (waiting for the
        # peers included), by kind: all-reduce, all-gather, send, receive.
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.device = device
        self.ranks = Topology(topology).ranks
        self.index = index
        me = self.ranks[index]
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if index == 0:
                store = dist.TCPStore(
                    board.host(), 0, is_master=True, wait_for_workers=False, timeout=timeout
                )
                board.post(key, f"{board.host()}:{store.port}")
            else:
                host, port = board.read(key, timeout_s).rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            self._store = store
            self.world = self._group(f"{key}/world", index, len(self.ranks), timeout)
            peers = [i for i, r in enumerate(self.ranks) if (r.pp, r.cp) == (me.pp, me.cp)]
            self.tp = (
                self._group(f"{key}/tp{me.pp}.{me.cp}", me.tp, len(peers), timeout)
                if len(peers) > 1
                else None
            )
            # The ranks holding the other positions of this rank's layers and heads.
            cp_peers = [i for i, r in enumerate(self.ranks) if (r.pp, r.tp) == (me.pp, me.tp)]
            self.cp_rank, self.cp_size = me.cp, len(cp_peers)
            self.cp = (
                self._group(f"{key}/cp{me.pp}.{me.tp}", me.cp, len(cp_peers), timeout)
                if len(cp_peers) > 1
                else None
            )
        except MeshError:
            raise
        except Exception as exc:  # the store or a peer never came
            raise MeshError(f"mesh {key}: {type(exc).__name__}: {exc}") from None
        # The same (cp, tp) rank one stage up and one stage down.
        self.prev = self._stage_peer(me, -1)
        self.next = self._stage_peer(me, +1)

    def _stage_peer(self, me, step: int) -> int | None:
        for i, r in enumerate(self.ranks):
            if (r.pp, r.cp, r.tp) == (me.pp + step, me.cp, me.tp):
                return i
        return None

    def _group(self, prefix: str, rank: int, size: int, timeout: datetime.timedelta):
        store = dist.PrefixStore(prefix, self._store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    # -- operations ------------------------------------------------------------------

    def _run(self, what: str, start: Callable[[], Any]) -> None:
        """Start an operation and wait for it; any failure (at the start or while
        waiting: a peer gone, a timeout) is a ``MeshError``."""
        if self.closed:
            raise MeshError(f"mesh {self.key}: {what} on a closed mesh")
        started = time.perf_counter()
        try:
            start().wait()
        except Exception as exc:
            raise MeshError(f"mesh {self.key}: {what} failed: {str(exc)[:200]}") from None
        self.calls[what] += 1
        self.seconds[what] += time.perf_counter() - started

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over this rank's tensor-parallel group, in place."""
        tp = self.tp
        if tp is not None or self.closed:
            self._run("all-reduce", lambda: tp.allreduce([t]))  # type: ignore[union-attr]
        return t

    def all_gather_cp(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` from every rank of this rank's context-parallel group, in CP order
        (every rank's ``t`` has the same shape)."""
        cp = self.cp
        if cp is None and not self.closed:
            return [t]
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.cp_size)]
        self._run("all-gather", lambda: cp.allgather([out], [t]))  # type: ignore[union-attr]
        return out

    def send_next(self, t: torch.Tensor) -> None:
        """Send ``t`` to the same rank of the next pipeline stage."""
        assert self.next is not None, "the last stage has no next"
        world, peer, t = self.world, self.next, t.contiguous()
        self._run("send", lambda: world.send([t], peer, 0))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """What the same rank of the previous pipeline stage sent."""
        assert self.prev is not None, "the first stage has no previous"
        world, peer = self.world, self.prev
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._run("receive", lambda: world.recv([out], peer, 0))
        return out

    def close(self) -> None:
        """Drop this generation now, its sockets with it (its peers' operations in
        it fail); an operation on it afterwards is a ``MeshError``."""
        self.closed = True
        if self.index == 0:
            self.board.drop(self.key)
        for name in ("tp", "cp", "world"):
            group = getattr(self, name, None)
            if group is not None:
                with contextlib.suppress(Exception):  # a group already broken
                    group.shutdown()
        self.tp = self.cp = self.world = None
        self._store = None
