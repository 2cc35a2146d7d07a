"""Exact-state tests of eviction, write policies, load-back and pins."""

import pytest

from fabric.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Medium
from tests.helpers import P, RouterView, make_cache, put, toks


def leaf(c, *pages):
    return c.placement.match_prefix(c.key(toks(*pages))).last_device_node


@pytest.mark.parametrize(
    ("policy", "victim"),
    [
        ("lru", 2),
        ("mru", 1),
        ("fifo", 1),
        ("filo", 3),
        ("lfu", 1),
        ("priority", 2),
        ("slru", 1),
        ("2q", 1),
        ("a2q", 2),  # no ghost hit yet: its credit is 0, and that is LRU
    ],
)
def test_eviction_order_follows_the_policy(clock, policy, victim):
    c = make_cache(clock=clock, eviction_policy=policy, write_policy="write_back")
    # page 1: created first, 1 hit, touched last; page 2: 3 hits, lowest priority,
    # least recently used; page 3: created last, 2 hits, highest priority.
    for page, hits, prio in ((1, 1, 5), (2, 3, 0), (3, 2, 9)):
        for _ in range(hits):
            clock.advance(1)
            put(c, toks(page), priority=prio)
    clock.advance(1)
    c.placement.match_prefix(c.key(toks(1)))
    assert c.device_evictions.evict(P) == 0, "write_back: written to L2 first"
    c.writes.complete(1)
    left = {p for p in (1, 2, 3) if c.placement.match_prefix(c.key(toks(p))).device_tokens}
    assert {1, 2, 3} - left == {victim}
    c.check_integrity()


def _cached(c, *pages):
    return c.placement.match_prefix(c.key(toks(*pages))).device_tokens


@pytest.mark.parametrize("policy", ["lru", "2q"])
def test_2q_keeps_a_reused_prompt_through_a_scan_that_flushes_lru(clock, policy):
    c = make_cache(device_pages=8, host_pages=1, clock=clock, eviction_policy=policy)
    for _ in range(2):  # used twice: protected under 2q
        clock.advance(1)
        put(c, toks(1, 2))
    for first in range(10, 40, 2):  # a scan: prompts used once, 15 times L1 in all
        clock.advance(1)
        put(c, toks(first, first + 1))
    kept = _cached(c, 1, 2) == 2 * P
    assert kept == (policy == "2q")
    c.check_integrity()


def test_2q_protects_a_prompt_that_returns_while_its_ghost_remembers_it(clock):
    c = make_cache(device_pages=8, host_pages=1, clock=clock, eviction_policy="2q")
    put(c, toks(1, 2))  # used once, then flushed by a scan: only the ghost has it
    for first in range(10, 30, 2):
        clock.advance(1)
        put(c, toks(first, first + 1))
    assert _cached(c, 1, 2) == 0
    clock.advance(1)
    put(c, toks(1, 2, 3))  # back, with one page more: its first page is remembered
    node = c.placement.match_prefix(c.key(toks(1, 2, 3))).last_device_node
    assert node.hit_count == 2, "protected on return, as if hit before"
    for first in range(40, 60, 2):
        clock.advance(1)
        put(c, toks(first, first + 1))
    assert _cached(c, 1, 2, 3) == 3 * P, "the scan took the single-use prompts instead"
    c.check_integrity()


def test_2q_ghost_is_bounded_by_its_factor_of_l1():
    c = make_cache(device_pages=8, host_pages=1, eviction_policy="2q")
    for first in range(0, 400, 2):
        put(c, toks(first + 1000, first + 1001))
    ghost = c.eviction
    assert ghost.ghost_capacity == ghost.ghost_factor * 8 * P
    assert 0 < ghost.ghost_tokens <= ghost.ghost_capacity
    assert ghost.ghost_tokens == sum(ghost.ghost.values())
    c.check_integrity()


