"""Exact-state tests of the holds that outlive a request: sessions between turns
(in L1 or L2, within a budget, until a TTL or their end) and pins from a client."""

import pytest

from fabric.cache.admission import Admission
from fabric.cache.keys import pack_tokens
from fabric.errors import InvalidInput
from tests.helpers import P, make_cache, toks


def lifecycle(clock, tier="device", fraction=0.5, ttl=10.0, **options):
    options.setdefault("tenant_share", 1.0)  # one tenant may take a whole budget here
    cache = make_cache(
        device_pages=8,
        host_pages=16,
        clock=clock,
        session_tier=tier,
        session_budget_fraction=fraction,
        session_ttl_s=ttl,
        **options,
    )
    return cache, Admission(cache)


def turn(a, tokens, session=None):
    req = a.begin(pack_tokens(tokens))
    assert a.prefill(req, len(tokens)) is not None
    return req, a.finish(req, session)


def test_a_device_session_keeps_its_turn_locked_in_l1_until_the_next_turn(clock):
    c, a = lifecycle(clock)
    req, why = turn(a, [*toks(1, 2), 9], session="s")
    assert why is None and req.node.lock_ref == 1 and c.sessions.held_tokens == 2 * P
    assert not c.placement.leased, "the unaligned tail page is freed at the end of the turn"
    assert c.device_evictions.evict(8 * P) == 0, "a kept session is not evictable"
    nxt, why = turn(a, toks(1, 2, 3), session="s")
    assert nxt.device_hit == 2 * P and why is None
    assert req.node.lock_ref == 1, "only through the new turn's node now"
    assert c.sessions.held_tokens == 3 * P
    c.check_integrity()
    assert a.end_session("s") and not a.end_session("s")
    assert c.tree.protected_size == 0
    c.check_integrity()


def test_sessions_expire_after_their_ttl_and_the_budget_drops_the_least_recent(clock):
    c, a = lifecycle(clock, fraction=0.5)  # budget: 4 pages of L1
    turn(a, toks(1, 2), session="old")
    clock.advance(5)
    turn(a, toks(3, 4), session="new")
    assert set(c.sessions.held) == {"old", "new"}
    clock.advance(2)
    turn(a, toks(5), session="newest")
    assert set(c.sessions.held) == {"new", "newest"}, "over budget: the oldest went"
    _, why = turn(a, toks(1, 2, 3, 4, 5), session="huge")
    assert "exceeds the session budget of 16" in why and "huge" not in c.sessions.held
    clock.advance(8)
    assert a.expire() == 1 and set(c.sessions.held) == {"newest"}
    clock.advance(10)
    assert a.expire() == 1 and c.tree.protected_size == 0
    c.check_integrity()


def test_a_host_session_keeps_its_turn_in_l2_while_l1_may_let_it_go(clock):
    c, a = lifecycle(clock, tier="host", immediate=True)
    req, why = turn(a, toks(1, 2), session="s")
    assert why is None and req.node.host_ref == 1
    assert c.writes.pending[0].lock_node is req.node, "written to L2 at once"
    c.poll()  # the write lands in L2
    assert req.node.lock_ref == 0
    assert c.device_evictions.evict(8 * P) == 2 * P
    assert c.host_evictions.evict(16 * P) == 0, "protected in L2"
    c.check_integrity()
    nxt = a.begin(pack_tokens(toks(1, 2, 3)))
    a.prefill(nxt, 3 * P)
    assert nxt.host_hit == 2 * P
    a.release(nxt)
    a.end_session("s")
    c.poll()
    assert c.device_evictions.evict(8 * P) == 3 * P and c.host_evictions.evict(16 * P) == 3 * P
    c.check_integrity()


def test_pins_from_a_client_are_refused_past_the_budget_and_unpinned(clock):
    c, a = lifecycle(clock, pin_budget_fraction=0.25)  # 4 pages of L2
    turn(a, toks(1, 2, 3))
    turn(a, toks(4, 5))
    key = c.key(toks(1, 2, 3))
    assert a.pin(key, 5).pinned_tokens == 3 * P and c.pins.pinned_size == 3 * P
    refused = a.pin(c.key(toks(4, 5)), 5)
    assert refused.pinned_tokens == 0 and "pin budget exhausted" in refused.reason
    assert a.unpin(c.key(toks(1))) == P, "only the prefix asked for: its node is split"
    assert c.pins.pinned_size == 2 * P
    c.check_integrity()
    assert a.unpin(key) == 2 * P and c.pins.pinned_size == 0 and a.unpin(key) == 0
    assert a.pin(c.key(toks(4, 5)), 5).pinned_tokens == 2 * P
    c.check_integrity()
    with pytest.raises(InvalidInput, match="unpin takes a TokenKey"):
        a.unpin(toks(4))


