"""The connector's worker side without an engine: KV blocks of plain tensors laid
out as vLLM's CPU backend lays them, stored as pages and loaded back bit for bit
(synchronously and on the load thread), refused pages reported as load errors,
and a pool whose geometry is not the declared one refused by name."""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import replace

import pytest
import torch

from fabric.cache.engine_input import L3, StoredRun, node_place
from fabric.cache.engine_places import BACKUP, MOVE, PREFETCH, Order
from fabric.engines import vllm_moves, vllm_writes
from fabric.engines.store import PageStore, StoreOptions
from fabric.engines.vllm_pages import (
    FabricConnectorStats,
    FabricStepMeta,
    PageLoad,
    PageSave,
    Placement,
)
from fabric.engines.vllm_worker import L2Options, WorkerSide
from fabric.l3.format import Provenance

pytestmark = pytest.mark.vllm

BLOCKS, HEADS, BLOCK, HEAD = 16, 2, 32, 64
BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD * 4
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROVENANCE = Provenance("m", "vllm-block/test", "float32", (2, HEADS, BLOCK, HEAD), BLOCK)
TAG = "0123456789abcdef"
PAGE_BYTES = BLOCK_BYTES * len(LAYERS)


def pload(
    hs, blocks, rid: str = "r", load_id: int = 0, asynchronous: bool = False, **more
) -> PageLoad:
    return PageLoad(load_id, rid, TAG, tuple(hs), tuple(blocks), asynchronous, **more)


def psave(run: StoredRun, blocks) -> PageSave:
    return PageSave(TAG, run, tuple(blocks))


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=g) for n in LAYERS}


def worker(
    tmp_path, kv: dict[str, torch.Tensor], tp_rank: int = 0, l2: bool = False, **options
) -> WorkerSide:
    node = L2Options(1 << 22, str(tmp_path / "shm"), "fabric", "kvfabric") if l2 else None
    (tmp_path / "shm").mkdir(exist_ok=True)
    side = WorkerSide(Placement(2, 1, tp_rank), LAYERS, BLOCKS, BLOCK_BYTES, None, node, **options)
    side.register(kv, PROVENANCE)
    return side


def hashes(n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(bytes([i])).digest() for i in range(n))


def stored(tmp_path, source: dict[str, torch.Tensor], blocks: tuple[int, ...]) -> StoreOptions:
    """Store ``source``'s ``blocks`` as pages ``hashes(len(blocks))``; the store."""
    store = StoreOptions(path=str(tmp_path))
    writer = worker(tmp_path, source)
    run = StoredRun("vllm", None, hashes(len(blocks)))
    writer.save(FabricStepMeta(saves=[psave(run, blocks)], store=store))
    writer.close()
    return store


