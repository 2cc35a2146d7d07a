"""One local Ray shared by the test modules that need nothing of it but a
running Ray on this machine: a module that declares ``SHARES_RAY = True`` calls
``shared_ray()`` in its fixture and leaves Ray running when it ends; every
other module (and every test without the ``ray`` marker) finds it stopped
first (``tests/conftest.py``), and the session stops it at its end. The sharing
modules run one after another (``tests/conftest.py`` orders them first), so
Ray starts once for all of them instead of once each (4-5 s a start and stop
on 2 cores). Each module still launches its own fabric, under its own name and
Ray namespace (``runtime.ray_namespace``), and shuts it down in its own fixture,
so the next module finds Ray with nothing of the last one's left in it.

Nothing here imports Ray until Ray is wanted: the fast tier imports this module."""

from __future__ import annotations

import sys

_state = {"shared": False}


def shared_ray() -> None:
    """Start the shared Ray unless it runs (2 CPUs, no dashboard, the head
    node's resource for control actors)."""
    import ray

    from actors.factory import HEAD_RESOURCE

    if _state["shared"] and ray.is_initialized():
        return
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace="kvfabric-tests",
        log_to_driver=False,
        resources={HEAD_RESOURCE: 10},
    )
    _state["shared"] = True


def stop_shared() -> None:
    """Stop the shared Ray if it runs (a module of its own Ray, or none, is next)."""
    if not _state["shared"]:
        return
    _state["shared"] = False
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
