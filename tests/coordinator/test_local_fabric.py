"""The fabric's logic end to end in one process: coordinator core + rank workers,
stepped by hand, so consensus is tested without timing."""

import dataclasses

import pytest

import fabric.cache.keys
import fabric.cache.radix
from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.errors import InvalidInput
from fabric.messages import decode, encode
from fabric.rank.worker import RankWorker
from tests.helpers import prompt, small_config, storage_options


def test_tp2_pp2_overlapping_prompts_evictions_and_load_backs_verify_on_every_rank():
    f = LocalFabric(small_config())
    prompts = [pack_tokens(prompt(seed, pages=6, shared=3)) for seed in range(8)]
    served = {"device": 0, "host": 0}
    for _ in range(2):
        for p in prompts:
            r = f.serve(p)
            assert r.error is None
            assert f.verify(r, p) == [True] * 4
            served["device"] += r.device_hit_tokens
            served["host"] += r.host_hit_tokens
            assert f.core.release(r.lease)
            f.core.cache.check_integrity()
    assert served["device"] > 0, "shared prefixes hit L1"
    assert served["host"] > 0, "L1 (24 pages) is too small for 8 prompts: some came back from L2"
    assert f.core.cache.stats.device_evicted_tokens > 0


def test_stale_or_cross_namespace_pages_fail_verification():
    f = LocalFabric(small_config())
    a = pack_tokens(prompt(1, pages=3))
    r = f.serve(a)
    assert type(r.lease.device_pages) is tuple, "a lease holds plain ints, not the core's arrays"
    assert f.verify(r, a) == [True] * 4
    assert f.verify(r, pack_tokens(prompt(2, pages=3))) == [False] * 4
    other = f.serve(a, namespace="tenant-b")
    assert other.device_hit_tokens == 0, "namespaces share nothing"
    assert set(other.lease.device_pages).isdisjoint(r.lease.device_pages)
    assert f.ranks[0].verify("tenant-b", a[: 12 * 4], list(r.lease.device_pages)) is False


def test_write_through_commits_only_when_the_slowest_rank_has_finished():
    f = LocalFabric(small_config())
    rid = f.core.submit(pack_tokens(prompt(1, pages=2)))
    slow = f.ranks[3]
    # The step that sends the compute and its write-through: one rank lags.
    wire = encode(f.core.next_batch())
    for rank in f.ranks:
        rank.accept(decode(wire))
        if rank is not slow:
            rank.run_pending()
    assert f.core.rounds.on_round([rank.report() for rank in f.ranks]) == [], (
        "compute not done everywhere"
    )
    assert len(f.core.cache.writes.pending) == 1, "MIN over ranks: not committed"
    assert f.core.cache.stats.written_tokens == 0
    slow.run_pending()
    assert [r.request_id for r in f.step()] == [rid]
    assert len(f.core.cache.writes.pending) == 0
    assert f.core.cache.stats.written_tokens == 8


def test_a_write_failing_on_one_rank_fails_it_for_all():
    f = LocalFabric(small_config())
    f.ranks[1].faults.fail_writes = True
    key_tokens = pack_tokens(prompt(1, pages=2))
    r = f.serve(key_tokens)
    f.step()
    node = f.core.cache.placement.match_prefix(
        f.core.cache.key(prompt(1, pages=2))
    ).last_device_node
    assert node.host_value is None, "MAX over ranks: one failure fails the copy"
    assert f.core.cache.stats.failed_write_tokens == 8
    assert f.verify(r, key_tokens) == [True] * 4
    f.core.cache.check_integrity()


def test_a_duplicated_command_is_applied_once():
    f = LocalFabric(small_config())
    f.core.submit(pack_tokens(prompt(1, pages=2)))
    batch = f.core.next_batch()
    assert [type(c).__name__ for c in batch.commands] == ["Compute", "Write"]
    rank = f.ranks[0]
    rank.accept(decode(encode(batch)))
    rank.accept(decode(encode(batch)))  # Ray retried the message
    assert rank.run_pending() == 2, "the compute, then the write"
    report = rank.report()
    assert (report.computes_done, report.writes_done) == (1, 1)


