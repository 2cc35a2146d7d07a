"""The coordinator never stops serving, never exceeds the message limit and never
leaks a lease: each case found by trying to break it, in one process."""

from __future__ import annotations

import pytest

from fabric.cache.keys import pack_tokens
from fabric.coordinator.requests import Lease
from fabric.driver import local
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError, InvalidInput
from tests.helpers import prompt, small_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drive(f: LocalFabric, rids: list[str], steps: int = 200) -> dict:
    for _ in range(steps):
        f.step()
        if all(rid in f.results for rid in rids):
            return {rid: f.results.pop(rid) for rid in rids}
    raise AssertionError(f"not finished: {[r for r in rids if r not in f.results]}")


def _sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = local.encode

    def recording(message):
        data = real(message)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(local, "encode", recording)
    return sizes


def test_a_long_prompt_under_a_small_message_limit_is_served_in_chunks(monkeypatch):
    f = LocalFabric(
        small_config(
            "runtime.max_message_bytes=4096",
            "cache.device_tokens=2048",
            "cache.host_tokens=4096",
        )
    )
    sizes = _sizes(monkeypatch)
    tokens = pack_tokens(range(1, 1201))
    r = f.serve(tokens)
    assert r.error is None and r.computed_tokens == 1200
    assert f.verify(r, tokens) == [True] * 4
    assert f.core.stats.resets == 0
    assert max(sizes) <= 4096 and len(sizes) > 1
    f.core.release(r.lease)
    again = f.serve(tokens)
    assert again.device_hit_tokens == 1200 and f.verify(again, tokens) == [True] * 4
    f.core.cache.check_integrity()


def test_a_burst_sharing_a_long_prefix_never_exceeds_the_limit(monkeypatch):
    f = LocalFabric(
        small_config(
            "runtime.max_message_bytes=8192",
            "cache.device_tokens=4096",
            "cache.host_tokens=8192",
        )
    )
    sizes = _sizes(monkeypatch)
    shared = list(range(1, 801))
    prompts = {
        f.core.submit(pack_tokens(shared + [5000 + i] * 40)): shared + [5000 + i] * 40
        for i in range(12)
    }
    results = _drive(f, list(prompts))
    for rid, result in results.items():
        assert result.error is None and f.verify(result, pack_tokens(prompts[rid])) == [True] * 4
    assert max(sizes) <= 8192
    assert f.core.stats.resets == 0
    f.core.cache.check_integrity()


def test_a_message_limit_too_small_for_one_page_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"runtime\.max_message_bytes=4096"):
        LocalFabric(
            small_config(
                "runtime.max_message_bytes=4096",
                "cache.page_size=1024",
                "cache.device_tokens=4096",
                "cache.host_tokens=4096",
                "topology.cp=1",
            )
        )


def test_an_error_while_admitting_fails_that_request_only_and_serving_goes_on(monkeypatch):
    f = LocalFabric(small_config())
    cache = f.core.cache
    real = cache.placement.match_prefix

    def poisoned(key, held=None):
        if key.namespace == "poison":
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "injected")
        return real(key, held)

    monkeypatch.setattr(cache.placement, "match_prefix", poisoned)
    good = [pack_tokens(prompt(s, pages=3)) for s in (1, 2)]
    rids = [f.core.submit(good[0]), f.core.submit(good[1], "poison"), f.core.submit(good[1])]
    results = _drive(f, rids)
    assert "internal error: UnicodeEncodeError" in results[rids[1]].error
    for rid, tokens in ((rids[0], good[0]), (rids[2], good[1])):
        assert results[rid].error is None and f.verify(results[rid], tokens) == [True] * 4
    assert f.core.stats.step_errors == 1
    f.core.cache.check_integrity()
    later = f.serve(pack_tokens(prompt(3, pages=2)))
    assert later.error is None


def test_a_round_that_cannot_be_reduced_is_recovered_from():
    f = LocalFabric(small_config())
    rid = f.core.submit(pack_tokens(prompt(1, pages=2)))
    f.core.next_batch()
    duplicate = [f.ranks[0].report()] * 4  # four reports, all claiming rank 0
    assert f.core.rounds.on_round(duplicate) == []
    assert f.core.stats.step_errors == 1
    result = _drive(f, [rid])[rid]
    assert result.error is None


