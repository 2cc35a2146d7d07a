"""kvfabric as a vLLM 0.33 secondary offloading tier, loaded by vLLM's own
``SecondaryTierFactory`` over a memoryview of a CPU tensor (the primary tier),
as vLLM's own ``tests/v1/kv_offload/tiering/test_fs_tier.py`` drives its file
system tier; side by side with that tier (``fs``) on the same chunks; and under
vLLM's scheduler-side ``TieringOffloadingManager`` (cascade from the CPU tier,
promotion back in another worker).

Not run: vLLM's scheduler and GPU workers (its wheel's compiled kernels need
CUDA; only its Python modules are installed here)."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from fabric.engines.vllm import KvFabricTier
from fabric.errors import ConfigError
from tests.interop.support import corrupt_one_payload_byte, offloading_spec, page_aligned

pytestmark = pytest.mark.interop

CHUNKS, CHUNK_FLOATS = 8, 4096
CTX = ReqContext(req_id="test")


def key(n: int, group: int = 0):
    return make_offload_key(n.to_bytes(32, "big"), group)


def job(job_id, keys, chunk_ids, promotion=False):
    return TransferJob(job_id, keys, np.array(chunk_ids, dtype=np.int64), promotion, CTX)


def make_tier(where, tensor=None, spec=None, **options):
    tensor = torch.zeros(CHUNKS, CHUNK_FLOATS) if tensor is None else tensor
    config = {
        "type": "KvFabricTier",
        "module_path": "fabric.engines.vllm",
        "path": str(where),
        **options,
    }
    tier = SecondaryTierFactory.create_secondary_tier(
        config, memoryview(tensor.numpy()), spec or offloading_spec()
    )
    return tier, tensor


def finish(tier):
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup(tier, keys, ctx=CTX, timeout=5.0):
    """vLLM's lookup cycle: ``lookup`` (RETRY while in flight), the step's end
    flushes the batch to the lookup thread, ``lookup`` again."""
    results = [tier.lookup(k, ctx) for k in keys]
    deadline = time.monotonic() + timeout
    while LookupResult.RETRY in results and time.monotonic() < deadline:
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)
        results = [tier.lookup(k, ctx) for k in keys]
    return results


@pytest.fixture
def tier(tmp_path):
    tier, tensor = make_tier(tmp_path)
    yield tier, tensor
    tier.shutdown()


def test_vllms_factory_loads_the_tier(tier):
    t, _ = tier
    assert isinstance(t, KvFabricTier) and t.medium is Medium.STORAGE


def test_miss_store_hit_then_load_into_other_slots_with_equal_bytes(tier):
    t, tensor = tier
    keys = [key(1), key(2), key(3)]
    assert lookup(t, keys) == [LookupResult.MISS] * 3
    tensor[:3] = torch.rand(3, CHUNK_FLOATS)
    expected = tensor[:3].clone()
    t.submit_store(job(1, keys, [0, 1, 2]))
    (stored,) = finish(t)
    assert stored.job_id == 1 and stored.success
    t.on_request_finished(CTX)
    assert lookup(t, keys) == [LookupResult.HIT] * 3
    tensor.zero_()
    t.submit_load(job(2, keys, [5, 6, 7], promotion=True))
    (loaded,) = finish(t)
    assert loaded.success and torch.equal(tensor[5:8], expected)
    t.submit_load(job(3, keys, [7, 0, 4], promotion=True))  # slots not in a run
    assert finish(t)[0].success and torch.equal(tensor[[7, 0, 4]], expected)


def test_a_missing_chunk_fails_the_load_from_there_and_becomes_a_miss(tier):
    t, tensor = tier
    tensor[:2] = torch.rand(2, CHUNK_FLOATS)
    t.submit_store(job(1, [key(10), key(11)], [0, 1]))
    assert finish(t)[0].success
    assert lookup(t, [key(10), key(11)]) == [LookupResult.HIT] * 2
    t.submit_load(job(2, [key(10), key(11), key(99)], [4, 5, 6], promotion=True))
    (result,) = finish(t)
    assert not result.success and tuple(result.successful_keys) == (key(10), key(11))


def test_a_corrupt_chunk_is_a_failed_load_never_a_hit(tmp_path):
    t, tensor = make_tier(tmp_path)
    try:
        tensor[:3] = torch.rand(3, CHUNK_FLOATS)
        keys = [key(1), key(2), key(3)]
        t.submit_store(job(1, keys, [0, 1, 2]))
        assert finish(t)[0].success
        corrupt_one_payload_byte(tmp_path, which=1)
        t.submit_load(job(2, keys, [4, 5, 6], promotion=True))
        (result,) = finish(t)
        assert not result.success and tuple(result.successful_keys) == (key(1),)
        assert lookup(t, [key(2)]) == [LookupResult.MISS], "a failed chunk is a miss from now on"
        assert t.store.backend.stats()["refused_checksum"] == 1
        t.on_request_finished(CTX)
        t.submit_store(job(3, keys, [0, 1, 2]))  # vLLM offloads it again: written anew
        assert finish(t)[0].success
        assert lookup(t, keys) == [LookupResult.HIT] * 3
        tensor[4:] = 0
        t.submit_load(job(4, keys, [4, 5, 6], promotion=True))
        assert finish(t)[0].success and torch.equal(tensor[4:7], tensor[:3])
    finally:
        t.shutdown()


def test_chunks_are_shared_between_workers_of_one_configuration_only(tmp_path):
    data = torch.rand(CHUNKS, CHUNK_FLOATS)
    writer, _ = make_tier(tmp_path, data.clone())
    writer.submit_store(job(1, [key(1)], [0]))
    assert finish(writer)[0].success
    writer.shutdown()

    def sees(**kw):
        spec_kw = {k: kw.pop(k) for k in ("model", "dtype", "tp_size", "rank") if k in kw}
        t, _ = make_tier(tmp_path, spec=offloading_spec(**spec_kw), **kw)
        try:
            return lookup(t, [key(1)]) == [LookupResult.HIT]
        finally:
            t.shutdown()

    assert sees()
    assert not sees(model="another-model")
    assert not sees(dtype="bfloat16")
    assert not sees(tp_size=2)
    assert not sees(namespace="tenant-b")
    assert not sees(backend="file"), "another store format in the same directory"
    t, _ = make_tier(tmp_path)
    try:
        assert lookup(t, [key(1, group=1)]) == [LookupResult.MISS], "another KV cache group"
    finally:
        t.shutdown()


def test_stored_chunks_are_events_when_asked_for(tmp_path):
    t, _ = make_tier(
        tmp_path, spec=offloading_spec(events=True), enable_kv_events=True, locality="LOCAL"
    )
    try:
        t.submit_store(job(1, [key(1), key(2)], [0, 1]))
        finish(t)
        (event,) = list(t.take_events())
        assert (
            event.keys == [key(1), key(2)] and not event.removed and event.medium is Medium.STORAGE
        )
        assert list(t.take_events()) == []
    finally:
        t.shutdown()


def test_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of path"):
        make_tier(tmp_path, path="")
    with pytest.raises(ConfigError, match="'colour' is unknown"):
        make_tier(tmp_path, colour="red")
    with pytest.raises(ConfigError, match="io_threads"):
        make_tier(tmp_path, io_threads="four")


def test_a_primary_view_smaller_than_the_declared_chunks_is_refused_naming_both(tmp_path):
    """The spec declares blocks of more bytes than a chunk of the view holds: the
    view is not this geometry's pool (a chunk would hold part of a block)."""
    spec = offloading_spec()
    spec.config = dataclasses.replace(spec.config, worker_kv_bytes_per_block=CHUNK_FLOATS * 8)
    with pytest.raises(
        ConfigError, match=f"is {CHUNK_FLOATS * 4} bytes, but .* = {CHUNK_FLOATS * 8}"
    ):
        make_tier(tmp_path, spec=spec)


