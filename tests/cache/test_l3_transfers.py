"""Prefetch (L3 -> L2) and backup (L2 -> L3) bookkeeping on the cache side."""

import pytest

from fabric.cache.controller import Completions, HitAnswer, as_answer
from fabric.cache.events import BlockStored, Medium
from fabric.cache.keys import chain_hashes, namespace_seed
from fabric.cache.l3_transfers import PrefetchState
from fabric.config import PrefetchConfig
from tests.helpers import P, make_cache, put, toks


def storage_cache(clock=None, write_policy="write_through", **prefetch):
    options = {"threshold_tokens": P, **prefetch}
    c = make_cache(
        clock=clock,
        host_pages=32,
        prefetch=PrefetchConfig(**options),
        write_policy=write_policy,
    )
    c.l3.attach()
    return c


def start(c, tokens, req="r1"):
    key = c.key(tokens)
    return key, c.l3.start_prefetch(req, key, c.placement.match_prefix(key))


def test_backup_follows_write_through_and_holds_host_protection_until_acked():
    c = storage_cache()
    put(c, toks(1, 2))
    c.writes.complete(1)
    node = c.placement.match_prefix(c.key(toks(1, 2))).last_host_node
    (bop,) = c.ctl.backups
    assert tuple(bop.host_pages) == (0, 1) and node.host_ref == 1
    c.events.take()
    c.l3.complete_backups(1)
    assert node.host_ref == 0
    (ev,) = c.events.take()
    assert isinstance(ev, BlockStored) and ev.medium is Medium.STORAGE
    c.check_integrity()


def test_failed_backup_releases_protection_and_node_stays_l2():
    c = storage_cache()
    put(c, toks(1))
    c.writes.complete(1)
    node = c.placement.match_prefix(c.key(toks(1))).last_host_node
    c.l3.complete_backups(1, failed={c.ctl.backups[0].op_id})
    assert node.host_ref == 0 and node.host_value is not None
    assert c.l3.stats.failed_backups == 1 and c.events.take()[-1].medium is Medium.HOST
    c.check_integrity()


def test_prefetch_inserts_the_min_completed_prefix_and_releases_the_rest():
    c = storage_cache(stop_policy="best_effort")
    key, st = start(c, toks(1, 2, 3, 4))
    (query,) = c.ctl.queries
    assert st.op_id is not None and (query.prev, query.tokens) == (
        c.tree.chain_hash(c.tree.root, key.namespace),
        key.data,
    )
    c.l3.complete_query(st.op_id, 3)
    op = c.l3.by_op[st.op_id]
    assert op.state is PrefetchState.LOADING and tuple(op.host_pages) == (0, 1, 2)
    assert c.l3.check_prefetch("r1") is None, "best effort still waits for one report"
    c.l3.update_progress(st.op_id, 2 * P)
    assert c.l3.check_prefetch("r1") == 2 * P  # then takes what has arrived
    m = c.placement.match_prefix(key)
    assert m.host_tokens == 2 * P and tuple(m.last_host_node.host_value) == (0, 1)
    assert c.ctl.stopped == [st.op_id] and not c.ctl.host.is_free(2), "tail held until released"
    c.check_integrity()
    c.l3.complete_release(st.op_id)
    assert c.ctl.host.is_free(2) and c.l3.inflight_tokens == 0
    c.check_integrity()


def test_prefetch_revoked_below_threshold_or_without_storage():
    c = storage_cache(threshold_tokens=2 * P)
    _, st = start(c, toks(1, 2, 3))
    c.l3.complete_query(st.op_id, 1)
    assert c.l3.by_op == {} and c.l3.stats.prefetch_revoked == 1
    assert start(c, toks(1), "r2")[1].reason == "below prefetch threshold"
    c.l3.detach()
    assert start(c, toks(1, 2, 3), "r3")[1].reason == "no storage attached"
    c.check_integrity()


def test_rate_limit_bounds_tokens_held_by_inflight_prefetches():
    c = storage_cache(max_inflight_fraction=0.25)  # 8 pages of 32
    assert start(c, toks(*range(1, 7)), "a")[1].op_id is not None
    assert start(c, toks(*range(11, 17)), "b")[1].reason == "rate limited"


def test_wait_complete_waits_and_terminated_flag_stops_it():
    c = storage_cache(stop_policy="wait_complete")
    _, st = start(c, toks(1, 2))
    c.l3.complete_query(st.op_id, 2)
    c.l3.update_progress(st.op_id, P)
    assert c.l3.check_prefetch("r1") is None
    c.apply(Completions(prefetch_terminated=frozenset({st.op_id})))
    assert c.l3.check_prefetch("r1") == P
    c.check_integrity()


