"""The engine lifecycle through the coordinator and every rank: unaligned
prompts, chunked prefill, decode, finish into sessions, abort at every stage,
pins — each lease's KV verified on all four ranks (TP=2 x PP=2)."""

import pytest

from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.errors import InvalidInput
from tests.helpers import FakeClock, prompt, small_config


def held_nothing(f: LocalFabric) -> None:
    c = f.core.cache
    c.check_integrity()
    assert not c.placement.leased and c.tree.protected_size == 0


def test_an_unaligned_prompt_is_served_whole_with_its_tail_in_a_page_of_its_own():
    f = LocalFabric(small_config())
    p = pack_tokens([*prompt(1, pages=3), 5, 6])
    r = f.serve(p)
    assert r.lease.tokens == 14 and len(r.lease.device_pages) == 4
    assert r.computed_tokens == 14
    assert f.verify(r, p) == [True] * 4
    again = f.serve(p)
    assert again.device_hit_tokens == 12 and again.computed_tokens == 2, "the tail is recomputed"
    assert f.verify(again, p) == [True] * 4
    f.core.release(r.lease)
    f.core.release(again.lease)
    held_nothing(f)


def test_chunked_prefill_serves_a_long_prompt_over_steps_and_shares_done_chunks():
    f = LocalFabric(small_config("cache.chunk_tokens=8"))
    long = pack_tokens(prompt(1, pages=10, shared=4))
    rid = f.core.submit(long)
    f.step()
    f.step()
    req = f.core.scheduler.running.get(rid) or next(
        r for r in f.core.scheduler.waiting if r.rid == rid
    )
    assert 0 < req.kv.filled < 40, "mid-prefill after two steps"
    other = f.serve(pack_tokens(prompt(2, pages=6, shared=4)))
    assert other.device_hit_tokens == 16, "it hit the chunks already placed"
    result = f._wait(rid, 100)
    assert result.error is None and result.computed_tokens == 40
    assert f.verify(result, long) == [True] * 4
    assert f.verify(other, pack_tokens(prompt(2, pages=6, shared=4))) == [True] * 4
    f.core.release(result.lease)
    f.core.release(other.lease)
    held_nothing(f)


def test_decode_appends_then_the_next_turn_hits_through_the_answer():
    f = LocalFabric(small_config())
    turn1 = [*prompt(1, pages=2), 7]
    r = f.serve(pack_tokens(turn1))
    answer = [901, 902, 903, 904, 905, 906]
    lease = r.lease
    for t in answer:
        step = f.append(lease, pack_tokens([t]))
        assert step.error is None and step.computed_tokens == 1 and step.prompt_tokens == 1
        lease = step.lease
    sequence = pack_tokens(turn1 + answer)
    assert lease.tokens == 15 and lease.request_id == r.request_id
    assert f.verify(step, sequence) == [True] * 4
    with pytest.raises(InvalidInput, match="no longer held"):
        f.core.append(r.lease, pack_tokens([1]))
    f.core.release(lease)
    turn2 = pack_tokens(turn1 + answer + [300, 301, 302, 303, 304])
    nxt = f.serve(turn2)
    assert nxt.device_hit_tokens == 12, "whole pages of prompt + answer"
    assert f.verify(nxt, turn2) == [True] * 4
    f.core.release(nxt.lease)
    held_nothing(f)


def test_abort_at_every_stage_leaves_nothing_held():
    f = LocalFabric(small_config("cache.chunk_tokens=4"))
    waiting = f.core.submit(pack_tokens(prompt(1, pages=2)))
    assert f.core.abort(waiting).error == "aborted"
    chunked = f.core.submit(pack_tokens(prompt(2, pages=5)))
    f.step()
    f.step(run_ranks=False)  # its second chunk is computing
    assert chunked in f.core.scheduler.running and f.core.abort(chunked) is None
    f.step()
    assert f.results.pop(chunked).error == "aborted"
    r = f.serve(pack_tokens([*prompt(3, pages=1), 1]))
    queued = f.core.append(r.lease, pack_tokens([2]))
    assert f.core.abort(queued).error == "aborted", "a decode not yet admitted"
    r = f.serve(pack_tokens([*prompt(4, pages=1), 1]))
    computing = f.core.append(r.lease, pack_tokens([2]))
    f.step(run_ranks=False)
    assert computing in f.core.scheduler.running and f.core.abort(computing) is None
    f.settle()
    assert f.results.pop(computing).error == "aborted"
    held_nothing(f)