def test_a2q_learns_from_which_leaves_come_back(clock):
    """A protected leaf back from the ghost raises the credit (the frequent are
    kept longer); a probation leaf back from it lowers the credit, and the
    eviction queue, built under the higher one, is rebuilt."""
    c = make_cache(device_pages=8, host_pages=1, clock=clock, eviction_policy="a2q")
    policy = c.eviction
    for _ in range(2):  # protected: used by two requests
        clock.advance(1)
        put(c, toks(1, 2))
    for first in range(10, 30, 2):  # a scan flushes it (credit 0: LRU)
        clock.advance(1)
        put(c, toks(first, first + 1))
    assert _cached(c, 1, 2) == 0 and policy.credit == 0
    clock.advance(1)
    put(c, toks(1, 2))  # back while the ghost remembers it was protected
    raised = policy.credit
    assert raised > 0
    assert policy.key(leaf(c, 1, 2))[0] == leaf(c, 1, 2).last_access + raised
    version = policy.version
    clock.advance(1)
    put(c, toks(10, 11))  # a single-use prompt of the scan comes back
    assert 0 <= policy.credit < raised and policy.version == version + 1
    # The queue follows the lowered credit: the next victim is the least recent
    # leaf as the policy orders now, not as the heap had it.
    leaves = c.tree.device_leaves
    leaves.begin()
    victim = leaves.pop()
    assert victim is min(leaves.members, key=policy.key)
    leaves.requeue(victim)
    c.check_integrity()


def test_a2q_ghost_counts_each_kind_of_leaf_it_remembers():
    c = make_cache(device_pages=8, host_pages=1, eviction_policy="a2q")
    for first in range(0, 400, 2):
        put(c, toks(first + 1000, first + 1001))
        if first % 20 == 0:
            put(c, toks(first + 1000, first + 1001))  # some protected
    ghost = c.eviction
    assert 0 < ghost.ghost_tokens <= ghost.ghost_capacity
    assert ghost.ghost_tokens == sum(t for t, _ in ghost.ghost.values())
    for kind in (False, True):
        assert ghost.ghost_kind[kind] == sum(t for t, p in ghost.ghost.values() if p == kind)
    c.check_integrity()


def test_write_through_demotes_backed_up_leaves_and_write_back_writes_first():
    wt = make_cache()
    put(wt, toks(1, 2))
    assert wt.ctl.writes == [1]
    assert wt.device_evictions.evict(2 * P) == 0, "a node whose write is in flight is locked"
    wt.writes.complete(1)
    assert wt.device_evictions.evict(2 * P) == 2 * P
    node = wt.placement.match_prefix(wt.key(toks(1, 2))).last_host_node
    assert node.device_value is None and tuple(node.host_value) == (0, 1)
    wt.check_integrity()

    wb = make_cache(write_policy="write_back")
    put(wb, toks(1, 2))
    assert wb.ctl.writes == []
    assert wb.device_evictions.evict(2 * P) == 0 and wb.ctl.writes == [1]
    wb.writes.complete(1)
    m = wb.placement.match_prefix(wb.key(toks(1, 2)))
    assert m.device_tokens == 0 and m.host_tokens == 2 * P
    wb.check_integrity()


def test_write_through_is_queued_once_per_step_not_inside_insert():
    c = make_cache()
    key = c.key(toks(1, 2))
    c.placement.insert(key, c.placement.alloc_device(2 * P))
    assert c.ctl.writes == [] and list(c.writes.candidates) == [
        c.placement.match_prefix(key).last_device_node
    ]
    assert c.writes.write_through() == 2 * P and c.ctl.writes == [1]
    assert c.writes.write_through() == 0, "each candidate is written once"


def test_write_through_skips_candidates_evicted_before_the_step():
    c = make_cache()
    key = c.key(toks(1, 2))
    c.placement.insert(key, c.placement.alloc_device(2 * P))
    assert c.device_evictions.evict(2 * P) == 2 * P
    assert c.writes.write_through() == 0 and c.ctl.writes == []
    c.check_integrity()


