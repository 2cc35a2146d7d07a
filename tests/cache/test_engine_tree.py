"""Engine pages in the tree (``fabric.cache.engine_tree``): a page is whole in a
place only once every rank of the engine stored its shard there (the MIN over
ranks), lookups stop at the first page whole neither in L3 nor in the asker's
node L2, eviction is leaves first in the policy's order within each place's
capacity (never a page before the pages after it), leases hold what a lookup
matched, and bad input names the bad value and changes nothing."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fabric.cache.engine_holds import HoldOptions
from fabric.cache.engine_input import L3, PageName, StoredRun
from fabric.cache.engine_places import BACKUP, DELETE, MOVE, PREFETCH, Order, ranks_of
from fabric.cache.engine_tree import EngineTree
from fabric.cache.events import BlockRemoved, BlockStored, Medium
from fabric.cache.keys import chain_hashes, namespace_seed, pack_tokens
from fabric.errors import InvalidInput
from tests.helpers import example_count, machine_settings

TAG = "0123456789abcdef"
L2A, L2B = "l2@node-a", "l2@node-b"


def engine_name(page: bytes) -> bytes:
    """A page's name in its engine, as a test's engine would send it."""
    return hashlib.sha256(b"engine" + page).digest()


def chain(n: int, namespace: str = "vllm", first: int = 0) -> list[bytes]:
    tokens = pack_tokens(range(first, first + 4 * n))
    return chain_hashes(namespace_seed(namespace), tokens, 16)


def run(hashes, parent=None, namespace="vllm", place=L3, page_bytes=10) -> StoredRun:
    return StoredRun(namespace, parent, tuple(hashes), place, page_bytes)


def stored(events) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.page_hashes]


def test_a_page_is_whole_only_once_every_rank_stored_it():
    tree = EngineTree()
    c = chain(4)
    assert tree.report(TAG, 2, {0: [run(c)]}) == ([], [])
    assert tree.lookup(TAG, 2, [c]) == [0]
    events, _ = tree.report(TAG, 2, {1: [run(c[:3])]})
    assert events == [BlockStored(tuple(c[:3]), Medium.STORAGE, "vllm", None)]
    # The MIN over ranks: rank 1 stored three pages, so three pages hit.
    assert tree.lookup(TAG, 2, [c, c[:2], chain(2, first=99)]) == [3, 2, 0]


def test_runs_reported_out_of_order_meet_in_one_path():
    tree = EngineTree()
    c = chain(5)
    tree.report(TAG, 2, {0: [run(c)], 1: [run(c[:1]), run(c[2:], parent=c[1])]})
    assert tree.lookup(TAG, 2, [c]) == [1]
    events, _ = tree.report(TAG, 2, {1: [run(c[1:2], parent=c[0])]})
    assert tree.lookup(TAG, 2, [c]) == [5]
    assert events == [BlockStored((c[1],), Medium.STORAGE, "vllm", c[0])]
    # A run whose parent the tree does not know yet waits for it.
    d = chain(3, first=40)
    tree.report(TAG, 1, {0: [run(d[1:], parent=d[0])]})
    assert tree.lookup(TAG, 1, [d]) == [0]
    events, _ = tree.report(TAG, 1, {0: [run(d[:1])]})
    assert tree.lookup(TAG, 1, [d]) == [3]
    assert stored(events) == d


def test_engines_and_worlds_never_see_each_others_pages():
    tree = EngineTree()
    c = chain(3)
    tree.report(TAG, 1, {0: [run(c)]})
    assert tree.lookup(TAG, 1, [c]) == [3]
    assert tree.lookup("fedcba9876543210", 1, [c]) == [0]
    assert tree.lookup(TAG, 2, [c]) == [0]


def test_a_nodes_l2_serves_that_node_only_and_l3_serves_every_node():
    tree = EngineTree()
    c = chain(4)
    events, _ = tree.report(TAG, 1, {0: [run(c, place=L2A)]})
    assert events == [BlockStored(tuple(c), Medium.HOST, "vllm", None, place="node-a")]
    assert tree.lookup(TAG, 1, [c], place=L2A) == [4]
    assert tree.lookup(TAG, 1, [c], place=L2B) == [0]
    assert tree.lookup(TAG, 1, [c]) == [0]
    tree.report(TAG, 1, {0: [run(c[:2])]})
    assert tree.lookup(TAG, 1, [c], place=L2B) == [2]
    assert tree.stats.l2_hit_pages == 4
    places = tree.residency()
    assert places[L2A]["pages"] == 4 and places[L3]["pages"] == 2
    assert places[L3]["bytes"] == 20 and places[L3]["tenants"] == {"vllm": 2}


def test_forget_ends_matches_until_stored_again_and_keeps_what_follows():
    tree = EngineTree()
    c = chain(4)
    tree.report(TAG, 2, {0: [run(c)], 1: [run(c)]})
    assert tree.forget(TAG, 2, [c[2], chain(1, first=77)[0]]) == [
        BlockRemoved((c[2],), Medium.STORAGE, "vllm")
    ]
    assert tree.stats.forgotten_pages == 1
    assert tree.lookup(TAG, 2, [c]) == [2]
    tree.report(TAG, 2, {0: [run(c[2:3], c[1])], 1: [run(c[2:3], c[1])]})
    assert tree.lookup(TAG, 2, [c]) == [4]  # the page after it was kept


def test_eviction_takes_leaves_first_in_policy_order_within_the_cap():
    """Least recently used first, but never a page before the pages after it:
    what stays is always a whole prefix (a flat LRU forgot a chain's first page,
    which a lookup refreshes first, and with it every page after) — and of a
    leaf, only as many of its last pages as the room needs."""
    tree = EngineTree("lru", capacity={L3: 60})  # six pages of 10 bytes
    a, b = chain(4), chain(3, first=50)
    tree.report(TAG, 1, {0: [run(a)]}, now=1.0)
    tree.lookup(TAG, 1, [a[:2]], now=2.0)  # a's first two pages are used again
    events, drops = tree.report(TAG, 1, {0: [run(b)]}, now=3.0)  # 70 bytes: one page goes
    assert drops == [Order(TAG, 1, L3, 1, (a[3],), DELETE, "vllm", a[2])]
    assert BlockRemoved((a[3],), Medium.STORAGE, "vllm") in events
    assert tree.lookup(TAG, 1, [a], now=4.0) == [3]
    assert tree.lookup(TAG, 1, [b], now=4.5) == [3]
    assert tree.places.used[L3] == 60
    c = chain(3, first=90)
    _, drops = tree.report(TAG, 1, {0: [run(c)]}, now=5.0)  # 90 bytes: a goes, tail first
    assert [o.hashes for o in drops] == [(a[2],), tuple(a[:2])]
    assert tree.lookup(TAG, 1, [a, b, c], now=6.0) == [0, 3, 3]
    assert tree.stats.evicted_by_place == {L3: 4}


def test_a_leased_match_is_kept_past_capacity_until_released_or_expired():
    tree = EngineTree("lru", capacity={L3: 30})
    a, b = chain(3), chain(3, first=50)
    tree.report(TAG, 1, {0: [run(a)]}, now=0.0)
    assert tree.lookup(TAG, 1, [a], ["e/r1"], 5.0, now=0.0) == [3]
    _, drops = tree.report(TAG, 1, {0: [run(b)]}, now=1.0)  # a is leased: b goes
    assert [d.hashes for d in drops] == [tuple(b)]
    assert tree.lookup(TAG, 1, [a, b], now=1.0) == [3, 0]
    assert tree.leased == 1 and tree.release(["e/r1", "e/unknown"]) == 1
    _, drops = tree.report(TAG, 1, {0: [run(b)]}, now=2.0)  # now a may go
    assert [d.hashes for d in drops] == [tuple(a)]
    # A lease not released ends when its time is up (at the next lookup).
    tree.lookup(TAG, 1, [b], ["e/r2"], 5.0, now=10.0)
    assert tree.lookup(TAG, 1, [[]], now=15.0) == [0]
    assert tree.leased == 0 and tree.stats.leases_expired == 1


def test_under_write_back_a_page_leaving_a_nodes_l2_for_good_moves_to_l3_first():
    tree = EngineTree("lru", capacity={L2A: 40}, write_policy="write_back")
    a, b = chain(4), chain(3, first=50)
    tree.report(TAG, 1, {0: [run(a[:2]), run(a, place=L2A)]}, now=1.0)  # L3 has a's first two
    _, orders = tree.report(TAG, 1, {0: [run(b, place=L2A)]}, now=2.0)  # 70 bytes: 30 go
    assert [(o.kind, o.place, o.hashes, o.parent) for o in orders] == [
        (MOVE, L2A, tuple(a[2:]), a[1]),
        (DELETE, L2A, (a[1],), a[0]),  # L3 holds it already
    ]
    assert orders[0].namespace == "vllm"
    # Write-through: what leaves L2 is in L3 already (every store wrote both).
    tree = EngineTree("lru", capacity={L2A: 40})
    tree.report(TAG, 1, {0: [run(a, place=L2A)]}, now=1.0)
    assert {o.kind for o in tree.report(TAG, 1, {0: [run(b, place=L2A)]}, now=2.0)[1]} == {DELETE}


def test_under_selective_write_through_a_page_hit_twice_is_copied_to_l3_once():
    tree = EngineTree(write_policy="write_through_selective")
    c = chain(3)
    tree.report(TAG, 2, {0: [run(c, place=L2A)], 1: [run(c, place=L2A)]})
    assert tree.lookup(TAG, 2, [c], place=L2A) == [3] and tree.take_orders() == []
    assert tree.lookup(TAG, 2, [c, c], place=L2A) == [3, 3]
    (order,) = tree.take_orders()
    assert (order.kind, order.place, order.mask, order.hashes) == (BACKUP, L2A, 0b11, tuple(c))
    tree.lookup(TAG, 2, [c], place=L2A)
    assert tree.take_orders() == [], "asked once"
    tree.report(TAG, 2, {0: [run(c)], 1: [run(c)]})  # the copy arrived
    tree.lookup(TAG, 2, [c], place=L2B)  # found in L3 by another node: nothing to copy
    assert tree.take_orders() == []


def test_under_best_effort_a_lookup_takes_its_nodes_l2_and_prefetches_what_only_l3_has():
    """``l2_only``: the hit is the leading pages whole in the asker's L2; the pages
    after it that L3 holds whole are ordered read into that L2 (once while the
    order is in flight), and count once they land there."""
    tree = EngineTree()
    c = chain(5)
    tree.report(TAG, 2, {r: [run(c), run(c[:2], place=L2A)] for r in (0, 1)})
    assert tree.lookup(TAG, 2, [c], place=L2A, l2_only=True, now=1.0) == [2]
    (order,) = tree.take_orders()
    assert (order.kind, order.place, order.mask) == (PREFETCH, L2A, 0b11)
    assert (order.hashes, order.parent, order.namespace) == (tuple(c[2:]), c[1], "vllm")
    assert tree.lookup(TAG, 2, [c[:4]], place=L2A, l2_only=True, now=2.0) == [2]
    assert tree.take_orders() == [], "ordered once while in flight"
    # Without l2_only (timeout, wait_complete), L3 counts: the load reads it.
    assert tree.lookup(TAG, 2, [c], place=L2A, now=2.0) == [5]
    assert tree.take_orders() == []
    tree.report(TAG, 2, {r: [run(c[2:], c[1], place=L2A)] for r in (0, 1)})  # it landed
    assert tree.lookup(TAG, 2, [c], place=L2A, l2_only=True, now=3.0) == [5]
    assert tree.stats.prefetch_pages == 3 and tree.take_orders() == []
    # Not landed (a rank failed): ordered again once its retry time is up.
    d = chain(3, first=60)
    tree.report(TAG, 2, {r: [run(d)] for r in (0, 1)})
    tree.lookup(TAG, 2, [d], place=L2B, l2_only=True, now=4.0)
    assert [o.hashes for o in tree.take_orders()] == [tuple(d)]
    tree.lookup(TAG, 2, [d], place=L2B, l2_only=True, now=5.0)
    assert tree.take_orders() == []
    tree.lookup(TAG, 2, [d], place=L2B, l2_only=True, now=20.0)
    assert [o.hashes for o in tree.take_orders()] == [tuple(d)]
    # An asker with no L2 has nothing to prefetch into: L3 counts.
    assert tree.lookup(TAG, 2, [d], l2_only=True, now=21.0) == [3]
    assert tree.take_orders() == []


def test_a_replicas_device_blocks_are_a_place_vllm_keeps_and_the_tree_is_told_of():
    """L1 (``l1@<replica>``): pages a replica's blocks hold, announced with medium
    device and the replica; never counted by a lookup (vLLM's own cache serves
    them), never evicted or ordered by the tree; ``drop`` and ``drop_place`` say
    vLLM let them go."""
    l1 = "l1@node-a:1234"
    tree = EngineTree(index_pages=5)
    c = chain(4)
    events, _ = tree.report(TAG, 2, {r: [run(c, place=l1)] for r in (0, 1)})
    assert events == [BlockStored(tuple(c), Medium.DEVICE, "vllm", None, place="node-a:1234")]
    assert tree.lookup(TAG, 2, [c], place=l1) == [0]
    assert tree.residency()[l1]["pages"] == 4
    tree.report(TAG, 2, {r: [run(c[:2])] for r in (0, 1)})  # L3 has the first two
    assert tree.drop(TAG, 2, l1, [c[3], c[2], chain(1, first=99)[0]]) == [
        BlockRemoved((c[3],), Medium.DEVICE, "vllm", "node-a:1234"),
        BlockRemoved((c[2],), Medium.DEVICE, "vllm", "node-a:1234"),
    ]
    assert len(tree) == 2, "pages in no place are pruned"
    d = chain(3, first=40)
    tree.report(TAG, 2, {r: [run(d, place=l1)] for r in (0, 1)})
    tree.forget(TAG, 2, [d[2]])  # a failed load: every place but L1 would be ordered
    assert tree.take_orders() == [], "nothing to order of vLLM's blocks"
    orphan = chain(2, first=120)
    tree.report(TAG, 2, {0: [run(orphan[1:], orphan[0], place=l1)]})  # waits for its parent
    events = tree.drop_place(l1)
    assert {e.medium for e in events} == {Medium.DEVICE}
    tree.report(TAG, 2, {r: [run(orphan[:1])] for r in (0, 1)})  # the parent comes: L1 is gone
    assert l1 not in tree.residency() or tree.residency()[l1]["pages"] == 0
    assert l1 not in tree.residency() or tree.residency()[l1]["pages"] == 0
    assert tree.lookup(TAG, 2, [c]) == [2] and len(tree) == 3  # (and the orphan's parent)


def test_a_lookup_stopping_at_a_page_the_tree_evicted_from_l3_is_final():
    """The store may still hold an evicted page until its delete is carried out:
    a lookup that stops there says so (the engine is not to look beyond), until
    the page is stored anew."""
    tree = EngineTree("lru", capacity={L3: 40})
    a, b = chain(3), chain(3, first=50)
    tree.report(TAG, 1, {0: [run(a)]}, now=1.0)
    tree.report(TAG, 1, {0: [run(b)]}, now=2.0)  # 60 bytes: a's last two pages go
    final: list[bool] = []
    assert tree.lookup(TAG, 1, [a, b, chain(2, first=90)], final=final, now=3.0) == [1, 3, 0]
    assert final == [True, False, False]
    tree.report(TAG, 1, {0: [run(a[1:], a[0])]}, now=4.0)  # stored anew
    final = []
    tree.lookup(TAG, 1, [a], final=final, now=5.0)
    assert final == [False]


def test_a_replicas_l1_not_heard_of_for_its_ttl_is_forgotten():
    """A replica stopped before its connector could drop its L1 (or idle that long):
    its blocks leave the tree once a report comes ``L1_TTL_S`` after the last word
    of them — the tree may know less of L1 than there is, never more."""
    from fabric.cache.engine_index import L1_TTL_S

    l1, other = "l1@node-a:1", "l1@node-b:2"
    tree = EngineTree()
    c, d = chain(3), chain(2, first=40)
    tree.report(TAG, 1, {0: [run(c, place=l1)]}, now=0.0)
    tree.report(TAG, 1, {0: [run(d, place=other)]}, now=L1_TTL_S - 1)
    events, _ = tree.report(TAG, 1, {0: [run(d)]}, now=L1_TTL_S + 1)
    assert [(e.medium, e.page_hashes) for e in events if isinstance(e, BlockRemoved)] == [
        (Medium.DEVICE, tuple(c))
    ]
    assert tree.residency()[other]["pages"] == 2 and tree.lookup(TAG, 1, [c]) == [0]


def test_a_lookup_makes_room_in_its_nodes_l2_for_the_pages_its_request_will_store():
    """A node's L2 regions refuse a page when its set is full of held ones: the tree
    evicts for a request's pages at its lookup, before they come, so the regions
    never hold more than the tree counts plus the step's stores."""
    tree = EngineTree("lru", capacity={L2A: 50}, write_policy="write_back")
    a, b = chain(4), chain(5, first=50)
    tree.report(TAG, 1, {0: [run(a[:1]), run(a, place=L2A)]}, now=1.0)  # 40 of 50 bytes
    # b's request will store 5 pages here (the one after its lookup's too): 10 fit.
    assert tree.lookup(TAG, 1, [b[:4]], now=2.0, place=L2A) == [0]
    orders = tree.take_orders()
    assert [(o.kind, o.hashes) for o in orders] == [(MOVE, tuple(a[1:]))]
    events = tree.take_events()  # (the lookup's evictions, announced by the caller)
    assert [(type(e), e.page_hashes) for e in events] == [(BlockRemoved, tuple(a[1:]))]
    assert tree.take_events() == []
    assert tree.places.used[L2A] == 10  # a's first page: L3 holds it, it stays in L2 too
    _, after = tree.report(TAG, 1, {0: [run(b[:4], place=L2A)]}, now=3.0)
    assert after == [] and tree.places.used[L2A] == 50  # they came: nothing more leaves
    # A lookup whose pages are in the node's L2 needs no room; one of another node's
    # L2, or with no place, makes none here.
    assert tree.lookup(TAG, 1, [b[:4]], now=4.0, place=L2A) == [4] and not tree.take_orders()
    tree.lookup(TAG, 1, [chain(3, first=90)], now=5.0, place=L2B)
    tree.lookup(TAG, 1, [chain(3, first=90)], now=5.0)
    assert not tree.take_orders() and tree.places.used[L2A] == 50


