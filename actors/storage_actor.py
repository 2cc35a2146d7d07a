"""The storage actor: owns the L3 backend (``StorageService``). Ranks call it for
their shard's page batches (bytes travel as numpy arrays through Ray's object
store); the coordinator calls it for hit queries and attach/detach/clear.

The coordinator owns which backend is attached: a storage actor restarted by Ray
asks it for that spec on start (and the coordinator re-sends it with
``ensure``), so a backend attached at runtime survives the restart."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Any

import numpy as np
import ray

from actors.ray_metrics import node_ip
from actors.storage_group import storage_names
from fabric.cache.controller import HitAnswer
from fabric.config import FabricConfig
from fabric.l3.backend import Location
from fabric.l3.format import Provenance
from fabric.l3.service import StorageService
from fabric.l3.shards import ShardAnswer, ShareQuery, merge_shares, shares

log = logging.getLogger(__name__)

Spec = tuple[str, dict[str, Any]] | None


class StorageActor:
    def __init__(self, config: dict, coordinator_name: str | None = None, shard: int = 0) -> None:
        """``shard``: which of the ``storage.actors`` this is (``fabric.l3.shards``)."""
        self.config = FabricConfig.from_dict(config)
        self.shard = shard
        self._peers: dict[int, Any] = {}  # the other storage actors, by shard
        self.service = StorageService(self.config, shard)
        self.delay_s = 0.0
        self.l3_fault: str | None = None
        self._released = threading.Event()
        self._released.set()
        self._holding = 0
        self._holding_lock = threading.Lock()
        with warnings.catch_warnings():  # Ray's own property uses a deprecated API
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if coordinator_name and restarted:
            self._restore(coordinator_name)

    def _restore(self, coordinator_name: str) -> None:
        """Take the backend the coordinator says is attached (it may have been
        attached or detached at runtime, unlike the launch config's)."""
        try:
            coordinator = ray.get_actor(
                coordinator_name, namespace=self.config.runtime.ray_namespace
            )
            spec = ray.get(coordinator.storage_spec.remote(), timeout=10)
        except Exception as exc:  # the coordinator re-sends it with ensure()
            log.warning("storage restarted; could not ask the coordinator for L3: %s", exc)
            return
        log.warning("storage restarted: restoring L3 %s", spec[0] if spec else "none")
        self.ensure(spec)

    def query(self, queries: list[tuple[int, bytes, bytes]]) -> dict[int, tuple[int, list[bytes]]]:
        """Per ``(op id, chain hash before, packed tokens)``: the pages' chain hashes
        (hashed here, not in the coordinator) and how many leading pages every
        shard holds (for a hybrid model, the deepest end among them with every
        component)."""
        batch = self.config.prefetch.query_batch_pages
        return {op: self.service.answer(prev, tokens, batch) for op, prev, tokens in queries}

    def lead(self, queries: list[tuple[int, bytes, bytes]]) -> dict[int, HitAnswer]:
        """Lead hit queries over several storage actors (``fabric.l3.shards``): per
        ``(op id, chain hash before, packed tokens)``, hash the pages here, ask
        each actor about the pages it owns (every other one's share sent before
        this one's own is checked), and merge the answers into one store's."""
        batch = self.config.prefetch.query_batch_pages
        by_op = {op: self.service.hashes(prev, tokens) for op, prev, tokens in queries}
        split = shares(by_op, self.config.storage.actors)
        asked = {
            s: self._peer(s).held.remote(share)
            for s, share in enumerate(split)
            if share and s != self.shard
        }
        answers = [self.service.held(split[self.shard], batch)]
        if asked:
            answers += ray.get(list(asked.values()), timeout=self.config.runtime.rank_timeout_s)
        model = self.config.model
        parts = tuple(c for c in model.components if c != "full")
        return merge_shares(by_op, answers, parts, model.window_pages(self.config.cache.page_size))

    def held(self, items: list[ShareQuery]) -> dict[int, ShardAnswer]:
        """This actor's shares of hit queries another actor leads."""
        return self.service.held(items, self.config.prefetch.query_batch_pages)

    def _peer(self, shard: int) -> Any:
        """The storage actor ``shard`` (looked up by name once; a restarted one
        keeps its name and its handle)."""
        peer = self._peers.get(shard)
        if peer is None:
            name = storage_names(self.config)[shard]
            peer = ray.get_actor(name, namespace=self.config.runtime.ray_namespace)
            self._peers[shard] = peer
        return peer

    def load(self, suffix: str, page_hashes: list[bytes], component: str = "full") -> np.ndarray:
        self._fault()
        return self.service.load(suffix, page_hashes, component)

    def locate(
        self, suffix: str, page_hashes: list[bytes], component: str = "full"
    ) -> tuple[str, list[Location]] | None:
        self._fault()
        return self.service.locate(suffix, page_hashes, component)

    def read_elsewhere(self, pages: int, refused: str | None = None) -> None:
        self.service.read_elsewhere(pages, refused)

    def store(
        self, suffix: str, page_hashes: list[bytes], pages: np.ndarray, component: str = "full"
    ) -> bool:
        self._fault()
        if self.l3_fault is not None:
            log.warning("L3 is %s (chaos): %d pages not stored", self.l3_fault, len(page_hashes))
            return False
        return self.service.store(suffix, page_hashes, pages, component)

    def engine_exists(self, keys: list[str]) -> list[bool]:
        """Per full page key of an engine's page (``fabric.engines``), whether L3
        holds it."""
        return self.service.engine_exists(keys)

    def engine_load(self, keys: list[str], provenance: Provenance) -> np.ndarray:
        self._fault()
        return self.service.engine_load(keys, provenance)

    def engine_delete(self, keys: list[str]) -> int:
        """Delete an engine's pages the fabric's tree evicted; how many were here."""
        self._fault()
        return self.service.engine_delete(keys)

    def engine_store(
        self, keys: list[str], pages: np.ndarray, provenance: Provenance, writer: str
    ) -> list[bool]:
        self._fault()
        if self.l3_fault is not None:
            log.warning("L3 is %s (chaos): %d engine pages not stored", self.l3_fault, len(keys))
            return [False] * len(keys)
        return self.service.engine_store(keys, pages, provenance, writer)

    def usage_by_writer(self) -> list[dict[str, Any]]:
        return self.service.usage_by_writer()

    def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def attach(self, name: str, extra: dict[str, Any]) -> str:
        return self.service.attach(name, extra)

    def detach(self) -> bool:
        return self.service.detach()

    def ensure(self, spec: Spec) -> str:
        """Make the attached backend ``spec`` (``None``: none): ``kept`` when it
        already is, else ``restored``."""
        if spec == self.service.spec:
            return "kept"
        self.service.detach()
        if spec is not None:
            self.service.attach(*spec)
        return "restored"

    def spec(self) -> Spec:
        return self.service.spec

    def clear(self) -> bool:
        return self.service.clear()

    def take_removed(self) -> list[bytes]:
        """Pages that left L3 on their own since the last call (for KV events)."""
        return self.service.take_removed()

    def stats(self) -> dict[str, Any]:
        return self.service.stats()

    def describe(self) -> str:
        """This actor's role and live figures, in one line (`kvfabric status`)."""
        service = getattr(self, "service", None)
        if service is None:
            return "kvfabric storage (starting)"
        st = service.stats()
        who = f"kvfabric storage of {self.config.runtime.name}"
        if self.config.storage.actors > 1:
            who += f" ({self.shard + 1} of {self.config.storage.actors})"
        if not st.get("attached"):
            return f"{who}: no L3 attached"
        return (
            f"{who}: L3 {st.get('backend')}, "
            f"{st.get('pages', '?')} pages, {st.get('bytes', 0) >> 20} MiB, "
            f"read {st.get('get_pages', 0)} written {st.get('set_pages', 0)} pages"
        )

    def __repr__(self) -> str:
        """What the Ray dashboard shows for this actor: Ray reads the repr once, as
        the actor starts, so it holds only what does not change (role, shard,
        node). The moving figures are in Ray's metrics and `kvfabric status`."""
        config = getattr(self, "config", None)
        name = config.runtime.name if config is not None else "?"
        shard = getattr(self, "shard", 0)
        of = (
            f" ({shard + 1} of {config.storage.actors})"
            if config and config.storage.actors > 1
            else ""
        )
        return f"kvfabric storage of {name}{of}, node {node_ip()}"

    def set_faults(self, delay_s: float = 0.0, hold: bool = False, l3: str | None = None) -> None:
        """Chaos hook: delay every page batch, hold every one until released (or
        until the actor is killed under it), or make L3 refuse every write as a
        read-only (``l3="read_only"``) or full (``l3="full"``) store would."""
        if l3 not in (None, "read_only", "full"):
            raise ValueError(f"l3={l3!r} is refused: allowed is None, 'read_only' or 'full'")
        self.l3_fault = l3
        self.delay_s = delay_s
        if hold:
            self._released.clear()
        else:
            self._released.set()

    def holding(self) -> int:
        """How many page batches the ``hold`` fault is holding right now."""
        return self._holding

    def _fault(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._released.is_set():
            return
        with self._holding_lock:
            self._holding += 1
        try:
            self._released.wait()
        finally:
            with self._holding_lock:
                self._holding -= 1

    def ping(self) -> None:
        """A no-op, for liveness checks."""
