"""KV events over ZMQ, read the way a router reads them: plain ZMQ sockets (SUB,
and DEALER for replay) and msgspec structs declared here to the vLLM / SGLang
layout — nothing imported from kvfabric's own wire module."""

import hashlib

import msgspec
import pytest
import zmq

from fabric.cache.keys import pack_tokens
from fabric.errors import ConfigError
from fabric.local import LocalFabric
from tests.helpers import prompt, small_config, storage_options

END_SEQ = b"\xff" * 8


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list
    data_parallel_rank: int | None


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVBatch(Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decode_batch = msgspec.msgpack.Decoder(KVBatch).decode


def expected_hashes(tokens: list[int], page: int, namespace: str = "default") -> list[int]:
    """The chain as documented: SHA-256 over (previous hash, page as uint32 LE),
    seeded by the namespace; routers get each hash's last 8 bytes big-endian."""
    prev = hashlib.sha256(b"kvfabric/ns\0" + namespace.encode()).digest()
    out = []
    for start in range(0, len(tokens) - len(tokens) % page, page):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page])
        prev = hashlib.sha256(prev + data).digest()
        out.append(int.from_bytes(prev[-8:], "big"))
    return out


@pytest.fixture
def fabric(tmp_path):
    f = LocalFabric(
        small_config(
            *storage_options(tmp_path),
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            "events.topic=kv@fabric",
            "events.data_parallel_rank=3",
        )
    )
    yield f
    f.close()


def receive(sock: zmq.Socket, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    """Every message that arrives until ``timeout_ms`` passes without one."""
    got = []
    while sock.poll(timeout_ms):
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"kv@fabric"
        got.append((int.from_bytes(seq, "big"), payload))
        timeout_ms = 300
    return got


def listen(fabric, sub: zmq.Socket, seeds) -> list[tuple[int, bytes]]:
    """Serve prompts until the subscriber hears something (ZMQ's slow joiner: a
    subscription takes a moment to reach the publisher; what is sent before is
    lost to this subscriber), then everything until the line goes quiet."""
    for seed in seeds:
        r = fabric.serve(pack_tokens(prompt(seed, pages=2)))
        assert r.error is None and fabric.core.release(r.lease)
        fabric.settle()
        got = receive(sub, timeout_ms=500)
        if got:
            return got
    pytest.fail("the subscriber never heard the publisher")


def test_a_subscriber_sees_a_gap_replays_it_and_decodes_every_event(fabric):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        first = prompt(1, pages=5)
        r = fabric.serve(pack_tokens(first))
        assert r.error is None and fabric.core.release(r.lease)
        second = first[:12] + [9000 + t for t in range(12)]  # shares 3 pages
        r2 = fabric.serve(pack_tokens(second))
        assert r2.error is None and fabric.core.release(r2.lease)
        fabric.settle()
        assert fabric.publisher.flush(), "the batches are sent before anyone subscribes"
        sent_before = fabric.publisher.published_batches
        assert sent_before > 0, "nobody listened: these batches are only in the replay buffer"
        sub.connect(fabric.publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@fabric")
        live = listen(fabric, sub, range(100, 140))
        seqs = [s for s, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gap while listening"
        assert seqs[0] >= sent_before > 0, "a gap: batches 0..k-1 were missed"

        # Replay the gap from the ROUTER.
        dealer.connect(fabric.publisher.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        replayed = []
        while dealer.poll(2000):
            frames = dealer.recv_multipart()
            assert len(frames) == 3
            if frames[1] == END_SEQ:
                assert frames == [b"", END_SEQ, b""]
                break
            assert frames[0] == b"kv@fabric"
            replayed.append((int.from_bytes(frames[1], "big"), frames[2]))
        else:
            pytest.fail("no end-of-replay marker")
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert dict(replayed)[seqs[0]] == live[0][1], "a replayed batch is the batch sent"
        assert len(replayed) >= seqs[-1] + 1

        batches = [decode_batch(p) for _, p in replayed]
        assert all(b.data_parallel_rank == 3 and b.ts > 0 for b in batches)
        events = [e for b in batches for e in b.events]
        raw = msgspec.msgpack.decode(replayed[0][1])
        assert isinstance(raw, list) and len(raw) == 3, "payload: [ts, events, rank]"
        stored_raw = next(e for e in raw[1] if e["type"] == "BlockStored")
        assert "lora_name" in stored_raw and stored_raw["lora_name"] is None, "vLLM requires it"
        assert stored_raw["namespace"] == "default"

        gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
        chain = expected_hashes(first, 4)
        assert gpu[0].block_hashes == chain and gpu[0].parent_block_hash is None
        assert gpu[0].token_ids == first[:20] and gpu[0].block_size == 4
        assert gpu[0].lora_id is None
        new = expected_hashes(second, 4)
        tail = next(e for e in gpu if e.block_hashes == new[3:])
        assert tail.parent_block_hash == new[2] == chain[2], "the shared prefix links them"
        assert tail.token_ids == second[12:]
        media = {e.medium for e in events if isinstance(e, BlockStored)}
        assert media == {"GPU", "CPU", "STORAGE"}, "write-through to L2 and backup to L3"
        assert all(
            0 <= h < 2**64 for e in events if hasattr(e, "block_hashes") for h in e.block_hashes
        )
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_evictions_and_a_reset_reach_the_subscriber(fabric):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(fabric.publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        heard = listen(fabric, sub, range(100, 140))
        for seed in range(8):  # 8 x 6 pages > L1 (24 pages): evictions
            r = fabric.serve(pack_tokens(prompt(seed, pages=6)))
            assert r.error is None and fabric.core.release(r.lease)
        fabric.settle()
        fabric.core.reset("test")
        fabric.step()
        events = [e for _, p in heard + receive(sub) for e in decode_batch(p).events]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert removed and {e.medium for e in removed} <= {"GPU", "CPU"}
        assert any(e.medium == "GPU" for e in removed)
        assert isinstance(events[-1], AllBlocksCleared)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_events_config_is_checked_and_a_busy_address_is_one_line(fabric):
    with pytest.raises(ConfigError, match="events.endpoint=.*cache.kv_events=true"):
        small_config("cache.kv_events=false", "events.endpoint=tcp://127.0.0.1:5999")
    with pytest.raises(ConfigError, match=r"events\.endpoint='udp://x'"):
        small_config("events.endpoint=udp://x")
    with pytest.raises(ConfigError, match="events.replay_endpoint=.*needs events.endpoint"):
        small_config("events.replay_endpoint=tcp://127.0.0.1:*")
    taken = fabric.publisher.endpoint
    with pytest.raises(ConfigError, match=f"events.endpoint='{taken}' cannot be bound"):
        LocalFabric(small_config(f"events.endpoint={taken}"))