def test_selective_write_through_waits_for_the_second_hit():
    c = make_cache(write_policy="write_through_selective")
    put(c, toks(1))
    assert c.ctl.writes == []
    put(c, toks(1))
    assert c.ctl.writes == [1]
    c.writes.complete(1)
    c.check_integrity()


def test_a_node_is_backed_up_only_with_its_parent():
    c = make_cache(write_policy="write_through_selective")
    put(c, toks(1))
    put(c, toks(1, 2))  # page 1: 2 hits -> written; page 2: 1 hit
    c.writes.complete(1)
    put(c, toks(1, 3))
    put(c, toks(1, 3))  # page 3 reaches 2 hits; its parent is already in L2
    c.writes.complete(1)
    n3 = leaf(c, 1, 3)
    assert n3.host_value is not None and n3.parent.host_value is not None
    c.check_integrity()


def test_evicting_an_unbacked_leaf_deletes_it():
    c = make_cache(write_policy="write_through_selective")
    put(c, toks(1, 2))
    assert c.device_evictions.evict(P) == 2 * P
    assert c.tree.walk() == []
    removed = [e for e in c.events.take() if isinstance(e, BlockRemoved)]
    assert [e.medium for e in removed] == [Medium.DEVICE]
    c.check_integrity()


def test_failed_write_leaves_node_l1_only_and_frees_host_pages():
    c = make_cache()
    put(c, toks(1))
    put(c, toks(1, 2))
    c.writes.complete(2, failed={1})
    n1, n2 = leaf(c, 1), leaf(c, 1, 2)
    assert n1.host_value is None and n2.host_value is None, "child's copy dropped with parent's"
    assert c.ctl.host.available_pages == 16
    assert c.tree.evictable_size == 2 * P
    c.check_integrity()


def test_evict_host_removes_unprotected_l2_only_leaves():
    c = make_cache()
    put(c, toks(1, 2))
    c.writes.complete(1)
    c.device_evictions.evict(2 * P)
    c.events.take()
    node = c.placement.match_prefix(c.key(toks(1, 2))).last_host_node
    node.host_ref += 1
    assert c.host_evictions.evict(P) == 0
    node.host_ref -= 1
    assert c.host_evictions.evict(P) == 2 * P
    assert c.tree.walk() == [] and c.ctl.host.available_pages == 16
    assert [e.medium for e in c.events.take()] == [Medium.HOST]
    c.check_integrity()


def test_load_back_is_all_or_nothing_with_threshold_and_quota():
    c = make_cache(load_back_threshold=3 * P)
    put(c, toks(1, 2))
    c.writes.complete(1)
    c.device_evictions.evict(8 * P)
    node = c.placement.match_prefix(c.key(toks(1, 2))).last_host_node
    assert c.loads.load_back(node) is None, "below threshold"
    c2 = make_cache()
    put(c2, toks(1, 2))
    c2.writes.complete(1)
    c2.device_evictions.evict(8 * P)
    node = c2.placement.match_prefix(c2.key(toks(1, 2))).last_host_node
    assert c2.loads.load_back(node, mem_quota=P) is None, "over quota"
    lb = c2.loads.load_back(node)
    assert lb.tokens == 2 * P and tuple(lb.device_pages) == (0, 1) and c2.ctl.loads == [lb.op_id]
    assert node.lock_ref == 1
    c2.loads.complete(1)
    assert node.lock_ref == 0
    assert tuple(c2.placement.match_prefix(c2.key(toks(1, 2))).device_pages) == (0, 1)
    c2.check_integrity()


def test_load_back_evicts_l1_to_make_room_but_not_its_own_ancestor():
    c = make_cache(device_pages=4)
    put(c, toks(1, 2))
    c.writes.complete(1)
    put(c, toks(1, 2, 3, 4))
    c.writes.complete(1)
    c.device_evictions.evict(2 * P)  # pages 3,4 demoted
    put(c, toks(7, 8))
    c.writes.complete(1)
    node = c.placement.match_prefix(c.key(toks(1, 2, 3, 4))).last_host_node
    lb = c.loads.load_back(node)
    assert lb is not None and lb.tokens == 2 * P
    assert c.placement.match_prefix(c.key(toks(7, 8))).device_tokens == 0
    assert c.placement.match_prefix(c.key(toks(1, 2))).device_tokens == 2 * P
    c.check_integrity()


