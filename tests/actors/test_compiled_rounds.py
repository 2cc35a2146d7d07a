"""Consensus rounds on a Ray Compiled Graph (``runtime.compiled_rounds``): served
pages verify, a rank killed mid-traffic drops the graph (the round goes again
with plain calls) and a new one is compiled for the restarted rank, and a
restarted coordinator serves. Two ranks only: each actor in a graph polls a core.
Rounds that fall back, and the drivers' submits, go as Ray calls here
(``runtime.round_transport=ray``, ``submit_transport=ray``): the tests that cover
the Ray-call transports."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from actors import compiled_rounds  # noqa: E402
from fabric.client import launch  # noqa: E402
from tests.helpers import prompt, small_config, wait_for, where_now  # noqa: E402

pytestmark = pytest.mark.ray

NS = "kvfabric-test-compiled"


@pytest.fixture(scope="module")
def fabric():
    assert not ray.is_initialized(), "this module starts its own Ray"
    f = launch(
        small_config(
            "runtime.name=compiled",
            f"runtime.ray_namespace={NS}",
            "runtime.compiled_rounds=true",
            "runtime.round_transport=ray",
            "runtime.submit_transport=ray",
            "runtime.rank_timeout_s=10",
            "topology.pp=1",
        ),
        announce=False,
    )
    yield f
    f.shutdown()
    assert not ray.is_initialized()


def _compiled(fabric) -> dict:
    return fabric.stats()["compiled_rounds"]


def test_requests_are_served_through_the_compiled_graph(fabric):
    for seed in range(3):
        p = prompt(seed, pages=3)
        r = fabric.submit(p, timeout=60)
        assert r.error is None and fabric.verify(r, p) == [True] * 2
        fabric.release(r.lease)
    c = _compiled(fabric)
    assert c["active"] and c["compiles"] == 1 and c["failures"] == 0
    assert c["rounds"] > 0
    fabric.check_integrity()
    # The Ray-call transports: no rank serves a round socket, no submit went by one.
    for rank in fabric._deployment.ranks:
        with pytest.raises(ray.exceptions.RayTaskError, match="serves no socket rounds"):
            ray.get(rank.round_endpoint.remote(), timeout=30)
    assert fabric._calls is False


def _incarnation(rank):
    try:
        return ray.get(rank.info.remote(), timeout=5)["incarnation"]
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
        return None


def test_a_rank_killed_mid_traffic_drops_the_graph_and_a_new_one_is_compiled(fabric):
    before = _compiled(fabric)
    rank = fabric._deployment.ranks[1]
    old = _incarnation(rank)
    ray.kill(rank, no_restart=False)
    # ray.kill returns before the process dies: wait for the new one.
    assert wait_for(lambda: _incarnation(rank) not in (None, old), timeout=60)
    p = prompt(20, pages=3)
    r = fabric.submit(p, timeout=120)  # served once the rank is back (plain calls meanwhile)
    assert r.error is None and fabric.verify(r, p) == [True] * 2
    fabric.release(r.lease)

    def recompiled() -> bool:
        time.sleep(compiled_rounds.RETRY_S / 4)
        q = prompt(21, pages=2)
        fabric.release(fabric.submit(q, timeout=60).lease)  # a round, to compile on
        c = _compiled(fabric)
        return c["active"] and c["compiles"] > before["compiles"]

    assert wait_for(recompiled, timeout=60)
    c = _compiled(fabric)
    assert c["failures"] > before["failures"] and c["last_error"]
    assert fabric.stats()["now"]["leases"] == 0
    fabric.check_integrity()


def test_a_restarted_coordinator_serves_again(fabric):
    old_pid = ray.get(fabric.coordinator.where.remote())[0]
    ray.kill(fabric.coordinator, no_restart=False)

    def restarted() -> bool:
        here = where_now(fabric.coordinator)
        return here is not None and here[0] != old_pid

    assert wait_for(restarted, timeout=120)
    p = prompt(30, pages=3)
    r = fabric.submit(p, timeout=120)
    assert r.error is None and fabric.verify(r, p) == [True] * 2
    fabric.release(r.lease)
    assert fabric.stats()["compiled_rounds"]["rounds"] > 0, "the new coordinator compiled its own"
    fabric.check_integrity()
