"""Serve a workload through the core alone, with an in-process controller.

This is what a coordinator does per request, minus the actors: match, load back
from L2, prefetch from L3, compute the rest, insert, release. Used by the
core-only demo and by ``bench/tree_ops.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fabric.cache.hicache import HiCache
from fabric.cache.inprocess import InProcessController
from fabric.cache.keys import TokenKey
from fabric.config import FabricConfig
from fabric.workload import Request, iter_packed


@dataclass
class ReplayStats:
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    refused_requests: int = 0
    match_us: list[float] = field(default_factory=list)
    insert_us: list[float] = field(default_factory=list)

    def tiers(self) -> dict[str, int]:
        return {
            "device": self.device_hit_tokens,
            "host": self.host_hit_tokens,
            "storage": self.storage_hit_tokens,
            "computed": self.computed_tokens,
        }


class CoreReplay:
    """One ``HiCache`` with an immediate in-process controller and, with
    ``storage=True``, an in-memory L3 that backups fill."""

    def __init__(self, config: FabricConfig, storage: bool = True, namespace: str = "default"):
        cc = config.cache
        self.ctl = InProcessController(cc.device_pages, cc.host_pages, cc.page_size)
        self.cache = HiCache(cc, self.ctl, config.prefetch)
        if storage:
            self.cache.storage.attach()
        self.namespace = namespace
        self.stats = ReplayStats()

    def serve(self, packed: bytes) -> None:
        cache, stats = self.cache, self.stats
        key = TokenKey(packed, cache.page_size, self.namespace)
        stats.requests += 1
        stats.prompt_tokens += key.num_tokens
        if key.num_tokens > cache.config.device_tokens:
            stats.refused_requests += 1
            return
        t0 = time.perf_counter()
        match = cache.match_prefix(key)
        stats.match_us.append((time.perf_counter() - t0) * 1e6)
        stats.device_hit_tokens += match.device_tokens
        if match.host_tokens:
            loaded = cache.load_back(match.last_host_node)
            stats.host_hit_tokens += loaded.tokens if loaded else 0
            match = cache.match_prefix(key)
        if cache.storage.start_prefetch(stats.requests, key, match).op_id is not None:
            cache.poll()  # hit query answered, prefetch queued
            cache.poll()  # prefetch progress reported
            if cache.storage.check_prefetch(stats.requests):
                loaded = cache.load_back(cache.match_prefix(key).last_host_node)
                stats.storage_hit_tokens += loaded.tokens if loaded else 0
            cache.poll()
            match = cache.match_prefix(key)
        new_tokens = key.num_tokens - match.device_tokens
        cache.inc_lock_ref(match.last_device_node)
        pages = cache.alloc_device(new_tokens)
        cache.dec_lock_ref(match.last_device_node)
        if pages is None:
            stats.refused_requests += 1
            return
        stats.computed_tokens += new_tokens
        t0 = time.perf_counter()
        cache.insert(key, match.device_pages + pages)
        stats.insert_us.append((time.perf_counter() - t0) * 1e6)
        cache.poll()
        cache.take_events()

    def run(
        self,
        requests: Iterable[Request],
        progress: Callable[[int], None] | None = None,
    ) -> ReplayStats:
        for i, (_, packed) in enumerate(iter_packed(list(requests)), 1):
            self.serve(packed)
            if progress is not None:
                progress(i)
        return self.stats
