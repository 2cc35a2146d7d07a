"""The one place that makes actor classes remote: names, restarts, resources and
placement (each pipeline stage's ranks packed on one node)."""

from __future__ import annotations

import contextlib
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.coordinator_actor import CoordinatorActor
from actors.rank_actor import RankActor
from actors.storage_actor import StorageActor
from actors.storage_group import storage_names
from fabric.config import FabricConfig
from fabric.errors import FabricError
from fabric.topology import Topology

# A rank reserves a sliver of a CPU, so a laptop can hold many; on GPU, one GPU each.
_RANK_CPU = 0.01
# The default `runtime.control_resource`: the node that should run the coordinator and the storage
# actor (cluster.yaml gives it to the head node). Requested only where the cluster
# has it, so a plain local Ray places them anywhere.
HEAD_RESOURCE = "kvfabric_head"


def head_placement(config: FabricConfig) -> dict[str, Any]:
    """Actor options that pin the coordinator or the storage actor to the nodes with
    ``runtime.control_resource`` (the head node by default), when the cluster has
    them (a plain local Ray places them anywhere)."""
    resource = config.runtime.control_resource
    if resource and ray.cluster_resources().get(resource, 0) >= 2:
        return {"resources": {resource: 1}}
    return {}


def rank_name(config: FabricConfig, index: int) -> str:
    return f"{config.runtime.name}-rank-{index}"


def coordinator_name(config: FabricConfig) -> str:
    return f"{config.runtime.name}-coordinator"


def storage_name(config: FabricConfig) -> str:
    """The (first) storage actor's name."""
    return storage_names(config)[0]


def uses_gpu(config: FabricConfig) -> bool:
    device = config.runtime.device
    return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)


def remote(cls: type, **options: Any) -> Any:
    return ray.remote(**options)(cls)


@dataclass
class Deployment:
    coordinator: Any
    ranks: list[Any]
    storage: Any  # the first storage actor
    placement_groups: list[PlacementGroup]
    instance: str = ""  # this launch: the ranks' shared L2 files are its own
    storages: list[Any] = field(default_factory=list)  # every storage actor

    def __post_init__(self) -> None:
        if not self.storages:
            self.storages = [self.storage]

    def kill(self) -> None:
        # The ranks' shared L2 files go with the fabric (a rank that is down
        # leaves its file to the next rank start's sweep on that node).
        with contextlib.suppress(Exception):
            ray.get([r.shutdown.remote(True) for r in self.ranks], timeout=10)
        for actor in [self.coordinator, *self.ranks, *self.storages]:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)


def _ready(refs: list, actors: list, timeout: float) -> None:
    """Wait for actors to come up. One that failed in its constructor (a bad L3
    path, an unreachable Redis, a missing extra) is not restarted: every actor
    made so far is killed and the error is raised here as one line."""
    try:
        ray.get(refs, timeout=timeout)
    except ray.exceptions.RayActorError as exc:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        found = [m for m in map(_FABRIC_ERROR.search, str(exc).splitlines()) if m]
        if found:
            raise FabricError(found[-1].group(1)) from None
        raise FabricError(f"a kvfabric actor failed to start: {str(exc).splitlines()[0]}") from None


_FABRIC_ERROR = re.compile(r"fabric\.errors\.\w+: (.*)$")


def _rank_actor(
    config: FabricConfig, index: int, pg: PlacementGroup, gpu: bool, instance: str
) -> Any:
    """Rank ``index``'s actor, in its pipeline stage's placement group (its bundle
    is its place in the stage): Ray restarts it, on another node if its node is
    lost and the group is placed again there."""
    topo = Topology(config.topology)
    rank = topo.ranks[index]
    bundle_index = topo.stage(rank.pp).index(rank)
    cls = remote(
        RankActor,
        name=rank_name(config, index),
        namespace=config.runtime.ray_namespace,
        max_restarts=-1,
        max_task_retries=0,
        max_concurrency=4,
        num_cpus=_RANK_CPU,
        num_gpus=1 if gpu else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle_index),
    )
    return cls.remote(config.to_dict(), index, storage_names(config), instance)


def recreate_rank(deployment: Deployment, config: FabricConfig, index: int) -> Any:
    """A new actor for rank ``index`` after its old one died for good (killed with
    no restart): same name and place; the coordinator finds it by name."""
    rank = Topology(config.topology).ranks[index]
    handle = _rank_actor(
        config, index, deployment.placement_groups[rank.pp], uses_gpu(config), deployment.instance
    )
    deployment.ranks[index] = handle
    return handle


def _refuse_taken_name(config: FabricConfig, world_size: int) -> None:
    rt = config.runtime
    names = [coordinator_name(config), *storage_names(config)]
    names += [rank_name(config, i) for i in range(world_size)]
    for name in names:
        try:
            ray.get_actor(name, namespace=rt.ray_namespace)
        except ValueError:
            continue
        raise FabricError(
            f"a fabric named {rt.name!r} already runs in Ray namespace {rt.ray_namespace!r} "
            f"on this cluster (actor {name}): launch this one under another --name "
            f"(runtime.name), or use that one (kvfabric status --name {rt.name})"
        )


def deploy(config: FabricConfig) -> Deployment:
    """Create the storage actor, the rank actors (one placement group per pipeline
    stage) and the coordinator, and start its step loop. A fabric of the same
    name in the same Ray namespace is refused before anything is made."""
    topo = Topology(config.topology)
    _refuse_taken_name(config, topo.world_size)
    storages = [
        remote(
            StorageActor,
            name=name,
            namespace=config.runtime.ray_namespace,
            max_restarts=-1,
            max_concurrency=16,
            num_cpus=0,
            **head_placement(config),
        ).remote(config.to_dict(), coordinator_name(config), shard)
        for shard, name in enumerate(storage_names(config))
    ]
    _ready([s.ping.remote() for s in storages], storages, 120)
    gpu = uses_gpu(config)
    instance = uuid.uuid4().hex[:12]  # this launch (every restart of a rank keeps it)
    bundle = {"GPU": 1, "CPU": _RANK_CPU} if gpu else {"CPU": _RANK_CPU}
    ns = config.runtime.ray_namespace
    data = config.to_dict()
    groups: list[PlacementGroup] = []
    ranks = []
    for pp in range(config.topology.pp):
        stage = topo.stage(pp)
        pg = placement_group([bundle] * len(stage), strategy="STRICT_PACK")
        groups.append(pg)
        try:
            ray.get(pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            for made in groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(made)
            for storage in storages:
                with contextlib.suppress(Exception):
                    ray.kill(storage, no_restart=True)
            for _, handle in ranks:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            raise FabricError(
                f"pipeline stage {pp} needs {len(stage)} x {bundle} on one node and no node "
                "of this cluster could offer it within 120 s: lower topology.tp / "
                "topology.cp, or add a node that has them"
            ) from None
        for rank in stage:
            index = topo.ranks.index(rank)
            ranks.append((index, _rank_actor(config, index, pg, gpu, instance)))
    ranks.sort(key=lambda pair: pair[0])
    handles = [h for _, h in ranks]
    try:
        _ready([h.info.remote() for h in handles], [*storages, *handles], 300)
    except FabricError:
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        raise
    coordinator = remote(
        CoordinatorActor,
        name=coordinator_name(config),
        namespace=ns,
        max_restarts=-1,
        max_concurrency=1000,
        num_cpus=0,
        **head_placement(config),
    ).remote(data, [rank_name(config, i) for i in range(topo.world_size)], storage_names(config))
    ray.get(coordinator.start.remote(), timeout=120)
    return Deployment(coordinator, handles, storages[0], groups, instance, storages)
