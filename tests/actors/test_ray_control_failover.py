"""The node that runs the control actors (the coordinator and the storage actor)
is lost: Ray starts them again on another node that has
``runtime.control_resource``, and the new coordinator adopts the L2 pages every
rank still holds, as after its own restart. (Losing the head node itself takes
the GCS with it; with Ray's GCS fault tolerance the GCS comes back and this is
what happens next. One Ray per machine and no HA Redis here: the control node
lost is a worker, the GCS stays.)"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from actors.factory import HEAD_RESOURCE  # noqa: E402
from fabric.client import launch  # noqa: E402
from tests.actors.test_ray_rank_keeps_l2 import a_pass  # noqa: E402
from tests.helpers import prompt, small_config, wait_for, where_now  # noqa: E402

pytestmark = pytest.mark.ray

NS = "kvfabric-control-failover"


@pytest.fixture(scope="module")
def cluster():
    # The ranks on the head (the only CPUs); two CPU-less nodes that may run the
    # control actors. A lost node is noticed after ~3 missed health checks.
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    control = [c.add_node(num_cpus=0, resources={HEAD_RESOURCE: 2}) for _ in range(2)]
    ray.init(address=c.address, namespace=NS, log_to_driver=False)
    try:
        yield c, control
    finally:
        ray.shutdown()
        c.shutdown()


def test_control_actors_come_back_on_another_control_node_and_adopt_l2(cluster):
    c, control = cluster
    fabric = launch(
        small_config(
            "runtime.name=failover", f"runtime.ray_namespace={NS}", "cache.host_tokens=384"
        ),
        announce=False,
    )
    try:
        deployment = fabric._deployment
        where = {n.node_id: n for n in control}
        coordinator_node = ray.get(fabric.coordinator.where.remote(), timeout=30)[1]
        storage_node = ray.get(deployment.storage.where.remote(), timeout=30)[1]
        assert coordinator_node in where and storage_node in where
        ranks = {ray.get(r.where.remote(), timeout=30)[1] for r in deployment.ranks}
        assert ranks.isdisjoint(where), "the ranks run on the head"

        prompts = [prompt(seed, pages=3, shared=1) for seed in range(8)]
        a_pass(fabric, prompts)
        assert fabric.settle(30)
        before = a_pass(fabric, prompts)
        epoch = fabric.stats()["epoch"]

        c.remove_node(where[coordinator_node], allow_graceful=False)
        survivor = next(n for n in where if n != coordinator_node)

        def on_survivor(actor) -> bool:
            here = where_now(actor, timeout=5)
            return here is not None and here[1] == survivor

        assert wait_for(lambda: on_survivor(fabric.coordinator), 120)
        assert wait_for(lambda: on_survivor(deployment.storage), 120)
        # The new coordinator opened a newer epoch and took back every rank's L2.
        after = a_pass(fabric, prompts)
        stats = fabric.stats()
        assert stats["epoch"] > epoch and stats["counters"]["adopted_tokens"] > 0, stats
        assert after >= 0.95 * before, (after, before)
        fabric.check_integrity()
    finally:
        fabric.shutdown()
