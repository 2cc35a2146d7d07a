"""KV events over ZMQ, read the way a router reads them: plain ZMQ sockets (SUB,
and DEALER for replay) and msgspec structs declared here to the vLLM / SGLang
layout — nothing imported from kvfabric's own wire module."""

import hashlib
import itertools

import msgspec
import pytest
import zmq

from fabric.cache.keys import pack_tokens
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError
from tests.helpers import prompt, small_config, storage_options, wait_for

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
        before = [e for _, p in heard + receive(sub) for e in decode_batch(p).events]
        removed = [e for e in before if isinstance(e, BlockRemoved)]
        assert removed and {e.medium for e in removed} <= {"GPU", "CPU"}
        assert any(e.medium == "GPU" for e in removed)
        fabric.core.rounds.reset("test")
        fabric.step()
        after = [e for _, p in receive(sub) for e in decode_batch(p).events]
        assert after and all(isinstance(e, BlockRemoved) for e in after)
        assert {e.medium for e in after} == {"GPU", "CPU"}, "a reset: L1 and L2 gone, L3 kept"
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


class Router:
    """A router's index built only from the feed: it subscribes, replays whatever
    it missed (the start included) and applies batches in sequence order."""

    def __init__(self, ctx: zmq.Context, publisher, topic: bytes = b"") -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(publisher.endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(publisher.replay_endpoint)
        self.next_seq = 0
        self.view: dict[str, set[int]] = {}

    def sync(self) -> None:
        while self.sub.poll(300):
            _, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self._replay(seq)
            if seq == self.next_seq:
                self._apply(payload)

    def _replay(self, until: int) -> None:
        self.dealer.send(self.next_seq.to_bytes(8, "big"))
        while self.dealer.poll(2000):
            frames = self.dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                return
            seq = int.from_bytes(frames[-2], "big")
            if seq == self.next_seq and seq < until:
                self._apply(frames[-1])
        pytest.fail("no end of replay")

    def _apply(self, payload: bytes) -> None:
        self.next_seq += 1
        for e in decode_batch(payload).events:
            if isinstance(e, AllBlocksCleared):
                self.view.clear()
            elif isinstance(e, BlockStored):
                self.view.setdefault(e.medium, set()).update(e.block_hashes)
            else:
                self.view.setdefault(e.medium, set()).difference_update(e.block_hashes)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def inventory(f: LocalFabric, media: dict[str, str]) -> dict[str, set[int]]:
    """What the fabric holds, by medium name: L1 and L2 from its tree, L3 the pages
    it knows its store holds (each checked there on every shard)."""
    from fabric.cache.keys import chain_hashes, namespace_seed

    tree = f.core.cache.tree
    out: dict[str, set[int]] = {name: set() for name in media.values()}
    stack = [(c, namespace_seed(c.namespace)) for c in tree.root.children.values()]
    while stack:
        node, prev = stack.pop()
        hashes = chain_hashes(prev, node.key, tree.page_bytes)
        if node.device_value is not None:
            out[media["device"]] |= {low64(h) for h in hashes}
        if node.host_value is not None and node.write_op is None:
            out[media["host"]] |= {low64(h) for h in hashes}
        stack.extend((child, hashes[-1]) for child in node.children.values())
    known = f.core.cache.events.l3
    keys = [f.storage.key(h, sfx) for h in known for sfx in f.storage.suffixes]
    assert not keys or f.storage.backend.exists(keys) == len(keys)
    out[media["storage"]] = {low64(h) for h in known}
    return out


def low64(page_hash: bytes) -> int:
    return int.from_bytes(page_hash[-8:], "big")


MEDIA = {
    "vllm": {"device": "GPU", "host": "CPU", "storage": "STORAGE"},
    "sglang": {"device": "GPU", "host": "CPU_PINNED", "storage": "DISK"},
}


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_a_router_that_replays_and_follows_holds_the_inventory_after_every_change(
    tmp_path, dialect
):
    """Evictions in every tier (L1 and L2 small, a small L3 file store), a reset,
    ``storage clear``, ``detach`` and ``attach``, and a coordinator restart: after
    each, a router built only from the feed (replay, then follow) holds exactly
    what the fabric holds, in the medium names of the dialect asked for."""
    media = MEDIA[dialect]
    f = LocalFabric(
        small_config(
            *storage_options(tmp_path, "storage.max_bytes=30000"),
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            f"events.dialect={dialect}",
        )
    )
    ctx = zmq.Context()
    router = Router(ctx, f.publisher)

    def serve(seeds) -> None:
        for seed in seeds:
            r = f.serve(pack_tokens(prompt(seed, pages=6)))
            assert r.error is None and f.core.release(r.lease)
            f.settle()

    def agrees() -> None:
        f.step()
        assert f.publisher.flush()
        router.sync()
        truth = inventory(f, media)
        assert {m: router.view.get(m, set()) for m in truth} == truth

    try:
        serve(range(12))  # 72 pages through L1 (24) and L2 (48): evictions in both
        agrees()
        assert f.storage.backend.counters["evicted_pages"] > 0, "the store was meant to evict"
        assert router.view[media["storage"]] and router.view[media["host"]]
        serve(range(3))  # hits from L3 re-enter L2 and L1
        agrees()
        f.core.rounds.reset("test")
        agrees()
        assert not router.view[media["device"]] and router.view[media["storage"]]
        f.clear_storage()
        agrees()
        assert not router.view[media["storage"]]
        serve([40, 41])
        agrees()
        spec = f.storage.spec
        assert f.detach_storage()
        agrees()
        assert not router.view[media["storage"]]
        f.attach_storage(*spec)
        serve([40, 41, 42])  # the store's pages found again by hit queries
        agrees()
        assert router.view[media["storage"]]
        f.restart_coordinator()
        agrees()
    finally:
        router.close()
        ctx.term()
        f.close()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_replay_replies_keep_a_req_socket_s_delimiter_and_the_dialect_s_frames(tmp_path, dialect):
    f = LocalFabric(
        small_config(
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            "events.topic=kv",
            f"events.dialect={dialect}",
        )
    )
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    try:
        r = f.serve(pack_tokens(prompt(1, pages=3)))
        assert r.error is None and f.core.release(r.lease)
        f.settle()
        assert f.publisher.flush()
        req.connect(f.publisher.replay_endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])  # as a REQ socket frames it
        got = []
        while req.poll(2000):
            frames = req.recv_multipart()
            assert frames[0] == b"", "the delimiter comes back first"
            got.append(frames[1:])
            if END_SEQ in frames:
                break
        *batches, end = got
        if dialect == "sglang":
            assert end == [END_SEQ, b""]
            assert all(len(b) == 2 for b in batches)
            seqs = [int.from_bytes(b[0], "big") for b in batches]
        else:
            assert end == [b"", END_SEQ, b""]
            assert all(len(b) == 3 and b[0] == b"kv" for b in batches)
            seqs = [int.from_bytes(b[1], "big") for b in batches]
        assert batches and seqs == list(range(len(batches)))
        decode_batch(batches[0][-1])
    finally:
        req.close(linger=0)
        ctx.term()
        f.close()


