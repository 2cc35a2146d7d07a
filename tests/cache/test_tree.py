"""Exact-state tests of match, insert, split, locks and namespaces."""

import pytest

from fabric.cache.events import AllBlocksCleared, BlockStored, Medium
from fabric.errors import InvalidInput
from tests.helpers import FakeClock, P, make_cache, put, toks


def test_insert_then_match_returns_device_pages_and_splits_inside_a_node():
    c = make_cache(write_policy="write_back")
    r = put(c, toks(1, 2, 3))
    assert r.cached_tokens == 0 and tuple(r.last_node.device_value) == (0, 1, 2)
    m = c.placement.match_prefix(c.key(toks(1, 2, 9)))
    assert tuple(m.device_pages) == (0, 1) and m.device_tokens == 2 * P and m.host_tokens == 0
    upper = m.last_device_node
    assert tuple(upper.device_value) == (0, 1) and tuple(
        next(iter(upper.children.values())).device_value
    ) == (2,)
    assert c.tree.root.children[("default", upper.key[: 4 * P])] is upper
    c.check_integrity()


def test_insert_returns_cached_length_and_frees_duplicate_pages():
    c = make_cache(write_policy="write_back")
    put(c, toks(1, 2))
    key = c.key(toks(1, 2, 3))
    fresh = c.placement.alloc_device(3 * P)
    assert tuple(fresh) == (2, 3, 4)
    r = c.placement.insert(key, fresh)
    assert r.cached_tokens == 2 * P and r.duplicate_pages == (2, 3)
    assert c.ctl.device.is_free(2) and c.ctl.device.is_free(3)
    assert tuple(c.placement.match_prefix(key).device_pages) == (0, 1, 4)
    c.check_integrity()


def test_unaligned_tail_is_not_cached_and_empty_keys_match_nothing():
    c = make_cache()
    key = c.key([*toks(1), 7, 7])
    assert key.num_tokens == P
    put(c, [*toks(1), 7, 7])
    assert c.placement.match_prefix(c.key([1, 1])).device_tokens == 0
    assert c.placement.insert(c.key([]), []).cached_tokens == 0
    c.check_integrity()


def test_namespaces_never_share_nodes():
    c = make_cache()
    put(c, toks(1, 2), "a")
    assert c.placement.match_prefix(c.key(toks(1, 2), "b")).device_tokens == 0
    put(c, toks(1, 2), "b")
    assert len(c.tree.root.children) == 2
    assert {n.namespace for n in c.tree.walk()} == {"a", "b"}
    c.check_integrity()


def test_locks_move_tokens_between_evictable_and_protected_along_the_path():
    c = make_cache(write_policy="write_back")
    put(c, toks(1, 2))
    put(c, toks(1, 2, 3))
    leaf = c.placement.match_prefix(c.key(toks(1, 2, 3))).last_device_node
    assert (c.tree.evictable_size, c.tree.protected_size) == (3 * P, 0)
    c.placement.inc_lock_ref(leaf)
    c.placement.inc_lock_ref(leaf)
    assert (c.tree.evictable_size, c.tree.protected_size) == (0, 3 * P)
    assert leaf.parent.lock_ref == 2
    c.placement.dec_lock_ref(leaf)
    c.placement.dec_lock_ref(leaf)
    assert (c.tree.evictable_size, c.tree.protected_size) == (3 * P, 0)
    with pytest.raises(InvalidInput, match="below zero"):
        c.placement.dec_lock_ref(leaf)
    c.check_integrity()


def test_priority_is_max_propagated_along_the_path():
    c = make_cache(write_policy="write_back")
    put(c, toks(1, 2), priority=1)
    put(c, toks(1, 3), priority=5)
    m = c.placement.match_prefix(c.key(toks(1)))
    assert m.last_device_node.priority == 5
    assert c.placement.match_prefix(c.key(toks(1, 2))).last_device_node.priority == 1


def test_reinsert_over_l1_evicted_node_gives_it_the_new_device_value():
    c = make_cache()  # write_through: inserted nodes are backed up at once
    put(c, toks(1, 2))
    c.writes.complete(1)
    assert c.device_evictions.evict(2 * P) == 2 * P
    m = c.placement.match_prefix(c.key(toks(1, 2)))
    assert m.device_tokens == 0 and m.host_tokens == 2 * P
    r = put(c, toks(1, 2))
    assert r.cached_tokens == 0 and r.last_node.device_value is not None
    assert r.last_node.host_value is not None
    c.check_integrity()


def test_insert_emits_block_stored_for_device():
    c = make_cache(write_policy="write_back")
    assert c.events.take() == [AllBlocksCleared("")]  # a new log: subscribers start over
    put(c, toks(1, 2))
    (event,) = c.events.take()
    assert isinstance(event, BlockStored) and event.medium is Medium.DEVICE
    assert list(event.page_hashes) == c.key(toks(1, 2)).page_hashes()
    assert c.events.take() == []


def test_kv_events_round_trip_as_msgpack_for_a_router():
    import msgspec

    from fabric.cache.events import KVEvent

    c = make_cache()
    put(c, toks(1, 2), namespace="tenant-a")
    c.device_evictions.evict(8)
    c.reset()
    events = c.events.take()
    assert {type(e).__name__ for e in events} >= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    wire = msgspec.msgpack.encode(events)
    assert msgspec.msgpack.decode(wire, type=list[KVEvent]) == events


def test_a_request_is_hashed_once_and_integrity_checks_every_kept_hash():
    """Page hashes are L3 addresses: the prefetch's chain is reused by the insert,
    and a node holding a wrong hash is an integrity violation."""
    import pytest

    from fabric.errors import IntegrityError

    c = make_cache()
    c.l3.attach()
    key = c.key(toks(1, 2, 3))
    put(c, toks(1))
    anchor = c.placement.match_prefix(key).last_device_node
    hashes = key.chain_from(1, c.tree.page_hashes(anchor)[-1])
    assert hashes == key.page_hashes()[1:]
    leaf = c.placement.insert(
        key, c.placement.match_prefix(key).device_pages + c.placement.alloc_device(8)
    ).last_node
    assert leaf.page_hashes == key.page_hashes()[1:]
    c.check_integrity()
    leaf.page_hashes = list(reversed(leaf.page_hashes))
    with pytest.raises(IntegrityError, match="page hashes differ"):
        c.check_integrity()


def test_a_match_that_splits_a_node_refreshes_only_the_matched_half():
    # SGLang refreshes the whole node it splits; kvfabric only the half the
    # match used, so the unused tail keeps its age and is evicted first (a
    # documented difference: docs/architecture.md).
    clock = FakeClock()
    c = make_cache(device_pages=4, write_policy="write_through_selective", clock=clock)
    put(c, toks(1, 2, 3))
    clock.advance(10)
    upper = c.placement.match_prefix(c.key(toks(1, 9))).last_device_node
    (lower,) = upper.children.values()
    assert upper.last_access == 11.0 and lower.last_access == 1.0
    put(c, toks(7))  # takes the last free page
    assert c.device_evictions.evict(P) == 2 * P
    assert lower.parent is None and upper.device_value is not None, "the stale tail went first"
