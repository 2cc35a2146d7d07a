"""A rank that is gone for good: requests fail with an error naming it, they do
not wait for ever, and the coordinator keeps answering."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from actors.factory import HEAD_RESOURCE  # noqa: E402
from fabric.client import launch  # noqa: E402
from tests.helpers import prompt, small_config, wait_for  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py


@pytest.fixture(scope="module")
def fabric():
    shared_ray()
    f = launch(
        small_config(
            "runtime.name=kvfabric-lost",
            "runtime.ray_namespace=kvfabric-lost",
            "runtime.rank_timeout_s=2",
            "runtime.rank_absent_timeout_s=3",
        )
    )
    try:
        yield f
    finally:
        f.shutdown()


def test_requests_fail_naming_a_rank_that_is_gone_for_good(fabric):
    r = fabric.submit(prompt(1, pages=2), timeout=60)
    fabric.release(r.lease)
    rank = fabric._deployment.ranks[1]
    pid = ray.get(rank.where.remote(), timeout=30)[0]
    ray.kill(rank, no_restart=True)
    # Gone: its process ended (ray.kill returns before it does, and until then the
    # rank still answers rounds over its socket).
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60)
    lost = fabric.submit(prompt(2, pages=2), timeout=60)
    assert lost.error is not None and "rank pp0-cp0-tp1 (index 1) has not answered" in lost.error
    stats = fabric.stats()
    assert stats["now"]["absent_ranks"] == ["pp0-cp0-tp1"]
    assert stats["counters"]["failed"] >= 1 and stats["now"]["running"] == 0


def test_the_coordinator_and_storage_take_the_head_nodes_resource(fabric):
    assert ray.available_resources().get(HEAD_RESOURCE) == 8
