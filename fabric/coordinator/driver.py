"""The coordinator's step protocol — start, step, adopt, deliver — over any rank
group: the Ray actor (``actors/coordinator_actor.py``) and ``LocalFabric`` run the
same code, and tests run it against a fake group.

A ``RankGroup`` is every call to the ranks: their reports when the coordinator
starts, their L2 inventories, one round (the same batch to each, each rank's report
bytes or why there is none), and restarting one. A ``StorageLink`` answers the
step's L3 hit queries. Everything here is without Ray: report decoding, missing and
malformed replies, a storage call that fails, stragglers the policy restarts, the
adoption after a rank restart, KV events to the publisher, the core's time."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from fabric.coordinator.commands import Answer, Query
from fabric.coordinator.core import CoordinatorCore
from fabric.coordinator.requests import RequestResult
from fabric.messages import InvalidMessage, Report, decode, encode

log = logging.getLogger(__name__)


class Replies(NamedTuple):
    """A round's replies, by rank index: a report's bytes, or why none came; and how
    long each rank took to reply (``None``: not measured)."""

    replies: list[bytes | str]
    reply_s: list[float | None]


class RankGroup(Protocol):
    async def reports(self) -> list[Report]:
        """Each rank's report now (as it starts, or comes back)."""
        ...

    async def inventories(self, epoch: int) -> list[Any]:
        """Each rank's L2 inventory at ``epoch``; raises if some rank gives none."""
        ...

    async def round(self, batch: bytes) -> Replies:
        """Send ``batch`` to every rank; their replies, within the round's deadline."""
        ...

    def restart(self, index: int) -> None:
        """Restart rank ``index`` (a straggler the policy treats as failed)."""
        ...


class StorageLink(Protocol):
    def query(self, queries: list[Query]) -> Awaitable[Mapping[int, Answer]]:
        """Start answering the step's hit queries: ``(hit pages, hashes)`` by op id."""
        ...


class Step(enum.Enum):
    SKIPPED = "skipped"  # nothing to send or to hear: no round
    MISSING = "missing"  # some rank gave no usable report
    ROUND = "round"  # every rank reported; the round committed


class CoordinatorDriver:
    def __init__(
        self,
        core: CoordinatorCore,
        ranks: RankGroup,
        storage: StorageLink,
        deliver: Callable[[list[RequestResult]], None],
        publish: Callable[[list], None] | None = None,
        after_round: Callable[[], None] | None = None,
        skip_idle_rounds: bool = True,
    ) -> None:
        """``deliver`` hands finished requests' results to their callers;
        ``publish``, when given, takes each step's KV events (the ZMQ publisher);
        ``after_round``, when given, runs after each round, before the publishing
        (``LocalFabric`` takes the pages L3 reports removed there). Without
        ``skip_idle_rounds`` every step is a round, needed or not (``LocalFabric``,
        stepped by hand, hears every rank at each step)."""
        self.core = core
        self.ranks = ranks
        self.storage = storage
        self.deliver = deliver
        self.publish = publish
        self.after_round = after_round
        self.skip_idle_rounds = skip_idle_rounds
        runtime = core.config.runtime
        self.timeout_s = runtime.rank_timeout_s
        self.max_message_bytes = runtime.max_message_bytes

    async def start(self, storage_attached: bool) -> int:
        """Open an epoch newer than any rank has seen and adopt the L2 pages every rank
        still holds (none when a rank cannot say); returns the epoch."""
        core = self.core
        epoch = core.start(await self.ranks.reports())
        try:
            held = await self.ranks.inventories(epoch)
        except Exception as exc:
            log.warning("no L2 pages adopted: a rank gave no inventory (%s)", exc)
        else:
            core.adopt(held)
        if storage_attached:
            core.storage_attached()
        return epoch

    async def step(self) -> Step:
        """One step: the batch to every rank (and the hit queries to storage), their
        reports reduced and committed, finished requests delivered."""
        core, stats = self.core, self.core.stats
        started = time.perf_counter()
        batch = core.next_batch()
        queries = core.take_queries()
        if self.skip_idle_rounds and not core.round_needed(batch, queries):
            stats.rounds_skipped += 1
            self._publish()  # what the step queued (expired leases' pages)
            stats.core_time_s += time.perf_counter() - started
            return Step.SKIPPED
        data = encode(batch)
        stats.core_time_s += time.perf_counter() - started
        asked = self.storage.query(queries) if queries else None
        replies = await self.ranks.round(data)
        answers = await self._answers(asked, queries)
        started = time.perf_counter()
        reports, missing = self.reports(replies.replies)
        core.rounds.rank_latencies(replies.reply_s)
        if missing:
            self.deliver(core.rounds.on_missing(missing))
            outcome = Step.MISSING
        else:
            self.deliver(core.rounds.on_round(reports, answers))
            self._restart_stragglers()
            outcome = Step.ROUND
        stats.core_time_s += time.perf_counter() - started
        if core.rounds.adopt_wanted:
            await self.adopt()
        if self.after_round is not None:
            self.after_round()
        self._publish()
        return outcome

    def reports(self, replies: Sequence[bytes | str]) -> tuple[list[Report], dict[int, str]]:
        """Each rank's decoded report, and why for the ranks that gave none usable (a
        malformed one is counted in ``bad_messages``)."""
        reports, missing = [], {}
        for index, reply in enumerate(replies):
            if isinstance(reply, str):
                missing[index] = reply
                continue
            try:
                report = decode(reply, self.max_message_bytes)
                if not isinstance(report, Report) or report.rank != index:
                    raise InvalidMessage(f"not a Report of rank {index}")
            except InvalidMessage as bad:
                self.core.stats.bad_messages += 1
                missing[index] = f"bad report: {bad}"
                continue
            reports.append(report)
        return reports, missing

    async def _answers(
        self, asked: Awaitable[Mapping[int, Answer]] | None, queries: list[Query]
    ) -> Mapping[int, Answer]:
        """The storage's answers; a failed or slow call finds nothing (the
        prefetches are revoked; the requests go on without L3)."""
        if asked is None:
            return {}
        try:
            return await asyncio.wait_for(asked, self.timeout_s)
        except Exception:
            self.core.stats.storage_errors += 1
            return {op: (0, ()) for op, *_ in queries}

    async def adopt(self) -> None:
        """After a rank restarted: every rank's inventory at the new epoch, and the L2
        pages all of them still name alike taken back (a restarted rank that kept
        its L2 in shared memory loses nothing; one that did not, all)."""
        core = self.core
        try:
            held = await asyncio.wait_for(self.ranks.inventories(core.rounds.epoch), self.timeout_s)
        except Exception as exc:
            core.rounds.adopt_wanted = False
            log.warning("no L2 pages adopted after a rank restart: %s", exc)
            return
        core.adopt(held)

    def _restart_stragglers(self) -> None:
        """Stragglers the policy treats as failed (``runtime.straggler_policy=restart``)
        restart; the next round finds them new, and the epoch resets as for a rank
        that died."""
        stragglers = self.core.rounds.stragglers
        for index in stragglers.take_restart():
            log.warning(
                "rank %s: a straggler, restarted (runtime.straggler_policy=restart)",
                self.core.rounds.names([index]),
            )
            stragglers.forget(index)
            self.ranks.restart(index)

    def _publish(self) -> None:
        if self.publish is not None:
            self.publish(self.core.events.drain())
