"""The consensus round on a Ray Compiled Graph (``runtime.compiled_rounds``).

One graph, compiled by the coordinator inside its running event loop: the
step's batch goes to every rank's ``step`` through shared-memory channels and
the reports come back the same way, without a Ray RPC per rank. What it costs
and how it fails shapes the code:

- every actor in a graph polls its channels on a core, busy or idle (so it is
  off by default);
- only the process that compiled a graph may run it, and an actor can be in one
  graph at a time;
- a rank that dies, or a round that times out with only some ranks answered,
  leaves the graph unusable (out of step): any failure tears it down, the
  round is sent again with plain calls (ranks take a repeated batch as a no-op,
  as they must for duplicated messages), and a new graph is compiled for the
  ranks of a later round, after ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

# After a failure, plain calls for this long before compiling again (a rank that
# flaps must not cost a compile per round).
RETRY_S = 2.0


class CompiledRounds:
    def __init__(self) -> None:
        self.graph: Any = None
        self._members: tuple[Any, ...] = ()
        self._retry_at = 0.0
        self.compiles = 0
        self.rounds = 0
        self.failures = 0
        self.last_error = ""
        self._teardowns: set[asyncio.Task] = set()

    def _ids(self, ranks: list[Any]) -> tuple[Any, ...]:
        return tuple(r._actor_id for r in ranks)

    async def _compile(self, ranks: list[Any], timeout_s: float) -> bool:
        from ray.dag import InputNode, MultiOutputNode

        started = time.perf_counter()
        try:
            # A graph a dead coordinator compiled may still hold the ranks.
            calls = [rank.leave_graphs.remote() for rank in ranks]
            stale = sum(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))
            if stale:
                log.info("closed %d compiled-graph tasks left on the ranks", stale)
            with InputNode() as batch:
                dag = MultiOutputNode([rank.step.bind(batch) for rank in ranks])
            self.graph = dag.experimental_compile(enable_asyncio=True)
        except Exception as exc:
            self._fail(f"compile: {type(exc).__name__}: {exc}")
            return False
        self._members = self._ids(ranks)
        self.compiles += 1
        log.info(
            "consensus rounds on a compiled graph (%.2f s to compile)",
            time.perf_counter() - started,
        )
        return True

    async def round(self, ranks: list[Any], data: bytes, timeout_s: float) -> list[Any] | None:
        """Every rank's reply to ``data`` through the graph, in rank order; ``None``
        when there is no usable graph or it failed (it is dropped: send the round
        with plain calls)."""
        if self.graph is not None and self._members != self._ids(ranks):
            await self.drop("the ranks changed", failed=False)
        if self.graph is None and (
            time.monotonic() < self._retry_at or not await self._compile(ranks, timeout_s)
        ):
            return None
        try:
            futures = await self.graph.execute_async(data)
            replies = await asyncio.wait_for(asyncio.gather(*futures), timeout_s)
        except Exception as exc:
            reason = (
                f"no reply within {timeout_s} s"
                if isinstance(exc, asyncio.TimeoutError)
                else f"{type(exc).__name__}: {str(exc)[:200]}"
            )
            await self.drop(reason)
            return None
        self.rounds += 1
        return list(replies)

    def _fail(self, reason: str) -> None:
        self.failures += 1
        self.last_error = reason
        self._retry_at = time.monotonic() + RETRY_S
        log.warning("compiled consensus round failed (%s): plain calls for now", reason)

    async def drop(self, reason: str, failed: bool = True) -> None:
        """Tear the graph down (``failed``: and count it, plain calls for a while)."""
        graph, self.graph, self._members = self.graph, None, ()
        if graph is None:
            return
        if failed:
            self._fail(reason)
        # In the background: a teardown waits for every rank's loop to end, up to
        # 30 s for a dead one, and the step loop goes on with plain calls meanwhile
        # (the next compile closes whatever is left: ``RankActor.leave_graphs``).
        task = asyncio.get_running_loop().create_task(self._teardown(graph))
        self._teardowns.add(task)
        task.add_done_callback(self._teardowns.discard)

    @staticmethod
    async def _teardown(graph: Any) -> None:
        try:
            await asyncio.to_thread(graph.teardown)
        except Exception as exc:
            log.warning("tearing down the compiled graph: %s", exc)

    def stats(self) -> dict[str, Any]:
        return {
            "active": self.graph is not None,
            "compiles": self.compiles,
            "rounds": self.rounds,
            "failures": self.failures,
            "last_error": self.last_error,
        }
