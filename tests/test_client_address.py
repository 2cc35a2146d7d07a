"""Which cluster a command talks to (fabric.driver.cluster.resolve): an address with
no Ray behind it fails at once, in one line (Ray itself retries for minutes);
``auto`` never picks among several local clusters by chance."""

import socket

import pytest

from fabric.driver import cluster
from fabric.driver.cluster import _check_reachable, resolve
from fabric.errors import FabricError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def test_nothing_listening_is_refused_at_once_naming_the_setting():
    port = closed_port()
    with pytest.raises(FabricError, match=rf"no Ray cluster at --address='127.0.0.1:{port}'"):
        _check_reachable(f"127.0.0.1:{port}", "--address")
    with pytest.raises(FabricError, match=r"\[::1\]"):
        _check_reachable(f"[::1]:{port}", "--address")
    with pytest.raises(FabricError, match=rf"no Ray cluster at runtime.address='127.0.0.1:{port}'"):
        resolve(f"127.0.0.1:{port}", setting="runtime.address")


def test_a_listening_port_and_client_addresses_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        _check_reachable(address, "--address")
        assert resolve(address).address == address
    assert resolve("ray://head:10001").address == "ray://head:10001"


def test_a_malformed_address_names_what_is_allowed():
    with pytest.raises(FabricError, match="allowed is HOST:PORT, auto, local or ray://"):
        resolve("just-a-host", setting="runtime.address")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine whose local clusters and `ray start` cluster the test sets."""
    state = {"live": [], "started": None}
    monkeypatch.setattr(cluster, "_live_local_clusters", lambda: sorted(state["live"]))
    monkeypatch.setattr(cluster, "_ray_start_cluster", lambda: state["started"])
    monkeypatch.setattr(cluster, "records_dir", lambda: tmp_path / "fabrics")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return state


def test_empty_means_ray_address_then_the_ray_start_cluster_then_a_private_ray(
    machine, monkeypatch
):
    assert resolve("").address is None
    assert resolve("local").address is None
    machine["started"] = "10.0.0.1:6379"
    assert resolve("").address == "10.0.0.1:6379"
    assert "ray start" in resolve("").reason
    assert resolve("local").address is None  # a private Ray, even beside a cluster
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert resolve("").address == "ray://head:10001"
    assert resolve("auto").address == "ray://head:10001"


def test_auto_among_several_local_clusters_follows_the_fabric_s_record(machine):
    machine["live"] = ["10.0.0.1:40001", "10.0.0.1:40002"]
    with pytest.raises(FabricError, match=r"2 Ray clusters .*10.0.0.1:40001, 10.0.0.1:40002"):
        resolve("auto", "first")
    cluster.record_fabric("first", "kvfabric", "10.0.0.1:40002")
    cluster.record_fabric("second", "kvfabric", "10.0.0.1:40001")
    for _ in range(5):  # the same answer every time
        assert resolve("auto", "first").address == "10.0.0.1:40002"
        assert resolve("auto", "second").address == "10.0.0.1:40001"
    # Another namespace is another fabric.
    with pytest.raises(FabricError, match="none is known to run fabric 'first'"):
        resolve("auto", "first", "elsewhere")
    # A record of a cluster that is gone is not followed; the `ray start` one is.
    machine["live"] = ["10.0.0.1:40001", "10.0.0.1:6379"]
    machine["started"] = "10.0.0.1:6379"
    assert resolve("auto", "first").address == "10.0.0.1:6379"
    # Forgetting only drops the record of that cluster.
    cluster.forget_fabric("second", "kvfabric", "10.0.0.1:9999")
    assert resolve("auto", "second").address == "10.0.0.1:40001"
    cluster.forget_fabric("second", "kvfabric", "10.0.0.1:40001")
    assert resolve("auto", "second").address == "10.0.0.1:6379"


def test_auto_with_one_local_cluster_or_none(machine):
    with pytest.raises(FabricError, match="no Ray cluster runs on this machine"):
        resolve("auto")
    machine["live"] = ["10.0.0.1:40001"]
    assert resolve("auto").address == "10.0.0.1:40001"


def test_a_taken_dashboard_port_gives_way_to_a_free_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        other = cluster.free_port("127.0.0.1", taken)
        assert other != taken
    free = closed_port()
    assert cluster.free_port("127.0.0.1", free) == free
