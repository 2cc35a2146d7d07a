"""Every Ray call the coordinator makes to its ranks, in one place: their handles
(looked up again by name after a rank's actor died for good), a round's fan-out with
its deadline (over the ranks' sockets when ``runtime.round_transport`` is ``zmq``,
their addresses asked of each rank by a Ray call; on a compiled graph when
``runtime.compiled_rounds`` is on and works), each reply's time, and the other calls that go to every rank (inventories,
verification, reads, their one-line descriptions). It is the ``RankGroup`` of
``fabric.coordinator.driver``; the driver's tests use a fake one instead."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import ray

from actors.calls import awaited, described
from actors.compiled_rounds import CompiledRounds
from fabric.config import FabricConfig
from fabric.coordinator.driver import Replies
from fabric.coordinator.requests import Lease
from fabric.messages import Report, decode
from fabric.round_sockets import RoundSockets, ray_tls

log = logging.getLogger(__name__)


class RayRankGroup:
    def __init__(self, config: FabricConfig, names: list[str]) -> None:
        self.names = list(names)
        self.namespace = config.runtime.ray_namespace
        self.timeout_s = config.runtime.rank_timeout_s
        self.handles = [ray.get_actor(name, namespace=self.namespace) for name in names]
        # Ranks whose actor died for good: looked up again by name before each
        # round (an operator or the chaos harness may have made a new one).
        self.dead: set[int] = set()
        self.compiled = CompiledRounds() if config.runtime.compiled_rounds else None
        self.sockets: RoundSockets | None = None
        if config.runtime.round_transport == "zmq" and not ray_tls():
            self.sockets = RoundSockets(len(names), config.runtime.max_message_bytes)

    async def reports(self) -> list[Report]:
        replies = await asyncio.gather(*(a.report.remote() for a in self.handles))
        return [decode(r) for r in replies]  # type: ignore[misc]

    async def inventories(self, epoch: int) -> list[Any]:
        return list(
            await asyncio.gather(*(awaited(a.inventory.remote(epoch)) for a in self.handles))
        )

    async def round(self, batch: bytes) -> Replies:
        """Send ``batch`` to every rank; each rank's reply, or why it gave none within
        ``runtime.rank_timeout_s``. On the compiled graph when it is on and works;
        otherwise (and again after any graph failure) over the ranks' sockets, or
        one call per rank (``runtime.round_transport``)."""
        if self.dead:
            await self._find_new_ranks()
        if self.compiled is not None and not self.dead:
            replies = await self.compiled.round(self.handles, batch, self.timeout_s)
            if replies is not None:  # a compiled round has no reply time per rank
                return Replies(list(replies), [None] * len(replies))
        if self.sockets is not None:
            return await self._socket_round(self.sockets, batch)
        sent = time.perf_counter()
        calls = [asyncio.ensure_future(awaited(rank.step.remote(batch))) for rank in self.handles]
        replied: dict[int, float] = {}
        for index, call in enumerate(calls):  # when each reply came (stragglers)
            call.add_done_callback(lambda _, i=index: replied.setdefault(i, time.perf_counter()))
        _, pending = await asyncio.wait(calls, timeout=self.timeout_s)
        for call in pending:
            call.cancel()
        out: list[bytes | str] = []
        for index, call in enumerate(calls):
            if call in pending:
                out.append(f"no reply within {self.timeout_s} s")
            elif call.exception() is not None:  # a dead, restarting or failing rank
                exc = call.exception()
                out.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                if isinstance(exc, ray.exceptions.ActorDiedError):
                    self.dead.add(index)
            else:
                out.append(call.result())
        reply_s = [
            replied[i] - sent if i in replied and call not in pending else None
            for i, call in enumerate(calls)
        ]
        return Replies(out, reply_s)

    async def _socket_round(self, sockets: RoundSockets, batch: bytes) -> Replies:
        """A round over the ranks' sockets, linking first (within the round's
        deadline) each rank that has no usable link: a new or restarted rank."""
        started = time.monotonic()
        absent = {}
        unlinked = [i for i in range(len(self.handles)) if not sockets.usable(i)]
        if unlinked:
            absent = await self._link(sockets, unlinked)
        left = max(0.0, self.timeout_s - (time.monotonic() - started))
        replies, reply_s = await sockets.round(batch, left, absent)
        return Replies(replies, reply_s)

    async def _link(self, sockets: RoundSockets, indices: list[int]) -> dict[int, str]:
        """Ask each rank of ``indices`` for its round socket and link it; returns
        why, for each rank that gave none."""
        calls = {
            i: asyncio.ensure_future(awaited(self.handles[i].round_endpoint.remote()))
            for i in indices
        }
        _, pending = await asyncio.wait(calls.values(), timeout=self.timeout_s)
        absent = {}
        for index, call in calls.items():
            if call in pending:
                call.cancel()
                absent[index] = f"no round socket named within {self.timeout_s} s"
            elif call.exception() is not None:
                exc = call.exception()
                absent[index] = f"{type(exc).__name__}: {str(exc)[:200]}"
                if isinstance(exc, ray.exceptions.ActorDiedError):
                    self.dead.add(index)
            else:
                sockets.connect(index, *call.result())
        return absent

    def restart(self, index: int) -> None:
        """Kill rank ``index``'s actor with a restart: Ray starts it anew."""
        if self.sockets is not None:
            self.sockets.drop(index)
        with contextlib.suppress(Exception):
            ray.kill(self.handles[index], no_restart=False)

    async def _find_new_ranks(self) -> None:
        """Take the handle of a new actor made under a dead rank's name."""
        for index in sorted(self.dead):
            try:
                handle = await asyncio.to_thread(ray.get_actor, self.names[index], self.namespace)
            except ValueError:
                continue  # none yet
            if handle._actor_id != self.handles[index]._actor_id:
                self.handles[index] = handle
                self.dead.discard(index)
                if self.sockets is not None:
                    self.sockets.drop(index)
                log.warning("rank %s has a new actor: using it", self.names[index])

    # -- calls to every rank besides the rounds ---------------------------------------------

    async def verify(self, lease: Lease, tokens: bytes) -> list[bool | None]:
        """Per rank, whether the lease's pages hold exactly the producer's KV of
        ``tokens`` (``None`` from a rank no longer in the lease's epoch)."""
        cached = tokens[: lease.tokens * 4]
        pages = list(lease.device_pages)
        parts = (list(lease.sliding), list(lease.mamba))
        calls = [
            r.verify.remote(lease.namespace, cached, pages, *parts, epoch=lease.epoch)
            for r in self.handles
        ]
        return list(await asyncio.gather(*calls))

    async def read(self, lease: Lease) -> list:
        """Every rank's shard of the lease's KV."""
        pages = list(lease.device_pages)
        return list(
            await asyncio.gather(*(r.read.remote(lease.tokens, pages) for r in self.handles))
        )

    async def read_parts(self, lease: Lease) -> list:
        """Every rank's shard of the lease's other components."""
        sliding, mamba = list(lease.sliding), list(lease.mamba)
        return list(
            await asyncio.gather(*(r.read_parts.remote(sliding, mamba) for r in self.handles))
        )

    async def describe(self) -> list[dict[str, Any]]:
        """Every rank's line in ``kvfabric status``."""
        return list(
            await asyncio.gather(
                *(described("rank", n, a) for n, a in zip(self.names, self.handles, strict=True))
            )
        )

    async def infos(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(r.info.remote() for r in self.handles)))

    async def stop(self) -> None:
        if self.sockets is not None:
            self.sockets.close()
        if self.compiled is not None:
            await self.compiled.drop("stopped", failed=False)
