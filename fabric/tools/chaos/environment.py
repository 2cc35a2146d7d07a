"""What chaos faults do to the machine rather than to an actor — a node removed,
L3's file system filled or remounted read-only — and the audits after a run:
where the actors ran and every L3 page read back. Functions of what they are
given; Ray is imported inside them."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from fabric.config import FabricConfig
from fabric.topology import Topology

log = logging.getLogger(__name__)

# ``threading.Event.wait``: returns early (True) once the run is stopped.
Wait = Callable[[float], Any]


def is_local(node_id: str) -> bool:
    """The node is this machine (a process there can be signalled from here)."""
    import ray

    here = ray.util.get_node_ip_address()
    return any(
        n["NodeID"] == node_id and n["Alive"] and n["NodeManagerAddress"] == here
        for n in ray.nodes()
    )


def node_of(cluster: Any, actor: Any) -> tuple[Any, str]:
    """The worker node of a local ``cluster`` that ``actor`` runs on, and its id."""
    import ray

    if cluster is None:
        raise RuntimeError("node loss needs a local cluster")
    _, node_id = ray.get(actor.where.remote(), timeout=10)
    victim = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
    if victim is None:
        raise RuntimeError("that rank is on the head node")
    return victim, node_id


def lose_node(cluster: Any, rank: Any, wait: Wait, hold: float) -> None:
    """Remove the worker node a rank runs on; add a new one after ``hold``."""
    victim, _ = node_of(cluster, rank)
    cluster.remove_node(victim, allow_graceful=False)
    wait(hold)
    cluster.add_node(num_cpus=2)


def mount_l3(path: str) -> str | None:
    """L3 on a tmpfs of its own where this process may mount one (root), so that
    ``l3_full`` fills a real file system (writes fail with ENOSPC) instead of
    setting a flag in the storage actor: the mount point, or ``None``."""
    if os.geteuid() != 0:
        return None
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "kvfabric-chaos-l3", path],
        capture_output=True,
        text=True,
    )
    if done.returncode == 0:
        return path
    log.info("chaos: L3 on the directory as it is (no tmpfs: %s)", done.stderr.strip())
    return None


def unmount_l3(mount: str) -> None:
    subprocess.run(["umount", "-l", mount], capture_output=True)


def fill_l3(mount: str, wait: Wait, hold: float) -> str:
    """Fill L3's file system for ``hold`` seconds: every write fails for real."""
    ballast = os.path.join(mount, ".chaos-ballast")
    fd = os.open(ballast, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        st = os.statvfs(mount)
        free = st.f_bavail * st.f_frsize
        while free > 0:  # metadata takes a little: the largest that fits
            try:
                os.posix_fallocate(fd, 0, free)
                break
            except OSError:
                free -= 1 << 20
        wait(hold)
        return f"tmpfs filled ({free >> 20} MiB of ballast)"
    finally:
        os.close(fd)
        os.unlink(ballast)


def read_only_l3(mount: str, wait: Wait, hold: float) -> str:
    """Remount L3's file system read-only under the running fabric for ``hold``
    seconds: every write fails with EROFS, reads go on. The store holds no
    file open for writing between appends; one in flight makes the remount
    busy for a moment, so it is tried again."""

    def remount(mode: str) -> None:
        cmd = ["mount", "-o", f"remount,bind,{mode}", mount]
        deadline = time.monotonic() + 10.0
        while True:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"remount {mode}: {done.stderr.strip()[:200]}")
            time.sleep(0.05)

    remount("ro")
    try:
        wait(hold)
    finally:
        remount("rw")
    return "L3 file system remounted read-only"


def l3_writes_failed(storages: list[Any]) -> int:
    """Page writes L3 refused so far (the storage actors' counts: one that is
    down counts 0, so a difference across a storage restart may undercount)."""
    import ray

    total = 0
    for storage in storages:
        with contextlib.suppress(Exception):
            total += int(ray.get(storage.stats.remote(), timeout=10).get("set_failed", 0))
    return total


def placement(fabric: Any, config: FabricConfig) -> dict:
    """Where the actors are: the coordinator and the storage actor on the nodes
    with ``runtime.control_resource``, each pipeline stage's ranks on one node."""
    import ray

    deployment = fabric._deployment
    resource = config.runtime.control_resource
    control = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)}
    coordinator = ray.get(fabric.coordinator.where.remote(), timeout=30)[1]
    storages = [ray.get(s.where.remote(), timeout=30)[1] for s in deployment.storages]
    nodes = [ray.get(r.where.remote(), timeout=30)[1] for r in deployment.ranks]
    topo = Topology(config.topology)
    stages = [
        {nodes[topo.ranks.index(r)] for r in topo.stage(pp)} for pp in range(config.topology.pp)
    ]
    return {
        "coordinator_on_control_node": coordinator in control,
        "storage_on_control_node": all(node in control for node in storages),
        "stages_packed": all(len(s) == 1 for s in stages),
        "rank_nodes": len(set(nodes)),
    }


def scan_l3(config: FabricConfig) -> dict:
    """Every page in L3, read back as a prefetch reads it (through a backend of
    the fabric's kind on the same directory): valid, or the reason the read
    refuses it (a counted miss, never served)."""
    import numpy as np

    from fabric.l3 import make_backend
    from fabric.l3.service import StorageService, backend_spec, provenance_bytes

    off = config.replace(storage={**config.storage.model_dump(), "backend": "none"})
    shapes = StorageService(off).shapes
    by_tag = {(prov.tag, suffix): prov for (_, suffix), prov in shapes.items()}
    name, options = backend_spec(config.storage)
    any_prov = next(iter(shapes.values()))
    backend = make_backend(name, any_prov, provenance_bytes(any_prov), options)
    out: Counter[str] = Counter()
    try:
        for key in backend.page_keys():
            _, tag, suffix = key.split(".")
            prov = by_tag.get((tag, suffix))
            if prov is None:
                out["foreign"] += 1
                continue
            row = np.empty((1, provenance_bytes(prov)), dtype=np.uint8)
            out["valid"] += backend.get([key], row, prov)
        refused = backend.stats()
    finally:
        backend.close()
    for reason, n in refused.items():
        if reason.startswith("refused_") or reason == "get_miss":
            out[reason.removeprefix("refused_")] += n
    return dict(out)
