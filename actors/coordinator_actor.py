"""The coordinator actor: owns the ``CoordinatorCore`` and runs its step loop.

An async actor: drivers' ``submit`` calls wait on futures while the loop runs
one consensus round per step. Nothing in the loop blocks on a single actor:
each round sends one batch to every rank (and the step's hit queries to the
storage actor) and awaits all replies together, with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from actors.calls import dead_jobs
from actors.coordinator_metrics import feed_metrics, prometheus_exporter
from actors.engine_calls import EngineCalls
from actors.rank_group import RayRankGroup
from actors.ray_metrics import CoordinatorMetrics, node_ip
from actors.storage_group import StorageGroup
from actors.submit_calls import SubmitCalls
from fabric.cache.results import PinResult
from fabric.config import FabricConfig, StorageConfig
from fabric.coordinator.core import CoordinatorCore
from fabric.coordinator.driver import CoordinatorDriver, Step
from fabric.coordinator.figures import figures, one_line, status_view
from fabric.coordinator.publisher import KVEventPublisher
from fabric.coordinator.requests import Lease, RequestResult
from fabric.coordinator.waiters import Waiters, Wakeup
from fabric.errors import InvalidInput
from fabric.l3 import parse_options
from fabric.l3.service import backend_spec
from fabric.observe.series import to_builtins

log = logging.getLogger(__name__)

# How often the coordinator checks that the drivers holding leases still run,
# and that the storage actor holds the L3 backend it should.
OWNER_CHECK_S = 2.0
STORAGE_CHECK_S = 1.0


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidInput(f"timeout_s={value!r} is refused: allowed is a number >= 0")
    return float(value)


class CoordinatorActor(EngineCalls, SubmitCalls):
    def __init__(self, config: dict, rank_names: list[str], storage_names: list[str] | str) -> None:
        """``storage_names``: the storage actors' (one name: one actor)."""
        self.config = FabricConfig.from_dict(config)
        self.config_dict = config
        self.ranks = RayRankGroup(self.config, rank_names)
        if isinstance(storage_names, str):
            storage_names = [storage_names]
        self.storage = StorageGroup.named(self.config, storage_names)
        self.waiters = Waiters()
        self._task: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        self._wakeup: Wakeup | None = None
        self._next_owner_check = 0.0
        self._storage_spec: tuple[str, dict[str, Any]] | None = None
        self._next_storage_check = 0.0
        self._storage_sync: asyncio.Task | None = None
        self.publisher: KVEventPublisher | None = None
        self.ray_metrics: CoordinatorMetrics | None = None
        self._starting: asyncio.Lock | None = None
        self.driver = self._driver()

    def _driver(self) -> CoordinatorDriver:
        """A new core, and the step protocol over this actor's ranks and storage."""
        publish = self.publisher.publish if self.publisher is not None else None
        return CoordinatorDriver(
            CoordinatorCore(self.config), self.ranks, self.storage, self._deliver, publish
        )

    @property
    def core(self) -> CoordinatorCore:
        return self.driver.core

    async def start(self) -> int:
        """Start the step loop (idempotent). A restarted coordinator opens an epoch
        newer than any rank has seen, so every rank resets its counters, and
        adopts the L2 pages every rank still holds (``CoordinatorCore.adopt``).
        Calls that race (requests arriving at a restarted coordinator) start it once."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            await self._start_once()
        return self.core.rounds.epoch

    async def _start_once(self) -> None:
        if self._task is None:
            if self.config.events.enabled and self.publisher is None:
                self.publisher = KVEventPublisher(self.config.events, self.config.cache.page_size)
                self.driver.publish = self.publisher.publish
            self._wakeup = Wakeup()
            # A restarted coordinator takes back the L2 pages every rank still holds
            # (none when a rank cannot say: it adopts only what all of them hold).
            self._storage_spec = await self.storage.spec()
            await self.driver.start(self._storage_spec is not None)
            self._task = asyncio.get_running_loop().create_task(self._loop())
            if self._metrics_task is None:  # once: a core started afresh keeps them
                self.ray_metrics = CoordinatorMetrics(self.config.runtime.name)
                feed = feed_metrics(
                    lambda: figures(self.core),
                    self.storage,
                    self.ray_metrics,
                    prometheus_exporter(self.config.runtime),
                    lambda: self.publisher.stats() if self.publisher is not None else None,
                )
                self._metrics_task = asyncio.get_running_loop().create_task(feed)

    async def submit(
        self,
        tokens: bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        owner: str | None = None,
        session: str | None = None,
        release: Sequence[Lease] = (),
    ) -> RequestResult:
        """Serve one prompt; ``release``: leases of this driver's earlier results to
        let go first (one call instead of two: a release rides on the next submit)."""
        results = await self.submit_many(
            [tokens], namespace, priority, [request_id], owner, session, release
        )
        return results[0]

    async def submit_many(
        self,
        prompts: Sequence[bytes],
        namespace: str = "default",
        priority: int = 0,
        request_ids: Sequence[str | None] | None = None,
        owner: str | None = None,
        session: str | None = None,
        release: Sequence[Lease] = (),
    ) -> list[RequestResult]:
        """Serve several prompts in one call, after releasing ``release`` (each a
        ``Lease``); one result per prompt, in order. A bad lease or prompt raises
        ``InvalidInput`` before anything is released or submitted."""
        if self._task is None:  # a restarted coordinator starts on its first request
            await self.start()
        started = time.perf_counter()
        try:
            rids = self.core.submit_many(
                prompts, namespace, priority, request_ids, owner, session, release
            )
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started
        results = self.waiters.wait(rids)
        self._wake()
        return await results

    async def append(self, lease: Lease, tokens: bytes, owner: str | None = None) -> RequestResult:
        """Decode: the KV of ``tokens`` generated after a leased request; the result
        carries a new lease on all its tokens (the given one is consumed)."""
        result = self.waiters.wait([self.core.append(lease, tokens, owner)])
        self._wake()
        return (await result)[0]

    async def end_session(self, session: str) -> bool:
        ended = self.core.end_session(session)
        if ended:
            self._wake()
        return ended

    async def pin(self, tokens: bytes, namespace: str, ttl_s: float) -> PinResult:
        return self.core.pin(tokens, namespace, ttl_s)

    async def unpin(self, tokens: bytes, namespace: str) -> int:
        return self.core.unpin(tokens, namespace)

    async def abort(self, request_id: str) -> bool:
        result = self.core.abort(request_id)
        if result is not None:
            self._deliver([result])
            return True
        return request_id in self.core.scheduler.running

    async def release(self, lease: Lease, session: str | None = None) -> bool:
        started = time.perf_counter()
        try:
            released = self.core.release(lease, session)
        finally:
            self.core.stats.core_time_s += time.perf_counter() - started
        if released:
            self._wake()
        return released

    async def renew(self, lease: Lease) -> bool:
        """Extend a lease by its TTL from now; ``False`` if it is gone."""
        return self.core.renew(lease)

    async def verify(self, lease: Lease, tokens: bytes) -> list[bool | None]:
        """Per rank, whether the lease's pages hold exactly the producer's KV of
        ``tokens`` (``None`` from a rank no longer in the lease's epoch — restarted
        since, its pages gone; the coordinator ends the lease when it sees that)."""
        if not isinstance(tokens, bytes):
            raise InvalidInput(f"tokens must be packed bytes, got {type(tokens).__name__}")
        return await self.ranks.verify(self._held(lease), tokens)

    async def read_kv(self, lease: Lease) -> list:
        """Every rank's shard of a held lease's KV (``Fabric.read_kv``)."""
        return await self.ranks.read(self._held(lease))

    async def read_parts(self, lease: Lease) -> list:
        """Every rank's shard of a held lease's other components (``Fabric.read_parts``)."""
        return await self.ranks.read_parts(self._held(lease))

    def _held(self, lease: Lease) -> Lease:
        """``lease``, if the coordinator holds it; ``InvalidInput`` otherwise."""
        if self.core.leases.check(lease) is None:
            raise InvalidInput(f"lease {lease.request_id!r} is not held")
        return lease

    async def computed_tokens_by_rank(self) -> dict[str, int]:
        """Tokens each rank has run through its share of the model since it started."""
        return {info["rank"]: info["computed_tokens"] for info in await self.ranks.infos()}

    async def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    async def running_config(self) -> dict[str, Any]:
        """This fabric's configuration (what ``connect()`` hands a driver)."""
        return self.config_dict

    async def stats(self) -> dict[str, Any]:
        """The coordinator's figures as plain data (``fabric.coordinator.figures``),
        with L3's counters, the KV publisher's and the compiled rounds'."""
        out = to_builtins(figures(self.core))
        out["l3"] = await self.storage.stats(10)
        out["engine_pages"] = self.engine_stats()
        if self.publisher is not None:
            out["kv_events"] = self.publisher.stats()
        if self.ranks.compiled is not None:
            out["compiled_rounds"] = self.ranks.compiled.stats()
        return out

    async def status(self) -> dict[str, Any]:
        """What ``kvfabric status`` shows: every actor (alive, its live figures),
        the epoch, per-tier usage, transfers in flight, L3 usage. Cheap: counters
        the core keeps and one short call per actor."""
        f = figures(self.core)
        me = {
            "role": "coordinator",
            "name": str(self.config.runtime.name),
            "alive": True,
            "describe": one_line(f),
        }
        ranks, storages, l3 = await asyncio.gather(
            self.ranks.describe(), self.storage.describe(), self.storage.stats(5)
        )
        events = self.publisher.stats() if self.publisher else None
        return status_view(f, [me, *ranks, *storages], l3, events)

    async def settle(self, timeout_s: float = 60.0) -> bool:
        """Wait until nothing is in flight (write-throughs, backups, prefetches);
        ``False`` if that takes longer than ``timeout_s``."""
        deadline = time.monotonic() + _seconds(timeout_s)
        while not self.core.idle:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def take_events(self, limit: int = 10_000, namespace: str | None = None) -> list:
        """The oldest KV events (of one namespace, if given), for a KV-aware router.
        With ``events.endpoint`` set they go to ZMQ each step instead."""
        return self.core.events.take(limit, namespace)

    async def check_integrity(self) -> None:
        self.core.cache.check_integrity()

    # -- L3 at runtime -----------------------------------------------------------------

    async def attach_storage(
        self, backend: str, options: dict[str, Any] | str | None = None
    ) -> str:
        """Attach an L3 backend with its options (a mapping, or JSON / ``@file`` text):
        the same one again keeps it; another is refused until ``detach_storage``.
        Bad options raise ``ConfigError`` naming the key."""
        if isinstance(options, str):
            options = parse_options(options)
        storage = StorageConfig(
            **{**self.config.storage.model_dump(), "backend": backend, "options": options or {}}
        )
        name, spec_options = backend_spec(storage)
        outcome = await self.storage.attach(name, spec_options)
        self._storage_spec = (name, spec_options)
        self.core.storage_attached()
        self._wake()
        return outcome

    async def detach_storage(self, timeout_s: float = 30.0) -> bool:
        """Issue no new L3 work, stop every prefetch and wait for what is in flight
        to end, then close the backend. Past ``timeout_s`` the fabric resets (so no
        rank writes a host page any more) and everything pending is released."""
        timeout_s = _seconds(timeout_s)
        self.core.storage_begin_detach()
        self._wake()
        deadline = time.monotonic() + timeout_s
        while not self.core.storage_drained() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not self.core.storage_drained():
            self._deliver(self.core.rounds.reset("storage detach timed out"))
            self.core.storage_force_detach()
        self._storage_spec = None
        detached = await self.storage.detach()
        self.core.l3_cleared()
        return detached

    async def storage_spec(self) -> tuple[str, dict[str, Any]] | None:
        """The L3 backend that should be attached (a restarted storage actor asks)."""
        return self._storage_spec

    async def clear_storage(self) -> bool:
        cleared = await self.storage.clear()
        self.core.l3_cleared()
        return cleared

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.ranks.stop()
        self._close_calls()
        if self.publisher is not None:
            self.publisher.close()

    # -- the step loop ---------------------------------------------------------------

    async def _loop(self) -> None:
        """One step after another, for ever: an error in a step is logged, counted
        and recovered from (the request it concerns fails); the loop goes on."""
        while True:
            try:
                await self._wait_for_work()
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                try:
                    self._deliver(self.core.rounds.recover(exc))
                except Exception:
                    log.critical("coordinator could not recover; starting afresh", exc_info=True)
                    self._start_afresh(f"coordinator failed: {type(exc).__name__}: {exc}")
                    return
                await asyncio.sleep(0.05)

    def _start_afresh(self, error: str) -> None:
        """Last resort: fail everything pending and drop the core; the next call
        starts a new one (a new epoch: ranks reset, L3 stays)."""
        self.waiters.fail_all(error)
        self.driver = self._driver()
        self._task = None

    async def _wait_for_work(self) -> None:
        """Sleep while idle, until woken, the next lease or session expires or drivers are due
        a liveness check; reclaim the leases of drivers that have exited."""
        assert self._wakeup is not None
        now = time.monotonic()
        if now >= self._next_owner_check:
            self._next_owner_check = now + OWNER_CHECK_S
            owners = self.core.owners()
            if owners:
                for owner in owners & await asyncio.to_thread(dead_jobs):
                    log.warning("driver %s exited: reclaiming its leases", owner)
                    self._deliver(self.core.reclaim(owner))
        if not self.core.idle:
            return
        wake_at = [self._next_owner_check] if self.core.owners() else []
        expiry = self.core.next_expiry()
        if expiry is not None:
            wake_at.append(expiry)
        timeout = max(0.0, min(wake_at) - time.monotonic()) if wake_at else None
        await self._wakeup.sleep(timeout)

    async def _sync_storage(self) -> None:
        """Make every storage actor hold the backend this coordinator says is
        attached (a restarted one comes back with the launch config's)."""
        restored, failed = await self.storage.ensure(self._storage_spec, STORAGE_CHECK_S * 10)
        if failed:
            self.core.stats.storage_errors += failed
            log.warning("%d storage actor(s) unavailable", failed)
        if restored:
            self.core.stats.storage_restores += restored
            log.warning("%d storage actor(s) had lost the L3 backend: restored", restored)
        if self.config.cache.kv_events:
            removed = await self.storage.take_removed(10)
            if removed:
                self.core.l3_removed(removed)

    async def _step(self) -> None:
        now = time.monotonic()
        if now >= self._next_storage_check and (
            self._storage_sync is None or self._storage_sync.done()
        ):
            self._next_storage_check = now + STORAGE_CHECK_S
            self._storage_sync = asyncio.get_running_loop().create_task(self._sync_storage())
        started = time.perf_counter()
        outcome = await self.driver.step()
        if outcome is Step.SKIPPED:
            return
        if self.ray_metrics is not None:
            self.ray_metrics.round_seconds.observe(time.perf_counter() - started)
        if outcome is Step.MISSING:
            await asyncio.sleep(0.05)
        await asyncio.sleep(self.config.runtime.step_interval_s)

    def describe(self) -> str:
        """This actor's role and live figures in one line (``kvfabric status``)."""
        return one_line(figures(self.core))

    def __repr__(self) -> str:
        """What the Ray dashboard shows for this actor: Ray reads the repr once, as
        the actor starts, so it holds only what does not change (role, shard,
        node). The moving figures are in Ray's metrics and `kvfabric status`."""
        config = getattr(self, "config", None)
        name = config.runtime.name if config is not None else "?"
        return f"kvfabric coordinator of {name}, node {node_ip()}"

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _deliver(self, results: list[RequestResult]) -> None:
        metrics = self.ray_metrics
        for result in results:
            if metrics is not None and result.error is None:
                metrics.request_seconds.observe(result.latency_s)
            self.waiters.deliver(result)
