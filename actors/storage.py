"""The storage actor: owns the L3 backend (``StorageService``). Ranks call it for
their shard's page batches (bytes travel as numpy arrays through Ray's object
store); the coordinator calls it for hit queries and attach/detach/clear."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from fabric.config import FabricConfig
from fabric.l3.service import StorageService


class StorageActor:
    def __init__(self, config: dict) -> None:
        self.config = FabricConfig.from_dict(config)
        self.service = StorageService(self.config)
        self.delay_s = 0.0

    def query(self, queries: list[tuple[int, list[bytes]]]) -> dict[int, int]:
        """Per op id, how many leading pages every shard holds."""
        batch = self.config.prefetch.query_batch_pages
        return {op: self.service.query(hashes, batch) for op, hashes in queries}

    def load(self, suffix: str, page_hashes: list[bytes]) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.service.load(suffix, page_hashes)

    def store(self, suffix: str, page_hashes: list[bytes], pages: np.ndarray) -> bool:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.service.store(suffix, page_hashes, pages)

    def attach(self, name: str, extra: dict[str, Any]) -> str:
        return self.service.attach(name, extra)

    def detach(self) -> bool:
        return self.service.detach()

    def clear(self) -> bool:
        return self.service.clear()

    def stats(self) -> dict[str, Any]:
        return self.service.stats()

    def set_faults(self, delay_s: float = 0.0) -> None:
        """Chaos hook: delay every page batch."""
        self.delay_s = delay_s

    def ping(self) -> None:
        """A no-op, for liveness checks."""