def test_a_restarted_rank_makes_the_coordinator_drop_l1_l2_and_keep_serving():
    config = small_config()
    f = LocalFabric(config)
    a = pack_tokens(prompt(1, pages=3))
    first = f.serve(a)
    f.core.release(first.lease)
    f.ranks[2] = RankWorker(config, 2)  # Ray restarted it: empty pools, new incarnation
    f.step()
    assert f.core.stats.resets == 1 and f.core.rounds.epoch == 2
    assert f.core.cache.tree.walk() == []
    again = f.serve(a)
    assert again.device_hit_tokens == 0 and again.computed_tokens == 12
    assert f.verify(again, a) == [True] * 4
    assert f.core.release(first.lease) is False, "leases die with a reset"
    f.core.cache.check_integrity()


def test_requests_in_flight_during_a_restart_are_retried():
    config = small_config()
    f = LocalFabric(config)
    a = pack_tokens(prompt(1, pages=3))
    rid = f.core.submit(a)
    f.step(run_ranks=False)  # computes sent, not done
    f.ranks[0] = RankWorker(config, 0)
    f.step()
    assert f.core.stats.retried == 1
    for _ in range(5):
        f.step()
    result = f.results[rid]
    assert result.error is None and f.verify(result, a) == [True] * 4


def test_bad_input_is_refused_and_the_fabric_keeps_serving():
    f = LocalFabric(small_config("runtime.namespaces=a,b"))
    for args, match in [
        ((b"",), "non-empty"),
        ((b"\x01\x02\x03",), "non-empty"),
        ((pack_tokens(range(200)), "a"), "larger than L1"),
        ((pack_tokens(range(8)), "c"), "not allowed"),
        ((pack_tokens(range(8)), "a", "high"), "priority"),
    ]:
        with pytest.raises(InvalidInput, match=match):
            f.core.submit(*args)
    f.core.submit(pack_tokens(range(8)), "a", request_id="x")
    with pytest.raises(InvalidInput, match="already in use"):
        f.core.submit(pack_tokens(range(8)), "a", request_id="x")
    assert f.serve(pack_tokens(range(8)), "b").error is None
    while "x" not in f.results:
        f.step()
    with pytest.raises(InvalidInput, match="already in use"):  # its lease is held
        f.core.submit(pack_tokens(range(8)), "a", request_id="x")
    assert f.core.release(f.results.pop("x").lease)
    f.core.submit(pack_tokens(range(8)), "a", request_id="x")


def test_abort_of_waiting_and_running_requests():
    f = LocalFabric(small_config())
    rid = f.core.submit(pack_tokens(prompt(1, pages=2)))
    assert f.core.abort(rid).error == "aborted"
    rid = f.core.submit(pack_tokens(prompt(2, pages=2)))
    f.step(run_ranks=False)
    assert f.core.abort(rid) is None
    f.step()
    assert f.results[rid].error == "aborted"
    assert f.core.cache.device_sizes().protected == 0
    f.core.cache.check_integrity()


def test_a_request_waits_for_a_lease_release_when_l1_is_held():
    f = LocalFabric(small_config())  # L1: 24 pages
    held = f.serve(pack_tokens(prompt(1, pages=20)))
    rid = f.core.submit(pack_tokens(prompt(2, pages=10)))
    for _ in range(3):
        f.step()
    assert rid not in f.results and f.core.idle, "waiting, not failed, and not spinning"
    assert f.core.release(held.lease)
    f.step()
    f.step()
    assert f.results[rid].error is None


def test_a_blocked_request_is_admitted_when_write_throughs_unlock_room():
    f = LocalFabric(small_config())  # L1: 24 pages
    slow = f.ranks[3]
    a = f.core.submit(pack_tokens(prompt(1, pages=20)))
    # Step by hand, the slow rank runs only its computes: the write-through lags.
    wire = encode(f.core.next_batch())
    for rank in f.ranks:
        rank.accept(decode(wire))
        if rank is not slow:
            rank.run_pending()
    slow.run_one(block=False)  # the compute, not the write
    (first,) = f.core.rounds.on_round([r.report() for r in f.ranks])
    assert first.request_id == a and len(f.core.cache.writes.pending) == 1
    f.core.release(first.lease)
    b = f.core.submit(pack_tokens(prompt(2, pages=10)))
    f.step(run_ranks=False)  # blocked: A's pages are locked by its write
    slow.run_pending()
    for _ in range(10):  # step only while the coordinator has something to do
        if f.core.idle:
            break
        f.step()
    assert b in f.results and f.results[b].error is None


def test_consecutive_copies_of_a_step_are_merged_into_one_and_counted_each():
    f = LocalFabric(small_config())
    for seed in (1, 2, 3):
        f.core.submit(pack_tokens(prompt(seed, pages=2)))
    batch = f.core.next_batch()
    kinds = [type(c).__name__ for c in batch.commands]
    assert kinds == ["Compute"] * 3 + ["Write"] * 3
    rank = f.ranks[0]
    rank.accept(batch)
    assert rank.run_pending() == 4, "three computes, then one merged copy"
    assert rank.report().writes_done == 3


