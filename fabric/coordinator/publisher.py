"""KV events over ZMQ, in the layout vLLM and SGLang publish, so a KV-aware
router (Dynamo, llm-d, ...) can index the fabric as it indexes an engine.

The wire:

- a PUB socket sends each batch as three frames ``[topic, seq, payload]``:
  ``seq`` is 8 bytes big-endian, counting batches from 0; ``payload`` is a
  msgpack array ``[ts, events, data_parallel_rank]``;
- each event is a map naming its class under ``"type"``: ``BlockStored``
  (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved`` (``block_hashes``,
  ``medium``) or ``AllBlocksCleared``; every event also carries ``namespace``
  and ``place`` — the node whose L2 holds an engine's pages, else empty
  (decoders that do not know the fields skip them);
- a ROUTER socket answers a replay request ``[seq]`` (after an empty delimiter
  frame, as a REQ socket sends it, or without one, from a DEALER) with every
  buffered batch from ``seq`` on and then an end marker, behind the same
  envelope: in the ``vllm`` dialect ``[topic, seq, payload]`` and
  ``[b"", 0xFF x 8, b""]``; in the ``sglang`` dialect ``[seq, payload]`` and
  ``[0xFF x 8, b""]`` (``events.dialect``). Replay never holds up the live
  feed: queued batches are published first every loop, replays are served in
  slices round robin (at most ``REPLAY_CLIENTS`` at once); a malformed request,
  or one past that cap, gets one short answer — ``0xFF x 7 + 0xFE`` in the
  sequence's place and the reason as the payload — and a request over
  ``REPLAY_MAX_MESSAGE`` bytes is dropped by ZMQ.

Hashes are the low 64 bits (the last 8 bytes, big-endian) of the SHA-256 page
hashes by default, or the 32 bytes. An engine's page whose connector named it
goes out under the engine's own block hash (vLLM's: the same low 64 bits vLLM's
events carry) with its token ids and the engine's block size, so a router that
indexes the engine's own events finds it in the fabric's tiers under the same
key. Media: L1 is ``GPU``; L2 and L3 are ``CPU``
and ``STORAGE`` (vLLM's names) or ``CPU_PINNED`` and ``DISK`` (SGLang's). L1
keeps its name on a CPU-only fabric: it is the tier the model reads. The
publisher's thread owns both sockets; ``publish`` only queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from fabric.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from fabric.cache.keys import unpack_tokens
from fabric.config import EventsConfig
from fabric.errors import ConfigError

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
# A refused replay request's answer: this seq, then the reason (UTF-8 text).
ERROR_SEQ = b"\xff" * 7 + b"\xfe"
# Replay is served beside the live feed, never before it: requests taken per loop,
# replays in progress at most, batches sent per loop, and per client in turn.
REPLAY_ACCEPT = 16
REPLAY_CLIENTS = 32
REPLAY_SLICE = 256
REPLAY_TURN = 32
# The share of one core the replay may take (its thread's CPU time): after each
# slice it waits until that slice's CPU time is this share of the time since,
# so a flood of replaying clients cannot slow live requests (bench/replay_flood.py).
REPLAY_SHARE = 0.1
# Larger replay requests are dropped by ZMQ (the peer is disconnected).
REPLAY_MAX_MESSAGE = 1024


@dataclass
class _Replay:
    envelope: list[bytes]
    next: int


MEDIA = {Medium.DEVICE: "GPU", Medium.HOST: "CPU", Medium.STORAGE: "STORAGE"}
# Each engine's names for the media (events.dialect).
DIALECT_MEDIA = {
    "vllm": MEDIA,
    "sglang": {Medium.DEVICE: "GPU", Medium.HOST: "CPU_PINNED", Medium.STORAGE: "DISK"},
}

Hash = int | bytes


class WireBlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    namespace: str
    place: str = ""


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    namespace: str
    place: str = ""


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    namespace: str


WireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


class WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None


def low64(page_hash: bytes) -> int:
    """A page hash as the uint64 a router indexes: its last 8 bytes, big-endian."""
    return int.from_bytes(page_hash[-8:], "big")


def to_wire(
    events: Sequence[KVEvent], page_size: int, uint64: bool = True, dialect: str = "vllm"
) -> list[WireEvent]:
    """The core's events in the routers' layout, media named as ``dialect`` names them.
    An engine page its engine named (``BlockStored.engine_hashes``) goes out under
    the engine's block hashes, with its tokens and the engine's block size, as
    the engine's own events have it."""
    h = low64 if uint64 else bytes
    media = DIALECT_MEDIA[dialect]
    out: list[WireEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            hashes, parent_hash = e.page_hashes, e.parent_hash
            if e.engine_hashes:
                hashes, parent_hash = e.engine_hashes, e.engine_parent
            tokens = unpack_tokens(e.tokens)
            out.append(
                WireBlockStored(
                    [h(x) for x in hashes],
                    None if parent_hash is None else h(parent_hash),
                    tokens,
                    len(tokens) // len(hashes) if e.engine_hashes and tokens else page_size,
                    None,
                    media[e.medium],
                    None,
                    e.namespace,
                    e.place,
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(
                WireBlockRemoved(
                    [h(x) for x in e.engine_hashes or e.page_hashes],
                    media[e.medium],
                    e.namespace,
                    e.place,
                )
            )
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append(WireAllBlocksCleared(e.namespace))
    return out


class KVEventPublisher:
    """Publishes batches of the core's KV events on ZMQ (see the module doc).

    ``publish`` queues a batch and returns; a thread encodes it, sends it and
    keeps the last ``buffer_batches`` for replay. A full queue drops the batch
    (counted in ``dropped_batches``, logged): a subscriber sees the gap in the
    sequence numbers. ``endpoint`` / ``replay_endpoint`` are the bound
    addresses (a ``*`` port resolved).
    """

    def __init__(self, config: EventsConfig, page_size: int) -> None:
        if not config.enabled:
            raise ConfigError("events.endpoint is empty: no KV event publisher to start")
        self.config = config
        self.page_size = page_size
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, Sequence[KVEvent]] | None] = queue.Queue(
            config.max_queue_batches
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self.endpoint = _bind(self._pub, config.endpoint, "events.endpoint")
            self.replay_endpoint = ""
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_MESSAGE)
                self.replay_endpoint = _bind(
                    self._replay, config.replay_endpoint, "events.replay_endpoint"
                )
        except BaseException:
            self._close_sockets()
            raise
        self.published_batches = 0
        self.published_events = 0
        self.dropped_batches = 0
        self.replays = 0
        self.replay_refused = 0
        self.replay_cpu_s = 0.0  # CPU time the replays took
        self._replay_at = 0.0  # when the replay's budget allows its next slice
        self._replaying: deque[_Replay] = deque()
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (nothing for an empty one)."""
        if not events:
            return
        if not self._running:
            raise RuntimeError("the KV event publisher is closed")
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped_batches += 1
            log.warning(
                "KV event queue full (events.max_queue_batches=%d): a batch of %d events "
                "dropped; subscribers see a gap",
                self.config.max_queue_batches,
                len(events),
            )

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "published_batches": self.published_batches,
            "published_events": self.published_events,
            "dropped_batches": self.dropped_batches,
            "replays": self.replays,
            "replay_cpu_s": round(self.replay_cpu_s, 3),
            "replay_refused": self.replay_refused,
        }

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch is sent; ``False`` on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        if not self._running:
            return
        self.flush(timeout_s)
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV event thread did not stop within %.1f s", timeout_s)
            return  # it still owns the sockets; the process exit closes them
        self._close_sockets()

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        """Live batches first, every loop: whatever is queued is published before
        any replay frame is sent. Replay requests are taken a few at a time and
        served in slices, round robin, so no number of replaying clients can hold
        up the live feed (or one another)."""
        encode = msgspec.msgpack.Encoder().encode
        uint64 = self.config.hash_format == "uint64"
        rank = self.config.data_parallel_rank
        while True:
            busy = False
            while True:  # the live feed: everything queued now
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.task_done()
                    return
                busy = True
                self._publish(item, encode, uint64, rank)
            if self._replay is not None:
                try:
                    busy |= self._take_replay_requests()
                    busy |= self._replay_within_budget()
                except zmq.ZMQError:
                    log.exception("KV event replay failed")
            if not busy:  # idle: wait for a batch (or a replay's next turn) a moment
                wait = 0.02
                if self._replaying:
                    wait = min(wait, max(self._replay_at - time.monotonic(), 0.0005))
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if item is None:
                    self._queue.task_done()
                    return
                self._publish(item, encode, uint64, rank)

    def _publish(
        self, item: tuple[float, Sequence[KVEvent]], encode: Any, uint64: bool, rank: Any
    ) -> None:
        ts, events = item
        try:
            wire = to_wire(events, self.page_size, uint64, self.config.dialect)
            payload = encode(WireBatch(ts, wire, rank))
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published_batches += 1
            self.published_events += len(events)
        except Exception:
            log.exception("KV event batch of %d events not published", len(events))
        finally:
            self._queue.task_done()

    # -- replay ---------------------------------------------------------------------

    def _take_replay_requests(self) -> bool:
        """Accept up to ``REPLAY_ACCEPT`` requests: each becomes a cursor over the
        buffer, or — malformed, or past ``REPLAY_CLIENTS`` replays at once — a
        short error reply."""
        assert self._replay is not None
        took = False
        for _ in range(REPLAY_ACCEPT):
            if not self._replay.poll(0):
                break
            took = True
            frames = self._replay.recv_multipart()
            envelope = frames[:1]
            if len(frames) == 3 and frames[1] == b"":  # a REQ socket's delimiter: echoed
                envelope, frames = frames[:2], [frames[0], frames[2]]
            if len(frames) != 2 or len(frames[1]) != 8:
                self.replay_refused += 1
                log.warning(
                    "KV event replay request refused: %d frames, %d bytes (starts %r)",
                    len(frames),
                    sum(map(len, frames[1:])),
                    b"".join(frames[1:])[:16],
                )
                self._refuse(envelope, "a replay request is one frame: the start seq, 8 bytes")
                continue
            if len(self._replaying) >= REPLAY_CLIENTS:
                self.replay_refused += 1
                self._refuse(envelope, f"busy: {REPLAY_CLIENTS} replays in progress; retry")
                continue
            self.replays += 1
            start = int.from_bytes(frames[1], "big")
            self._replaying.append(_Replay(envelope, start))
        return took

    def _replay_within_budget(self) -> bool:
        """Send a replay slice if the replay's budget (``REPLAY_SHARE`` of a core)
        allows one now; whether one was sent."""
        now = time.monotonic()
        if not self._replaying or now < self._replay_at:
            return False
        started = time.thread_time()
        self._send_replay_slice()
        spent = time.thread_time() - started
        self._replay_at = now + spent / REPLAY_SHARE
        self.replay_cpu_s += spent
        return True

    def _send_replay_slice(self) -> bool:
        """Send up to ``REPLAY_SLICE`` batches of the pending replays, a few per
        client in turn; a finished replay gets its end marker."""
        if not self._replaying:
            return False
        assert self._replay is not None
        sglang = self.config.dialect == "sglang"
        budget = REPLAY_SLICE
        buffer = self._buffer
        oldest = buffer[0][0] if buffer else self._seq
        while budget > 0 and self._replaying:
            cursor = self._replaying.popleft()
            cursor.next = max(cursor.next, oldest)
            for _ in range(min(REPLAY_TURN, budget)):
                if cursor.next >= self._seq:
                    break
                seq, payload = buffer[cursor.next - oldest]
                body = [seq.to_bytes(8, "big"), payload]
                self._replay.send_multipart(
                    [*cursor.envelope, *([] if sglang else [self._topic]), *body]
                )
                cursor.next += 1
                budget -= 1
            if cursor.next >= self._seq:
                end = [END_SEQ, b""] if sglang else [b"", END_SEQ, b""]
                self._replay.send_multipart([*cursor.envelope, *end])
            else:
                self._replaying.append(cursor)
        return True

    def _refuse(self, envelope: list[bytes], why: str) -> None:
        """A short error reply: the end marker with the reason as its payload."""
        assert self._replay is not None
        sglang = self.config.dialect == "sglang"
        frames = [ERROR_SEQ, why.encode()] if sglang else [b"", ERROR_SEQ, why.encode()]
        self._replay.send_multipart([*envelope, *frames])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.Socket, address: str, setting: str) -> str:
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ConfigError(f"{setting}={address!r} cannot be bound: {exc}") from None
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)
