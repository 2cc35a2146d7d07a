"""The coordinator's step protocol (``CoordinatorDriver``) against a fake rank group,
no Ray: what the actor does with missing, malformed and slow replies, a failing
storage link, an inventory that cannot be taken, a straggler the policy restarts,
and KV events with and without a publisher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from fabric.cache.keys import pack_tokens
from fabric.coordinator.core import CoordinatorCore
from fabric.coordinator.driver import CoordinatorDriver, Replies, Step
from fabric.coordinator.requests import RequestResult
from fabric.driver.local import LocalFabric, LocalRanks
from tests.helpers import FakeClock, prompt, small_config


class FakeRanks(LocalRanks):
    """The ranks of a ``LocalFabric``, with each round's replies passed through
    ``tamper`` (index, reply) first, inventories that can fail, and restarts
    recorded."""

    def __init__(self, fabric: LocalFabric) -> None:
        super().__init__(fabric)
        self.tamper: Callable[[int, bytes | str], bytes | str] = lambda _, reply: reply
        self.inventory_error: Exception | None = None
        self.restarted: list[int] = []
        self.reply_s: list[float | None] | None = None

    async def inventories(self, epoch: int) -> list:
        if self.inventory_error is not None:
            raise self.inventory_error
        return await super().inventories(epoch)

    async def round(self, batch: bytes) -> Replies:
        got = await super().round(batch)
        replies = [self.tamper(i, reply) for i, reply in enumerate(got.replies)]
        return Replies(replies, self.reply_s or got.reply_s)

    def restart(self, index: int) -> None:
        self.restarted.append(index)


class FakeStorage:
    """A storage link whose answers fail (``error``) or never come (``hang``)."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.hang = False

    def query(self, queries):
        async def answer():
            if self.hang:
                await asyncio.sleep(3600)
            if self.error is not None:
                raise self.error
            return {op: (0, ()) for op, *_ in queries}

        return answer()


class Harness:
    def __init__(self, *overrides: str, publish: bool = False) -> None:
        self.clock = FakeClock()
        config = small_config("runtime.rank_timeout_s=0.05", *overrides)
        self.local = LocalFabric(config, clock=self.clock)
        self.ranks = FakeRanks(self.local)
        self.storage = FakeStorage()
        self.results: list[RequestResult] = []
        self.published: list = []
        self.driver = CoordinatorDriver(
            CoordinatorCore(config, self.clock),
            self.ranks,
            self.storage,
            self.results.extend,
            self.published.extend if publish else None,
        )
        self.core = self.driver.core
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def start(self) -> int:
        return self.run(self.driver.start(storage_attached=False))

    def step(self) -> Step:
        return self.run(self.driver.step())

    def serve(self, seed: int, pages: int = 3) -> RequestResult:
        rid = self.core.submit(pack_tokens(prompt(seed, pages)))
        for _ in range(50):
            self.step()
            for r in self.results:
                if r.request_id == rid:
                    return r
        raise AssertionError(f"{rid} not served")

    def close(self) -> None:
        self.loop.close()
        self.local.close()


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(*overrides: str, publish: bool = False) -> Harness:
        h = Harness(*overrides, publish=publish)
        h.start()
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_a_served_request_is_delivered_and_an_idle_step_sends_no_round(harness):
    h = harness()
    result = h.serve(1)
    assert result.error is None and result.lease is not None
    assert h.core.release(result.lease)
    for _ in range(20):  # the write-throughs and their acks
        if h.core.idle:
            break
        h.step()
    rounds = h.core.stats.rounds
    assert h.step() is Step.SKIPPED
    assert h.core.stats.rounds == rounds and h.core.stats.rounds_skipped >= 1


def test_events_stay_queued_without_a_publisher_and_go_to_it_with_one(harness):
    kept = harness()
    kept.serve(2)
    assert len(kept.core.events) > 0, "take_events still has them"
    published = harness(publish=True)
    published.serve(2)
    assert len(published.core.events) == 0 and published.published


def test_a_rank_that_gives_no_reply_resets_once_then_fails_requests_naming_it(harness):
    h = harness("runtime.rank_absent_timeout_s=5")
    h.ranks.tamper = lambda i, reply: "ActorDiedError: gone" if i == 1 else reply
    h.core.submit(pack_tokens(prompt(3, 3)))
    assert h.step() is Step.MISSING
    resets = h.core.stats.resets
    assert h.step() is Step.MISSING and h.core.stats.resets == resets, "one reset, not one a round"
    h.clock.advance(6)
    h.step()
    failed = [r for r in h.results if r.error]
    assert failed and "has not answered" in failed[0].error and "ActorDiedError" in failed[0].error


@pytest.mark.parametrize(
    "bad",
    [b"\x00not msgpack", "wrong rank"],
    ids=["malformed", "another rank's report"],
)
def test_a_bad_report_is_counted_and_treated_as_missing(harness, bad):
    h = harness()
    good: dict[int, bytes | str] = {}

    def tamper(i: int, reply: bytes | str) -> bytes | str:
        good[i] = reply
        if bad == "wrong rank":
            return good[0] if i == 1 else reply  # rank 0's report in rank 1's place
        return bad if i == 0 else reply

    h.ranks.tamper = tamper
    h.core.submit(pack_tokens(prompt(4, 2)))
    assert h.step() is Step.MISSING
    assert h.core.stats.bad_messages == 1
    assert list(h.core.rounds.absent) == [1 if bad == "wrong rank" else 0]


def test_a_storage_link_that_fails_or_hangs_is_counted_and_the_request_served(harness):
    h = harness("prefetch.threshold_tokens=0")
    h.core.storage_attached()  # so the step asks L3 for hits
    h.storage.error = ConnectionError("storage actor gone")
    first = h.serve(5)
    assert first.error is None
    errors = h.core.stats.storage_errors
    assert errors >= 1, "the failed hit query is counted"
    h.storage.error, h.storage.hang = None, True
    second = h.serve(6)
    assert second.error is None and h.core.stats.storage_errors > errors


def test_no_inventory_at_start_adopts_nothing_and_a_failed_one_after_a_restart_gives_up(harness):
    h = Harness()
    try:
        h.ranks.inventory_error = TimeoutError("rank 1 gives no inventory")
        assert h.start() >= 1, "the coordinator opens its epoch anyway"
        assert h.core.stats.adopted_tokens == 0
        h.core.rounds.adopt_wanted = True
        h.run(h.driver.adopt())
        assert h.core.rounds.adopt_wanted is False
    finally:
        h.close()


def test_a_straggler_under_the_restart_policy_is_restarted_through_the_group(harness):
    h = harness(
        "runtime.straggler_policy=restart",
        "runtime.straggler_rounds=2",
        "runtime.straggler_lag_s=0.01",
    )
    h.ranks.reply_s = [0.0, 0.0, 0.0, 5.0]  # rank 3 replies 5 s late, every round
    for seed in range(10, 20):
        h.core.submit(pack_tokens(prompt(seed, 2)))
        h.step()
        if h.ranks.restarted:
            break
    assert h.ranks.restarted == [3]


def test_every_reply_goes_through_the_wire_format(harness):
    h = harness()
    seen: list[bytes | str] = []

    def keep(i: int, reply: bytes | str) -> bytes | str:
        seen.append(reply)
        return reply

    h.ranks.tamper = keep
    h.serve(7)
    assert seen and all(isinstance(r, bytes) for r in seen), "encoded, as a Ray rank's"