def test_a_replay_flood_never_holds_up_the_live_feed_and_bad_requests_get_a_short_answer(
    tmp_path, caplog
):
    """Many clients replaying the whole buffer over and over: every live batch
    still goes out as it is published (the publisher's queue drains), replays
    still finish, a malformed request is answered in one short frame, a huge one
    is dropped by ZMQ, and nothing untrusted reaches the log beyond a prefix."""
    import threading

    from fabric.coordinator.publisher import ERROR_SEQ

    f = LocalFabric(
        small_config(
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            "events.buffer_batches=2000",
        )
    )
    ctx = zmq.Context()
    stop = threading.Event()
    finished = []

    def flood() -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f.publisher.replay_endpoint)
        try:
            while not stop.is_set():
                sock.send((0).to_bytes(8, "big"))
                while not stop.is_set() and sock.poll(5000):
                    frames = sock.recv_multipart()
                    if frames[-2] in (END_SEQ, ERROR_SEQ):
                        finished.append(frames[-2] == END_SEQ)
                        break
        finally:
            sock.close(linger=0)

    try:
        for seed in range(150):  # a deep buffer for every replay to walk
            r = f.serve(pack_tokens(prompt(seed, pages=2)))
            assert r.error is None and f.core.release(r.lease)
        assert f.publisher.flush()
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(20)]
        for t in threads:
            t.start()
        before = f.publisher.published_batches
        for seed in range(150, 200):
            r = f.serve(pack_tokens(prompt(seed, pages=2)))
            assert r.error is None and f.core.release(r.lease)
        assert f.publisher.flush(30), "the live feed drained while 20 clients replayed"
        assert f.publisher.published_batches > before
        assert wait_for(lambda: sum(finished) >= 20, 60), "replays finish too"
        stop.set()
        for t in threads:
            t.join(10)

        bad = ctx.socket(zmq.DEALER)
        bad.connect(f.publisher.replay_endpoint)
        bad.send_multipart([b"\x00" * 3, b"more"])
        assert bad.poll(5000)
        *_, seq, why = bad.recv_multipart()
        assert seq == ERROR_SEQ and b"8 bytes" in why and len(why) < 200
        bad.send(b"x" * (1 << 20))  # past the socket's message limit: dropped
        assert not bad.poll(1000)
        bad.close(linger=0)
        assert f.publisher.stats()["replay_refused"] >= 1
        assert all(len(r.getMessage()) < 500 for r in caplog.records)
    finally:
        stop.set()
        ctx.term()
        f.close()


def test_replay_takes_at_most_its_share_of_a_core(fabric, monkeypatch):
    """After each slice the replay waits until the slice's CPU time is
    ``REPLAY_SHARE`` of the time since (the clocks are the test's)."""
    from fabric.coordinator import publisher as pub

    pub_ = fabric.publisher
    pub_.close()  # its thread stopped: the turns below are the test's alone
    clock = {"wall": 100.0, "cpu": 5.0}
    monkeypatch.setattr(pub.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(pub.time, "thread_time", lambda: clock["cpu"])
    sent = []

    def slice_():  # a slice that takes 2 ms of CPU
        clock["cpu"] += 0.002
        sent.append(clock["wall"])
        return True

    monkeypatch.setattr(pub_, "_send_replay_slice", slice_)
    monkeypatch.setattr(pub_, "_replaying", [object()])
    pub_._replay_at = 0.0
    assert pub_._replay_within_budget()
    for _ in range(5):
        clock["wall"] += 0.002 / pub.REPLAY_SHARE - 0.001
        assert not pub_._replay_within_budget(), "too soon: over its share"
        clock["wall"] += 0.001
        assert pub_._replay_within_budget()
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert all(g >= 0.002 / pub.REPLAY_SHARE - 1e-9 for g in gaps)
    assert pub_.replay_cpu_s == pytest.approx(0.012)
