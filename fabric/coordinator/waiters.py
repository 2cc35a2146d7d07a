"""Callers waiting for their requests' results, one future per call: a call of
many prompts (an engine step's) is answered once all of them finished, without a
future, a gather and a loop callback per request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fabric.coordinator.requests import RequestResult


class _Call:
    __slots__ = ("future", "left", "results")

    def __init__(self, future: asyncio.Future, count: int) -> None:
        self.future = future
        self.results: list[RequestResult | None] = [None] * count
        self.left = count


class Waiters:
    def __init__(self) -> None:
        self._by_request: dict[str, tuple[_Call, int]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def wait(self, request_ids: Sequence[str]) -> asyncio.Future:
        """A future of the results of ``request_ids``, in their order; call from
        inside the running event loop."""
        call = _Call(asyncio.get_running_loop().create_future(), len(request_ids))
        for index, rid in enumerate(request_ids):
            self._by_request[rid] = (call, index)
        return call.future

    def deliver(self, result: RequestResult) -> None:
        """One request's result; its call's future resolves with its last one."""
        entry = self._by_request.pop(result.request_id, None)
        if entry is None:  # nobody waits (a driver's call that was cancelled)
            return
        call, index = entry
        call.results[index] = result
        call.left -= 1
        if not call.left and not call.future.done():
            call.future.set_result(call.results)

    def fail_all(self, error: str) -> None:
        """Every request still waited for ends with ``error``."""
        for rid in list(self._by_request):
            self.deliver(RequestResult(rid, 0, error=error))


class Wakeup:
    """What the step loop sleeps on while idle: ``set`` wakes the sleep in progress
    (a set while none is in progress is not kept, as ``asyncio.Event`` after
    ``clear``). One future a sleep and a timer, where ``asyncio.wait_for`` of an
    event costs a task, a waiter and more loop turns; call from inside the loop."""

    __slots__ = ("_sleep",)

    def __init__(self) -> None:
        self._sleep: asyncio.Future | None = None

    def set(self) -> None:
        sleep = self._sleep
        if sleep is not None and not sleep.done():
            sleep.set_result(None)

    async def sleep(self, timeout: float | None) -> None:
        """Until ``set`` or ``timeout`` seconds (``None``: until ``set``)."""
        loop = asyncio.get_running_loop()
        self._sleep = sleep = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, self.set)
        try:
            await sleep
        finally:
            self._sleep = None
            if timer is not None:
                timer.cancel()