def test_a_new_epoch_waits_for_the_copy_in_flight():
    import threading

    from fabric.messages import Batch

    f = LocalFabric(small_config())
    rank = f.ranks[0]
    started, release = threading.Event(), threading.Event()

    class SlowFiller:
        def fill(self, *args):
            started.set()
            release.wait(5)

    rank.filler = SlowFiller()
    f.core.submit(pack_tokens(prompt(1, pages=2)))
    rank.accept(f.core.next_batch())
    worker = threading.Thread(target=rank.run_one, kwargs={"block": False})
    worker.start()
    assert started.wait(5)
    accepted = threading.Event()
    threading.Thread(
        target=lambda: (rank.accept(Batch(rank.ledger.epoch + 1, ())), accepted.set())
    ).start()
    assert not accepted.wait(0.3), "the new epoch waits while the old copy runs"
    release.set()
    assert accepted.wait(5)
    worker.join(5)
    assert rank.report().computes_done == 0, "the old epoch's compute is not counted in the new one"


def test_a_compute_failing_on_a_rank_resets_and_retries_the_request():
    f = LocalFabric(small_config())
    tokens = pack_tokens(prompt(1, pages=3))

    class Broken:
        def fill(self, *args):
            raise RuntimeError("the model crashed")

    healthy = f.ranks[2].filler
    f.ranks[2].filler = Broken()
    rid = f.core.submit(tokens)
    f.step()
    assert f.core.stats.resets == 1 and f.core.stats.retried == 1
    f.ranks[2].filler = healthy
    for _ in range(5):
        f.step()
    result = f.results[rid]
    assert result.error is None and f.verify(result, tokens) == [True] * 4


def test_kv_events_are_drained_each_step_and_kept_for_a_router():
    from fabric.cache.events import BlockStored, Medium

    f = LocalFabric(small_config())
    tokens = pack_tokens(prompt(1, pages=2))
    f.core.release(f.serve(tokens).lease)
    f.settle()
    assert len(f.core.cache.events) == 0, "the cache's own queue is drained every step"
    events = f.core.events.take()
    stored = {e.medium for e in events if isinstance(e, BlockStored)}
    assert stored == {Medium.DEVICE, Medium.HOST}
    assert f.core.events.take() == []


def test_kv_events_name_their_namespace_and_a_consumer_can_take_only_its_own():
    from fabric.cache.events import AllBlocksCleared, BlockRemoved

    f = LocalFabric(small_config())
    for seed in range(6):  # more than L1 holds: some pages are removed from L1 too
        for ns in ("tenant-a", "tenant-b"):
            f.core.release(f.serve(pack_tokens(prompt(seed, pages=3)), namespace=ns).lease)
    f.settle()
    mine = f.core.events.take(namespace="tenant-a")
    assert mine[0] == AllBlocksCleared(""), "a new coordinator's clear concerns every namespace"
    mine = mine[1:]
    assert mine and {e.namespace for e in mine} == {"tenant-a"}
    assert any(isinstance(e, BlockRemoved) for e in mine)
    rest = f.core.events.take()
    assert rest and {e.namespace for e in rest} == {"tenant-b"}
    with pytest.raises(InvalidInput, match="namespace"):
        f.core.events.take(namespace="\udcff")


def test_kv_events_nobody_takes_are_dropped_oldest_first_and_counted(caplog):
    f = LocalFabric(small_config("runtime.max_pending_requests=2"))  # a queue of 32
    assert f.core.events.maxlen == 32
    with caplog.at_level("WARNING", logger="fabric.coordinator.core"):
        for seed in range(40):
            f.core.release(f.serve(pack_tokens(prompt(seed, pages=3))).lease)
        f.settle()
    got = figures(f.core)
    assert got.now.events_queued == 32 and got.counters.events_dropped > 0
    assert sum("nobody takes them" in r.message for r in caplog.records) == 1, "said once"
    assert len(f.core.events.take(limit=100)) == 32
    assert figures(f.core).now.events_queued == 0


