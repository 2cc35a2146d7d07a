"""The fabric on a real local Ray: one session and one fabric for the module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from fabric.errors import InvalidInput  # noqa: E402
from tests.helpers import (  # noqa: E402
    prompt,
    small_config,
    wait_for,
    where_now,
)
from tests.ray_session import shared_ray  # noqa: E402

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py

NAME = "kvfabric-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def fabric():
    shared_ray()
    f = launch(
        small_config(
            f"runtime.name={NAME}",
            "runtime.ray_namespace=kvfabric-tests",
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            f"runtime.metrics_port={METRICS_PORT}",
            "cache.tenant_share=1",  # one tenant: it may hold the whole pin and session budgets
        )
    )
    try:
        yield f
    finally:
        f.shutdown()


def test_tp2_pp2_serves_verified_pages_through_evictions_and_load_backs(fabric):
    prompts = [prompt(seed, pages=6, shared=3) for seed in range(8)]
    tiers = {"device": 0, "host": 0}
    for _ in range(2):
        for p in prompts:
            r = fabric.submit(p, timeout=60)
            assert r.error is None
            assert fabric.verify(r, p) == [True] * 4
            tiers["device"] += r.device_hit_tokens
            tiers["host"] += r.host_hit_tokens
            assert fabric.release(r.lease)
    assert tiers["device"] > 0 and tiers["host"] > 0
    fabric.check_integrity()


def test_releases_ride_on_submits_and_submit_many_serves_a_batch(fabric):
    prompts = [prompt(seed, pages=2) for seed in range(500, 504)]
    held = fabric.submit_many(prompts[:2], timeout=60)
    assert [fabric.verify(r, p) for r, p in zip(held, prompts[:2], strict=True)] == [[True] * 4] * 2
    leases = fabric.stats()["now"]["leases"]
    r = fabric.submit(prompts[2], timeout=60, release=[h.lease for h in held])
    assert r.error is None and fabric.stats()["now"]["leases"] == leases - 1
    skipped = fabric.stats()["counters"]["rounds_skipped"]
    many = fabric.submit_many(prompts[3:] + prompts[:1], timeout=60, release=r.lease)
    assert [x.error for x in many] == [None, None] and fabric.verify(many[1], prompts[0])[0]
    with pytest.raises(InvalidInput, match="same lease twice"):
        fabric.submit_many(prompts[:1], release=[many[0].lease, many[0].lease])
    assert fabric.stats()["now"]["leases"] == leases  # nothing released, nothing queued
    for x in many:
        assert fabric.release(x.lease)
    assert wait_for(lambda: fabric.stats()["counters"]["rounds_skipped"] > skipped, 10), (
        "a release that admits nothing sends no round"
    )


def test_the_coordinator_actor_publishes_kv_events_on_zmq(fabric):
    import msgspec
    import zmq

    endpoint = fabric.stats()["kv_events"]["endpoint"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        stored, rank = [], None
        for seed in range(770, 790):  # until the subscription has reached the publisher
            p = prompt(seed, pages=3)
            r = fabric.submit(p, timeout=60)
            assert r.error is None and fabric.release(r.lease)
            while sub.poll(1000):
                _, _seq, payload = sub.recv_multipart()
                _ts, events, rank = msgspec.msgpack.decode(payload)
                stored += [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
            if stored:
                break
        assert stored and stored[-1]["token_ids"] == p and rank == 0
    finally:
        sub.close(linger=0)
        ctx.term()


def test_kvfabric_events_reads_a_publishing_fabric_s_replay_buffer(fabric):
    import json

    p = prompt(91, pages=2)
    r = fabric.submit(p, timeout=60)
    assert r.error is None and fabric.release(r.lease)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fabric.cli",
            "events",
            "--address",
            ray.get_runtime_context().gcs_address,
            "--name",
            NAME,
            "--ray-namespace",
            "kvfabric-tests",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    *lines, last = done.stdout.strip().splitlines()
    events = [json.loads(line) for line in lines]
    assert json.loads(last)["events"] == len(events)
    stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert any(e["token_ids"] == p for e in stored), "the replay buffer holds every batch sent"


def test_the_prometheus_endpoint_serves_the_fabric_s_series(fabric):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}  # not serving yet
        return {
            s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    r = fabric.submit(prompt(81, pages=2), timeout=60)
    assert r.error is None and fabric.release(r.lease)
    assert wait_for(
        lambda: scrape().get("kvfabric_requests_total[('outcome', 'finished')]", 0) >= 1,
        timeout=15,
    )
    samples = scrape()
    assert samples["kvfabric_rank_up[('rank', 'pp1-cp0-tp1')]"] == 1
    assert "kvfabric_consensus_round_duration_seconds_count[]" in samples


def test_a_two_turn_conversation_decodes_keeps_its_session_and_pins(fabric):
    turn1 = [*prompt(40, pages=3), 1, 2]
    r = fabric.submit(turn1, timeout=60)
    answer = [500, 501, 502, 503, 504]
    lease = r.lease
    for t in answer:
        step = fabric.append(lease, [t], timeout=60)
        assert step.error is None and step.request_id == r.request_id
        lease = step.lease
    assert fabric.verify(step, turn1 + answer) == [True] * 4
    assert fabric.release(lease, session="chat")
    turn2 = [*turn1, *answer, 7, 7, 7]
    r2 = fabric.submit(turn2, timeout=60)
    assert r2.device_hit_tokens == 16, "the kept turn and the answer's whole page"
    assert fabric.verify(r2, turn2) == [True] * 4
    assert fabric.release(r2.lease, session="chat")
    assert fabric.end_session("chat")
    pinned = fabric.pin(turn2, ttl_s=30)
    assert pinned.pinned_tokens == 20, "every whole page of the second turn"
    assert fabric.unpin(turn2) == 20
    with pytest.raises(InvalidInput, match="no longer held"):
        fabric.append(r.lease, [1])
    fabric.check_integrity()


def test_write_through_waits_for_the_slowest_rank(fabric):
    slow = fabric._deployment.ranks[3]
    ray.get(slow.set_faults.remote(delay_s=1.5))
    try:
        before = fabric.stats()["cache"]["written_tokens"]
        r = fabric.submit(prompt(50, pages=2), timeout=60)
        stats = fabric.stats()
        assert stats["now"]["inflight"]["device_to_host"] >= 1, (
            "3 of 4 ranks finished; MIN says not yet"
        )
        assert stats["cache"]["written_tokens"] == before
        assert wait_for(lambda: fabric.stats()["cache"]["written_tokens"] >= before + 8)
        fabric.release(r.lease)
    finally:
        ray.get(slow.set_faults.remote())
    fabric.check_integrity()


def test_a_write_failing_on_one_rank_fails_for_all(fabric):
    rank = fabric._deployment.ranks[0]
    ray.get(rank.set_faults.remote(fail_writes=True))
    try:
        before = fabric.stats()["cache"]["failed_write_tokens"]
        r = fabric.submit(prompt(60, pages=2), timeout=60)
        assert wait_for(lambda: fabric.stats()["cache"]["failed_write_tokens"] >= before + 8)
        assert fabric.verify(r, prompt(60, pages=2)) == [True] * 4
        fabric.release(r.lease)
    finally:
        ray.get(rank.set_faults.remote())
    fabric.check_integrity()


def test_bad_input_gets_clear_errors_and_the_fabric_keeps_serving(fabric):
    with pytest.raises(InvalidInput, match="token -1 at position 1"):
        fabric.submit([1, -1, 2])
    with pytest.raises(InvalidInput, match="token 'x'"):
        fabric.submit([1, "x"])
    with pytest.raises(InvalidInput, match="larger than L1"):
        fabric.submit(list(range(500)))
    with pytest.raises(InvalidInput, match="namespace"):
        fabric.submit([1, 2, 3, 4], namespace="")
    with pytest.raises(InvalidInput, match="non-empty"):
        fabric.submit([])
    with pytest.raises(InvalidInput, match="UTF-8"):
        fabric.submit([1, 2, 3, 4], namespace="tenant-\udcff")
    with pytest.raises(InvalidInput, match="token True"):
        fabric.submit([1, True, 3, 4])
    with pytest.raises(InvalidInput, match="not str"):
        fabric.release("req-1")
    with pytest.raises(InvalidInput, match="request_id"):
        fabric.abort(["req-1"])
    with pytest.raises(InvalidInput, match="timeout_s='soon'"):
        fabric.settle("soon")
    with pytest.raises(InvalidInput, match="limit"):
        fabric.take_events(-1)
    r = fabric.submit(prompt(70, pages=2), timeout=60)
    assert r.error is None and fabric.release(r.lease)


def test_two_driver_processes_submit_at_once(fabric):
    address = ray.get_runtime_context().gcs_address
    script = textwrap.dedent(
        f"""
        import sys
        from fabric.client import connect
        f = connect({NAME!r}, address={address!r}, ray_namespace="kvfabric-tests")
        seed = int(sys.argv[1])
        for i in range(6):
            tokens = [7000 + t for t in range(12)] + [seed * 1000 + i * 100 + t for t in range(8)]
            r = f.submit(tokens, timeout=120)
            assert r.error is None, r.error
            assert f.verify(r, tokens) == [True] * 4
            f.release(r.lease)
        print("driver ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for seed in (101, 102)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        assert "driver ok" in out
    fabric.check_integrity()


def test_a_rank_restarted_by_ray_makes_the_coordinator_reset_and_keep_serving(fabric):
    p = prompt(80, pages=3)
    first = fabric.submit(p, timeout=60)
    fabric.release(first.lease)
    resets = fabric.stats()["counters"]["resets"]
    old = ray.get(fabric._deployment.ranks[1].info.remote())
    ray.kill(fabric._deployment.ranks[1], no_restart=False)
    assert wait_for(lambda: _incarnation(fabric) not in (None, old["incarnation"]), timeout=120)
    again = fabric.submit(p, timeout=120)
    assert fabric.stats()["counters"]["resets"] > resets
    assert again.error is None and again.device_hit_tokens == 0, "L1/L2 were dropped"
    assert fabric.verify(again, p) == [True] * 4
    fabric.release(again.lease)
    fabric.check_integrity()


def _incarnation(fabric):
    try:
        return ray.get(fabric._deployment.ranks[1].info.remote(), timeout=5)["incarnation"]
    except Exception:
        return None


def test_a_malformed_message_is_refused_by_a_rank_that_keeps_serving(fabric):
    rank = fabric._deployment.ranks[0]
    with pytest.raises(ray.exceptions.RayTaskError, match="does not decode"):
        ray.get(rank.step.remote(b"\xc1garbage"))
    r = fabric.submit(prompt(90, pages=2), timeout=60)
    assert fabric.verify(r, prompt(90, pages=2)) == [True] * 4
    fabric.release(r.lease)


def test_a_restarted_coordinator_adopts_what_the_ranks_hold_in_l2_and_serves_it(fabric):
    p = prompt(95, pages=2)
    fabric.release(fabric.submit(p, timeout=60).lease)
    assert fabric.settle(30)  # written through to L2 on every rank
    old_pid = ray.get(fabric.coordinator.where.remote())[0]
    ray.kill(fabric.coordinator, no_restart=False)
    # ray.kill returns before the process dies (the old one may still answer); while
    # Ray restarts it, calls raise ActorUnavailableError: a driver retries.
    assert wait_for(lambda: _coordinator_pid(fabric) not in (None, old_pid), timeout=120)
    # Requests racing to a restarted coordinator start it once, all served.
    refs = [fabric.submit_async(p) for _ in range(3)]
    results = [fabric.result(ref, timeout=60) for ref in refs]
    stats = fabric.stats()
    assert stats["epoch"] > 1, "a newer epoch than any rank has seen"
    assert stats["counters"]["adopted_tokens"] > 0, "the L2 pages every rank still held"
    assert [r.error for r in results] == [None] * 3
    assert all(r.device_hit_tokens + r.host_hit_tokens == 8 for r in results)
    assert any(r.host_hit_tokens == 8 for r in results), "served from the adopted L2"
    for r in results:
        assert fabric.verify(r, p) == [True] * 4
        fabric.release(r.lease)
    # The handle's socket went with the old process: it links to the new one.
    old_link = fabric._calls
    r = fabric.submit(p, timeout=60)
    assert r.error is None and fabric._calls is not old_link and fabric._calls.lost is False
    fabric.release(r.lease)
    fabric.check_integrity()


def _coordinator_pid(fabric):
    here = where_now(fabric.coordinator)
    return None if here is None else here[0]


def test_a_rank_answering_with_garbage_is_counted_and_serving_resumes(fabric):
    rank = fabric._deployment.ranks[2]
    nested = b"\x91" * 100_000 + b"\x00"
    before = fabric.stats()["counters"]["bad_messages"]
    ray.get(rank.set_faults.remote(bad_report=nested))
    ref = fabric.submit_async(prompt(110, pages=2))
    assert wait_for(lambda: fabric.stats()["counters"]["bad_messages"] > before, 30)
    ray.get(rank.set_faults.remote())
    r = fabric.result(ref, timeout=60)
    assert r.error is None and fabric.verify(r, prompt(110, pages=2)) == [True] * 4
    fabric.release(r.lease)
    fabric.check_integrity()


def test_a_client_timeout_aborts_the_request_and_holds_nothing(fabric):
    slow = fabric._deployment.ranks[0]
    ray.get(slow.set_faults.remote(delay_s=3.0))
    try:
        # A prompt that needs a load-back: its copy is slow, so the request is still
        # running when the client gives up.
        with pytest.raises(TimeoutError, match="aborted"):
            fabric.submit(prompt(120, pages=2), timeout=0.3)
    finally:
        ray.get(slow.set_faults.remote())
    assert wait_for(lambda: fabric.stats()["now"]["running"] == 0, 30)
    assert fabric.stats()["now"]["leases"] == 0
    fabric.check_integrity()


def test_the_leases_of_a_driver_that_exits_are_reclaimed(fabric):
    address = ray.get_runtime_context().gcs_address
    script = textwrap.dedent(
        f"""
        from fabric.client import connect
        f = connect({NAME!r}, address={address!r}, ray_namespace="kvfabric-tests")
        r = f.submit([9000 + t for t in range(8)], timeout=120)
        assert r.lease is not None
        print("exiting with a lease held")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert wait_for(lambda: fabric.stats()["counters"]["leases_reclaimed"] >= 1, 60)
    assert fabric.stats()["now"]["leases"] == 0
    fabric.check_integrity()


def test_an_engine_connectors_link_finds_pages_whole_once_every_rank_reported_them(fabric):
    """What ``KvFabricConnector``'s scheduler side does, through its own link to
    the coordinator actor: reports by rank, lookups answered with the MIN over
    ranks, a forgotten page, and a bad call taken as the fabric being down."""
    from fabric.engines.fabric_link import FabricLink

    link = FabricLink(NAME, "auto", "kvfabric-tests", timeout_s=30, retry_s=0.5)
    link.start()
    try:
        _link_sees_whole_pages(fabric, link)
    finally:
        link.close()


def _link_sees_whole_pages(fabric, link) -> None:
    import hashlib

    from fabric.cache.engine_input import StoredRun

    tag = "00112233445566aa"
    assert link.up and link.calls is not None, "calls go over the coordinator's socket"
    chain = [hashlib.sha256(b"engine page %d" % i).digest() for i in range(4)]
    link.report(tag, 2, {0: [StoredRun("engine-test", None, tuple(chain))]})
    assert _lookup(link, tag, [chain]) == [0]  # one rank of two
    link.report(tag, 2, {1: [StoredRun("engine-test", None, tuple(chain[:3]))]})
    other = [hashlib.sha256(b"another prefix").digest()]
    assert _lookup(link, tag, [chain, chain[:2], other]) == [3, 2, 0]
    # Leased lookups: held in the coordinator until released, with a later call or
    # on their own.
    assert _lookup(link, tag, [chain], ["e1/r1"], 30.0) == [3]
    assert fabric.stats()["engine_pages"]["leased"] == 1
    assert _lookup(link, tag, [other], ["e1/r2"], 30.0, ["e1/r1"]) == [0]
    assert fabric.stats()["engine_pages"]["leased"] == 0
    assert _lookup(link, tag, [chain], ["e1/r3"], 30.0) == [3]
    link.release(tag, 2, ["e1/r3"])
    assert wait_for(lambda: fabric.stats()["engine_pages"]["leased"] == 0, timeout=10)
    # A session holds a conversation's pages (sent without waiting for its reply).
    link.hold(tag, 2, chain[:3], "conv-" + tag, "session")
    held = lambda: fabric.stats()["engine_pages"]["holds"]["session"]["held"]  # noqa: E731
    assert wait_for(lambda: held() >= 1, timeout=10)
    link.forget(tag, 2, [chain[1]])
    assert _lookup(link, tag, [chain]) == [1]
    pages = fabric.stats()["engine_pages"]
    assert pages["whole_pages"] >= 3 and pages["forgotten_pages"] >= 1
    # A call the coordinator refuses: the link serves without it, then tries again.
    assert _lookup(link, "not-a-tag", [chain]) is None
    assert not link.up
    assert wait_for(lambda: link.up, timeout=10)
    assert _lookup(link, tag, [chain]) == [1]
    calls, link.calls = link.calls, None  # a pin, over Ray calls
    link.hold(tag, 2, chain[:1], "pin/" + tag, "pin", 60.0)
    pinned = lambda: fabric.stats()["engine_pages"]["holds"]["pin"]["held"]  # noqa: E731
    assert wait_for(lambda: pinned() >= 1, timeout=10)
    link._check_reports(in_flight=0)
    link.calls = calls


def _lookup(link, tag, chains, leases=None, lease_s=0.0, release=()):
    return link.lookup(tag, 2, chains, leases, lease_s, list(release), time.monotonic() + 30)


@ray.remote
class _SlowReports:
    """A coordinator stand-in whose reports land late, as a busy one's may: a
    lookup sent after a report must still see it."""

    def __init__(self) -> None:
        self.reported = 0

    async def engine_report(self, tag, world, reports, place, place_bytes, names=None):
        import asyncio

        await asyncio.sleep(0.3)
        self.reported += 1
        return 0, []

    async def engine_lookup(self, tag, world, chains, leases, lease_s, release, place=""):
        return [self.reported] * len(chains), []


def test_an_engine_links_lookup_sees_every_report_it_sent_before(fabric):
    from fabric.cache.engine_input import StoredRun
    from fabric.engines.fabric_link import FabricLink

    link = FabricLink(NAME, "auto", "kvfabric-tests", timeout_s=30, retry_s=0.5)
    link.start()
    assert link.up
    link.calls.close()
    link.calls = None  # as Ray calls (a coordinator whose socket is not reachable)
    slow = link.coordinator = _SlowReports.remote()
    for _ in range(3):
        link.report("00112233445566aa", 1, {0: [StoredRun("t", None, (b"\0" * 32,))]})
    deadline = time.monotonic() + 30
    assert link.lookup("00112233445566aa", 1, [[b"\0" * 32]], None, 0.0, [], deadline) == [3]
    ray.kill(slow)  # nothing of this test's is left in the shared Ray
