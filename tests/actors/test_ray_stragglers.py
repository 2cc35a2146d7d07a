"""A slow but alive rank on Ray: named in status and metrics within a bounded
number of rounds (policy report), or restarted and the fabric serving at full
speed again (policy restart)."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from fabric.cli.render import status_text  # noqa: E402
from fabric.client import launch  # noqa: E402
from tests.helpers import prompt, small_config, wait_for  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py

NS = "kvfabric-stragglers"


@pytest.fixture(scope="module")
def cluster():
    shared_ray()
    yield


def make(name: str, policy: str):
    return launch(
        small_config(
            f"runtime.name={name}",
            f"runtime.ray_namespace={NS}",
            "topology.pp=1",  # two ranks: TP2
            "runtime.straggler_rounds=2",
            f"runtime.straggler_policy={policy}",
        )
    )


def serve(fabric, seed: int) -> None:
    tokens = prompt(seed, pages=2)
    r = fabric.submit(tokens, timeout=60)
    assert r.error is None, r.error
    assert fabric.verify(r, tokens) == [True, True]
    fabric.release(r.lease)


def test_a_slow_rank_is_named_and_let_go_once_it_keeps_up(cluster):
    fabric = make("strag-report", "report")
    try:
        serve(fabric, 1)
        slow = fabric._deployment.ranks[1]
        ray.get(slow.set_faults.remote(delay_s=0.6))
        started = time.monotonic()
        seed = 2
        while not fabric.status()["stragglers"] and time.monotonic() - started < 60:
            serve(fabric, seed)
            seed += 1
        status = fabric.status()
        assert list(status["stragglers"]) == ["pp0-cp0-tp1"], status["stragglers"]
        assert status["stragglers"]["pp0-cp0-tp1"]["latency_s"] > 0.25
        assert "STRAGGLER rank pp0-cp0-tp1" in status_text({**status, "cluster": "here"}, "")
        assert fabric.stats()["counters"]["resets"] == 0, "report only: nothing is reset"
        ray.get(slow.set_faults.remote())
        deadline = time.monotonic() + 60
        while fabric.status()["stragglers"] and time.monotonic() < deadline:
            seed += 1
            serve(fabric, seed)  # every rank keeps up again
        assert fabric.status()["stragglers"] == {}
    finally:
        fabric.shutdown()


def test_the_restart_policy_restarts_a_straggler_and_the_fabric_keeps_serving(cluster):
    fabric = make("strag-restart", "restart")
    try:
        serve(fabric, 1)
        slow = fabric._deployment.ranks[0]
        ray.get(slow.set_faults.remote(delay_s=0.6))
        started = time.monotonic()
        seed = 2
        while fabric.stats()["ranks"]["stragglers_named"] == 0 and time.monotonic() - started < 60:
            serve(fabric, seed)
            seed += 1
        assert fabric.stats()["ranks"]["stragglers_named"] == 1
        assert wait_for(lambda: fabric.stats()["counters"]["resets"] >= 1, 60), (
            "treated as failed: reset"
        )
        # The restarted actor has no injected delay: requests are fast and verified again.
        for s in range(3):
            serve(fabric, 100 + s)
        assert fabric.status()["stragglers"] == {}
        fabric.check_integrity()
    finally:
        fabric.shutdown()
