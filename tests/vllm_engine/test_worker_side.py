"""The connector's worker side without an engine: KV blocks of plain tensors laid
out as vLLM's CPU backend lays them, stored as pages and loaded back bit for bit
(synchronously and on the load thread), refused pages reported as load errors,
and a pool whose geometry is not the declared one refused by name."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import StoreOptions
from fabric.engines.vllm_pages import (
    FabricConnectorStats,
    FabricStepMeta,
    PageLoad,
    PageSave,
    Placement,
)
from fabric.engines.vllm_worker import WorkerSide
from fabric.l3.format import Provenance

pytestmark = pytest.mark.vllm

BLOCKS, HEADS, BLOCK, HEAD = 16, 2, 32, 64
BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD * 4
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROVENANCE = Provenance("m", "vllm-block/test", "float32", (2, HEADS, BLOCK, HEAD), BLOCK)


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g) for n in LAYERS}


def worker(tmp_path, kv: dict[str, torch.Tensor], tp_rank: int = 0) -> WorkerSide:
    side = WorkerSide(PROVENANCE, Placement(2, 1, tp_rank), LAYERS, BLOCKS, BLOCK_BYTES, None)
    side.register(kv)
    return side


def hashes(n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(bytes([i])).digest() for i in range(n))


def stored(tmp_path, source: dict[str, torch.Tensor], blocks: tuple[int, ...]) -> StoreOptions:
    """Store ``source``'s ``blocks`` as pages ``hashes(len(blocks))``; the store."""
    store = StoreOptions(path=str(tmp_path))
    writer = worker(tmp_path, source)
    run = StoredRun("vllm", None, hashes(len(blocks)))
    writer.save(FabricStepMeta(saves=[PageSave(run, blocks)], store=store))
    writer.close()
    return store


def test_stored_blocks_load_back_bit_for_bit_into_other_blocks(tmp_path):
    store = StoreOptions(path=str(tmp_path))
    source, target = caches(1), caches(2)
    writer = worker(tmp_path, source)
    run = StoredRun("vllm", None, hashes(5))
    writer.save(FabricStepMeta(saves=[PageSave(run, (3, 4, 5, 6, 7))], store=store))
    writer.close()
    meta = writer.worker_meta()
    assert meta is not None and meta.stored == {0: [run]} and meta.ended == {0: list(run.hashes)}
    reader = worker(tmp_path, target)
    reader.load(FabricStepMeta(loads=[PageLoad("r", run.hashes, (9, 10, 11, 12, 13))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][9:14], source[name][3:8])
    assert reader.take_stats().data["loaded_pages"] == 5
    # The other TP rank's keys are its own: none of rank 0's pages are its.
    other = worker(tmp_path, caches(3), tp_rank=1)
    other.load(FabricStepMeta(loads=[PageLoad("r", run.hashes, (0, 1, 2, 3, 4))], store=store))
    assert other.load_errors() == {0, 1, 2, 3, 4}
    for side in (reader, other):
        side.close()


def test_asynchronous_loads_are_reported_when_done(tmp_path):
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1, 2))
    reader = worker(tmp_path, target)
    job = PageLoad("r", hashes(4), (5, 6, 7, 8), asynchronous=True)
    reader.load(FabricStepMeta(loads=[job], store=store))
    done: set[str] = set()
    for _ in range(1000):
        done = reader.finished_loads()
        if done:
            break
        reader._loading["r"][1].result(timeout=10)
    assert done == {"r"}
    # The fourth page was never stored: its block is a load error, reported with it.
    assert reader.load_errors() == {8}
    for name in LAYERS:
        assert torch.equal(target[name][5:8], source[name][0:3])
    meta = reader.worker_meta()
    assert meta is not None and meta.failed == {0: [hashes(4)[3]]}
    reader.close()


def test_a_corrupted_page_is_never_copied_into_a_block(tmp_path):
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1, 2, 3))
    for segment in tmp_path.rglob("*.kvs"):
        data = bytearray(segment.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside one page's payload
        segment.write_bytes(bytes(data))
    before = {n: t.clone() for n, t in target.items()}
    reader = worker(tmp_path, target)
    reader.load(FabricStepMeta(loads=[PageLoad("r", hashes(4), (8, 9, 10, 11))], store=store))
    errors = reader.load_errors()
    assert errors and max(errors) == 11
    bad = min(errors)
    for name in LAYERS:
        assert torch.equal(target[name][8:bad], source[name][0 : bad - 8])
        assert torch.equal(target[name][bad:12], before[name][bad:12])
    reader.close()


def test_a_pool_that_is_not_the_declared_geometry_is_refused_by_name(tmp_path, caplog):
    kv = {n: torch.zeros(BLOCKS, HEADS * 2, BLOCK, 2 * HEAD) for n in LAYERS}  # 2x the heads
    with caplog.at_level(logging.ERROR):
        side = worker(tmp_path, kv)
    assert f"declares {BLOCK_BYTES}" in caplog.text and str(2 * BLOCK_BYTES) in caplog.text
    store = StoreOptions(path=str(tmp_path))
    side.save(
        FabricStepMeta(saves=[PageSave(StoredRun("vllm", None, hashes(1)), (0,))], store=store)
    )
    side.load(FabricStepMeta(loads=[PageLoad("r", hashes(1), (1,))], store=store))
    assert side.load_errors() == {1}
    meta = side.worker_meta()
    assert meta is not None and meta.stored == {} and meta.failed == {0: [hashes(1)[0]]}
    assert meta.ended == {0: [hashes(1)[0]]}  # the store it was asked for ended, skipped
    assert not list(tmp_path.rglob("*.kvs"))


def test_connector_stats_add_up_over_ranks():
    a = FabricConnectorStats({"loaded_pages": 3, "stored_pages": 1})
    b = FabricConnectorStats({"loaded_pages": 2, "load_seconds": 0.5})
    total = a.aggregate(b).reduce()
    assert total["loaded_pages"] == 5 and total["stored_pages"] == 1
    assert total["load_seconds"] == 0.5
    a.reset()
    assert a.is_empty()