def test_stored_blocks_load_back_bit_for_bit_into_other_blocks(tmp_path):
    store = StoreOptions(path=str(tmp_path))
    source, target = caches(1), caches(2)
    writer = worker(tmp_path, source)
    run = StoredRun("vllm", None, hashes(5))
    writer.save(FabricStepMeta(saves=[psave(run, (3, 4, 5, 6, 7))], store=store))
    writer.close()
    meta = writer.worker_meta()
    assert meta is not None and meta.stored == [(TAG, 0, replace(run, page_bytes=PAGE_BYTES))]
    assert meta.ended == [(0, h) for h in run.hashes]
    reader = worker(tmp_path, target)
    reader.load(FabricStepMeta(loads=[pload(run.hashes, (9, 10, 11, 12, 13))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][9:14], source[name][3:8])
    assert reader.take_stats().data["loaded_pages"] == 5
    # The other TP rank's keys are its own: none of rank 0's pages are its.
    other = worker(tmp_path, caches(3), tp_rank=1)
    other.load(FabricStepMeta(loads=[pload(run.hashes, (0, 1, 2, 3, 4))], store=store))
    assert other.load_errors() == {0, 1, 2, 3, 4}
    for side in (reader, other):
        side.close()


def test_a_store_reports_each_place_it_reached_and_the_fabrics_evictions_are_carried_out(
    tmp_path,
):
    """Pages stored in L3 and in the node's L2 are reported for both places (with
    the rank's page size); an order for this rank deletes its shards there, and
    one for another rank, or another node, is left alone."""
    store = StoreOptions(path=str(tmp_path))
    writer = worker(tmp_path, caches(1), l2=True)
    run = StoredRun("vllm", None, hashes(4))
    writer.save(FabricStepMeta(saves=[psave(run, (0, 1, 2, 3))], store=store))
    drain(writer)
    here = node_place(str(tmp_path / "shm"))
    assert writer.pages.l2_place == here
    assert sorted(r.place for _, _, r in writer.worker_meta().stored) == sorted([L3, here])
    orders = [
        Order(TAG, 2, L3, 0b01, run.hashes[2:]),
        Order(TAG, 2, here, 0b01, run.hashes[3:]),
        Order(TAG, 2, L3, 0b10, run.hashes[:2]),  # rank 1's: not this worker's
        Order(TAG, 2, "l2@elsewhere", 0b01, run.hashes[:2]),  # another node's
    ]
    writer.save(FabricStepMeta(orders=orders, store=store))
    drain(writer)
    keys = writer.pages.keys(TAG, run.hashes)
    assert writer.pages.store.present(keys) == [True, True, False, False]
    assert [f is not None for f in writer.pages.l2.find(keys)] == [True, True, True, False]
    counts = writer.take_stats().data
    assert counts["l3_deleted_pages"] == 2 and counts["l2_dropped_pages"] == 1
    writer.close()


def test_under_write_back_a_page_waits_in_the_nodes_l2_until_the_fabric_moves_it(
    tmp_path, monkeypatch
):
    """The fabric's write policy reaches the workers with its store: under
    write-back a store fills the node's L2 only; a ``BACKUP`` order copies pages
    from there to L3 (reported stored there, in runs after their parent) and
    keeps them; a ``MOVE`` copies and then empties the slots. Pages the node's
    L2 no longer holds are skipped, never copied; a copy goes a page buffer at a
    time (one page, here), in buffers the step's stores used in vLLM's inference
    mode and gave back."""
    monkeypatch.setattr(vllm_moves, "STAGING_BYTES", PAGE_BYTES)
    store = StoreOptions(path=str(tmp_path), write_policy="write_back")
    source = caches(1)
    writer = worker(tmp_path, source, l2=True)
    here = node_place(str(tmp_path / "shm"))
    run = StoredRun("vllm", None, hashes(4))
    with torch.inference_mode():  # as vLLM's forward calls the connector
        writer.save(FabricStepMeta(saves=[psave(run, (0, 1, 2, 3))], store=store))
    drain(writer)
    reported = [r for _, _, r in writer.worker_meta().stored]
    assert {r.place for r in reported} == {here}
    assert [h for r in reported for h in r.hashes] == list(run.hashes)
    keys = writer.pages.keys(TAG, run.hashes)
    assert writer.pages.store.present(keys) == [False] * 4
    writer.pages.l2.remove(keys[1:2])  # replaced meanwhile: not copied
    h = run.hashes
    orders = [
        Order(TAG, 2, here, 0b11, h[:2], BACKUP, "vllm", None),
        Order(TAG, 2, here, 0b01, h[2:], MOVE, "vllm", h[1]),
    ]
    writer.save(FabricStepMeta(orders=orders, store=store))
    drain(writer)
    assert writer.pages.store.present(keys) == [True, False, True, True]
    assert [f is not None for f in writer.pages.l2.find(keys)] == [True, False, False, False]
    stored = [(r.place, r.parent, r.hashes) for _, _, r in writer.worker_meta().stored]
    assert stored == [(L3, None, h[:1]), (L3, h[1], h[2:])]
    counts = writer.take_stats().data
    assert counts["l3_copied_pages"] == 3 and counts["orders_failed"] == 0
    writer.close()
    reader = worker(tmp_path, target := caches(2))
    reader.load(FabricStepMeta(loads=[pload(h[2:], (8, 9))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][8:10], source[name][2:4])
    reader.close()


def test_asynchronous_loads_are_reported_when_done(tmp_path):
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1, 2))
    reader = worker(tmp_path, target)
    job = pload(hashes(4), (5, 6, 7, 8), asynchronous=True)
    reader.load(FabricStepMeta(loads=[job], store=store))
    done: set[str] = set()
    for _ in range(1000):
        done = reader.finished_loads()
        if done:
            break
        threading.Event().wait(0.01)
    assert done == {"r"}
    # The fourth page was never stored: its block is a load error, reported with it.
    assert reader.load_errors() == {8}
    for name in LAYERS:
        assert torch.equal(target[name][5:8], source[name][0:3])
    meta = reader.worker_meta()
    assert meta is not None and meta.failed == [(TAG, 0, hashes(4)[3])]
    assert meta.loaded == [(0, 0, 3)]  # the load's outcome: three pages of four
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
    reader.load(FabricStepMeta(loads=[pload(hashes(4), (8, 9, 10, 11))], store=store))
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
    side.save(FabricStepMeta(saves=[psave(StoredRun("vllm", None, hashes(1)), (0,))], store=store))
    side.load(FabricStepMeta(loads=[pload(hashes(1), (1,))], store=store))
    assert side.load_errors() == {1}
    meta = side.worker_meta()
    # Its load is an error here, but no verdict on the page: others may load it.
    assert meta is not None and meta.stored == [] and meta.failed == []
    assert meta.ended == [(0, hashes(1)[0])]  # the store it was asked for ended, skipped
    assert meta.loaded == [(0, 0, 0)]
    assert not list(tmp_path.rglob("*.kvs"))