def test_a_nodes_l2_holds_half_of_what_its_engines_regions_hold():
    """Engines declare their node L2 regions; engines of one tag share theirs."""
    tree = EngineTree("lru")
    tree.declare(L2A, TAG, 100)
    tree.declare(L2A, TAG, 100)  # another replica of the same engine: the same regions
    tree.declare(L2A, "fedcba9876543210", 60)
    tree.declare(L3, TAG, 1000)  # L3's cap is the fabric's, not an engine's
    assert tree.places.cap(L2A) == 80 and tree.places.cap(L2B) == 0 and tree.places.cap(L3) == 0
    c = chain(9)
    tree.report(TAG, 1, {0: [run(c[:5], place=L2A)]})
    _, orders = tree.report(TAG, 1, {0: [run(c[5:], c[4], place=L2A)]})  # 90 bytes of 80
    assert tree.places.used[L2A] == 80 and [o.hashes for o in orders] == [(c[8],)]


def test_the_trees_own_bound_evicts_whole_nodes_from_every_place():
    tree = EngineTree("lru", index_pages=4)
    a, b = chain(3), chain(3, first=50)
    tree.report(TAG, 1, {0: [run(a), run(a, place=L2A)]}, now=1.0)
    _, drops = tree.report(TAG, 1, {0: [run(b)]}, now=2.0)
    assert sorted(d.place for d in drops) == [L2A, L3]
    assert len(tree) == 3 and tree.lookup(TAG, 1, [a, b], place=L2A) == [0, 3]


