"""Evictions waiting for an engine (``fabric.coordinator.engine_orders``): each
goes to one engine of its tag and world that can reach its place, oldest first,
a reply's worth at a time; past the bound the oldest are let go, counted."""

from __future__ import annotations

from fabric.cache.engine_input import L3
from fabric.cache.engine_places import Order
from fabric.coordinator import engine_orders
from fabric.coordinator.engine_orders import PendingOrders

TAG, OTHER = "0123456789abcdef", "fedcba9876543210"


def drop(place: str, n: int = 1, tag: str = TAG, first: int = 0) -> Order:
    return Order(tag, 1, place, 1, tuple(bytes([first + i]) * 32 for i in range(n)))


def test_an_engine_takes_l3s_drops_and_its_own_nodes_only_once():
    pending = PendingOrders()
    l3, here, there, other = drop(L3), drop("l2@a"), drop("l2@b"), drop(L3, tag=OTHER)
    pending.add([l3, here, there, other])
    assert pending.take(TAG, 1, "l2@a") == [l3, here]
    assert pending.take(TAG, 1, "l2@a") == []
    assert pending.take(TAG, 2, "l2@b") == []  # another world
    assert pending.take(TAG, 1, "") == []  # no L2: L3's only
    assert pending.take(TAG, 1, "l2@b") == [there]
    assert pending.take(OTHER, 1, "") == [other]
    assert len(pending) == 0


def test_a_reply_carries_a_bounded_share_and_the_oldest_go_past_the_bound(monkeypatch):
    monkeypatch.setattr(engine_orders, "MAX_PAGES_PER_REPLY", 3)
    pending = PendingOrders(max_pages=5)
    pending.add(
        [drop(L3, 2, first=i * 2) for i in range(4)]
    )  # 8 pages: the oldest two drops let go
    assert pending.let_go == 4 and len(pending) == 4
    first = pending.take(TAG, 1, "")
    assert [d.hashes[0][0] for d in first] == [4, 6]
    assert pending.take(TAG, 1, "") == [] and len(pending) == 0


def test_the_coordinator_announces_engine_pages_by_tier_and_place_and_hands_each_drop_once():
    """Through the core: a node's L2 and L3 reports become KV events with their
    medium and place (on the wire too); pages evicted past L3's cap go back to
    the next report of an engine of their tag, once."""
    from fabric.cache.engine_input import StoredRun
    from fabric.cache.events import BlockRemoved, BlockStored, Medium
    from fabric.coordinator.core import CoordinatorCore
    from fabric.coordinator.publisher import WireBlockStored, to_wire
    from tests.helpers import small_config

    config = small_config("storage.max_bytes=40")
    core = CoordinatorCore(config)
    core.events.take()
    a = tuple(bytes([i]) * 32 for i in range(3))
    b = tuple(bytes([9 + i]) * 32 for i in range(3))
    whole, drops = core.engines.report(
        TAG, 1, {0: [StoredRun("t", None, a, "l2@n1", 10), StoredRun("t", None, a, L3, 10)]},
        "l2@n1",
    )  # fmt: skip
    assert whole == 6 and drops == []
    events = core.events.take()
    assert [(e.medium, e.place) for e in events] == [(Medium.HOST, "n1"), (Medium.STORAGE, "")]
    wire = to_wire(events, 4)
    assert isinstance(wire[0], WireBlockStored) and wire[0].place == "n1"
    assert core.engines.lookup(TAG, 1, [list(a)], place="l2@n2")[0] == [3]  # L3 serves every node
    whole, drops = core.engines.report(TAG, 1, {0: [StoredRun("t", None, b, L3, 10)]}, "l2@n2")
    # a, least recently used: its last pages, as many as the room needs
    assert [(d.place, d.hashes) for d in drops] == [(L3, a[1:])]
    removed = [e for e in core.events.take() if isinstance(e, BlockRemoved)]
    assert [e.page_hashes for e in removed] == [a[1:]]
    assert core.engines.lookup(TAG, 1, [list(a)])[0] == [-2], "final: a's second page was evicted"
    assert core.engines.report(TAG, 1, {}, "l2@n1") == (0, [])  # handed once
    assert not any(isinstance(e, BlockStored) for e in core.events.take())