def test_connector_stats_add_up_over_ranks():
    a = FabricConnectorStats({"loaded_pages": 3, "stored_pages": 1})
    b = FabricConnectorStats({"loaded_pages": 2, "load_seconds": 0.5})
    total = a.aggregate(b).reduce()
    assert total["loaded_pages"] == 5 and total["stored_pages"] == 1
    assert total["load_seconds"] == 0.5
    a.reset()
    assert a.is_empty()


def drain(side: WorkerSide) -> None:
    """Wait for the worker's stores (and promotions) in flight to end."""
    assert side.writes.drain(side.clock() + 60)


def drop_l3(tmp_path) -> None:
    for segment in tmp_path.rglob("*.kvs"):
        segment.unlink()


def test_a_page_another_engine_stored_on_the_node_loads_from_shared_memory(tmp_path):
    store = StoreOptions(path=str(tmp_path))
    source, target = caches(1), caches(2)
    writer = worker(tmp_path, source, l2=True)
    run = StoredRun("vllm", None, hashes(4))
    writer.save(FabricStepMeta(saves=[psave(run, (0, 1, 2, 3))], store=store))
    drain(writer)
    assert writer.take_stats().data["l2_stored_pages"] == 4
    drop_l3(tmp_path)  # only the node's L2 has them now (the writer still runs)
    reader = worker(tmp_path, target, l2=True)
    reader.load(FabricStepMeta(loads=[pload(run.hashes, (4, 5, 6, 7))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][4:8], source[name][0:4])
    stats = reader.take_stats().data
    assert stats["loaded_pages"] == 4 and stats["l2_loaded_pages"] == 4
    region = reader.pages.l2.path
    writer.close()
    assert region.exists()  # the reader still uses it
    reader.close()
    assert not region.exists()  # its last user removed it


def test_a_damaged_node_l2_page_is_read_from_l3_instead(tmp_path):
    source, target = caches(1), caches(2)
    store = StoreOptions(path=str(tmp_path))
    writer = worker(tmp_path, source, l2=True)
    run = StoredRun("vllm", None, hashes(3))
    writer.save(FabricStepMeta(saves=[psave(run, (0, 1, 2))], store=store))
    drain(writer)
    reader = worker(tmp_path, target, l2=True)
    (found,) = reader.pages.l2.find(reader.pages.keys(TAG, run.hashes[1:2]))
    reader.pages.l2.pool[found[0], 7] ^= 0xFF  # a writer on the node damages the second page
    reader.load(FabricStepMeta(loads=[pload(run.hashes, (5, 6, 7))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][5:8], source[name][0:3])
    stats = reader.take_stats().data
    assert stats["loaded_pages"] == 3 and stats["l2_loaded_pages"] == 2
    reader.close()
    writer.close()


def test_pages_read_from_l3_are_kept_in_the_node_l2_for_the_next_reader(tmp_path):
    """A load's pages read from L3 go to the node's L2 too, reported stored there
    (after their parent), so the fabric's tree counts them for the node."""
    source = caches(1)
    store = stored(tmp_path, source, (0, 1, 2))  # an engine without a node L2 (another node)
    first = worker(tmp_path, caches(2), l2=True)
    h = hashes(3)
    first.load(FabricStepMeta(loads=[pload(h[1:], (4, 5), namespace="vllm", parent=h[0])],
                              store=store))  # fmt: skip
    assert first.load_errors() == set()
    drain(first)  # its promotions are stored by then
    here = node_place(str(tmp_path / "shm"))
    run = StoredRun("vllm", h[0], h[1:], here, PAGE_BYTES)
    assert first.worker_meta().stored == [(TAG, 0, run)]
    first.load(FabricStepMeta(loads=[pload(h[:1], (3,), namespace="vllm")], store=store))
    drain(first)
    drop_l3(tmp_path)
    target = caches(3)
    second = worker(tmp_path, target, l2=True)
    second.load(FabricStepMeta(loads=[pload(hashes(3), (7, 8, 9))], store=store))
    assert second.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][7:10], source[name][0:3])
    second.close()
    first.close()