def test_timeout_policy_uses_base_plus_per_ki_token_capped(clock):
    c = storage_cache(
        clock,
        stop_policy="timeout",
        timeout_base_s=1,
        timeout_per_ki_token_s=1024 / P,
        timeout_max_s=2.5,
    )
    _, st = start(c, toks(1, 2, 3))
    c.l3.complete_query(st.op_id, 3)  # limit = min(1 + 3, 2.5) = 2.5 s
    clock.advance(2.4)
    assert c.l3.check_prefetch("r1") is None
    clock.advance(0.2)
    assert c.l3.check_prefetch("r1") == 0, "timed out with nothing completed"
    c.l3.complete_release(st.op_id)
    assert c.ctl.host.available_pages == 32
    c.check_integrity()


def test_abort_mid_prefetch_inserts_nothing_and_frees_after_release():
    c = storage_cache()
    put(c, toks(1))
    c.writes.complete(1)
    c.l3.complete_backups(1)
    key, st = start(c, toks(1, 2, 3))
    anchor = c.l3.by_op[st.op_id].anchor
    assert anchor.host_ref == 1
    c.l3.complete_query(st.op_id, 3)
    c.l3.update_progress(st.op_id, 3 * P)
    c.l3.abort("r1")
    assert anchor.host_ref == 0 and c.l3.check_prefetch("r1") == 0
    c.l3.complete_release(st.op_id)
    assert c.placement.match_prefix(key).matched_tokens == P
    c.check_integrity()


def test_prefetch_gives_l1_only_nodes_their_host_copy_and_frees_duplicates():
    c = storage_cache(write_policy="write_through_selective")
    put(c, toks(1, 2))  # L1 only: one hit
    key, st = start(c, toks(1, 2, 3, 4))
    assert c.l3.by_op[st.op_id].start_page == 0
    c.l3.complete_query(st.op_id, 4)
    c.l3.update_progress(st.op_id, 4 * P)
    assert c.l3.check_prefetch("r1") == 2 * P
    m = c.placement.match_prefix(key)
    assert m.device_tokens == 2 * P and m.host_tokens == 2 * P
    assert tuple(m.last_device_node.host_value) == (0, 1)
    c.check_integrity()


def test_detach_releases_everything_pending():
    c = storage_cache()
    put(c, toks(1))
    c.writes.complete(1)
    _, st = start(c, toks(5, 6, 7))
    c.l3.complete_query(st.op_id, 3)
    c.l3.detach()
    assert c.l3.by_op == {} and c.l3.backups == type(c.l3.backups)()
    assert all(n.host_ref == 0 for n in c.tree.walk())
    c.check_integrity()


def test_duplicate_request_id_is_refused():
    c = storage_cache()
    start(c, toks(1, 2))
    with pytest.raises(ValueError, match="already has a prefetch"):
        start(c, toks(1, 2))


def test_an_answers_hashes_are_kept_for_the_key_and_its_prefetch():
    c = storage_cache()
    key, st = start(c, toks(1, 2, 3, 4))
    (q,) = c.ctl.queries
    answer = c.ctl.answer(q.prev, q.tokens)  # hashed by the answerer, as the storage actor does
    assert answer.hashes == chain_hashes(namespace_seed(key.namespace), key.data, key.page_bytes)
    c.l3.complete_query(st.op_id, 4, answer.hashes)
    assert key.known_hashes(0) == answer.hashes
    assert c.ctl.prefetches[st.op_id].page_hashes == tuple(answer.hashes)
    c.check_integrity()


@pytest.mark.parametrize("damage", ["last", "other_prefix", "count", "not_bytes", "one_not_bytes"])
def test_an_answer_whose_hashes_are_not_the_asked_chain_is_refused(damage):
    c = storage_cache()
    key, st = start(c, toks(1, 2, 3, 4))
    (q,) = c.ctl.queries
    hashes = list(c.ctl.answer(q.prev, q.tokens).hashes)
    if damage == "last":
        hashes[-1] = bytes(32)
    elif damage == "other_prefix":
        hashes = list(c.ctl.answer(bytes(32), q.tokens).hashes)
    elif damage == "count":
        hashes = hashes[:-1]
    elif damage == "not_bytes":
        hashes = [h.hex() for h in hashes]
    else:
        hashes[-2] = hashes[-2].hex()
    c.l3.complete_query(st.op_id, 4, hashes)
    assert c.l3.by_op == {} and c.l3.stats.bad_answers == 1
    assert c.l3.stats.prefetch_revoked == 1 and c.ctl.prefetches == {}
    assert key.known_hashes(0) is None, "no hash of a refused answer is kept"
    assert c.placement.match_prefix(key).host_tokens == 0
    c.check_integrity()


def test_answers_from_another_process_are_read_defensively():
    hashes = [bytes(32)]
    assert as_answer((3, hashes)) == HitAnswer(3, hashes)
    assert as_answer(HitAnswer(2, hashes)) == HitAnswer(2, hashes)
    assert as_answer(2) == HitAnswer(2, ())
    for junk in (None, True, "3", 2.0, (1, 2, 3), ("3", hashes), (True, hashes), (3, b"x" * 32)):
        assert as_answer(junk) == HitAnswer(0, ()), junk
