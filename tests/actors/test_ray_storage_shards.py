"""L3 over three storage actors (``storage.actors=3``) through real actors: the
hit query fans out and merges, ranks split their pages by owner, one storage
actor restarted is restored and serves its share again, clear and detach reach
every actor, and ``status`` shows each."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from tests.actors.test_ray_storage import RANKS, ray_session  # noqa: E402, F401 - the fixture
from tests.actors.test_ray_storage import make as make_fabric  # noqa: E402
from tests.helpers import prompt, wait_for  # noqa: E402

pytestmark = pytest.mark.ray


def make(tmp_path, name):
    """A fabric over three storage actors on one segment store."""
    return make_fabric(tmp_path, name, "storage.backend=segment", "storage.actors=3")


def per_actor(fabric, key):
    return [ray.get(s.stats.remote(), timeout=30).get(key, 0) for s in fabric._deployment.storages]


@pytest.mark.usefixtures("ray_session")
def test_three_storage_actors_share_l3_and_survive_a_restart_of_one(tmp_path):
    tokens = prompt(1, pages=10)
    first = make(tmp_path, "shards-a")
    try:
        assert len(first._deployment.storages) == 3
        r = first.submit(tokens, timeout=60)
        first.release(r.lease)
        assert first.settle(30)
        assert first.stats()["l3_transfers"]["backed_up_tokens"] == 40
        written = per_actor(first, "set_pages")
        assert sum(written) == 10 * RANKS and sum(map(bool, written)) >= 2, written
        assert first.stats()["l3"]["set_pages"] == 10 * RANKS, "the figures add up over the actors"
        status = first.status()
        storages = [a for a in status["actors"] if a["role"] == "storage"]
        assert [a["alive"] for a in storages] == [True] * 3, storages
        assert "(2 of 3)" in storages[1]["describe"]
    finally:
        first.shutdown()

    second = make(tmp_path, "shards-b")
    try:
        # One storage actor restarted before anything is asked: it comes back with
        # the backend and finds its pages in the shared store.
        victim = second._deployment.storages[1]
        ray.kill(victim, no_restart=False)
        assert wait_for(lambda: "error" not in second.stats()["l3"], 60)
        r = second.submit(tokens, timeout=60)
        assert r.storage_hit_tokens == 40 and r.computed_tokens == 0, r
        assert second.verify(r, tokens) == [True] * RANKS
        second.release(r.lease)
        assert second.settle(30)
        second.check_integrity()
        # Clear reaches every actor: nothing of it is served after.
        assert second.clear_storage()
        assert per_actor(second, "pages") == [0, 0, 0]
    finally:
        second.shutdown()

    third = make(tmp_path, "shards-c")
    try:
        r = third.submit(tokens, timeout=60)
        assert r.storage_hit_tokens == 0 and third.verify(r, tokens) == [True] * RANKS
        third.release(r.lease)
        assert third.settle(30)
        assert third.detach_storage(30)
        attached = [ray.get(s.spec.remote(), timeout=30) for s in third._deployment.storages]
        assert attached == [None] * 3, "detach reaches every actor"
    finally:
        third.shutdown()
