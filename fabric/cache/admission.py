"""The request lifecycle over one cache — the one the coordinator serves with, the
in-process replay runs and the benches measure.

``start_prefetch`` (when L3 may hold more than L1 and L2), ``check_prefetch``
until it ends, then ``admit``: match, load the L2 tail back, lock, make room in
L1, allocate the missing pages and insert the whole prompt. The caller has the
missing pages computed (``Admitted.new_pages`` from ``start_page`` on) and
unlocks ``Admitted.node`` when it is done with the KV.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from fabric.cache.allocator import Pages
from fabric.cache.hicache import HiCache
from fabric.cache.keys import TokenKey
from fabric.cache.node import TreeNode


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us per request
class Admitted:
    """A prompt made resident in L1 and locked at ``node``: ``device_pages`` hold
    every page of it; ``new_pages`` (from page ``start_page`` on) still need their
    KV computed; ``prefix_node`` ends the cached prefix before them (its chain
    hash is where their hashes continue). Hits are in tokens; ``storage_hit`` counts L2 pages a prefetch
    brought from L3 and that were loaded back."""

    node: TreeNode
    prefix_node: TreeNode
    device_pages: Pages
    start_page: int
    new_pages: Pages
    device_hit: int
    host_hit: int
    storage_hit: int


class Admission:
    def __init__(self, cache: HiCache) -> None:
        self.cache = cache

    def start_prefetch(self, req_id: Hashable, key: TokenKey) -> bool:
        """Start fetching from L3 what L1 and L2 lack of ``key``; ``False`` when not
        worth it (no storage, below the threshold, rate limited)."""
        l3 = self.cache.storage
        if not l3.attached:
            return False
        return l3.start_prefetch(req_id, key, self.cache.match_prefix(key)).op_id is not None

    def check_prefetch(self, req_id: Hashable) -> int | None:
        """``None`` while the prefetch should be waited for; else the tokens it added
        to L2 (0 for none)."""
        return self.cache.storage.check_prefetch(req_id)

    def admit(self, key: TokenKey, priority: int = 0, prefetched: int = 0) -> Admitted | None:
        """Make ``key`` resident and locked; ``None`` (nothing changed) when L1 has no
        room now. ``prefetched``: tokens its prefetch added to L2."""
        cache = self.cache
        match = cache.match_prefix(key)
        device_hit = match.device_tokens
        host_hit = storage_hit = 0
        if match.host_tokens:
            loaded = cache.load_back(match.last_host_node)
            if loaded is not None:
                storage_hit = min(prefetched, loaded.tokens)
                host_hit = loaded.tokens - storage_hit
                match = cache.match_prefix(key)
        cache.inc_lock_ref(match.last_device_node)
        extended = cache.extend(key, match, priority)
        if extended is None:
            cache.dec_lock_ref(match.last_device_node)
            return None
        node, new_pages = extended
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(match.last_device_node)
        return Admitted(
            node,
            match.last_device_node,
            match.device_pages + new_pages,
            match.device_tokens // key.page_size,
            new_pages,
            device_hit,
            host_hit,
            storage_hit,
        )