def forward(side: WorkerSide, meta: FabricStepMeta, layers=LAYERS, after_layer=None) -> None:
    """One engine step as vLLM runs it: start_load_kv, each attention layer
    waiting for its load and saving once computed, then wait_for_save."""
    side.load(meta)
    for name in layers:
        side.wait_layer(name)
        if after_layer is not None:
            after_layer(name)
        side.save_layer(name)
    side.save(meta)


def test_once_the_forward_waits_for_each_layer_loads_run_layer_by_layer(tmp_path):
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1, 2, 3))
    reader = worker(tmp_path, target)
    forward(reader, FabricStepMeta(store=store))  # a step without loads: waits are seen
    seen = {}

    def check(name):  # the layer is whole when the forward reaches it
        seen[name] = torch.equal(target[name][8:12], source[name][0:4])

    meta = FabricStepMeta(loads=[pload(hashes(4), (8, 9, 10, 11))], store=store)
    reader.load(meta)
    assert reader._step is not None  # read on the step thread while the forward runs
    for name in LAYERS:
        reader.wait_layer(name)
        check(name)
        reader.save_layer(name)
    reader.save(meta)
    assert seen == dict.fromkeys(LAYERS, True)
    assert reader.load_errors() == set()
    assert reader.take_stats().data["loaded_pages"] == 4
    reader.close()


def test_a_forward_that_does_not_wait_for_a_layer_gets_its_loads_recomputed(tmp_path, caplog):
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1))
    reader = worker(tmp_path, target)
    forward(reader, FabricStepMeta(store=store))
    meta = FabricStepMeta(loads=[pload(hashes(2), (4, 5))], store=store)
    with caplog.at_level(logging.WARNING):
        forward(reader, meta, layers=LAYERS[:1])  # the second layer never waited
    assert reader.load_errors() == {4, 5}
    assert "did not wait for layers [1]" in caplog.text
    reader.load(meta)  # from then on, read before the forward
    assert reader._step is None and reader.load_errors() == set()
    reader.close()


