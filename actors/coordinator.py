"""The coordinator actor: owns the ``CoordinatorCore`` and runs its step loop.

An async actor: drivers' ``submit`` calls wait on futures while the loop runs
one consensus round per step. Nothing in the loop blocks on a single rank: the
round awaits every rank's reply together, with a deadline.
"""

from __future__ import annotations

import asyncio
import time

import ray

from fabric.config import FabricConfig
from fabric.coordinator import CoordinatorCore, Lease, RequestResult
from fabric.errors import InvalidInput
from fabric.messages import InvalidMessage, Report, decode, encode


class CoordinatorActor:
    def __init__(self, config: dict, rank_names: list[str]) -> None:
        self.config = FabricConfig.from_dict(config)
        self.core = CoordinatorCore(self.config)
        ns = self.config.runtime.ray_namespace
        self.ranks = [ray.get_actor(name, namespace=ns) for name in rank_names]
        self.futures: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None

    async def start(self) -> int:
        """Start the step loop (idempotent). A restarted coordinator opens an epoch
        newer than any rank has seen, so every rank resets its counters."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            epochs = [
                decode(r).epoch
                for r in await asyncio.gather(*(a.report.remote() for a in self.ranks))
            ]  # type: ignore[attr-defined]
            self.core.epoch = max([*epochs, 0]) + 1
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return self.core.epoch

    async def submit(
        self,
        tokens: bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
    ) -> RequestResult:
        if self._task is None:  # a restarted coordinator starts on its first request
            await self.start()
        rid = self.core.submit(tokens, namespace, priority, request_id)
        future = asyncio.get_running_loop().create_future()
        self.futures[rid] = future
        assert self._wakeup is not None
        self._wakeup.set()
        return await future

    async def abort(self, request_id: str) -> bool:
        result = self.core.abort(request_id)
        if result is not None:
            self._deliver([result])
            return True
        return request_id in self.core.running

    async def release(self, lease: Lease | str) -> bool:
        released = self.core.release(lease)
        if released and self._wakeup is not None:
            self._wakeup.set()
        return released

    async def verify(self, lease: Lease, tokens: bytes) -> list[bool]:
        """Per rank, whether the lease's pages hold exactly the producer's KV of
        ``tokens``. Call while holding the lease."""
        held = self.core.leases.get(lease.request_id)
        if held is None or held[0] != lease:
            raise InvalidInput(f"lease {lease.request_id!r} is not held (released, or reset)")
        cached = tokens[: lease.tokens * 4]
        pages = list(lease.device_pages)
        return list(
            await asyncio.gather(
                *(r.verify.remote(lease.namespace, cached, pages) for r in self.ranks)
            )
        )

    async def stats(self) -> dict:
        return self.core.snapshot()

    async def check_integrity(self) -> None:
        self.core.cache.check_integrity()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- the step loop ---------------------------------------------------------------

    async def _loop(self) -> None:
        runtime = self.config.runtime
        assert self._wakeup is not None
        while True:
            if self.core.idle:
                self._wakeup.clear()
                await self._wakeup.wait()
            started = time.perf_counter()
            data = encode(self.core.next_batch())
            self.core.stats.core_time_s += time.perf_counter() - started
            calls = [rank.step.remote(data) for rank in self.ranks]
            try:
                replies = await asyncio.wait_for(
                    asyncio.gather(*calls, return_exceptions=True), runtime.rank_timeout_s
                )
            except TimeoutError:
                self._deliver(self.core.reset("a rank timed out"))
                continue
            reports = []
            for reply in replies:
                try:
                    if isinstance(reply, BaseException):
                        raise reply
                    report = decode(reply, runtime.max_message_bytes)
                    if not isinstance(report, Report):
                        raise InvalidMessage("a rank answered with something other than a Report")
                    reports.append(report)
                except InvalidMessage:
                    self.core.stats.bad_messages += 1
                except Exception:
                    pass
            if len(reports) != len(self.ranks):
                self._deliver(self.core.reset("a rank did not answer"))
                await asyncio.sleep(0.05)
                continue
            started = time.perf_counter()
            self._deliver(self.core.on_round(reports))
            self.core.stats.core_time_s += time.perf_counter() - started
            await asyncio.sleep(runtime.step_interval_s)

    def _deliver(self, results: list[RequestResult]) -> None:
        for result in results:
            future = self.futures.pop(result.request_id, None)
            if future is not None and not future.done():
                future.set_result(result)
