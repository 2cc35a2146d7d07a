"""The coordinator's index of engine pages: a page is whole only once every rank
of the engine reported it (the MIN over ranks), lookups stop at the first page
that is not, and bad input names the bad value."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fabric.cache.events import BlockRemoved, BlockStored, Medium
from fabric.cache.keys import chain_hashes, namespace_seed, pack_tokens
from fabric.coordinator.engine_pages import EnginePages, StoredRun
from fabric.errors import InvalidInput
from tests.helpers import machine_settings

TAG = "0123456789abcdef"


def chain(n: int, namespace: str = "vllm", first: int = 0) -> list[bytes]:
    tokens = pack_tokens(range(first, first + 4 * n))
    return chain_hashes(namespace_seed(namespace), tokens, 16)


def run(hashes: list[bytes], parent: bytes | None = None, namespace: str = "vllm") -> StoredRun:
    return StoredRun(namespace, parent, tuple(hashes))


def test_a_page_is_whole_only_once_every_rank_reported_it():
    pages = EnginePages()
    c = chain(4)
    assert pages.report(TAG, 2, {0: [run(c)]}) == []
    assert pages.lookup(TAG, 2, [c]) == [0]
    events = pages.report(TAG, 2, {1: [run(c[:3])]})
    assert pages.lookup(TAG, 2, [c]) == [3]
    assert events == [BlockStored(tuple(c[:3]), Medium.STORAGE, "vllm", None)]
    # The MIN over ranks: rank 1 stored three pages, so three pages hit.
    assert pages.lookup(TAG, 2, [c, c[:2], chain(2, first=99)]) == [3, 2, 0]


def test_lookup_stops_at_the_first_page_missing_for_some_rank():
    pages = EnginePages()
    c = chain(5)
    pages.report(TAG, 2, {0: [run(c)], 1: [run(c[:1]), run(c[2:], parent=c[1])]})
    assert pages.lookup(TAG, 2, [c]) == [1]
    events = pages.report(TAG, 2, {1: [run(c[1:2], parent=c[0])]})
    assert pages.lookup(TAG, 2, [c]) == [5]
    assert events == [BlockStored((c[1],), Medium.STORAGE, "vllm", c[0])]


def test_groups_and_worlds_never_see_each_others_pages():
    pages = EnginePages()
    c = chain(3)
    pages.report(TAG, 1, {0: [run(c)]})
    assert pages.lookup(TAG, 1, [c]) == [3]
    assert pages.lookup("fedcba9876543210", 1, [c]) == [0]
    assert pages.lookup(TAG, 2, [c]) == [0]


def test_forget_ends_matches_until_stored_again():
    pages = EnginePages()
    c = chain(4)
    pages.report(TAG, 2, {0: [run(c)], 1: [run(c)]})
    assert pages.forget(TAG, 2, [c[2], chain(1, first=77)[0]]) == [
        BlockRemoved((c[2],), Medium.STORAGE, "vllm")
    ]
    assert pages.stats.forgotten_pages == 1
    assert pages.lookup(TAG, 2, [c]) == [2]
    pages.report(TAG, 2, {0: [run(c[2:3], c[1])], 1: [run(c[2:3], c[1])]})
    assert pages.lookup(TAG, 2, [c]) == [4]


def test_least_recently_used_entries_are_forgotten_past_capacity():
    pages = EnginePages(capacity=4)
    a, b = chain(3), chain(3, first=50)
    pages.report(TAG, 1, {0: [run(a)]})
    assert pages.lookup(TAG, 1, [a]) == [3]  # a is now the most recently used
    pages.report(TAG, 1, {0: [run(b)]})
    assert len(pages) == 4
    assert pages.stats.evicted_pages == 2
    assert pages.lookup(TAG, 1, [b]) == [3]
    assert pages.lookup(TAG, 1, [a]) == [0]  # its first pages went first


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda p: p.lookup("XYZ", 1, [[]]), "tag 'XYZ'"),
        (lambda p: p.lookup(TAG, 0, [[]]), "world 0"),
        (lambda p: p.lookup(TAG, True, [[]]), "world True"),
        (lambda p: p.lookup(TAG, 1, [[b"short"]]), "page hash b'short'"),
        (lambda p: p.lookup(TAG, 1, "not a list"), "chains must be"),
        (lambda p: p.lookup(TAG, 1, [[]] * 5000), "at most 4096 page-hash lists"),
        (lambda p: p.report(TAG, 1, {0: [run(chain(1))] * 5000}), "rank 0's runs"),
        (lambda p: p.report(TAG, 2, {2: []}), "rank 2"),
        (lambda p: p.report(TAG, 2, {0: ["run"]}), "StoredRun, got str"),
        (lambda p: p.report(TAG, 2, {0: [run(chain(1), namespace="")]}), "namespace ''"),
        (lambda p: p.report(TAG, 2, {0: [run(chain(1), parent=b"x")]}), "parent b'x'"),
        (lambda p: p.forget(TAG, 1, [hashlib.sha256().digest()[:31]]), "page hash"),
    ],
)
def test_bad_input_is_refused_naming_the_value_and_changes_nothing(call, needle):
    pages = EnginePages()
    pages.report(TAG, 2, {0: [run(chain(2))]})
    with pytest.raises(InvalidInput, match=needle.replace("(", r"\(")):
        call(pages)
    assert len(pages) == 2
    assert pages.lookup(TAG, 2, [chain(2)]) == [0]


def test_a_leased_page_is_kept_past_capacity_until_released_or_expired():
    pages = EnginePages(capacity=3)
    a, b = chain(3), chain(3, first=50)
    pages.report(TAG, 1, {0: [run(a)]})
    assert pages.lookup(TAG, 1, [a], ["e/r1"], 5.0, now=0.0) == [3]
    pages.report(TAG, 1, {0: [run(b)]})  # b needs the room, but a is leased: b goes
    assert pages.lookup(TAG, 1, [a, b], now=1.0) == [3, 0]
    assert len(pages) == 3 and pages.leased == 1
    assert pages.release(["e/r1", "e/unknown"]) == 1
    pages.report(TAG, 1, {0: [run(chain(1, first=90))]})  # now a may go
    assert len(pages) == 3
    assert pages.lookup(TAG, 1, [a]) == [0]
    # A lease not released ends when its time is up (at the next lookup).
    c = chain(3, first=120)
    pages.report(TAG, 1, {0: [run(c)]})
    pages.lookup(TAG, 1, [c], ["e/r2"], 5.0, now=10.0)
    assert pages.lookup(TAG, 1, [[]], now=15.0) == [0]
    assert pages.leased == 0 and pages.stats.leases_expired == 1


@pytest.mark.parametrize(
    ("leases", "lease_s", "needle"),
    [
        (["a", "b"], 1.0, "one lease name per chain"),
        ([""], 1.0, "lease name ''"),
        (["x" * 300], 1.0, "1..256 characters"),
        ([7], 1.0, "lease name 7"),
        (["a"], -1.0, "lease_s -1.0"),
        (["a"], float("nan"), "lease_s nan"),
        (["a"], 601.0, "lease_s 601.0"),
        (["a"], True, "lease_s True"),
    ],
)
def test_bad_leases_are_refused_naming_the_value(leases, lease_s, needle):
    pages = EnginePages()
    pages.report(TAG, 1, {0: [run(chain(2))]})
    with pytest.raises(InvalidInput, match=needle):
        pages.lookup(TAG, 1, [chain(2)], leases, lease_s)
    assert pages.leased == 0 and pages.stats.lookups == 0
    with pytest.raises(InvalidInput, match="lease names"):
        pages.release("e/r1")


def test_a_bad_run_among_good_ones_records_none_of_them():
    pages = EnginePages()
    c = chain(2)
    with pytest.raises(InvalidInput):
        pages.report(TAG, 1, {0: [run(c), run([b"bad"])]})
    assert len(pages) == 0


class EnginePagesMachine(RuleBasedStateMachine):
    """Model: per group, which ranks reported each page, and the order of use.
    A lookup is the leading run of pages every rank reported (the MIN over ranks),
    never more; past ``capacity`` only the least recently used entries are gone."""

    @initialize(capacity=st.sampled_from([3, 8, 1000]))
    def setup(self, capacity: int) -> None:
        self.pages = EnginePages(capacity)
        self.capacity = capacity
        self.model: dict[tuple[str, int, bytes], set[int]] = {}
        self.order: list[tuple[str, int, bytes]] = []  # least recently used first
        self.chains = {ns: chain(6, ns) for ns in ("a", "b")}
        self.now = 0.0
        self.leases: dict[str, tuple[float, list[tuple[str, int, bytes]]]] = {}

    def _leased(self, key: tuple[str, int, bytes]) -> bool:
        return any(key in held for _, held in self.leases.values())

    def _evict(self) -> None:
        """Least recently used first; a leased entry is kept and made most recent."""
        over, looked = len(self.order) - self.capacity, 0
        while over > 0 and looked < len(self.order):
            key = self.order.pop(0)
            if self._leased(key):
                self.order.append(key)
                looked += 1
                continue
            del self.model[key]
            over -= 1

    def _use(self, key: tuple[str, int, bytes]) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    @rule(
        tag=st.sampled_from([TAG, "fedcba9876543210"]),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        start=st.integers(0, 5),
        length=st.integers(1, 4),
        rank=st.integers(0, 2),
    )
    def report(self, tag, world, ns, start, length, rank) -> None:
        rank %= world
        c = self.chains[ns]
        hashes = c[start : start + length]
        parent = c[start - 1] if start else None
        events = self.pages.report(tag, world, {rank: [StoredRun(ns, parent, tuple(hashes))]})
        whole = []
        for h in hashes:
            key = (tag, world, h)
            ranks = self.model.setdefault(key, set())
            if rank not in ranks and len(ranks) + 1 == world:
                whole.append(h)
            ranks.add(rank)
            self._use(key)
        assert [h for e in events for h in e.page_hashes] == whole
        self._evict()

    @rule(
        tag=st.sampled_from([TAG, "fedcba9876543210"]),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        length=st.integers(0, 6),
    )
    def lookup(self, tag, world, ns, length) -> None:
        self._lookup(tag, world, ns, length, None)

    @rule(
        tag=st.sampled_from([TAG, "fedcba9876543210"]),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        length=st.integers(0, 6),
        name=st.sampled_from(["e/r1", "e/r2", "f/r1"]),
        lease_s=st.sampled_from([0.0, 1.0, 5.0]),
    )
    def lease(self, tag, world, ns, length, name, lease_s) -> None:
        """A lookup that leases what it matched under ``name``."""
        self._lookup(tag, world, ns, length, (name, lease_s))

    @rule(names=st.lists(st.sampled_from(["e/r1", "e/r2", "f/r1", "unknown"]), max_size=3))
    def release(self, names) -> None:
        ended = self.pages.release(names)
        assert ended == len({n for n in names if n in self.leases})
        for name in names:
            self.leases.pop(name, None)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, seconds) -> None:
        self.now += seconds

    def _lookup(self, tag, world, ns, length, lease) -> None:
        c = self.chains[ns][:length]
        self.leases = {n: v for n, v in self.leases.items() if v[0] > self.now}  # expired
        if lease is None:
            (hit,) = self.pages.lookup(tag, world, [c], now=self.now)
        else:
            name, lease_s = lease
            (hit,) = self.pages.lookup(tag, world, [c], [name], lease_s, self.now)
        expected = 0
        for h in c:
            if len(self.model.get((tag, world, h), ())) != world:
                break
            expected += 1
        assert hit == expected
        for h in c[:hit]:
            self._use((tag, world, h))
        if lease is not None and hit and lease[1] > 0:
            self.leases[lease[0]] = (self.now + lease[1], [(tag, world, h) for h in c[:hit]])
        assert self.pages.leased == len(self.leases)

    @rule(
        tag=st.sampled_from([TAG, "fedcba9876543210"]),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        at=st.integers(0, 5),
    )
    def forget(self, tag, world, ns, at) -> None:
        key = (tag, world, self.chains[ns][at])
        events = self.pages.forget(tag, world, [key[2]])
        was_whole = len(self.model.get(key, ())) == world
        assert [h for e in events for h in e.page_hashes] == ([key[2]] if was_whole else [])
        self.model.pop(key, None)
        if key in self.order:
            self.order.remove(key)
        for _, held in self.leases.values():  # a forgotten page is no lease's any more
            while key in held:
                held.remove(key)

    @invariant()
    def bounded(self) -> None:
        leased = {key for _, held in self.leases.values() for key in held if key in self.model}
        assert len(self.pages) == len(self.model)
        assert len(self.model) - self.capacity <= len(leased)  # only leases keep it over


EnginePagesMachine.TestCase.settings = machine_settings(examples=200, steps=40)
TestEnginePagesMachine = EnginePagesMachine.TestCase