def test_each_layer_is_saved_as_the_forward_computes_it(tmp_path):
    store = StoreOptions(path=str(tmp_path))
    source = caches(1)
    computed = {n: t[0:2].clone() for n, t in source.items()}
    writer = worker(tmp_path, source)
    run = StoredRun("vllm", None, hashes(2))

    meta = FabricStepMeta(saves=[psave(run, (0, 1))], store=store)
    writer.load(meta)
    writer.wait_layer(LAYERS[0])
    writer.save_layer(LAYERS[0])
    source[LAYERS[0]][0:2] = 0  # the blocks change after layer 0 was saved
    writer.wait_layer(LAYERS[1])
    writer.save_layer(LAYERS[1])
    writer.save(meta)
    writer.close()
    target = caches(2)
    reader = worker(tmp_path, target)
    reader.load(FabricStepMeta(loads=[pload(run.hashes, (5, 6))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][5:7], computed[name])
    reader.close()


class WedgedStore(PageStore):
    """A store whose reads and writes hang until ``go`` is set (a wedged NFS mount),
    then serve ``rows`` (reads) and succeed (writes)."""

    def __init__(self, rows=None):
        super().__init__("vllm")
        self.go = threading.Event()
        self.rows = rows

    def _present(self, keys):
        return [True] * len(keys)

    def _load(self, keys, out, provenance):
        self.go.wait(30)
        out[: len(keys)] = self.rows[: len(keys)]
        return len(keys)

    def _store(self, keys, pages, provenance):
        self.go.wait(30)
        return [True] * len(keys)

    def _delete(self, keys):
        return 0

    def clear(self):
        return True


def wedged_reader(tmp_path, target, source_rows, **options) -> tuple[WorkerSide, WedgedStore]:
    reader = worker(tmp_path, target, timeout_s=0.2, **options)
    reader.pages.store = store = WedgedStore(source_rows)
    return reader, store


def test_a_load_from_a_wedged_store_is_given_up_and_never_writes_a_block_after(tmp_path):
    target = caches(2)
    before = {n: t.clone() for n, t in target.items()}
    rows = torch.full((4, 2 * BLOCK_BYTES), 7, dtype=torch.uint8).numpy()
    reader, store = wedged_reader(tmp_path, target, rows)
    meta = FabricStepMeta(loads=[pload(hashes(4), (8, 9, 10, 11), load_id=5)])
    reader.load(meta)  # read before the forward: given up after timeout_s, not hung
    assert reader.load_errors() == {8, 9, 10, 11}
    meta = reader.worker_meta()
    assert meta.loaded == [(0, 5, 0)]
    assert meta.failed == []  # given up, not found bad: the fabric forgets nothing
    assert reader.take_stats().data["load_timeouts"] == 1
    store.go.set()  # the store comes back: the thread that was reading writes nothing
    reader._stepper.submit(lambda: None).result(timeout=30)  # (it has ended)
    for name in LAYERS:
        assert torch.equal(target[name], before[name])
    reader.close()


def test_a_forward_waiting_for_a_layer_of_a_wedged_load_goes_on_after_timeout_s(tmp_path):
    target = caches(2)
    rows = torch.full((2, 2 * BLOCK_BYTES), 7, dtype=torch.uint8).numpy()
    reader, store = wedged_reader(tmp_path, target, rows)
    forward(reader, FabricStepMeta())  # the forward waits for each layer: layer by layer
    before = {n: t.clone() for n, t in target.items()}
    forward(reader, FabricStepMeta(loads=[pload(hashes(2), (3, 4), load_id=1)]))
    assert reader.load_errors() == {3, 4}
    store.go.set()
    reader._stepper.submit(lambda: None).result(timeout=30)
    for name in LAYERS:
        assert torch.equal(target[name], before[name])
    reader.close()


def test_an_asynchronous_load_from_a_wedged_store_is_reported_done_and_failed(tmp_path):
    target = caches(2)
    before = {n: t.clone() for n, t in target.items()}
    rows = torch.full((3, 2 * BLOCK_BYTES), 7, dtype=torch.uint8).numpy()
    reader, store = wedged_reader(tmp_path, target, rows)
    reader.load(FabricStepMeta(loads=[pload(hashes(3), (1, 2, 3), load_id=2, asynchronous=True)]))
    done: set[str] = set()
    while not done:
        done = reader.finished_loads()
        threading.Event().wait(0.05)
    assert done == {"r"} and reader.load_errors() == {1, 2, 3}
    assert reader.worker_meta().loaded == [(0, 2, 0)]
    store.go.set()
    reader.async_loads._thread.submit(lambda: None).result(timeout=30)
    for name in LAYERS:
        assert torch.equal(target[name], before[name])
    reader.close()


def test_stores_past_the_write_queue_bound_are_dropped_and_counted_not_queued(
    tmp_path, monkeypatch
):
    source = caches(1)
    writer = worker(tmp_path, source, timeout_s=0.2)
    writer.pages.store = store = WedgedStore()
    buffer_bytes = writer.pages.page_bytes  # a store of one page holds one page's buffer
    monkeypatch.setattr(vllm_writes, "MAX_QUEUED_WRITE_BYTES", 2 * buffer_bytes)
    runs = [StoredRun("vllm", None, (h,)) for h in hashes(5)]
    for i, run in enumerate(runs):
        writer.load(FabricStepMeta())
        writer.save(FabricStepMeta(saves=[psave(run, (i,))]))
        assert writer.writes.queued_bytes <= 2 * buffer_bytes
    stats = writer.take_stats().data
    assert stats["store_dropped_pages"] == 3
    meta = writer.worker_meta()
    assert meta.ended == [(0, run.hashes[0]) for run in runs[2:]]  # the dropped ones ended
    store.go.set()
    drain(writer)
    assert {h for _, h in writer.worker_meta().ended} == {r.hashes[0] for r in runs[:2]}
    writer.close()


def test_closing_over_a_wedged_store_waits_at_most_timeout_s(tmp_path):
    writer = worker(tmp_path, caches(1), timeout_s=0.2)
    writer.pages.store = store = WedgedStore()
    writer.save(FabricStepMeta(saves=[psave(StoredRun("vllm", None, hashes(1)), (0,))]))
    writer.close()  # returns with the write still hanging
    assert not writer.writes.started
    store.go.set()


def test_finished_requests_are_reported_sent_once_their_pages_are_gathered(tmp_path):
    source = caches(1)
    writer = worker(tmp_path, source)
    store = StoreOptions(path=str(tmp_path))
    run = StoredRun("vllm", None, hashes(2))
    meta = FabricStepMeta(saves=[psave(run, (3, 4))], store=store, finished=["done"])
    writer.load(meta)
    assert writer.finished_sends() == set()
    writer.save(meta)
    assert writer.finished_sends() == {"done"}
    source[LAYERS[0]][3:5] = 0  # vLLM reuses the blocks: the pages were gathered before
    writer.close()
    target = caches(2)
    reader = worker(tmp_path, target)
    reader.load(FabricStepMeta(loads=[pload(run.hashes, (7, 8))], store=store))
    assert reader.load_errors() == set()
    assert not torch.equal(target[LAYERS[0]][7:9], source[LAYERS[0]][3:5])
    reader.close()


def test_layers_a_draft_model_reads_after_vllm_takes_the_steps_results_are_not_skipped(
    tmp_path,
):
    """With a draft model vLLM takes a step's results (load errors) before the
    draft's forward waits for its layers: those have not run yet, and read blocks
    the finished step has filled. A layer the forward passed is still caught."""
    source, target = caches(1), caches(2)
    store = stored(tmp_path, source, (0, 1))
    reader = worker(tmp_path, target)
    forward(reader, FabricStepMeta(store=store))  # learns the order: layer 0, then 1
    meta = FabricStepMeta(loads=[pload(hashes(2), (4, 5))], store=store)
    reader.load(meta)
    reader.wait_layer(LAYERS[0])  # the target's layer
    assert reader.load_errors() == set()  # results taken before the draft's layer 1
    reader.wait_layer(LAYERS[1])  # the draft's forward
    reader.save(meta)
    for name in LAYERS:
        assert torch.equal(target[name][4:6], source[name][0:2])
    reader.load(meta)
    reader.wait_layer(LAYERS[1])  # layer 0 was passed without a wait
    assert reader.load_errors() == {4, 5}
    reader.close()


def test_loads_behind_a_load_given_up_on_a_wedged_store_fail_at_once(tmp_path):
    target = caches(2)
    rows = torch.full((4, 2 * BLOCK_BYTES), 7, dtype=torch.uint8).numpy()
    reader, store = wedged_reader(tmp_path, target, rows)
    reader.load(FabricStepMeta(loads=[pload(hashes(2), (1, 2), load_id=1)]))
    assert reader.load_errors() == {1, 2}  # given up after timeout_s
    reader.load(FabricStepMeta(loads=[pload(hashes(2), (3, 4), load_id=2)]))
    assert reader.load_errors() == {3, 4}
    # Recomputed at once, not queued behind the wedged thread (to time out again).
    assert reader.take_stats().data["load_timeouts"] == 1
    assert reader.worker_meta().loaded == [(0, 1, 0), (0, 2, 0)]
    store.go.set()
    reader._stepper.submit(lambda: None).result(timeout=30)
    reader.close()


def test_a_steps_single_pages_are_packed_into_one_buffer_and_written_together(tmp_path):
    source = caches(1)
    writer = worker(tmp_path, source)
    store = StoreOptions(path=str(tmp_path))
    runs = [StoredRun("vllm", None, (h,)) for h in hashes(6)]
    meta = FabricStepMeta(saves=[psave(run, (i,)) for i, run in enumerate(runs)], store=store)
    forward(writer, meta)
    assert len(writer.writes) <= 1 and writer.writes.queued_bytes <= 8 * writer.pages.page_bytes
    drain(writer)
    stored_ = writer.worker_meta().stored
    assert sorted(run.hashes for _, _, run in stored_) == sorted(run.hashes for run in runs)
    writer.close()
    target = caches(2)
    reader = worker(tmp_path, target)
    for i, run in enumerate(runs):
        reader.load(FabricStepMeta(loads=[pload(run.hashes, (10 + i,))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][10:16], source[name][0:6])
    reader.close()


def test_the_write_queue_takes_promotions_from_load_threads_while_the_engine_stores(tmp_path):
    """Pages read from L3 are promoted into the node's L2 from load threads while
    the engine's thread stores and collects: nothing is lost, counted twice or
    left in the queue's bytes."""
    import sys

    source = caches(1)
    writer = worker(tmp_path, source, l2=True)
    writer.pages.store = WedgedStore()
    writer.pages.store.go.set()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []

    def promote() -> None:
        try:
            for i in range(300):
                buffer = writer.pages.buffer(1)
                run = StoredRun("vllm", None, (hashlib.sha256(b"p%d" % i).digest(),))
                writer.writes.promote(TAG, run, [f"{i:064x}.{TAG}.0-0-0"], buffer[:1], buffer)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=promote) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        ended = []
        for i in range(300):
            run = StoredRun("vllm", None, (hashlib.sha256(b"s%d" % i).digest(),))
            chunk = vllm_writes.SaveChunk([(TAG, run, (i % BLOCKS,), 0)], writer.pages.buffer(1))
            writer.writes.store(chunk)
            ended += writer.writes.take()[1]
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert writer.writes.drain(writer.clock() + 60)
    ended += writer.writes.take()[1]
    assert writer.writes.queued_bytes == 0
    assert len(ended) == len(set(ended)) == 300  # every store ended once
    writer.close()


def test_a_prefetch_order_reads_pages_from_l3_into_the_node_l2_and_reports_them(
    tmp_path, monkeypatch
):
    """``PREFETCH`` (the fabric's best_effort lookups): the worker reads its shards
    from L3 into its node's L2, a page buffer at a time, reports them stored
    there after their parent, and stops at a page L3 lacks; another node's
    prefetch is not its own."""
    monkeypatch.setattr(vllm_moves, "STAGING_BYTES", PAGE_BYTES)
    source = caches(1)
    store = stored(tmp_path, source, (0, 1, 2))
    h = hashes(5)  # L3 has the first three
    side = worker(tmp_path, caches(2), l2=True)
    here = node_place(str(tmp_path / "shm"))
    orders = [
        Order(TAG, 2, here, 0b11, h[1:], PREFETCH, "vllm", h[0]),
        Order(TAG, 2, "l2@elsewhere", 0b11, h[:1], PREFETCH, "vllm", None),
    ]
    side.save(FabricStepMeta(orders=orders, store=store))
    drain(side)
    assert side.worker_meta().stored == [
        (TAG, 0, StoredRun("vllm", h[0], h[1:3], here, PAGE_BYTES))
    ]
    keys = side.pages.keys(TAG, h)
    assert [f is not None for f in side.pages.l2.find(keys)] == [False, True, True, False, False]
    assert side.take_stats().data["l2_prefetched_pages"] == 2
    drop_l3(tmp_path)  # what the node's L2 holds now loads without L3
    target = caches(3)
    reader = worker(tmp_path, target, l2=True)
    reader.load(FabricStepMeta(loads=[pload(h[1:3], (6, 7))], store=store))
    assert reader.load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][6:8], source[name][1:3])
    for s in (reader, side):
        s.close()


