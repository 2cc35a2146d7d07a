"""kvfabric's KV event feed read with the engines' own structs: every batch a
router receives — L1/L2 traffic, L3 backups, L3 evictions, ``storage clear``,
``detach``, a reset and a coordinator restart — decodes with SGLang 0.5.20's
``KVEventBatch`` (``events.dialect=sglang``) and vLLM 0.33's (``vllm``), and
the media are the names each engine uses."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from fabric.cache.keys import pack_tokens
from fabric.driver.local import LocalFabric
from tests.helpers import prompt, small_config, storage_options

pytestmark = pytest.mark.interop


def engine_batch(dialect: str):
    if dialect == "sglang":
        from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium

        return KVEventBatch, {m.value for m in StorageMedium}
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, KVEventBatch

    return KVEventBatch, {MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE}


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_every_batch_decodes_with_the_engine_s_structs_removals_from_storage_included(
    tmp_path, dialect
):
    batch_type, engine_media = engine_batch(dialect)
    decode = msgspec.msgpack.Decoder(batch_type).decode
    f = LocalFabric(
        small_config(
            *storage_options(tmp_path, "storage.max_bytes=30000"),
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            f"events.dialect={dialect}",
        )
    )
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for seed in range(12):  # through every tier; the small L3 evicts
            r = f.serve(pack_tokens(prompt(seed, pages=6)))
            assert r.error is None and f.core.release(r.lease)
            f.settle()
        f.core.rounds.reset("test")
        f.step()
        f.clear_storage()
        r = f.serve(pack_tokens(prompt(50, pages=6)))
        assert r.error is None and f.core.release(r.lease)
        f.settle()
        assert f.detach_storage()
        f.restart_coordinator()
        f.step()
        assert f.publisher.flush()
        # Everything, from the start, through the replay socket.
        dealer.connect(f.publisher.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        payloads = []
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            if frames[-2] == b"\xff" * 8:
                break
            payloads.append(frames[-1])
        assert len(payloads) == f.publisher.published_batches
        events = [e for p in payloads for e in decode(p).events]  # every one decodes
        kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
        media = {m for _, m in kinds if m is not None}
        assert media <= engine_media and len(media) == 3, media
        storage = {"sglang": "DISK", "vllm": "STORAGE"}[dialect]
        for wanted in (("BlockStored", storage), ("BlockRemoved", storage)):
            assert wanted in kinds, (wanted, kinds)
        assert ("AllBlocksCleared", None) in kinds
        assert f.storage.spec is None
    finally:
        dealer.close(linger=0)
        ctx.term()
        f.close()