def test_pages_counted_before_their_ranks_size_was_known_are_counted_once_it_is():
    """Pages an engine found in L3 itself come without a page size: once the rank's
    size is known, what every place holds is counted anew (else evicting them
    would subtract bytes never added, and the cap would drift)."""
    tree = EngineTree("lru", capacity={L3: 35})
    c = chain(7)
    tree.report(TAG, 1, {0: [run(c[:3], page_bytes=0)]}, now=1.0)
    assert tree.places.used[L3] == 0
    _, orders = tree.report(TAG, 1, {0: [run(c[3:6], c[2])]}, now=2.0)  # 60 bytes of 35
    assert tree.places.used[L3] == 30 and [o.hashes for o in orders] == [tuple(c[3:6])]
    tree.report(TAG, 1, {0: [run(c[3:4], c[2])]}, now=3.0)
    assert tree.places.used[L3] == 40 - 10  # one leaf more went, its 10 bytes
    assert tree.residency()[L3]["bytes"] == 10 * sum(
        len(n.page_hashes) for n in tree.tree.walk() if L3 in (n.places or {})
    )


def test_forget_all_announces_every_whole_page_gone():
    tree = EngineTree()
    c = chain(2)
    tree.report(TAG, 1, {0: [run(c), run(c, place=L2A)]})
    events = tree.forget_all()
    assert sorted((e.medium, e.place) for e in events) == [
        (Medium.HOST, "node-a"),
        (Medium.STORAGE, ""),
    ]
    assert len(tree) == 0 and tree.lookup(TAG, 1, [c]) == [0]