class SlowStore(WedgedStore):
    """Every read takes ``seconds``."""

    def __init__(self, rows, seconds: float):
        super().__init__(rows)
        self.seconds = seconds
        self.reads = 0
        self.go.set()

    def _load(self, keys, out, provenance):
        import time

        self.reads += 1
        time.sleep(self.seconds)
        return super()._load(keys, out, provenance)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_load_past_its_prefetch_limit_starts_no_more_l3_reads_and_blames_no_page(
    tmp_path, monkeypatch, asynchronous
):
    """The ``timeout`` prefetch stop policy: a load's ``limit_s`` after it started,
    no L3 read starts; the pages read by then are loaded, the rest are load
    errors (recomputed) with no verdict on them — the fabric forgets none."""
    monkeypatch.setattr(vllm_moves, "STAGING_BYTES", PAGE_BYTES)  # a read per page
    rows = torch.full((1, 2 * BLOCK_BYTES), 7, dtype=torch.uint8).numpy()
    target = caches(2)
    reader = worker(tmp_path, target, timeout_s=30.0)
    reader.pages.store = store = SlowStore(rows, 0.2)
    job = pload(hashes(4), (8, 9, 10, 11), load_id=3, asynchronous=asynchronous, limit_s=0.1)
    reader.load(FabricStepMeta(loads=[job]))
    if asynchronous:
        deadline = reader.clock() + 30
        while "r" not in reader.finished_loads():
            assert reader.clock() < deadline
    assert reader.load_errors() == {9, 10, 11}
    meta = reader.worker_meta()
    assert meta.loaded == [(0, 3, 1)] and meta.failed == []
    assert store.reads == 1
    assert bool((target[LAYERS[0]][8].view(torch.uint8) == 7).all())
    reader.close()


def test_each_batch_of_orders_is_reported_carried_out_once_by_each_rank(tmp_path):
    """A rank counts a step's batch of orders done once it carried out its share —
    at once when none is its own — so the scheduler stops stepping for them."""
    store = StoreOptions(path=str(tmp_path))
    side = worker(tmp_path, caches(1), l2=True)
    side.save(FabricStepMeta(store=store))
    assert side.worker_meta() is None  # no orders: nothing to count
    other = Order(TAG, 2, L3, 0b10, hashes(1))  # rank 1's
    side.save(FabricStepMeta(orders=[other], store=store))
    assert side.worker_meta().orders_done == 1
    mine_ = Order(TAG, 2, L3, 0b01, hashes(2))
    side.save(FabricStepMeta(orders=[mine_, other], store=store))
    drain(side)
    assert side.worker_meta().orders_done == 1
    side.close()
