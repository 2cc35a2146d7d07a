"""The hierarchical cache: one radix tree over L1 (device), L2 (host) and L3 (storage).

``HiCache`` builds the parts of one cache in dependency order and holds them; its
callers (``Admission``, the coordinator, tests) use the parts themselves:
``placement`` (match, L1 leases, insert, locks), ``writes`` (L1 -> L2 copies),
``host_evictions`` and ``device_evictions``, ``loads`` (L2 -> L1 load-backs),
``l3`` (prefetch and backup, ``L3Transfers``), ``pins``, ``sessions`` and
``events``. What is left here spans several parts: a step's completions, the
tiers' sizes, a reset, pinning and the integrity check.

Every tier move is two-phase: the cache protects what moves and queues it, and
releases when told of the completion (``apply`` with a whole step's
``Completions``). Nothing here blocks, imports Ray or touches a tensor; its
controller moves the bytes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from fabric.cache.components import Components
from fabric.cache.controller import Completions, Controller
from fabric.cache.events import EventLog, Medium
from fabric.cache.evictions import DeviceEvictions, Drops, HostEvictions
from fabric.cache.integrity import check_integrity
from fabric.cache.keys import TOKEN_BYTES, TokenKey
from fabric.cache.l3_transfers import L3Transfers
from fabric.cache.loads import LoadBacks
from fabric.cache.pins import Pins
from fabric.cache.placement import Placement, Room, check_key
from fabric.cache.radix import RadixTree
from fabric.cache.results import CacheStats, PinResult, TierSizes
from fabric.cache.sessions import Sessions
from fabric.cache.writes import Writes
from fabric.config import CacheConfig, ModelConfig, PrefetchConfig
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
        self.parts = self._components(config, model)
        self.tree = RadixTree(self.page_size, self.eviction, self.parts)
        self.events = EventLog(
            self.tree.page_hashes, config.kv_events, self.page_size * TOKEN_BYTES
        )
        self.next_op_id = itertools.count(1).__next__
        self.stats = CacheStats()  # counters survive resets
        self.drops = Drops(self.tree, controller, self.events)
        if self.parts is not None:  # the components were made before the tree
            self.parts.remove = self.drops.drop_dead
        pin_budget = int(config.pin_budget_fraction * config.host_tokens)
        self.pins = Pins(self.tree, pin_budget, clock, int(config.tenant_share * pin_budget))
        self.host_evictions = HostEvictions(
            self.tree, controller, self.pins, self.drops, clock, self.stats
        )
        self.l3 = L3Transfers(
            self.tree,
            controller,
            prefetch or PrefetchConfig(),
            config.host_tokens,
            clock,
            self.events,
            self.host_evictions.evict,
            self.next_op_id,
            self.stats.transfer_sizes,
        )
        self.writes = Writes(
            self.tree,
            controller,
            self.write_policy,
            self.events,
            Room(controller, "host", self.host_evictions.evict),
            self.l3.backup,
            self.drops.demote,
            self.next_op_id,
            self.stats,
        )
        self.device_evictions = DeviceEvictions(
            self.tree,
            controller,
            self.write_policy,
            self.pins,
            self.drops,
            self.writes.write_backup,
            clock,
            self.stats,
        )
        self.loads = LoadBacks(
            self.tree,
            controller,
            config.load_back_threshold,
            Room(controller, "device", self.device_evictions.evict),
            self.events,
            self.next_op_id,
            self.stats,
        )
        self.placement = Placement(
            self.tree,
            controller,
            self.parts,
            self.events,
            self.writes,
            self.device_evictions,
            clock,
        )
        self.sessions = Sessions.from_config(
            config, self.tree, clock, self.writes.write_backup, self.placement.dec_lock_ref
        )
        self._init_state()

    def _components(self, config: CacheConfig, model: ModelConfig | None) -> Components | None:
        if model is None or len(model.components) <= 1:
            return None
        return Components(
            model.components,
            self.page_size,
            model.window_pages(self.page_size),
            config.sliding_pages,
            config.mamba_slots,
            self.eviction,
            config.host_sliding_pages,
            config.host_mamba_slots,
            config.mamba_checkpoint_tokens // self.page_size,
        )

    def _init_state(self) -> None:
        self.tree.clear()
        self.placement.leased.clear()
        self.writes.reset()
        self.loads.reset()
        self.pins.reset()
        self.sessions.reset()

    def key(self, tokens: Sequence[int], namespace: str = "default") -> TokenKey:
        return TokenKey(tokens, self.page_size, namespace)

    def pin_prefix(self, key: TokenKey, ttl_s: float) -> PinResult:
        """Keep ``key``'s cached prefix in L2 for ``ttl_s`` seconds (``Pins.pin``); a
        pinned node not in L2 yet is copied there."""
        check_key(key, self.page_size)
        return self.pins.pin(key, ttl_s, self.writes.write_backup)

    # -- completions and sizes -----------------------------------------------------------

    def apply(self, done: Completions) -> None:
        """Commit one step's completions, in the order they were queued."""
        self.writes.complete(done.writes, done.failed_writes)
        self.loads.complete(done.loads)
        self.l3.apply(done)

    def poll(self) -> Completions:
        """One step of a single-process cache: queue write-throughs, then take the
        controller's completions and commit them."""
        self.writes.write_through()
        done = self.ctl.take_completions()
        self.apply(done)
        return done

    def device_sizes(self) -> TierSizes:
        tree, size = self.tree, self.page_size
        return TierSizes(
            self.ctl.device.capacity_tokens,
            self.ctl.device.available_pages * size,
            tree.evictable_size,
            tree.protected_size + len(self.placement.leased) * size,
        )

    def host_sizes(self) -> TierSizes:
        """L2 tokens; evictable are those of L2-only nodes with no host protection."""
        size = self.page_size
        owned, evictable = self.tree.host_pages()
        owned += self.l3.held_host_pages() + self.writes.orphan_pages()
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
        self.l3.reset()
        self._init_state()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` listing every violated invariant (see ``fabric.cache.integrity``)."""
        check_integrity(self)
