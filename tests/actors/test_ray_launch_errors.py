"""Launch failures a new user meets end in one line naming the setting to fix,
with nothing left running."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from fabric.errors import FabricError  # noqa: E402
from tests.helpers import small_config  # noqa: E402

pytestmark = pytest.mark.ray


def test_an_unusable_l3_path_fails_the_launch_in_one_line_and_stops_its_ray():
    assert not ray.is_initialized()
    config = small_config("storage.backend=file", "storage.path=/proc/kvfabric-l3")
    with pytest.raises(FabricError) as caught:
        launch(config)
    message = str(caught.value)
    assert "storage path '/proc/kvfabric-l3' cannot be used" in message
    assert "set storage.path" in message and "\n" not in message
    assert not ray.is_initialized(), "the local Ray the launch started is gone"


def test_no_cluster_at_the_address_is_one_line_naming_the_setting(monkeypatch):
    import socket

    from fabric.driver import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "_live_local_clusters", lambda: [])
    monkeypatch.setattr(cluster, "_ray_start_cluster", lambda: None)
    with pytest.raises(
        FabricError, match=r"no Ray cluster runs on this machine for .*runtime.address=auto"
    ):
        launch(small_config("runtime.address=auto"))

    def no_cluster(**_kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", no_cluster)
    with socket.socket() as s:  # something listens there, but it is no Ray
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(
            FabricError, match=rf"no Ray cluster at .*runtime.address={address}.*ray start"
        ):
            launch(small_config(f"runtime.address={address}"))
    assert not ray.is_initialized()


def test_an_engine_s_store_finds_its_cluster_as_the_commands_do(monkeypatch):
    """An engine reaching a running fabric's L3 (``fabric.engines.store.RayStore``)
    resolves ``auto`` like kvfabric's commands: never by chance, one line when
    there is nothing to reach."""
    from fabric.driver import cluster
    from fabric.engines.store import RayStore, StoreOptions
    from fabric.errors import ConfigError

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "_live_local_clusters", lambda: ["10.0.0.1:1", "10.0.0.1:2"])
    monkeypatch.setattr(cluster, "_ray_start_cluster", lambda: None)
    with pytest.raises(ConfigError, match=r"fabric='prod': 2 Ray clusters run on this machine"):
        RayStore(StoreOptions(fabric="prod"), "sglang")
    monkeypatch.setattr(cluster, "_live_local_clusters", lambda: [])
    with pytest.raises(ConfigError, match=r"fabric='prod': no Ray cluster runs on this machine"):
        RayStore(StoreOptions(fabric="prod"), "sglang")
    assert not ray.is_initialized()
