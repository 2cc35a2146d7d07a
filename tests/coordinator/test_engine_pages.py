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
        for key in self.order[: max(len(self.order) - self.capacity, 0)]:
            del self.model[key]
        self.order = self.order[-self.capacity :]

    @rule(
        tag=st.sampled_from([TAG, "fedcba9876543210"]),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        length=st.integers(0, 6),
    )
    def lookup(self, tag, world, ns, length) -> None:
        c = self.chains[ns][:length]
        (hit,) = self.pages.lookup(tag, world, [c])
        expected = 0
        for h in c:
            if len(self.model.get((tag, world, h), ())) != world:
                break
            expected += 1
        assert hit == expected
        for h in c[:hit]:
            self._use((tag, world, h))

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

    @invariant()
    def bounded(self) -> None:
        assert len(self.pages) == len(self.model) <= self.capacity


EnginePagesMachine.TestCase.settings = machine_settings(examples=200, steps=40)
TestEnginePagesMachine = EnginePagesMachine.TestCase