def test_an_expired_pin_gives_its_budget_back_without_an_eviction(clock):
    """Tenant A pins the whole budget; once its TTL passes, tenant B's pin fits
    — no eviction has touched A's nodes, nothing is under pressure."""
    c, a = lifecycle(clock, pin_budget_fraction=0.25)  # 4 pages of L2
    turn(a, toks(1, 2, 3, 4))
    theirs = pack_tokens(toks(7, 8))
    other = a.begin(theirs, namespace="tenant-b")
    assert a.prefill(other, 2 * P) is not None
    a.finish(other)
    assert a.pin(c.key(toks(1, 2, 3, 4)), 5).pinned_tokens == 4 * P
    b_key = c.key(toks(7, 8), "tenant-b")
    assert "pin budget exhausted" in a.pin(b_key, 5).reason
    a.pin(c.key(toks(1, 2)), 1)  # splits the pinned node: its upper half is pinned too
    assert c.pins.pinned_size == 4 * P
    clock.advance(6)

    def evicted() -> int:
        return c.stats.device_evicted_tokens + c.stats.host_evicted_tokens

    before = evicted()
    assert a.pin(b_key, 5).pinned_tokens == 2 * P, "A's budget came back at its TTL"
    assert c.pins.pinned_size == 2 * P and evicted() == before, "no eviction was needed"
    c.check_integrity()
    clock.advance(6)
    a.expire()  # each step: expired pins go even when nobody pins again
    assert c.pins.pinned_size == 0
    c.check_integrity()


def test_one_tenant_pins_at_most_its_share_and_the_others_still_pin(clock):
    """Tenant A asks to pin more than ``cache.tenant_share`` of the pin budget:
    it gets its share, and tenant B's pin fits in what is left."""
    c, a = lifecycle(clock, pin_budget_fraction=0.5, tenant_share=0.5)  # 8 pages, 4 a tenant
    turn(a, toks(1, 2, 3, 4, 5))
    theirs = a.begin(pack_tokens(toks(7, 8)), namespace="tenant-b")
    assert a.prefill(theirs, 2 * P) is not None
    a.finish(theirs)
    a.pin(c.key(toks(1, 2)), 60)
    mine = a.pin(c.key(toks(1, 2, 3, 4, 5)), 60)
    assert mine.pinned_tokens == 2 * P, "the rest of the path would pass A's share"
    assert "tenant 'default' pin budget exhausted (8/16" in mine.reason
    assert c.pins.by_tenant == {"default": 2 * P}
    a.pin(c.key(toks(1, 2, 3, 4)), 60)
    assert c.pins.by_tenant == {"default": 4 * P} and c.pins.pinned_size == 4 * P
    b = a.pin(c.key(toks(7, 8), "tenant-b"), 60)
    assert b.pinned_tokens == 2 * P and b.reason is None, "B is not refused for A's pins"
    assert c.pins.by_tenant == {"default": 4 * P, "tenant-b": 2 * P}
    c.check_integrity()
    assert a.unpin(c.key(toks(1, 2, 3, 4))) == 4 * P
    assert c.pins.by_tenant == {"tenant-b": 2 * P}
    c.check_integrity()


def test_one_tenant_s_sessions_push_out_its_own_not_another_tenant_s(clock):
    """Sessions of one tenant past its share end its own least recently kept
    session; another tenant's session stays."""
    c, a = lifecycle(clock, tier="host", fraction=0.5, tenant_share=0.5)  # 8 pages, 4 a tenant
    first = a.begin(pack_tokens(toks(7, 8)), namespace="tenant-b")
    assert a.prefill(first, 2 * P) is not None
    assert a.finish(first, "b1") is None
    assert turn(a, toks(1, 2), session="a1")[1] is None
    assert turn(a, toks(3, 4), session="a2")[1] is None
    assert c.sessions.by_tenant == {"tenant-b": 2 * P, "default": 4 * P}
    assert turn(a, toks(5), session="a3")[1] is None
    assert list(c.sessions.held) == ["b1", "a2", "a3"], "A's own oldest went, not B's"
    assert c.sessions.by_tenant == {"tenant-b": 2 * P, "default": 3 * P}
    c.check_integrity()
    c.writes.complete(len(c.writes.pending))
    req, why = turn(a, toks(1, 2, 3, 4, 5), session="a4")
    assert "exceeds tenant 'default''s session budget of 16" in why
    assert list(c.sessions.held) == ["b1", "a2", "a3"] and not req.node.lock_ref
    c.check_integrity()


def test_bad_session_ids_are_refused_and_nothing_is_held(clock):
    c, a = lifecycle(clock)
    req = a.begin(pack_tokens(toks(1)))
    a.prefill(req, P)
    with pytest.raises(InvalidInput, match="session id 7"):
        a.finish(req, 7)
    assert not req.ended, "a refused finish changes nothing"
    a.finish(req)
    with pytest.raises(InvalidInput, match="session id ''"):
        a.end_session("")
    c.check_integrity()


def test_l1_eviction_keeps_a_node_a_session_protects_when_l2_has_no_room(clock):
    c, a = lifecycle(clock, tier="host", pin_budget_fraction=1.0)
    c.ctl.host = type(c.ctl.host)(2, P, "L2 host pool")  # L2 of two pages
    turn(a, toks(5, 6))
    c.writes.complete(len(c.writes.pending))
    assert a.pin(c.key(toks(5, 6)), 60).pinned_tokens == 2 * P  # L2 full, unevictable
    _, why = turn(a, toks(1, 2), session="s")
    assert why is None and c.ctl.host.available_pages == 0
    a.pin(c.key(toks(1, 2)), 60)  # a pin and the session on one L1-only node
    c.check_integrity()
    assert c.device_evictions.evict(8 * P) == 0, (
        "written nowhere, deleted never: the session keeps it"
    )
    assert c.placement.match_prefix(c.key(toks(1, 2))).device_tokens == 2 * P
    c.check_integrity()