def test_events_of_pages_their_engine_named_carry_its_names_and_tokens():
    """The connector sends vLLM's names of the pages it reports (``PageName``): the
    tree keeps them while it knows the page, and its events carry them — only
    for a run whose every page, and parent, is named (a router would otherwise
    see a chain's start that is not one)."""
    tree = EngineTree("lru", capacity={L2A: 30})
    c = chain(4)

    def name(i: int) -> PageName:
        return PageName(c[i], bytes([i + 1]) * 32, pack_tokens(range(4 * i, 4 * i + 4)))

    events, _ = tree.report(TAG, 1, {0: [run(c[:2], place=L2A)]}, names=[name(0), name(1)])
    (first,) = events
    assert first.page_hashes == tuple(c[:2])  # the fabric's own names stay
    assert first.engine_hashes == (b"\1" * 32, b"\2" * 32) and first.engine_parent is None
    assert first.tokens == pack_tokens(range(8))
    # c[2] named, its parent named: c[3] not named, so its run is not either.
    events, _ = tree.report(TAG, 1, {0: [run(c[2:3], c[1], place=L2A)]}, names=[name(2)])
    assert events[0].engine_hashes == (b"\3" * 32,) and events[0].engine_parent == b"\2" * 32
    events, _ = tree.report(TAG, 1, {0: [run(c[3:], c[2], place=L2A)]})
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].engine_hashes == () and stored[0].tokens == b""
    removed = [e for e in events if isinstance(e, BlockRemoved)]  # 40 bytes of 30: c[3] goes
    assert [(e.page_hashes, e.engine_hashes) for e in removed] == [((c[3],), ())]
    tree.report(TAG, 1, {0: [run(c[2:3], c[1], place=L2B)]})
    (gone,) = tree.forget(TAG, 1, [c[2]])[:1]
    assert gone.engine_hashes == (b"\3" * 32,)
    assert (TAG, 1, c[2]) not in tree.names  # the tree forgot the page: its name too
    # A name of a page the tree does not know is not kept.
    tree.report(TAG, 1, {}, names=[PageName(chain(1, first=77)[0], b"x", b"")])
    assert len(tree.names) == 2


@pytest.mark.parametrize(
    ("names", "needle"),
    [
        ("not a list", "names are refused"),
        (["name"], "PageName, got str"),
        ([PageName(b"short", b"x", b"")], "page hash b'short'"),
        ([PageName(bytes(32), b"", b"")], "engine hash b''"),
        ([PageName(bytes(32), bytes(65), b"")], "engine hash"),
        ([PageName(bytes(32), b"x", b"abc")], "tokens b'abc'"),
    ],
)
def test_bad_page_names_are_refused_naming_the_value_and_change_nothing(names, needle):
    tree = EngineTree()
    with pytest.raises(InvalidInput, match=needle.replace("(", r"\(")):
        tree.report(TAG, 1, {0: [run(chain(2))]}, names=names)
    assert len(tree) == 0 and tree.names == {}


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda t: t.lookup("XYZ", 1, [[]]), "tag 'XYZ'"),
        (lambda t: t.lookup(TAG, 0, [[]]), "world 0"),
        (lambda t: t.lookup(TAG, True, [[]]), "world True"),
        (lambda t: t.lookup(TAG, 1, [[b"short"]]), "page hash b'short'"),
        (lambda t: t.lookup(TAG, 1, "not a list"), "chains must be"),
        (lambda t: t.lookup(TAG, 1, [[]] * 5000), "at most 4096 page-hash lists"),
        (lambda t: t.report(TAG, 1, {0: [run(chain(1))] * 5000}), "rank 0's runs"),
        (lambda t: t.report(TAG, 2, {2: []}), "rank 2"),
        (lambda t: t.report(TAG, 2, {0: ["run"]}), "StoredRun, got str"),
        (lambda t: t.report(TAG, 2, {0: [run(chain(1), namespace="")]}), "namespace ''"),
        (lambda t: t.report(TAG, 2, {0: [run(chain(1), parent=b"x")]}), "parent b'x'"),
        (lambda t: t.report(TAG, 2, {0: [run(chain(1), place="l2@")]}), "place 'l2@'"),
        (lambda t: t.report(TAG, 2, {0: [run(chain(1), place="disk")]}), "place 'disk'"),
        (lambda t: t.report(TAG, 2, {0: [run(chain(1), page_bytes=-1)]}), "page_bytes -1"),
        (lambda t: t.forget(TAG, 1, [hashlib.sha256().digest()[:31]]), "page hash"),
    ],
)
def test_bad_input_is_refused_naming_the_value_and_changes_nothing(call, needle):
    tree = EngineTree()
    tree.report(TAG, 2, {0: [run(chain(2))]})
    with pytest.raises(InvalidInput, match=needle.replace("(", r"\(")):
        call(tree)
    assert len(tree) == 2
    assert tree.lookup(TAG, 2, [chain(2)]) == [0]


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
    tree = EngineTree()
    tree.report(TAG, 1, {0: [run(chain(2))]})
    with pytest.raises(InvalidInput, match=needle):
        tree.lookup(TAG, 1, [chain(2)], leases, lease_s)
    assert tree.leased == 0 and tree.stats.lookups == 0
    with pytest.raises(InvalidInput, match="lease names"):
        tree.release("e/r1")


