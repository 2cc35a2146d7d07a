"""The hierarchical cache: one radix tree over L1 (device), L2 (host) and L3 (storage).

``HiCache`` decides; its controller moves bytes. Every tier move is two-phase:
the cache protects what moves and queues it, and releases when told of the
completion (``complete_writes``, ``complete_loads``, ... or ``apply`` with a
whole step's ``Completions``). Nothing here blocks, imports Ray or touches a
tensor.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

from fabric.cache.allocator import Pages
from fabric.cache.components import Components, PartFill
from fabric.cache.controller import Completions, Controller
from fabric.cache.events import EventLog, KVEvent, Medium
from fabric.cache.evictions import Evictions
from fabric.cache.integrity import check_integrity
from fabric.cache.keys import TOKEN_BYTES, TokenKey
from fabric.cache.l3_queues import L3Queues
from fabric.cache.loads import LoadBacks
from fabric.cache.node import TreeNode, WriteOp
from fabric.cache.pins import Pins
from fabric.cache.placement import Placement, check_key, take_pages
from fabric.cache.radix import RadixTree
from fabric.cache.results import (
    CacheStats,
    InsertResult,
    LoadBack,
    MatchResult,
    PinResult,
    TierSizes,
)
from fabric.cache.sessions import Sessions
from fabric.cache.writes import Writes
from fabric.config import CacheConfig, ModelConfig, PrefetchConfig
from fabric.errors import InvalidInput
from policies import get_eviction_policy, get_write_policy


class HiCache:
    """The authoritative tree of one fabric. Single-threaded: call it from one
    thread (the coordinator's step loop, or a test)."""

    def __init__(
        self,
        config: CacheConfig,
        controller: Controller,
        prefetch: PrefetchConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: ModelConfig | None = None,
    ) -> None:
        self.config = config
        self.ctl = controller
        self.clock = clock
        self.page_size = config.page_size
        self.eviction = get_eviction_policy(config.eviction_policy)
        self.eviction.bind(config.device_tokens)
        self.write_policy = get_write_policy(config.write_policy)
        # A hybrid model's sliding-window and mamba components (None: full attention only).
        self.parts: Components | None = None
        if model is not None and len(model.components) > 1:
            self.parts = Components(
                model.components,
                self.page_size,
                model.window_pages(self.page_size),
                config.sliding_pages,
                config.mamba_slots,
                self.eviction,
                config.host_sliding_pages,
                config.host_mamba_slots,
            )
        self.tree = RadixTree(self.page_size, self.eviction, self.parts)
        self.events = EventLog(
            self.tree.page_hashes, config.kv_events, self.page_size * TOKEN_BYTES
        )
        self.next_op_id = itertools.count(1).__next__
        self.stats = CacheStats()  # counters survive resets
        self.storage = L3Queues(
            self.tree,
            controller,
            prefetch or PrefetchConfig(),
            config.host_tokens,
            clock,
            self.events,
            self.evict_host,
            self.next_op_id,
            self.stats.transfer_sizes,
        )
        pin_budget = int(config.pin_budget_fraction * config.host_tokens)
        self.pins = Pins(
            self.tree,
            pin_budget,
            clock,
            self.write_backup,
            int(config.tenant_share * pin_budget),
        )
        self.sessions = Sessions.from_config(
            config, self.tree, clock, self.write_backup, self.dec_lock_ref
        )
        self.writes = Writes(
            self.tree,
            controller,
            self.write_policy,
            self.events,
            lambda tokens: take_pages(self.ctl.host, tokens, self.evict_host),
            self.storage.backup,
            lambda node: self.evictions.demote(node),
            self.next_op_id,
            self.stats,
        )
        self.evictions = Evictions(
            self.tree,
            controller,
            self.write_policy,
            self.pins,
            self.events,
            self.write_backup,
            clock,
            self.stats,
        )
        self.loads = LoadBacks(
            self.tree,
            controller,
            config.load_back_threshold,
            lambda tokens: take_pages(self.ctl.device, tokens, self.evict),
            self.events,
            self.next_op_id,
            self.stats,
        )
        self.placement = Placement(
            self.tree, controller, self.parts, self.events, self.writes, self.evictions, clock
        )
        if self.parts is not None:
            self.parts.remove = self.placement.remove_dead
        self._init_state()

    def _init_state(self) -> None:
        self.tree.clear()
        self.placement.leased.clear()
        self.writes.reset()
        self.loads.reset()
        self.pins.reset()
        self.sessions.reset()

    def key(self, tokens: Sequence[int], namespace: str = "default") -> TokenKey:
        return TokenKey(tokens, self.page_size, namespace)

    # -- match and insert ------------------------------------------------------------

    def match_prefix(self, key: TokenKey, held: TreeNode | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` over L1 and L2 (``Placement.match_prefix``)."""
        return self.placement.match_prefix(key, held)

    def fill_parts(self, node: TreeNode, stop: TreeNode | None = None) -> PartFill | None:
        """A hybrid model's components for the ends from ``stop`` to ``node``
        (``Placement.fill_parts``)."""
        return self.placement.fill_parts(node, stop)

    def insert(self, key: TokenKey, device_pages: Sequence[int], priority: int = 0) -> InsertResult:
        """Cache ``key`` with KV in leased ``device_pages`` (``Placement.insert``)."""
        return self.placement.insert(key, device_pages, priority)

    def extend(
        self, key: TokenKey, match: MatchResult, priority: int = 0, first: int | None = None
    ) -> tuple[TreeNode, Pages] | None:
        """Allocate and insert what ``match`` lacks of ``key`` (``Placement.extend``)."""
        return self.placement.extend(key, match, priority, first)

    # -- L1 allocation and locks ---------------------------------------------------

    def alloc_device(self, num_tokens: int) -> Pages | None:
        """Lease L1 pages for ``num_tokens`` of new KV (``Placement.alloc_device``)."""
        return self.placement.alloc_device(num_tokens)

    def free_device(self, device_pages: Sequence[int]) -> None:
        """Return leased L1 pages (``Placement.free_device``)."""
        self.placement.free_device(device_pages)

    @property
    def leased(self) -> set[int]:
        return self.placement.leased

    @property
    def last_path(self) -> list[TreeNode]:
        return self.placement.last_path

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its path from L1 eviction (the node must be on device),
        and for a hybrid model what a match ending there needs of the other
        components."""
        if node is not self.tree.root and node.device_value is None:
            raise InvalidInput(f"cannot lock {node}: it is not on device")
        self.tree.inc_lock_ref(node)
        if self.parts is not None:
            self.parts.lock(node, self.tree.pages)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        self.tree.dec_lock_ref(node)
        if self.parts is not None:
            self.parts.unlock(node, self.tree.pages)

    # -- write policies --------------------------------------------------------------

    @property
    def pending_writes(self) -> deque[WriteOp]:
        return self.writes.pending

    def write_through(self) -> int:
        """Queue the L1 -> L2 copies this step's hits asked for (``Writes.write_through``)."""
        return self.writes.write_through()

    def write_backup(self, node: TreeNode, evict_after: bool = False) -> int:
        return self.writes.write_backup(node, evict_after)

    def complete_writes(self, n: int, failed: Collection[int] = ()) -> None:
        """The ``n`` oldest writes finished; those in ``failed`` did not (L1-only still)."""
        self.writes.complete(n, failed)

    # -- eviction and load-back (``Evictions``, ``LoadBacks``) --------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L1 if possible (``Evictions.evict_device``)."""
        return self.evictions.evict_device(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L2 if possible (``Evictions.evict_host``)."""
        return self.evictions.evict_host(num_tokens)

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> LoadBack | None:
        """Queue an L2 -> L1 load of the chain ending at ``node`` (``LoadBacks.load_back``)."""
        return self.loads.load_back(node, mem_quota)

    @property
    def pending_loads(self) -> deque[tuple[int, TreeNode]]:
        return self.loads.pending

    def complete_loads(self, n: int) -> None:
        """The ``n`` oldest queued loads finished on every rank."""
        self.loads.complete(n)

    # -- pins ------------------------------------------------------------------------

    def pin_prefix(self, key: TokenKey, ttl_s: float) -> PinResult:
        """Keep ``key``'s cached prefix in L2 for ``ttl_s`` seconds (see ``Pins.pin``)."""
        check_key(key, self.page_size)
        return self.pins.pin(key, ttl_s)

    @property
    def pinned_size(self) -> int:
        return self.pins.pinned_size

    # -- completions, events, sizes ----------------------------------------------------

    def apply(self, done: Completions) -> None:
        """Commit one step's completions, in the order they were queued."""
        self.complete_writes(done.writes, done.failed_writes)
        self.complete_loads(done.loads)
        self.storage.apply(done)

    def poll(self) -> Completions:
        """One step of a single-process cache: queue write-throughs, then take the
        controller's completions and commit them."""
        self.write_through()
        done = self.ctl.take_completions()
        self.apply(done)
        return done

    def complete_backups(self, n: int, failed: Collection[int] = ()) -> None:
        self.storage.complete_backups(n, failed)

    def take_events(self) -> list[KVEvent]:
        """Drain the queued KV events, oldest first."""
        return self.events.take()

    def device_sizes(self) -> TierSizes:
        tree, size = self.tree, self.page_size
        return TierSizes(
            self.ctl.device.capacity_tokens,
            self.ctl.device.available_pages * size,
            tree.evictable_size,
            tree.protected_size + len(self.leased) * size,
        )

    def host_sizes(self) -> TierSizes:
        """L2 tokens; evictable are those of L2-only nodes with no host protection."""
        size = self.page_size
        owned, evictable = self.tree.host_pages()
        owned += self.storage.held_host_pages() + self.writes.orphan_pages()
        return TierSizes(
            self.ctl.host.capacity_tokens,
            self.ctl.host.available_pages * size,
            evictable * size,
            (owned - evictable) * size,
        )

    def component_sizes(self) -> dict[str, TierSizes]:
        """A hybrid model's other components in L1: sliding in tokens, mamba in
        states (empty for full attention only)."""
        if self.parts is None:
            return {}
        return self.parts.sizes(self.tree.walk())

    def reset(self) -> None:
        """Forget everything in L1 and L2 (L3 stays) and reset the controller."""
        if self.events.enabled:  # a router drops exactly what L1 and L2 held
            for node in self.tree.walk():
                if node.device_value is not None:
                    self.events.removed(node, Medium.DEVICE)
                if node.host_value is not None and node.write_op is None:
                    self.events.removed(node, Medium.HOST)
        self.ctl.reset()
        self.storage.reset()
        self._init_state()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` listing every violated invariant (see ``fabric.cache.integrity``)."""
        check_integrity(self)