def test_a_session_keeps_the_turn_in_l1_across_other_traffic_until_it_ends():
    f = LocalFabric(small_config("cache.session_budget_fraction=0.5"))
    turn1 = pack_tokens(prompt(1, pages=4))
    r = f.serve(turn1)
    assert f.core.release(r.lease, session="chat-1")
    for seed in range(2, 8):  # enough to push anything unheld out of L1
        x = f.serve(pack_tokens(prompt(seed, pages=5)))
        f.core.release(x.lease)
    turn2 = pack_tokens([*prompt(1, pages=4), 11, 12, 13, 14])
    r2 = f.serve(turn2)
    assert r2.device_hit_tokens == 16
    assert f.verify(r2, turn2) == [True] * 4
    assert f.core.release(r2.lease, session="chat-1")
    now = figures(f.core).now
    assert now.sessions == 1 and now.session_tokens == 20
    assert f.core.end_session("chat-1") and not f.core.end_session("chat-1")
    with pytest.raises(InvalidInput, match="session id"):
        f.core.release(r2.lease, session="")
    held_nothing(f)


def test_pins_from_a_client_keep_a_prefix_in_l2_and_unpin_lets_it_go():
    f = LocalFabric(small_config())
    p = pack_tokens(prompt(1, pages=3))
    f.core.release(f.serve(p).lease)
    f.settle()
    pinned = f.core.pin(p, "default", 60)
    assert pinned.pinned_tokens == 12 and pinned.reason is None
    assert f.core.unpin(p, "default") == 12
    with pytest.raises(InvalidInput, match="namespace"):
        f.core.pin(p, "", 60)
    held_nothing(f)


def test_a_reset_while_decoding_fails_the_decode_naming_why():
    f = LocalFabric(small_config())
    r = f.serve(pack_tokens(prompt(1, pages=1)))
    rid = f.core.append(r.lease, pack_tokens([1]))
    failed = f.core.rounds.reset("a test reset")
    assert [x.request_id for x in failed] == [rid]
    assert "KV was lost (a test reset)" in failed[0].error
    f.settle()
    held_nothing(f)


def test_sessions_expire_at_the_step_after_their_ttl_which_an_idle_loop_wakes_for():
    clock = FakeClock()
    f = LocalFabric(small_config("cache.session_ttl_s=10", "runtime.lease_ttl_s=100"), clock=clock)
    r = f.serve(pack_tokens(prompt(1, pages=2)))
    f.core.release(r.lease, session="s")
    assert f.core.next_expiry() == clock.now + 10
    clock.advance(10)
    f.step()
    assert not f.core.cache.sessions.held and f.core.next_expiry() is None
    held_nothing(f)


def test_a_request_may_name_its_session_when_submitted():
    f = LocalFabric(small_config("cache.session_budget_fraction=0.5"))
    rid = f.core.submit(pack_tokens([*prompt(1, pages=2), 9]), session="chat-2")
    r = f._wait(rid, 100)
    step = f.append(r.lease, pack_tokens([8, 7, 6]))
    assert f.core.release(step.lease)  # the session named at submit keeps it
    assert f.core.cache.sessions.held_tokens == 12
    with pytest.raises(InvalidInput, match="session id"):
        f.core.submit(pack_tokens([1, 2]), session="")
    assert f.core.end_session("chat-2")
    held_nothing(f)


def test_a_legal_prompt_is_not_refused_while_another_tenant_s_sessions_hold_l1():
    """Sessions are a preference, not a lock against other tenants: tenant A's
    sessions hold 24 of 96 L1 tokens; tenant B's legal 96-token prompt is served
    once nothing else can free room, the least recently kept sessions let go."""
    f = LocalFabric(small_config("cache.session_budget_fraction=0.25", "cache.tenant_share=1"))
    for seed in range(3):  # three sessions of 8 tokens each
        r = f.serve(pack_tokens(prompt(seed, pages=2)), namespace="tenant-a")
        assert r.error is None
        f.core.release(r.lease, f"s{seed}")
    assert f.core.cache.sessions.held_tokens == 24
    rid = f.core.submit(pack_tokens(prompt(9, pages=24)), "tenant-b", request_id="probe")
    f.step()
    assert f.core.cache.sessions.held_tokens == 16 and not f.core.idle, (
        "one session let go, and the coordinator does not go idle on a request it can serve"
    )
    f.core.abort(rid)
    f.step()
    big = f.serve(pack_tokens(prompt(9, pages=24)), namespace="tenant-b")
    assert big.error is None, big.error
    assert f.verify(big, pack_tokens(prompt(9, pages=24))) == [True] * 4
    assert f.core.cache.sessions.held_tokens < 24, "sessions let go for it"
    f.core.release(big.lease)
    f.core.cache.check_integrity()