def test_a_bad_run_among_good_ones_records_none_of_them():
    tree = EngineTree()
    with pytest.raises(InvalidInput):
        tree.report(TAG, 1, {0: [run(chain(2)), run([b"bad"])]})
    assert len(tree) == 0


TAGS = [TAG, "fedcba9876543210"]
L1A = "l1@node-a:1"  # a replica's device blocks: vLLM evicts them, the tree is told
PLACES = [L3, L2A, L2B, L1A]
NAMES = ["e/r1", "e/r2", "f/r1"]


def test_a_session_keeps_its_conversation_past_capacity_until_its_next_turn_or_ttl():
    """A session (``hold``) locks its prefix in every place: eviction passes over
    it; the next turn under the same id takes over (the old turn's pages are
    evictable again), and the TTL ends it."""
    holds = HoldOptions(l3_bytes=1000, session_ttl_s=60.0)
    tree = EngineTree("lru", capacity={L3: 80}, holds=holds)
    a, b, c, d = (chain(4, first=f) for f in (0, 50, 100, 150))
    tree.report(TAG, 1, {0: [run(a)]}, now=1.0)
    assert tree.hold(TAG, 1, a[:3], "conv-1", "session", now=1.0) is None
    tree.report(TAG, 1, {0: [run(b)]}, now=2.0)
    _, drops = tree.report(TAG, 1, {0: [run(c)]}, now=3.0)  # 120 bytes: 40 go
    assert [o.hashes for o in drops] == [(a[3],), tuple(b[1:])], "the held prefix is passed over"
    assert [tree.lookup(TAG, 1, [x], now=t)[0] for x, t in ((a, 3.0), (b, 3.2), (c, 3.4))] == [
        3,
        1,
        4,
    ]
    figures = tree.holds.figures()["session"]
    assert (figures["held"], figures["bytes"], figures["tenants"]) == (1, 30, {"vllm": 30})
    # The next turn takes over: it holds c's first pages now, and a may go.
    assert tree.hold(TAG, 1, c[:2], "conv-1", "session", now=4.0) is None
    tree.lookup(TAG, 1, [c], now=4.0)
    _, drops = tree.report(TAG, 1, {0: [run(d)]}, now=5.0)
    assert [o.hashes for o in drops] == [tuple(a[:3]), (b[0],)]
    # Its TTL passes: nothing is held, and the cap applies to it again.
    tree.lookup(TAG, 1, [[]], now=70.0)
    assert tree.holds.figures()["session"]["held"] == 0
    assert all(n.lock_ref == 0 for n in tree.tree.walk())


def test_a_hold_waits_for_the_pages_its_request_stored_last_and_moves_down_to_them():
    tree = EngineTree()
    a = chain(5)
    tree.report(TAG, 2, {0: [run(a[:2])], 1: [run(a[:2])]}, now=1.0)
    assert tree.hold(TAG, 2, a, "pin/x", "pin", ttl_s=30.0, now=1.0) is None
    (held,) = tree.holds.kinds["pin"].held.values()
    assert held.node.page_hashes == a[:2]
    tree.report(TAG, 2, {0: [run(a[2:], a[1])]}, now=2.0)  # one rank's: the path is known
    (held,) = tree.holds.kinds["pin"].held.values()
    assert held.node.page_hashes[-1] == a[4] and held.expires_at == 31.0
    assert not tree.holds.awaiting
    # A chain the tree knows nothing of holds nothing, and says why.
    assert tree.hold(TAG, 2, chain(2, first=70), "s", "session", now=3.0) == (
        "no page of it is known"
    )