def test_the_same_chunks_round_trip_through_vllms_own_fs_tier(tmp_path):
    """The baseline bench/engines.py measures against: vLLM's file system tier
    on the same chunks, for the same round trip."""
    tensor = page_aligned(CHUNKS, CHUNK_FLOATS)
    tensor[:] = torch.rand(CHUNKS, CHUNK_FLOATS)
    expected = tensor[:4].clone()
    fs = SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root_dir": str(tmp_path / "fs"), "n_read_threads": 2, "n_write_threads": 2},
        memoryview(tensor.numpy()),
        offloading_spec(),
    )
    try:
        keys = [key(i) for i in range(4)]
        fs.submit_store(job(1, keys, [0, 1, 2, 3]))
        assert finish(fs)[0].success
        tensor.zero_()
        fs.submit_load(job(2, keys, [4, 5, 6, 7], promotion=True))
        assert finish(fs)[0].success and torch.equal(tensor[4:], expected)
    finally:
        fs.shutdown()


def _worker(engine_id: str, path, chunks: int, chunk_bytes: int):
    """One vLLM worker's scheduler-side offloading manager, built from vLLM's own
    classes: its shared-memory CPU region, its CPU primary tier and its
    TieringOffloadingManager, with the kvfabric tier (made by vLLM's factory
    over the primary's memoryview) as its secondary tier."""
    region = SharedOffloadRegion(engine_id, chunks, 0, chunk_bytes, 16)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=chunks, mmap_region=region)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvFabricTier", "module_path": "fabric.engines.vllm", "path": str(path)},
        primary.get_kv_memoryview(),
        offloading_spec(),
    )
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    memory = np.asarray(primary.get_kv_memoryview()).view(np.uint8)
    return manager, memory


def _steps(manager, until, steps: int = 500):
    for _ in range(steps):
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        if until():
            return True
        time.sleep(0.01)
    return False


def test_vllms_tiering_manager_cascades_to_kvfabric_and_another_worker_promotes_back(tmp_path):
    chunks, chunk_bytes = 8, 4 * 4096
    keys = [key(100 + i) for i in range(3)]
    a, memory_a = _worker(f"kvf-a-{os.getpid()}", tmp_path, chunks, chunk_bytes)
    try:
        ctx = ReqContext(req_id="writer")
        a.on_new_request(ctx)
        out = a.prepare_store(keys, ctx)
        slots = list(out.store_spec.block_ids)
        data = np.random.default_rng(1).integers(0, 256, (3, chunk_bytes), dtype=np.uint8)
        memory_a[slots] = data  # what the GPU -> CPU copy puts there
        a.complete_store(keys, ctx, success=True)  # cascades to the kvfabric tier
        a.on_request_finished(ctx)
        assert _steps(a, lambda: not a.has_pending_work())
    finally:
        a.shutdown()
    b, memory_b = _worker(f"kvf-b-{os.getpid()}", tmp_path, chunks, chunk_bytes)
    try:
        ctx = ReqContext(req_id="reader")
        b.on_new_request(ctx)
        assert _steps(b, lambda: [b.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3)
        spec = b.prepare_load(keys, ctx)
        assert np.array_equal(memory_b[list(spec.block_ids)], data), "promoted byte for byte"
        b.complete_load(keys, ctx)
        b.on_request_finished(ctx)
    finally:
        b.shutdown()
