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


def test_ray_accepts_cluster_yaml():
    validate_config(prepare_config(copy.deepcopy(CONFIG)))


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
            assert command.startswith("RAY_AUTH_MODE=token "), command
    assert CONFIG["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_only_the_head_offers_the_resource_the_factory_pins_to():
    nodes = CONFIG["available_node_types"]
    assert nodes[CONFIG["head_node_type"]]["resources"].get(HEAD_RESOURCE, 0) >= 2
    others = [n for name, n in nodes.items() if name != CONFIG["head_node_type"]]
    assert all(HEAD_RESOURCE not in n["resources"] for n in others)