def test_holds_stay_within_their_share_of_l3_and_one_tenants_share_of_that():
    """Sessions hold at most ``session_fraction`` of L3's cap, one tenant at most
    ``tenant_share`` of that: past it the tenant's own least recently kept go."""
    holds = HoldOptions(l3_bytes=200, session_fraction=0.5, tenant_share=0.5)  # 100, 50 a tenant
    tree = EngineTree(capacity={L3: 200}, holds=holds)
    a, b, c = chain(3, "t1"), chain(2, "t1", first=40), chain(3, "t2")
    tree.report(TAG, 1, {0: [run(a, namespace="t1"), run(b, namespace="t1")]})
    tree.report(TAG, 1, {0: [run(c, namespace="t2")]})
    assert tree.hold(TAG, 1, a, "s1", "session") is None  # 30 bytes of t1's 50
    assert tree.hold(TAG, 1, b, "s2", "session") is None  # 20 more: 50
    assert tree.hold(TAG, 1, a[:1], "s3", "session") is None  # 10 more: s1 (oldest) goes
    figures = tree.holds.figures()["session"]
    assert figures["tenants"] == {"t1": 30} and set(tree.holds.kinds["session"].held) == {
        "s2",
        "s3",
    }
    assert tree.hold(TAG, 1, c, "s4", "session") is None
    assert tree.holds.figures()["session"]["bytes"] == 60
    too_long = chain(6, "t2", first=200)
    tree.report(TAG, 1, {0: [run(too_long, namespace="t2")]})
    why = tree.hold(TAG, 1, too_long, "s5", "session")
    assert why is not None and "60 bytes exceeds tenant 't2'" in why and "50" in why


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda t: t.hold(TAG, 1, chain(1), "", "session"), "session id ''"),
        (lambda t: t.hold(TAG, 1, chain(1), "x", "forever"), "hold kind 'forever'"),
        (lambda t: t.hold(TAG, 1, chain(1), "x", "pin", ttl_s=-1), "hold ttl_s -1"),
        (lambda t: t.hold(TAG, 1, chain(1), "x", "pin", ttl_s=True), "hold ttl_s True"),
        (lambda t: t.hold(TAG, 1, [b"short"], "x", "pin"), "short"),
        (lambda t: t.hold("nothex", 1, chain(1), "x", "pin"), "tag 'nothex'"),
    ],
)
def test_a_bad_hold_is_refused_naming_the_value(call, needle):
    tree = EngineTree()
    tree.report(TAG, 1, {0: [run(chain(2))]})
    with pytest.raises(InvalidInput, match=None) as err:
        call(tree)
    assert needle in str(err.value)
    assert tree.holds.figures()["pin"]["held"] == 0