def test_pin_keeps_prefix_in_l2_until_ttl_and_hits_refresh_it(clock):
    c = make_cache(clock=clock, write_policy="write_back", pin_budget_fraction=0.5)
    put(c, toks(1, 2))
    res = c.pin_prefix(c.key(toks(1, 2, 3)), ttl_s=10)
    assert res.pinned_tokens == 2 * P and "only 8 of 12" in res.reason
    assert c.ctl.writes == [1], "pinning writes the prefix through to L2"
    c.writes.complete(1)
    c.device_evictions.evict(2 * P)
    assert c.host_evictions.evict(2 * P) == 0, "pinned"
    clock.advance(8)
    c.placement.match_prefix(c.key(toks(1, 2)))  # a hit refreshes the TTL to now + 10
    clock.advance(8)
    assert c.host_evictions.evict(2 * P) == 0
    clock.advance(3)
    assert c.host_evictions.evict(2 * P) == 2 * P, "expired pins are cleared lazily"
    assert c.pins.pinned_size == 0
    c.check_integrity()


def test_pin_budget_limits_and_reports_partial_pins():
    c = make_cache(host_pages=4, pin_budget_fraction=0.5)  # budget: 2 pages
    put(c, toks(1))
    put(c, toks(1, 2, 3))
    res = c.pin_prefix(c.key(toks(1, 2, 3)), ttl_s=5)
    assert res.pinned_tokens == P and "budget exhausted" in res.reason
    c.writes.complete(2)
    c.check_integrity()


def test_write_through_completion_emits_host_events():
    c = make_cache()
    put(c, toks(1))
    c.events.take()
    c.writes.complete(1)
    (ev,) = c.events.take()
    assert isinstance(ev, BlockStored) and ev.medium is Medium.HOST


def test_reset_removes_exactly_what_l1_and_l2_held_per_medium():
    c = make_cache()
    assert c.events.take() == [AllBlocksCleared("")]  # a new log: subscribers start over
    view = RouterView()
    put(c, toks(1, 2))
    put(c, toks(3), namespace="tenant-b")
    c.writes.complete(1)  # one node's L2 copy is confirmed, the other still in flight
    view.apply(c.events.take())
    view.check(c.tree)
    assert view.held[Medium.DEVICE] and view.held[Medium.HOST]
    c.reset()
    assert c.tree.walk() == [] and c.ctl.device.available_pages == 8
    events = c.events.take()
    assert events and all(isinstance(e, BlockRemoved) for e in events)
    assert {e.namespace for e in events} == {"default", "tenant-b"}
    view.apply(events)
    assert view.held == {Medium.DEVICE: set(), Medium.HOST: set(), Medium.STORAGE: set()}
    c.check_integrity()


def test_a_leaf_queue_rebuilds_when_the_policy_says_keys_went_down():
    from fabric.cache.leaves import LeafQueue
    from fabric.cache.node import TreeNode

    keys: dict[TreeNode, float] = {}
    version = [0]
    q = LeafQueue(lambda n: (keys[n], n.id), monotone=True, version=lambda: version[0])
    a, b = TreeNode(b"a", "default", None, 0.0), TreeNode(b"b", "default", None, 0.0)
    keys.update({a: 5.0, b: 3.0})
    q.add(a)
    q.add(b)
    keys[a] = 1.0  # a's key went down: the heap still has it at 5
    q.begin()
    assert q.pop() is b, "without a new version the heap is trusted (monotone keys)"
    q.requeue(b)
    version[0] += 1
    q.begin()
    assert q.pop() is a, "a new version: rebuilt, in the keys' order now"
