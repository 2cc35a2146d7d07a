"""Engines and a running kvfabric fabric (real Ray actors) on one L3: pages an
SGLang worker or a Hugging Face driver stores are served by the fabric to its
own clients, and pages the fabric's ranks computed are read by them — through
the shared directory or over Ray through the fabric's storage actor."""

from __future__ import annotations

import time

import pytest
import torch

from fabric.client import launch
from fabric.config import FabricConfig
from fabric.engines.hf import FabricGenerator
from fabric.engines.store import StoreOptions
from fabric.rank.model import assemble, build_model
from fabric.tools.chat import TINY_LLAMA, generate
from tests.interop.support import adapter, fill_random, host_pool, sglang_hashes
from tests.ray_session import shared_ray

pytestmark = [pytest.mark.interop, pytest.mark.ray]
SHARES_RAY = True  # tests/ray_session.py

NS = "kvfabric-engines-tests"
NAME = "engines"


@pytest.fixture(scope="module")
def fabric(tmp_path_factory):
    path = tmp_path_factory.mktemp("l3")
    shared_ray()
    config = FabricConfig().with_overrides(
        [
            *TINY_LLAMA,
            "topology.tp=1",
            "cache.page_size=4",
            "prefetch.threshold_tokens=4",
            "runtime.step_interval_s=0",
            f"runtime.name={NAME}",
            f"runtime.ray_namespace={NS}",
            f"storage.path={path}",
        ]
    )
    f = launch(config, announce=False)
    yield f
    f.shutdown()


def store_options(fabric, transport: str) -> dict:
    if transport == "path":
        return {"path": fabric.config.storage.path}
    return {"fabric": NAME, "ray_namespace": NS}


def served_kv(fabric, result, n: int) -> torch.Tensor:
    return assemble(fabric.read_kv(result.lease), fabric.config.model, 4, n)


def sglang_worker(fabric, transport):
    m = fabric.config.model
    pool = host_pool(m.layers, m.kv_heads, m.head_dim, 4, "layer_first", "float32")
    return pool, adapter(pool, model=m.model_id, **store_options(fabric, transport))


@pytest.mark.parametrize("transport", ["path", "ray"])
def test_pages_an_sglang_worker_stored_are_served_by_the_fabric(fabric, transport):
    start = 100 if transport == "path" else 200
    tokens = list(range(start, start + 24))
    pool, backend = sglang_worker(fabric, transport)
    src = pool.alloc(len(tokens))
    fill_random(pool, src)
    assert all(backend.batch_set_v1(sglang_hashes(tokens, 4), src))
    time.sleep(1.1)  # a page another process appended is seen at the store's next rescan
    result = fabric.submit(tokens, namespace="sglang", timeout=60)
    try:
        assert result.storage_hit_tokens == len(tokens) and result.computed_tokens == 0
        want = pool.kv_buffer[:, :, src].permute(0, 1, 3, 2, 4)  # (2, L, H, T, D)
        assert torch.equal(served_kv(fabric, result, len(tokens)), want)
    finally:
        fabric.release(result.lease)


@pytest.mark.parametrize("transport", ["path", "ray"])
def test_pages_the_fabric_computed_are_read_by_an_sglang_worker(fabric, transport):
    start = 300 if transport == "path" else 400
    tokens = list(range(start, start + 24))
    result = fabric.submit(tokens, namespace="sglang", timeout=60)
    kv = served_kv(fabric, result, len(tokens))
    fabric.release(result.lease)
    assert fabric.settle(30)
    pool, backend = sglang_worker(fabric, transport)
    dst = pool.alloc(len(tokens))
    hashes = sglang_hashes(tokens, 4)
    assert backend.batch_exists(hashes) == 6
    assert backend.batch_get_v1(hashes, dst) == [True] * 6
    assert torch.equal(pool.kv_buffer[:, :, dst].permute(0, 1, 3, 2, 4), kv)


def test_a_hugging_face_driver_and_the_fabric_continue_each_others_conversations(fabric):
    model = build_model(fabric.config.model)
    gen = FabricGenerator(model, fabric.config, StoreOptions(fabric=NAME, ray_namespace=NS))
    prompt = list(range(700, 717))
    (out,) = gen.generate([prompt], max_new_tokens=6)
    assert out.tokens == generate(model, prompt, 6) and out.stored_pages == 5
    # The fabric serves the driver's pages and its ranks verify them against
    # their own model's KV.
    turn = prompt + out.tokens + [9, 8, 7]
    result = fabric.submit(turn, timeout=60)
    try:
        assert result.storage_hit_tokens == 20
        assert fabric.verify(result, turn) == [True]
    finally:
        fabric.release(result.lease)
    assert fabric.settle(30)
    # The driver continues from what the fabric's ranks computed.
    (again,) = gen.generate([turn], max_new_tokens=4)
    assert again.hit_tokens == 24 and again.tokens == generate(model, turn, 4)


def test_storage_usage_says_which_engine_wrote_what(fabric):
    rows = fabric.storage_usage()
    writers = {w for row in rows for w in row["writers"]}
    assert {"kvfabric", "sglang", "hf"} <= writers
    assert all(row["model_id"] == "tiny-llama" for row in rows)
    assert sum(row["pages"] for row in rows) == fabric.stats()["l3"]["pages"]