class EngineTreeMachine(RuleBasedStateMachine):
    """Model: per (engine, place, page), the ranks that stored it there, updated
    from the reports and from the drops the tree returns. A lookup is the leading
    run of pages whole in L3 or the asker's L2, never more; a drop names exactly
    the ranks the model has there, and never a page while the page after it is
    in that place (leaves first); the bytes each place holds are exact, within its
    cap unless every leaf of it is leased; the tree's own bound holds likewise."""

    @initialize(
        l3=st.sampled_from([0, 40, 200]),
        l2=st.sampled_from([0, 30]),
        index=st.sampled_from([6, 1000]),
        policy=st.sampled_from(["lru", "a2q", "lfu"]),
        write=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
    )
    def setup(self, l3: int, l2: int, index: int, policy: str, write: str) -> None:
        self.tree = EngineTree(policy, index, {L3: l3, "l2@": l2}, write)
        self.write = write
        self.caps = {L3: l3, L2A: l2, L2B: l2, L1A: 0}
        self.index = index
        self.model: dict[tuple[str, int, str, bytes], int] = {}
        self.chains = {ns: chain(6, ns) for ns in ("a", "b")}
        self.after = {c[i]: c[i + 1] for c in self.chains.values() for i in range(len(c) - 1)}
        self.tenant = {h: ns for ns, c in self.chains.items() for h in c}
        self.now = 0.0
        self.leases: dict[str, float] = {}

    def _evictions(self) -> list[Order]:
        """Take the tree's orders and events made outside a report (room for a
        request, what a lease or hold let go): apply the orders, and check the
        events announce exactly the whole pages they removed."""
        orders, before = self.tree.take_orders(), dict(self.model)
        self._apply(orders)
        removed = [h for e in self.tree.take_events() for h in e.page_hashes]
        gone = [k for k, m in before.items() if m == (1 << k[1]) - 1 and k not in self.model]
        assert sorted(removed) == sorted(k[3] for k in gone)
        return orders

    def _apply(self, orders: list[Order]) -> None:
        """Each order is for pages of its place, with the ranks the model has there;
        an eviction never takes a page before the page after it; a copy to L3 is
        asked only where L3 lacks the page (write-back: the ranks it lacks)."""
        for o in orders:
            l3 = [self.model.get((o.tag, o.world, L3, h), 0) for h in o.hashes]
            if o.kind == BACKUP:
                assert self.write == "write_through_selective" and o.place != L3
                assert all(m != (1 << o.world) - 1 for m in l3)
                continue
            if o.kind == PREFETCH:  # pages L3 holds whole, read into a node's L2
                assert o.place != L3 and o.mask == (1 << o.world) - 1
                assert all(m == o.mask for m in l3)
                continue
            if o.kind == MOVE:
                assert self.write == "write_back" and o.place != L3
                assert all(o.mask & ~m for m in l3)
            for h in o.hashes:
                key = (o.tag, o.world, o.place, h)
                assert self.model.pop(key, 0) == o.mask
            nxt = self.after.get(o.hashes[-1])
            assert (o.tag, o.world, o.place, nxt) not in self.model, "a parent before its child"

    @rule(
        tag=st.sampled_from(TAGS),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        start=st.integers(0, 5),
        length=st.integers(1, 4),
        rank=st.integers(0, 2),
        place=st.sampled_from(PLACES),
        named=st.booleans(),
    )
    def report(self, tag, world, ns, start, length, rank, place, named) -> None:
        rank %= world
        c = self.chains[ns]
        hashes = c[start : start + length]
        parent = c[start - 1] if start else None
        if parent is not None and (tag, world, parent) not in self.tree.where:
            return  # it would wait for its parent (tested above)
        self.now += 1
        before, known = dict(self.model), len(self.tree)
        names = [PageName(h, engine_name(h), pack_tokens([h[0]])) for h in hashes if named]
        events, drops = self.tree.report(
            tag, world, {rank: [run(hashes, parent, ns, place)]}, now=self.now, names=names
        )
        for e in events:  # under the engine's names, or none: never a mix
            if isinstance(e, BlockStored) and e.engine_hashes:
                assert e.engine_hashes == tuple(engine_name(h) for h in e.page_hashes)
                assert e.tokens == pack_tokens([h[0] for h in e.page_hashes])
                expected = None if e.parent_hash is None else engine_name(e.parent_hash)
                assert e.engine_parent == expected
        full = (1 << world) - 1
        whole = []
        for h in hashes:
            key = (tag, world, place, h)
            old = self.model.get(key, 0)
            self.model[key] = old | 1 << rank
            if old | 1 << rank == full and old != full:
                whole.append(key)
        assert stored(events) == [k[3] for k in whole]
        self._apply(drops)
        for k in [k for k in self.model if k[2] == L1A]:  # no order: the tree forgot it
            node = self.tree.where.get((k[0], k[1], k[3]))
            if node is None or L1A not in (node.places or {}):
                assert known + len(hashes) > self.index, "only past the tree's bound"
                del self.model[k]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.page_hashes]
        gone = [k for k, m in before.items() if m == (1 << k[1]) - 1 and k not in self.model]
        gone += [k for k in whole if k not in self.model]
        assert sorted(removed) == sorted(k[3] for k in gone)

    @rule(
        tag=st.sampled_from(TAGS),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        length=st.integers(0, 6),
        place=st.sampled_from(["", L2A, L2B]),
        lease=st.one_of(st.none(), st.tuples(st.sampled_from(NAMES), st.sampled_from([1.0, 5.0]))),
        l2_only=st.booleans(),
    )
    def lookup(self, tag, world, ns, length, place, lease, l2_only) -> None:
        c = self.chains[ns][:length]
        self.leases = {n: t for n, t in self.leases.items() if t > self.now}
        name, lease_s = lease if lease is not None else (None, 0.0)
        leases = [name] if name is not None else None
        model = dict(self.model)
        (hit,) = self.tree.lookup(tag, world, [c], leases, lease_s, self.now, place, l2_only)
        orders = self._evictions()  # (among them, the room made for the request's pages)
        full, expected = (1 << world) - 1, 0
        only = l2_only and place
        for h in c:
            in_l2 = model.get((tag, world, place, h)) == full
            if not in_l2 and (only or model.get((tag, world, L3, h)) != full):
                break
            expected += 1
        assert hit == expected
        for h in c[:hit]:  # room is never made of the match itself
            assert all(self.model.get((tag, world, p, h)) == model.get((tag, world, p, h))
                       for p in (place, L3) if p)  # fmt: skip
        fetched = [h for o in orders if o.kind == PREFETCH for h in o.hashes]
        assert set(fetched) <= set(c[expected:]), "only what follows the hit is prefetched"
        if not only:
            assert not fetched
        if lease is not None:
            self.leases.pop(lease[0], None)
            if hit:
                self.leases[lease[0]] = self.now + lease[1]
        assert self.tree.leased == len(self.leases)

    @rule(names=st.lists(st.sampled_from([*NAMES, "unknown"]), max_size=3))
    def release(self, names) -> None:
        assert self.tree.release(names) == len({n for n in names if n in self.leases})
        for name in names:
            self.leases.pop(name, None)
        self._evictions()  # what the leases kept past a cap leaves now

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, seconds) -> None:
        self.now += seconds

    @rule(
        tag=st.sampled_from(TAGS),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        length=st.integers(1, 6),
        name=st.sampled_from(["s1", "s2"]),
        kind=st.sampled_from(["session", "pin"]),
        ttl_s=st.sampled_from([None, 1.0, 30.0]),
    )
    def hold(self, tag, world, ns, length, name, kind, ttl_s) -> None:
        """A hold adds nothing anywhere (what a hold it took over kept past a cap
        leaves); what it holds is on the tree, locked, and within its budget
        (checked in ``held``)."""
        before = dict(self.model)
        why = self.tree.hold(tag, world, self.chains[ns][:length], name, kind, ttl_s, self.now)
        known = (tag, world, self.chains[ns][0]) in self.tree.where
        assert (why is None) or not known or "exceeds" in why
        self._evictions()
        assert self.model.items() <= before.items()

    @invariant()
    def held(self) -> None:
        for kind in self.tree.holds.kinds.values():
            assert kind.held_tokens <= kind.budget
            assert kind.held_tokens == sum(h.tokens for h in kind.held.values())
            for h in kind.held.values():
                node = h.node
                assert node.lock_ref >= 1
                assert node.parent is not None and node in node.parent.children.values()

    @rule(
        tag=st.sampled_from(TAGS),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        at=st.integers(0, 5),
    )
    def forget(self, tag, world, ns, at) -> None:
        h = self.chains[ns][at]
        events = self.tree.forget(tag, world, [h])
        orders = self.tree.take_orders()  # the shards other ranks hold are deleted
        assert {(o.kind, o.place, o.hashes, o.mask) for o in orders} == {
            (DELETE, p, (h,), self.model[(tag, world, p, h)])
            for p in PLACES
            if (tag, world, p, h) in self.model and p != L1A
        }
        full = (1 << world) - 1
        was = sorted(p for p in PLACES if self.model.get((tag, world, p, h)) == full)
        assert sorted(e.medium for e in events) == sorted(
            {L3: Medium.STORAGE, L1A: Medium.DEVICE}.get(p, Medium.HOST) for p in was
        )
        for p in PLACES:
            self.model.pop((tag, world, p, h), None)

    @rule(
        tag=st.sampled_from(TAGS),
        world=st.sampled_from([1, 2, 3]),
        ns=st.sampled_from(["a", "b"]),
        at=st.lists(st.integers(0, 5), min_size=1, max_size=3),
        everything=st.booleans(),
    )
    def drop_l1(self, tag, world, ns, at, everything) -> None:
        """vLLM evicted pages from the replica's blocks (or cleared them all): they
        leave L1 alone, with an event for each page that was whole there."""
        hashes = [self.chains[ns][i] for i in at]
        if everything:
            events = self.tree.drop_place(L1A)
            gone = [k for k in self.model if k[2] == L1A]
        else:
            events = self.tree.drop(tag, world, L1A, hashes)
            gone = [(tag, world, L1A, h) for h in dict.fromkeys(hashes)]
            gone = [k for k in gone if k in self.model]
        removed = sorted(h for e in events for h in e.page_hashes)
        assert removed == sorted(k[3] for k in gone if self.model[k] == (1 << k[1]) - 1)
        assert {e.medium for e in events} <= {Medium.DEVICE}
        assert self.tree.take_orders() == []
        for k in gone:
            del self.model[k]

    @invariant()
    def names_only_of_known_pages(self) -> None:
        assert self.tree.names.keys() <= self.tree.where.keys()

    @invariant()
    def exact_and_bounded(self) -> None:
        used: dict[str, int] = {}
        for (_, _, place, _), mask in self.model.items():
            used[place] = used.get(place, 0) + 10 * len(list(ranks_of(mask)))
        places = self.tree.places
        assert {p: n for p, n in places.used.items() if n} == used
        whole: dict[str, dict[str, int]] = {}
        for (_, world, place, h), mask in self.model.items():
            if mask == (1 << world) - 1:
                tenants = whole.setdefault(place, {})
                tenants[self.tenant[h]] = tenants.get(self.tenant[h], 0) + 1
        figures = self.tree.residency()
        assert {p: f["tenants"] for p, f in figures.items() if f["pages"]} == whole
        assert all(f["pages"] == sum(f["tenants"].values()) for f in figures.values())
        for place, n in used.items():
            if 0 < self.caps[place] < n:
                assert all(node.lock_ref for node in places.queue(place).members)
        if len(self.tree) > self.index:
            assert all(node.lock_ref for node in places.ends.members)
        for node in [self.tree.tree.root, *self.tree.tree.walk()]:
            below: dict[str, int] = {}
            for child in node.children.values():
                for place in child.places or ():
                    below[place] = below.get(place, 0) + 1
            assert (node.children_in or {}) == below
        for (tag, world, h), node in self.tree.where.items():
            assert h in node.page_hashes
            parent = node.parent
            assert parent is self.tree.tree.root or (tag, world, parent.page_hashes[-1]) in (
                self.tree.where
            )


