"""The rank actor: owns one ``RankWorker`` and its transfer thread."""

from __future__ import annotations

import threading

from fabric.config import FabricConfig
from fabric.messages import Batch, InvalidMessage, decode, encode
from fabric.rank import RankWorker


class RankActor:
    """One per (pp, cp, tp). ``step`` is the only message the coordinator sends per
    step: it queues the batch and answers with all counters at once."""

    def __init__(self, config: dict, index: int) -> None:
        self.config = FabricConfig.from_dict(config)
        self.max_bytes = self.config.runtime.max_message_bytes
        self.worker = RankWorker(self.config, index)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._transfer_loop, name="kv-transfers", daemon=True
        )
        self._thread.start()

    def _transfer_loop(self) -> None:
        while not self._stop.is_set():
            self.worker.run_one(block=True, timeout=0.1)

    def step(self, batch: bytes) -> bytes:
        """Queue a step's commands; return this rank's report (msgpack)."""
        message = decode(batch, self.max_bytes)
        if not isinstance(message, Batch):
            raise InvalidMessage(f"a rank takes Batch messages, got {type(message).__name__}")
        self.worker.accept(message)
        return encode(self.worker.report())

    def ping(self) -> None:
        """A no-op, for measuring the bare cost of a call."""

    def report(self) -> bytes:
        return encode(self.worker.report())

    def verify(self, namespace: str, tokens: bytes, pages: list[int]) -> bool:
        return self.worker.verify(namespace, tokens, pages)

    def set_faults(self, delay_s: float = 0.0, fail_writes: bool = False) -> None:
        """Chaos hook: delay every copy, or fail every write."""
        self.worker.faults.delay_s = delay_s
        self.worker.faults.fail_writes = fail_writes

    def info(self) -> dict:
        w = self.worker
        return {
            "index": w.index,
            "rank": str(w.shard.rank),
            "incarnation": w.incarnation,
            "device": str(w.device),
            "l1_bytes": w.l1.nbytes,
            "l2_bytes": w.l2.nbytes,
            "pid": __import__("os").getpid(),
        }

    def shutdown(self) -> None:
        self._stop.set()