def test_retries_are_bounded_and_the_error_names_the_reason():
    f = LocalFabric(small_config("runtime.max_request_retries=2"))
    f.ranks[2].faults.fail_computes = True
    rid = f.core.submit(pack_tokens(prompt(1, pages=2)))
    result = _drive(f, [rid])[rid]
    assert result.error == "gave up after 2 retries: a compute failed on a rank"
    assert f.core.stats.gave_up == 1 and f.core.stats.resets == 3
    f.ranks[2].faults.fail_computes = False
    assert f.serve(pack_tokens(prompt(2, pages=2))).error is None


def test_an_absent_rank_holds_requests_then_fails_them_naming_the_rank():
    clock = Clock()
    f = LocalFabric(small_config("runtime.rank_absent_timeout_s=10"), clock=clock)
    core = f.core
    rid = core.submit(pack_tokens(prompt(1, pages=2)))
    core.next_batch()
    assert core.rounds.on_missing({1: "ActorDiedError: gone"}) == []
    assert core.stats.resets == 1 and core.rounds.absent == {1: 100.0}
    for _ in range(3):  # the rank stays away: no new reset, nothing admitted
        assert core.next_batch().commands == ()
        assert core.rounds.on_missing({1: "ActorDiedError: gone"}) == []
    assert core.stats.resets == 1
    clock.now += 11
    out = core.rounds.on_missing({1: "ActorDiedError: gone"})
    assert [r.request_id for r in out] == [rid]
    assert out[0].error.startswith("rank pp0-cp0-tp1 (index 1) has not answered for 11.0 s")
    # Back again: the next round clears the absence and requests are served.
    assert f.serve(pack_tokens(prompt(2, pages=2))).error is None


def test_leases_are_unguessable_and_only_the_lease_itself_releases():
    f = LocalFabric(small_config())
    a = f.serve(pack_tokens(prompt(1, pages=2)))
    b = f.serve(pack_tokens(prompt(2, pages=2)))
    assert len(a.lease.token) == 32 and a.lease.token != b.lease.token
    with pytest.raises(InvalidInput, match="not str"):
        f.core.release(a.request_id)
    forged = Lease(**{**vars(a.lease), "token": "0" * 32})
    assert f.core.release(forged) is False
    stolen = Lease(**{**vars(a.lease), "device_pages": b.lease.device_pages})
    with pytest.raises(InvalidInput, match="does not match"):
        f.core.release(stolen)
    assert len(f.core.leases) == 2
    assert f.core.release(a.lease) is True and f.core.release(a.lease) is False
    assert f.core.release(b.lease) is True
    f.core.cache.check_integrity()


def test_leases_expire_unless_renewed_and_expired_pages_are_evictable_again():
    clock = Clock()
    f = LocalFabric(small_config("runtime.lease_ttl_s=30"), clock=clock)
    kept = f.serve(pack_tokens(prompt(1, pages=2)))
    lost = f.serve(pack_tokens(prompt(2, pages=2)))
    protected = f.core.cache.device_sizes().protected
    clock.now += 20
    assert f.core.renew(kept.lease) is True
    clock.now += 15
    f.step()
    assert f.core.stats.leases_expired == 1
    assert f.core.release(lost.lease) is False
    assert f.core.cache.device_sizes().protected < protected
    assert f.verify(kept, pack_tokens(prompt(1, pages=2))) == [True] * 4
    clock.now += 31
    f.step()
    assert len(f.core.leases) == 0 and f.core.stats.leases_expired == 2
    f.core.cache.check_integrity()


def test_a_drivers_leases_and_requests_are_reclaimed_when_it_exits():
    f = LocalFabric(small_config())
    tokens = pack_tokens(prompt(1, pages=2))
    rid = f.core.submit(tokens, owner="01000000")
    held = _drive(f, [rid])[rid]
    other = f.serve(pack_tokens(prompt(3, pages=2)))
    waiting = f.core.submit(pack_tokens(prompt(2, pages=2)), owner="01000000")
    assert f.core.owners() == {"01000000"}
    out = f.core.reclaim("01000000")
    assert [r.request_id for r in out] == [waiting] and out[0].error == "aborted"
    assert f.core.release(held.lease) is False and f.core.stats.leases_reclaimed == 1
    assert f.core.release(other.lease) is True
    f.core.cache.check_integrity()