EngineTreeMachine.TestCase.settings = machine_settings(examples=200, steps=40)
TestEngineTreeMachine = EngineTreeMachine.TestCase


WIN, STATE = "1111111111111111", "2222222222222222"  # a hybrid engine's component groups


def pages(hashes, place=L3, page_bytes=10) -> list[StoredRun]:
    """Component pages: each a run of its own, without a parent."""
    return [run([h], place=place, page_bytes=page_bytes) for h in hashes]


def test_a_hybrid_hit_is_the_deepest_point_every_component_serves():
    tree = EngineTree()
    c = chain(8)
    tree.report(TAG, 2, {0: [run(c)], 1: [run(c)]})
    needs = [(WIN, 2), (STATE, 1)]
    # Full pages alone serve no hybrid hit: the window and the state are tombstones.
    assert tree.lookup(TAG, 2, [c], needs=needs) == [0]
    assert tree.lookup(TAG, 2, [c]) == [8]
    # A window before page 5 and a state at page 5, on both ranks: a hit of 5.
    tree.report(WIN, 2, {0: pages(c[3:5]), 1: pages(c[3:5])})
    tree.report(STATE, 2, {0: pages(c[4:5]), 1: pages(c[4:5])})
    assert tree.lookup(TAG, 2, [c], needs=needs) == [5]
    # A later point whose state only one rank stored is no hit point (the MIN).
    tree.report(WIN, 2, {0: pages(c[5:7]), 1: pages(c[5:7])})
    tree.report(STATE, 2, {0: pages(c[6:7])})
    assert tree.lookup(TAG, 2, [c], needs=needs) == [5]
    tree.report(STATE, 2, {1: pages(c[6:7])})
    assert tree.lookup(TAG, 2, [c], needs=needs) == [7]
    # A point past the full pages is none: the full pages bound every hit.
    assert tree.lookup(TAG, 2, [c[:6]], needs=needs) == [5]
    # A component evicted (forgotten) leaves its point a tombstone; the one before serves.
    tree.forget(WIN, 2, [c[5]])
    assert tree.lookup(TAG, 2, [c], needs=needs) == [5]
    # A component that needs every page bounds the point by its leading run.
    other = "3333333333333333"
    tree.report(other, 2, {0: pages(c[:3]), 1: pages(c[:3])})
    assert tree.lookup(TAG, 2, [c], needs=[*needs, (other, 0)]) == [0]
    tree.report(other, 2, {0: pages(c[3:6]), 1: pages(c[3:6])})
    assert tree.lookup(TAG, 2, [c], needs=[*needs, (other, 0)]) == [5]


def test_a_hybrid_lease_keeps_the_components_it_matched_past_capacity():
    tree = EngineTree("lru", capacity={L3: 60})
    c = chain(3)
    tree.report(TAG, 1, {0: [run(c)]}, now=0.0)
    tree.report(WIN, 1, {0: pages(c[1:3])}, now=0.0)
    assert tree.lookup(TAG, 1, [c], ["e/r1"], 5.0, now=1.0, needs=[(WIN, 2)]) == [3]
    other = chain(3, first=50)
    _, drops = tree.report(TAG, 1, {0: [run(other)]}, now=2.0)  # 80 bytes in 60
    assert not {h for d in drops for h in d.hashes} & set(c)
    assert tree.lookup(TAG, 1, [c], now=2.0, needs=[(WIN, 2)]) == [3]
    assert tree.release(["e/r1"]) == 1


@pytest.mark.parametrize(
    ("needs", "needle"),
    [
        ("x", "needs are refused"),
        ([("nothex", 1)], "tag 'nothex'"),
        ([(WIN, -1)], "need pages -1"),
        ([(WIN,)], "allowed is a (tag, pages) pair"),
    ],
)
def test_bad_needs_are_refused_naming_the_value(needs, needle):
    tree = EngineTree()
    with pytest.raises(InvalidInput, match=needle.replace("(", r"\(").replace(")", r"\)")):
        tree.lookup(TAG, 1, [chain(2)], needs=needs)


COMPONENT_TAGS = ["1111111111111111", "2222222222222222", "3333333333333333"]


@given(
    data=st.data(),
    world=st.integers(1, 2),
    n=st.integers(0, 8),
    befores=st.lists(st.integers(0, 3), min_size=1, max_size=3),
)
@settings(max_examples=example_count(200, 5000), deadline=None)
def test_a_hybrid_hit_is_the_deepest_point_every_component_serves_over_every_rank(
    data, world, n, befores
):
    """Against a direct reading of the rule: the deepest p within the chain's whole
    pages where each component holds whole (every rank) the ``before`` pages
    before p (0: all of them)."""
    tree = EngineTree()
    c = chain(8)
    full = data.draw(st.integers(0, n), label="chain pages whole")
    if full:
        tree.report(TAG, world, {r: [run(c[:full])] for r in range(world)})
    needs = list(zip(COMPONENT_TAGS, befores, strict=False))
    have = {}
    for tag, _ in needs:
        for j in range(8):
            ranks = data.draw(st.sets(st.integers(0, world - 1)), label=f"{tag[0]}{j}")
            for r in ranks:
                tree.report(tag, world, {r: pages(c[j : j + 1])})
            have[(tag, j)] = len(ranks) == world

    def serves(p: int) -> bool:
        return all(
            have[(tag, j)]
            for tag, before in needs
            for j in range(max(p - before, 0) if before else 0, p)
        )

    want = next((p for p in range(full, 0, -1) if serves(p)), 0)
    assert tree.lookup(TAG, world, [c[:n]], needs=needs) == [want]
