"""A rank SIGKILLed on Ray comes back on its node with its L2 (kept in /dev/shm):
with L3 off, the next pass over the same prompts hits at least 95% of what it
hit before, every lease verified; shutting the fabric down removes the files."""

from __future__ import annotations

import os
import signal

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from fabric.rank.shared_l2 import shm_dir  # noqa: E402
from tests.helpers import prompt, small_config, wait_for, where_now  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

NS = "kvfabric-keeps-l2"

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(shm_dir() is None, reason="no /dev/shm on this machine"),
]
SHARES_RAY = True  # tests/ray_session.py


@pytest.fixture(scope="module")
def fabric():
    shared_ray()
    f = launch(
        small_config(
            "runtime.name=keeps-l2",
            f"runtime.ray_namespace={NS}",
            "runtime.rank_timeout_s=2",
            "cache.host_tokens=384",
        )
    )
    try:
        yield f
    finally:
        f.shutdown()


def a_pass(fabric, prompts) -> int:
    hit = 0
    for tokens in prompts:
        r = fabric.submit(tokens, timeout=60)
        assert r.error is None, r.error
        assert fabric.verify(r, tokens) == [True] * 4
        hit += r.device_hit_tokens + r.host_hit_tokens
        fabric.release(r.lease)
    return hit


def files() -> list[str]:
    return sorted(p.name for p in shm_dir().glob("kvfabric-kvfabric-keeps-l2-keeps-l2-*.l2"))


def test_a_sigkilled_rank_comes_back_with_its_l2(fabric):
    assert fabric.config.storage.backend == "none"
    prompts = [prompt(seed, pages=3, shared=1) for seed in range(10)]
    a_pass(fabric, prompts)
    assert fabric.settle(30)
    before = a_pass(fabric, prompts)
    assert before > 0 and len(files()) == 4, files()
    rank = fabric._deployment.ranks[2]
    pid, _ = ray.get(rank.where.remote(), timeout=10)
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:  # Ray starts it again (unavailable meanwhile)
        here = where_now(rank)
        return here is not None and here[0] != pid

    assert wait_for(restarted, 90)
    # The coordinator sees the new incarnation at its next round (a request of
    # another prompt): it resets, then adopts what every rank still names.
    probe = [9_000 + t for t in range(8)]
    r = fabric.submit(probe, timeout=90)
    assert r.error is None, r.error
    fabric.release(r.lease)
    assert wait_for(lambda: fabric.stats()["counters"]["adopted_tokens"] > 0, 30), fabric.stats()
    after = a_pass(fabric, prompts)
    assert after >= 0.95 * before, (after, before)
    fabric.check_integrity()


def test_shutting_the_fabric_down_removes_its_l2_files(fabric):
    assert files()
    fabric.shutdown()
    assert files() == []