def test_a_restarted_rank_applies_no_command_meant_for_its_old_incarnation():
    config = small_config()
    f = LocalFabric(config)
    f.core.submit(pack_tokens(prompt(1, pages=2)))
    batch = f.core.next_batch()
    fresh = RankWorker(config, 0)  # restarted: empty pools, new incarnation
    fresh.accept(batch)
    assert fresh.run_pending() == 0, "its pages are gone: it must not compute or copy into them"
    f.ranks[0].accept(batch)
    assert f.ranks[0].run_pending() == 2


def test_ranks_forget_failures_once_the_coordinator_has_committed_them():
    f = LocalFabric(small_config())
    f.ranks[1].faults.fail_writes = True
    f.core.release(f.serve(pack_tokens(prompt(1, pages=2))).lease)
    assert f.ranks[1].report().failed, "the failed write is reported"
    f.ranks[1].faults.fail_writes = False
    f.settle()
    f.step()
    assert f.ranks[1].report().failed == (), "committed, so forgotten: reports stay small"
    assert f.core.cache.stats.failed_write_tokens == 8


@pytest.mark.parametrize("l3", [False, True])
def test_the_coordinator_hashes_only_the_pages_a_request_adds(monkeypatch, tmp_path, l3):
    # Page hashes (L3 keys, event ids, the chain a compute continues) are kept on
    # the tree and the key: a request that extends a cached prompt by 4 pages
    # costs the coordinator 4 SHA-256s, whatever the prompt's length — and none
    # with L3, whose hit query the storage service answers with the pages' hashes.
    hashed = []
    real = fabric.cache.keys.chain_hashes

    def counting(prev, data, page_bytes):
        hashed.append(len(data) // page_bytes)
        return real(prev, data, page_bytes)

    monkeypatch.setattr(fabric.cache.keys, "chain_hashes", counting)
    monkeypatch.setattr(fabric.cache.radix, "chain_hashes", counting)
    extra = [*storage_options(tmp_path), "prefetch.threshold_tokens=0"] if l3 else []
    f = LocalFabric(small_config("cache.device_tokens=192", "cache.host_tokens=384", *extra))
    tokens = prompt(1, pages=20)
    for _ in range(2):
        r = f.serve(pack_tokens(tokens))
        assert f.core.release(r.lease)
        f.settle()
    hashed.clear()
    r = f.serve(pack_tokens(tokens + prompt(2, pages=4)))
    f.settle()
    assert r.device_hit_tokens == 20 * 4 and f.verify(r, pack_tokens(tokens + prompt(2, pages=4)))
    assert sum(hashed) == (0 if l3 else 4), f"hashed {hashed} pages"


@pytest.mark.parametrize("kinds", ["[full, sliding]", "[full, mamba]"])
def test_a_hybrid_model_serves_verified_kv_and_hits_only_where_components_allow(kinds, tmp_path):
    f = LocalFabric(
        small_config(
            f"model.layer_kinds={kinds}",
            "model.sliding_window=6",
            "cache.mamba_states=4",
            "cache.sliding_tokens=16",
            *storage_options(tmp_path),
        )
    )
    prompts = [pack_tokens(prompt(seed, pages=6, shared=3)) for seed in range(6)]
    hits = 0
    for p in prompts:
        for _ in range(2):  # the second time hits, where nothing evicted it meanwhile
            r = f.serve(p)
            assert r.error is None
            assert f.verify(r, p) == [True] * 4
            hits += r.device_hit_tokens
            assert f.core.release(r.lease)
            f.core.cache.check_integrity()
    assert hits > 0
    # The shared three pages end in a split node that got no state or window of
    # its own there (matches stopped short of it), and the small pools evicted
    # components apart from the full pages.
    parts = f.core.cache.parts
    assert parts.stats.truncated_matches > 0
    assert parts.stats.mamba_evicted_states + parts.stats.sliding_evicted_pages > 0
    # Backups to L3 carry the components (``tests/l3/test_hybrid_l3.py``): none fails.
    f.settle()
    l3 = f.core.cache.l3
    assert l3.stats.backed_up_tokens > 0 and l3.stats.failed_backups == 0


def test_a_hybrid_lease_names_its_components_and_every_rank_checks_them():
    f = LocalFabric(
        small_config(
            "model.layers=4",
            "model.layer_kinds=[full, sliding, full, mamba]",
            "model.sliding_window=6",
            "model.mamba_state_bytes=64",
        )
    )
    p = pack_tokens(prompt(1, pages=5))
    first = f.serve(p)
    assert f.core.release(first.lease)
    again = f.serve(p)
    lease = again.lease
    assert again.device_hit_tokens == 20
    # The window before the end (5 tokens: pages 3 and 4) and the state at the end.
    assert [k for k, _ in lease.sliding] == [3, 4] and [e for e, _ in lease.mamba] == [5]
    assert f.verify(again, p) == [True] * 4
    # Stage 0 holds the sliding layer, stage 1 the mamba layer: a wrong value in
    # either is caught by the ranks that hold it.
    (_, sliding_page), (_, slot) = lease.sliding[0], lease.mamba[0]
    f.ranks[0].parts.sliding.pages[:, sliding_page] += 1
    f.ranks[3].parts.states.buffer[slot] += 1
    assert f.verify(again, p) == [False, True, True, False]


def test_submit_many_serves_every_prompt_and_lets_the_leases_it_names_go_first():
    f = LocalFabric(small_config())
    first = [pack_tokens(prompt(seed, pages=2)) for seed in range(3)]
    done = [f._wait(rid, 100) for rid in f.core.submit_many(first)]
    assert all(r.error is None for r in done) and len(f.core.leases) == 3
    for r, tokens in zip(done, first, strict=True):
        assert f.verify(r, tokens) == [True] * 4
    second = [pack_tokens(prompt(seed, pages=2)) for seed in range(3, 5)]
    rids = f.core.submit_many(second, request_ids=["a", "b"], release=[d.lease for d in done])
    assert rids == ["a", "b"] and not f.core.leases, "the three leases went first"
    again = [f._wait(rid, 100) for rid in rids]
    assert [r.request_id for r in again] == ["a", "b"] and len(f.core.leases) == 2
    # A lease that expired or was released already is no error: nothing to let go.
    assert f.core.submit_many([first[0]], release=[done[0].lease])
    f.core.cache.check_integrity()


def test_submit_many_is_all_or_nothing_on_bad_input():
    f = LocalFabric(small_config())
    r = f.serve(pack_tokens(prompt(1, pages=2)))
    good = pack_tokens(prompt(2, pages=2))
    forged = dataclasses.replace(r.lease, tokens=r.lease.tokens + 4)  # the same token
    for kwargs, match in [
        ({"prompts": [good, b"\x01"]}, "non-empty"),
        ({"prompts": []}, "non-empty list"),
        ({"prompts": [good, good], "request_ids": ["x", "x"]}, "given twice"),
        ({"prompts": [good], "request_ids": ["x", "y"]}, "one per prompt"),
        ({"prompts": [good], "release": [r.lease, "not a lease"]}, "not str"),
        ({"prompts": [good], "release": [r.lease, r.lease]}, "same lease twice"),
        ({"prompts": [good], "release": r.lease}, "list of Leases"),
        ({"prompts": [good], "release": [forged]}, "does not match"),
    ]:
        with pytest.raises(InvalidInput, match=match):
            f.core.submit_many(**kwargs)
        assert not f.core.scheduler.waiting and len(f.core.leases) == 1, kwargs
    assert f.core.release(r.lease)


def test_a_step_with_nothing_to_send_or_wait_for_needs_no_round():
    """``round_needed``: the actor skips a round after a release that admitted
    nothing, instead of sending the ranks an empty batch."""
    f = LocalFabric(small_config())
    r = f.serve(pack_tokens(prompt(1, pages=2)))
    f.settle()
    assert f.core.release(r.lease)
    assert not f.core.round_needed(f.core.next_batch(), f.core.take_queries())
    f.core.submit(pack_tokens(prompt(2, pages=2)))
    assert f.core.round_needed(f.core.next_batch(), f.core.take_queries())


def test_a_submit_many_call_larger_than_l1_fails_a_request_rather_than_wait_for_ever():
    """Its driver gets no result (so releases no lease) until every request of
    the call ends: a request with no room beside its own call's leases fails,
    naming why, and the others are served."""
    f = LocalFabric(small_config("storage.backend=none"))
    room = f.config.cache.device_tokens
    prompts = [pack_tokens(prompt(seed, pages=8)) for seed in range(room // 32 + 2)]
    rids = f.core.submit_many(prompts)
    for _ in range(200):
        f.step()
        if all(rid in f.results for rid in rids):
            break
    results = [f.results.pop(rid) for rid in rids]
    errors = [r.error for r in results if r.error is not None]
    assert errors and all("submit fewer prompts at once" in e for e in errors), errors
    served = [r for r in results if r.error is None]
    assert served
    assert all(f.verify(r, prompts[rids.index(r.request_id)]) == [True] * 4 for r in served)
    for r in served:
        assert f.core.release(r.lease)
    f.core.cache.check_integrity()
