"""A vLLM engine's own blocks as the L1 place of the fabric's tree
(``l1@<host>:<pid>``, one per engine replica): which pages this replica's
prefix cache holds, learnt from vLLM's KV events.

vLLM keeps and evicts its blocks itself and says so in its KV events
(``kv_events_config``: ``BlockStored`` when a block is cached, ``BlockRemoved``
when it is evicted, ``AllBlocksCleared`` on a reset), published on a ZeroMQ PUB
socket in this process. This module subscribes to it, names each of vLLM's
block hashes by the connector's own page hash (paired per request as the
scheduler side sees its whole blocks), and tells the fabric: blocks cached are
reported stored in this replica's L1 by every rank (vLLM caches a block on all
of them at once), blocks evicted are dropped from it. The tree never orders an
L1 eviction; its lookups never count L1 (vLLM's own prefix cache serves those
pages): L1 is what a router and ``kvfabric top`` see of each replica.

Events missed (a subscriber joins late; a gap in the sequence numbers) cannot
be recovered here: on a gap every page is dropped from this replica's L1 and
what follows is learnt anew, so the tree may know less of L1 than there is,
never more. An endpoint this process cannot subscribe to (one the publisher
connects to, ``tcp://*:0``) leaves L1 untracked, said once.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import OrderedDict
from typing import Any

import msgspec
import zmq

from fabric.cache.engine_input import L1_AT, StoredRun
from fabric.engines.vllm_requests import TrackedRequest

log = logging.getLogger(__name__)

# Messages read per step at most (the rest wait for the next step).
MAX_MESSAGES_PER_STEP = 256


def replica_place() -> str:
    """This engine replica's blocks as a place: its host and engine-core process."""
    return f"{L1_AT}{socket.gethostname() or 'node'}:{os.getpid()}"


def subscribe_endpoint(vllm_config: Any) -> str | None:
    """Where this process's KV event publisher can be subscribed to (``None``: it
    publishes none, or to an address only it connects to)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
        return None
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        return None
    from vllm.distributed.kv_events import ZmqEventPublisher

    dp = getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0
    endpoint = ZmqEventPublisher.offset_endpoint_port(events.endpoint, dp)
    if endpoint is None or endpoint.endswith(":0") or not endpoint.startswith(("tcp://", "ipc://")):
        return None
    if endpoint.startswith("tcp://") and "*" not in endpoint and "::" not in endpoint:
        return None  # the publisher connects there: another process binds it
    return endpoint.replace("*", "127.0.0.1").replace("[::]", "127.0.0.1")


def _decoder() -> msgspec.msgpack.Decoder:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    batch = msgspec.defstruct(
        "Batch",
        [
            ("ts", float),
            ("events", list[BlockStored | BlockRemoved | AllBlocksCleared]),
            ("data_parallel_rank", int | None, None),
        ],
        array_like=True,
    )  # vLLM's KVEventBatch, its events typed
    return msgspec.msgpack.Decoder(type=batch)


class DeviceBlocks:
    """This replica's L1: ``endpoint`` is its KV event publisher's, ``topic`` its
    topic; ``max_names`` bounds the pairs of vLLM's hashes and the connector's."""

    def __init__(self, endpoint: str, topic: str, block_size: int, max_names: int) -> None:
        self.place = replica_place()
        self.endpoint = endpoint
        self.block_size = block_size
        self.max_names = max_names
        # vLLM's block hash -> (the connector's page hash, namespace, its parent's hash)
        self.names: OrderedDict[Any, tuple[bytes, str, bytes | None]] = OrderedDict()
        self._seq = -1
        self._decode = _decoder()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)
        self.counts = {"stored": 0, "removed": 0, "unnamed": 0, "gaps": 0}

    def close(self) -> None:
        self._socket.close(linger=0)

    # -- naming vLLM's blocks --------------------------------------------------------

    def learn(self, state: TrackedRequest) -> None:
        """Pair the request's whole blocks' hashes in vLLM with the connector's."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        theirs = getattr(state.request, "block_hashes", None) or []
        start = state.l1_named
        if len(theirs) <= start:
            return
        state.hashes_to(len(theirs), self.block_size)
        end = min(len(theirs), len(state.hashes))
        for i in range(start, end):
            parent = state.hashes[i - 1] if i else None
            key = maybe_convert_block_hash(theirs[i])
            self.names[key] = (state.hashes[i], state.namespace, parent)
            self.names.move_to_end(key)
        state.l1_named = end
        while len(self.names) > self.max_names:
            self.names.popitem(last=False)

    # -- vLLM's events ---------------------------------------------------------------

    def poll(self, tag: str, world: int, link: Any) -> None:
        """Take the events published since the last call and tell the fabric."""
        for _ in range(MAX_MESSAGES_PER_STEP):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self._seq >= 0 and seq != self._seq + 1:
                self.counts["gaps"] += 1
                log.warning(
                    "kvfabric connector: KV events %d..%d missed; this replica's L1 is "
                    "learnt anew", self._seq + 1, seq - 1,
                )  # fmt: skip
                link.drop(tag, world, self.place, [], everything=True)
            self._seq = seq
            try:
                batch = self._decode.decode(frames[2])
            except msgspec.DecodeError as exc:
                log.warning("kvfabric connector: a KV event batch is unreadable: %s", exc)
                continue
            self._apply(batch.events, tag, world, link)

    def _apply(self, events: list, tag: str, world: int, link: Any) -> None:
        stored: list[StoredRun] = []
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                link.drop(tag, world, self.place, [], everything=True)
                stored = []
                continue
            if getattr(event, "medium", None) not in (None, "GPU"):
                continue  # an offloading tier's, not this replica's blocks
            if kind == "BlockStored":
                self._runs(event.block_hashes, stored)
            elif kind == "BlockRemoved":
                ours = [self._name(h) for h in event.block_hashes]
                gone = [n[0] for n in ours if n is not None]
                self.counts["removed"] += len(gone)
                if gone:
                    link.drop(tag, world, self.place, gone)
                for h in event.block_hashes:
                    self.names.pop(h, None)
        if stored:
            self.counts["stored"] += sum(len(r.hashes) for r in stored)
            link.report(tag, world, {rank: list(stored) for rank in range(world)})

    def _name(self, block_hash: Any) -> tuple[bytes, str, bytes | None] | None:
        name = self.names.get(block_hash)
        if name is None:
            self.counts["unnamed"] += 1  # a request the connector does not serve
        return name

    def _runs(self, block_hashes: list, runs: list[StoredRun]) -> None:
        """Add the blocks named to ``runs``, as runs of consecutive pages (each after
        the one before)."""
        for block_hash in block_hashes:
            name = self._name(block_hash)
            if name is None:
                continue
            page, namespace, parent = name
            last = runs[-1] if runs else None
            if last is not None and last.namespace == namespace and last.hashes[-1] == parent:
                runs[-1] = StoredRun(namespace, last.parent, (*last.hashes, page), self.place)
            else:
                runs.append(StoredRun(namespace, parent, (page,), self.place))
