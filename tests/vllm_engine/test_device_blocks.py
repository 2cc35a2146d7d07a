"""A replica's own blocks as the tree's L1 place (``fabric.engines.vllm_l1``),
from vLLM's own KV event publisher: blocks cached are reported in L1 as runs
of the connector's page hashes (every rank), blocks evicted dropped, a reset or
a gap in the events drops everything, and blocks of requests the connector
does not serve are passed over."""

from __future__ import annotations

import time

import pytest

from fabric.cache.engine_input import L1_AT, StoredRun
from fabric.cache.keys import namespace_seed
from fabric.engines.vllm_l1 import DeviceBlocks, subscribe_endpoint
from fabric.engines.vllm_requests import TrackedRequest
from tests.vllm_engine.test_scheduler_side import BLOCK, FakeLink, Req

pytestmark = pytest.mark.vllm
TAG = "0123456789abcdef"


def theirs(i: int) -> bytes:
    return bytes([i + 1]) * 32  # vLLM's hash of a block (opaque here)


def published(i: int):
    """The block's hash as vLLM publishes it (64-bit ints by default)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(theirs(i))


class Events:
    """vLLM's own publisher, and a subscriber that has joined (ZeroMQ drops what a
    subscriber not yet connected would have got)."""

    def __init__(self, tmp_path) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.endpoint = f"ipc://{tmp_path}/kv-events"
        self.publisher = ZmqEventPublisher(0, endpoint=self.endpoint, topic="kv")
        self.l1 = DeviceBlocks(self.endpoint, "kv", BLOCK, max_names=64)
        self.link = FakeLink()
        self.link.drops = []
        self.link.drop = lambda tag, world, place, hashes, everything=False: self.link.drops.append(
            (place, list(hashes), everything)
        )
        from vllm.distributed.kv_events import KVEventBatch

        deadline = time.monotonic() + 30
        while self.l1._seq < 0:  # a probe until one arrives
            assert time.monotonic() < deadline, "the subscriber never joined"
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[self._removed([1])]))
            time.sleep(0.05)
            self.l1.poll(TAG, 2, self.link)
        while self.l1._socket.poll(200):  # the probes still on their way
            self.l1.poll(TAG, 2, self.link)
        self.link.drops.clear()

    @staticmethod
    def _removed(hashes):
        from vllm.distributed.kv_events import BlockRemoved

        return BlockRemoved(block_hashes=list(hashes), medium="GPU")

    def send(self, *events) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        seq = self.l1._seq
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
        deadline = time.monotonic() + 10
        while self.l1._seq == seq:
            assert time.monotonic() < deadline, "the event never came"
            self.l1.poll(TAG, 2, self.link)
            time.sleep(0.01)

    def close(self) -> None:
        self.l1.close()
        self.publisher.shutdown()


def stored(hashes, parent=None, medium="GPU"):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=BLOCK,
        lora_id=None, medium=medium, lora_name=None,
    )  # fmt: skip


def test_blocks_vllm_caches_and_evicts_are_this_replicas_l1(tmp_path):
    events = Events(tmp_path)
    try:
        link, l1 = events.link, events.l1
        assert l1.place.startswith(L1_AT)
        r = Req("r", list(range(17)), block_hashes=[theirs(i) for i in range(4)])
        state = TrackedRequest(r, "vllm", namespace_seed("vllm"), TAG)
        l1.learn(state)
        ours = state.hashes[:4]
        events.send(
            stored([published(0), published(1)]),
            stored([published(2), published(3)], published(1)),
        )
        run = StoredRun("vllm", None, tuple(ours), l1.place)
        assert link.reports == [(TAG, {0: [run], 1: [run]})]  # both ranks: one run
        events.send(events._removed([published(3), published(9)]))  # one never seen
        assert link.drops == [(l1.place, [ours[3]], False)]
        assert l1.counts["unnamed"] >= 1
        # An offloading tier's events are not this replica's blocks.
        events.send(stored([published(3)], published(2), medium="CPU"))
        assert len(link.reports) == 1
        # A reset (AllBlocksCleared), and a gap in the events, drop everything.
        from vllm.distributed.kv_events import AllBlocksCleared

        events.send(AllBlocksCleared())
        assert link.drops[-1] == (l1.place, [], True)
        l1._seq -= 2  # as if two batches were missed
        events.send(stored([published(0)]))
        assert link.drops[-1] == (l1.place, [], True) and l1.counts["gaps"] == 1
        assert link.reports[-1] == (
            TAG, {r: [StoredRun("vllm", None, (ours[0],), l1.place)] for r in (0, 1)}
        )  # fmt: skip
    finally:
        events.close()


def test_l1_is_followed_only_where_vllm_publishes_events_this_process_can_read():
    from types import SimpleNamespace

    def config(endpoint, enabled=True, caching=True, publisher="zmq"):
        events = SimpleNamespace(
            enable_kv_cache_events=enabled, publisher=publisher, endpoint=endpoint, topic=""
        )
        return SimpleNamespace(
            kv_events_config=events,
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
            parallel_config=SimpleNamespace(data_parallel_index=1),
        )

    assert subscribe_endpoint(config("tcp://*:5557")) == "tcp://127.0.0.1:5558"  # DP rank 1
    assert subscribe_endpoint(config("tcp://*:0")) is None  # a port only vLLM knows
    assert subscribe_endpoint(config("tcp://10.0.0.1:5557")) is None  # vLLM connects there
    assert subscribe_endpoint(config("tcp://*:5557", enabled=False)) is None
    assert subscribe_endpoint(config("tcp://*:5557", caching=False)) is None
    assert subscribe_endpoint(config("tcp://*:5557", publisher="null")) is None
