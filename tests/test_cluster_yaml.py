"""cluster.yaml is a valid Ray cluster launcher config (by Ray's own validation) that
gives a working, authenticated cluster for the factory's placement."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
from ray.autoscaler._private.util import prepare_config, validate_config

from actors.factory import HEAD_RESOURCE

CONFIG = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster.yaml").read_text())


PREPARED = prepare_config(copy.deepcopy(CONFIG))  # what `ray up` runs: Ray's defaults merged
ROOT = Path(__file__).resolve().parents[1]


def test_ray_accepts_cluster_yaml():
    validate_config(prepare_config(copy.deepcopy(CONFIG)))


def test_every_node_has_a_named_image_and_python_3_11_with_the_project_s_ray():
    import tomllib

    for name, node in PREPARED["available_node_types"].items():
        assert node["node_config"].get("ImageId"), f"{name}: Ray would pick an old DLAMI"
    docker = PREPARED["docker"]
    (pin,) = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("ray[")
    ]
    version = pin.split("==")[1]
    for image in (docker["head_image"], docker["worker_image"]):
        assert image.startswith(f"rayproject/ray:{version}-py311"), image
    for commands in (PREPARED["head_setup_commands"], PREPARED["worker_setup_commands"]):
        text = "\n".join(commands)
        assert "ray-wheels" not in text and "anaconda3" not in text, "Ray's defaults leaked in"
        assert "version_info >= (3, 11)" in text
        assert f"pip install '{pin}'" in text
    assert any("boto3" in c for c in PREPARED["head_setup_commands"]), "the autoscaler needs it"


def test_ray_starts_with_the_ulimit_fixed_ports_and_metrics_on_every_node():
    for command in (*PREPARED["head_start_ray_commands"], *PREPARED["worker_start_ray_commands"]):
        if "ray start" in command:
            assert command.startswith("ulimit -n 65536;"), command
            assert "--object-manager-port=8076" in command
            assert "--metrics-export-port=8080" in command
    assert "--ulimit nofile=65536:65536" in PREPARED["docker"]["run_options"]


def test_the_shared_l3_directory_is_mounted_and_passed_into_the_container():
    (mount,) = PREPARED["initialization_commands"]
    assert "mount -t nfs4" in mount and "/mnt/kvfabric-l3" in mount
    assert "-v /mnt/kvfabric-l3:/mnt/kvfabric-l3" in PREPARED["docker"]["run_options"]


def test_kvfabric_comes_from_the_synced_working_tree():
    assert CONFIG["file_mounts"]["~/kvfabric"] == "."
    for commands in (CONFIG["head_setup_commands"], CONFIG["worker_setup_commands"]):
        installs = [c for c in commands if "kvfabric" in c]
        assert installs == ["pip install -e ~/kvfabric"]
        assert commands.index(installs[0]) > next(
            i for i, c in enumerate(commands) if "torch==" in c
        ), "torch first, so the project's range does not pull another build"


def test_gpu_workers_get_a_cuda_torch_and_the_head_a_cpu_one():
    (worker_torch,) = [c for c in CONFIG["worker_setup_commands"] if "torch==" in c]
    (head_torch,) = [c for c in CONFIG["head_setup_commands"] if "torch==" in c]
    assert "whl/cpu" not in worker_torch and "whl/cpu" in head_torch


def test_every_node_starts_ray_with_token_authentication():
    starts = CONFIG["head_start_ray_commands"] + CONFIG["worker_start_ray_commands"]
    assert [c for c in starts if "ray start" in c]
    for command in starts:
        if "ray start" in command:
            assert "RAY_AUTH_MODE=token ray start" in command, command
    assert CONFIG["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_only_the_head_offers_the_resource_the_factory_pins_to():
    nodes = CONFIG["available_node_types"]
    assert nodes[CONFIG["head_node_type"]]["resources"].get(HEAD_RESOURCE, 0) >= 2
    others = [n for name, n in nodes.items() if name != CONFIG["head_node_type"]]
    assert all(HEAD_RESOURCE not in n["resources"] for n in others)