def test_an_engines_report_declares_its_node_l2_and_a_bad_size_is_refused():
    import pytest

    from fabric.coordinator.core import CoordinatorCore
    from fabric.errors import InvalidInput
    from tests.helpers import small_config

    core = CoordinatorCore(small_config())
    assert core.engines.report(TAG, 1, {}, "l2@n1", 1000) == (0, [])
    assert core.engines.tree.places.cap("l2@n1") == 500
    with pytest.raises(InvalidInput, match="place_bytes -1"):
        core.engines.report(TAG, 1, {}, "l2@n1", -1)
    with pytest.raises(InvalidInput, match="place 'disk'"):
        core.engines.report(TAG, 1, {}, "disk", 10)
    with pytest.raises(InvalidInput, match="tag 'nope'"):
        core.engines.report("nope", 1, {}, "l2@n2", 10)
    assert core.engines.tree.places.cap("l2@n2") == 0, "a refused call declares nothing"


def test_under_best_effort_the_coordinator_prefetches_into_the_askers_node():
    """``prefetch.stop_policy=best_effort``: an engine's lookup takes what its
    node's L2 holds, and the pages only L3 holds go back, as a ``PREFETCH`` into
    that node's L2, with the lookup's answers; under the other
    policies L3 counts (the request waits for its own reads)."""
    from fabric.cache.engine_input import StoredRun
    from fabric.cache.engine_places import PREFETCH
    from fabric.coordinator.core import CoordinatorCore
    from tests.helpers import small_config

    a = [bytes([i]) * 32 for i in range(3)]
    for policy, hits in (("best_effort", 0), ("timeout", 3), ("wait_complete", 3)):
        core = CoordinatorCore(small_config(f"prefetch.stop_policy={policy}"))
        core.engines.report(TAG, 1, {0: [StoredRun("t", None, tuple(a), L3, 10)]})
        answers, orders = core.engines.lookup(TAG, 1, [a], place="l2@n1")
        assert answers == [hits]  # the prefetch goes back with the lookup's answers
        expected = [(PREFETCH, "l2@n1", tuple(a))] if policy == "best_effort" else []
        assert [(o.kind, o.place, o.hashes) for o in orders] == expected


def test_engine_pages_go_out_on_the_wire_under_their_engines_names_and_tokens():
    """A report with vLLM's names of its pages: the published events carry vLLM's
    block hashes (the low 64 bits, as vLLM's own events do), the parent's, the
    pages' token ids and the engine's block size — in every dialect and hash
    format; their removal names them the same way."""
    from fabric.cache.engine_input import PageName, StoredRun
    from fabric.cache.keys import pack_tokens
    from fabric.coordinator.core import CoordinatorCore
    from fabric.coordinator.publisher import WireBlockRemoved, WireBlockStored, to_wire
    from tests.helpers import small_config

    core = CoordinatorCore(small_config("storage.max_bytes=30"))
    core.events.take()
    a = tuple(bytes([i]) * 32 for i in range(3))
    theirs = [bytes([0xA0 + i]) * 24 + i.to_bytes(8, "big") for i in range(3)]
    names = [PageName(a[i], theirs[i], pack_tokens(range(2 * i, 2 * i + 2))) for i in range(3)]
    core.engines.report(TAG, 1, {0: [StoredRun("t", None, a, L3, 10)]}, names=names)
    (stored,) = to_wire(core.events.take(), 16)
    assert isinstance(stored, WireBlockStored)
    assert stored.block_hashes == [0, 1, 2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(6)) and stored.block_size == 2
    (raw,) = to_wire([core.engines.tree.forget_all()[0]], 16, uint64=False, dialect="sglang")
    assert isinstance(raw, WireBlockRemoved) and raw.block_hashes == theirs
    assert raw.medium == "DISK"


def test_a_delete_waiting_for_pages_stored_anew_is_called_off_for_the_ranks_that_stored_them():
    from fabric.cache.engine_input import StoredRun
    from fabric.cache.engine_places import BACKUP

    pending = PendingOrders()
    pages = tuple(bytes([i]) * 32 for i in range(3))
    pending.add([Order(TAG, 2, L3, 0b11, pages), Order(TAG, 2, L3, 0b01, pages[:1], BACKUP)])
    # Rank 0 stored page 1 again (a page forgotten, then recomputed and stored).
    pending.stored_again(TAG, 2, {0: [StoredRun("vllm", None, pages[1:2])]})
    got = pending.take(TAG, 2, "")
    assert Order(TAG, 2, L3, 0b11, (pages[0], pages[2])) in got  # the rest: as ordered
    assert Order(TAG, 2, L3, 0b10, (pages[1],)) in got  # rank 1's shard of it: still goes
    assert Order(TAG, 2, L3, 0b01, pages[:1], BACKUP) in got  # other kinds: untouched
    assert len(got) == 3 and len(pending) == 0
