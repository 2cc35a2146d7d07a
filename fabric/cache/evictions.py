"""L1 and L2 eviction: which leaves leave, in the eviction policy's order, and
what leaving means for each (demoted to L2, written back first, or deleted).

``Drops`` does the leaving itself (a demotion, a deletion); ``HostEvictions``
frees L2 and ``DeviceEvictions`` L1. They are apart so that the cache can be built
in dependency order: L2 eviction needs no writes; the writes need L2 room and a
demotion; L1 eviction needs the writes (under write-back a victim is copied to L2
first)."""

from __future__ import annotations

from collections.abc import Callable

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.controller import Controller
from fabric.cache.events import EventLog, Medium
from fabric.cache.node import TreeNode
from fabric.cache.pins import Pins
from fabric.cache.radix import RadixTree
from fabric.cache.results import CacheStats
from policies import WritePolicy


class Drops:
    """A node leaving a tier: demoted (its L1 copy dropped, kept in L2) or deleted
    (gone from the tree), its pages back to their pools, its events logged."""

    def __init__(self, tree: RadixTree, ctl: Controller, events: EventLog) -> None:
        self.tree = tree
        self.ctl = ctl
        self.events = events

    def demote(self, node: TreeNode, device: Pages | None = None) -> None:
        """Drop ``node``'s L1 copy (and its other components); it stays in L2. Its
        pages go back to the pool now, or join ``device`` for the caller to release."""
        if self.tree.parts is not None:
            self.tree.parts.drop(node)
        pages = self.tree.clear_device(node)
        if device is None:
            self.ctl.device.release(pages)
        else:
            device.extend(pages)
        self.events.removed(node, Medium.DEVICE)

    def delete(
        self, node: TreeNode, device: Pages | None = None, host: Pages | None = None
    ) -> None:
        """Remove the leaf ``node`` from the tree, its pages back to their pools now
        (or, for a tier given ``device`` / ``host``, into it for the caller to release)."""
        if self.tree.parts is not None:
            self.tree.parts.drop(node)
            self.tree.parts.drop_host(node)
        if node.device_value is not None:
            if device is None:
                self.ctl.device.release(node.device_value)
            else:
                device.extend(node.device_value)
            self.events.removed(node, Medium.DEVICE)
        if node.host_value is not None:
            if host is None:
                self.ctl.host.release(node.host_value)
            else:
                host.extend(node.host_value)
            self.events.removed(node, Medium.HOST)
        self.tree.detach_leaf(node)

    def drop_dead(self, node: TreeNode) -> bool:
        """Remove a device leaf a hybrid component is missing from (it serves
        nothing): demote it to L2 (kept for a later full-attention use) or delete it,
        unless an in-flight write or an L2 protection needs it as it is. Whether it
        went."""
        if node.write_op is not None:
            return False
        if node.host_value is not None:
            self.demote(node)
            return True
        if node.children or node.host_ref:
            return False
        self.delete(node)
        return True


class HostEvictions:
    """L2 eviction: L2-only leaves not protected by ``host_ref``, in policy order
    (an expired pin is let go on the way)."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        pins: Pins,
        drops: Drops,
        clock: Callable[[], float],
        stats: CacheStats,
    ) -> None:
        self.tree = tree
        self.ctl = ctl
        self.pins = pins
        self.drops = drops
        self.clock = clock
        self.stats = stats

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L2 from L2-only leaves not protected by
        ``host_ref`` (backups, prefetch anchors, unexpired pins). Returns tokens freed."""
        tree, now = self.tree, self.clock()
        leaves = tree.host_leaves
        leaves.begin()
        kept = []
        freed = 0
        host = as_pages()
        try:
            while freed < num_tokens:
                node = leaves.pop()
                if node is None:
                    break
                if node.pinned and node.pin_expiry < now:
                    self.pins.clear(node)
                if node.host_ref > 0:
                    kept.append(node)
                    continue
                freed += tree.tokens(node)
                self.drops.delete(node, None, host)
        finally:
            if host:
                self.ctl.host.release(host)
        for node in kept:
            leaves.requeue(node)
        self.stats.host_evicted_tokens += freed
        return freed


class DeviceEvictions:
    """L1 eviction, leaves first in policy order. Its collaborators besides the tree
    and the controller: the write policy, the pins, the drops, a way to queue a
    write-back (``Writes.write_backup``), the clock and counters."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        policy: WritePolicy,
        pins: Pins,
        drops: Drops,
        write_backup: Callable[[TreeNode, bool], int],
        clock: Callable[[], float],
        stats: CacheStats,
    ) -> None:
        self.tree = tree
        self.ctl = ctl
        self.policy = policy
        self.pins = pins
        self.drops = drops
        self.write_backup = write_backup
        self.clock = clock
        self.stats = stats

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L1 if possible, leaves first in policy order.

        A backed-up leaf is demoted (its L1 pages freed, the node kept in L2); one
        that is not is deleted, or under ``write_back`` (and for an active pin)
        written to L2 first and demoted when that completes. Returns tokens
        freed now; write-backs free theirs later.
        """
        tree, now = self.tree, self.clock()
        leaves = tree.device_leaves
        leaves.begin()
        kept = []
        freed = scheduled = 0
        # The victims' pages go back to the pool in one release (vector checks
        # once per eviction, not once per node), even if the loop fails midway.
        # (A deleted victim has no L2 copy: one with a copy is demoted.)
        device = as_pages()
        try:
            while freed + scheduled < num_tokens:
                node = leaves.pop()
                if node is None:
                    break
                tokens = tree.tokens(node)
                if node.pinned and node.pin_expiry < now:
                    self.pins.clear(node)
                if node.host_value is not None:
                    self.drops.demote(node, device)
                    freed += tokens
                elif (node.pinned or node.host_ref or self.policy.write_back) and self.write_backup(
                    node, True
                ):
                    scheduled += tokens
                elif node.children or node.host_ref > node.pinned:
                    # Under write_back: L2-only children and no room in L2 to keep
                    # this node; deleting it would orphan them. Or a session keeps it
                    # in L2 (a host protection besides a pin's) and L2 has no room
                    # for it now.
                    kept.append(node)
                else:
                    if node.pinned:
                        self.pins.clear(node)
                    self.drops.delete(node, device)
                    freed += tokens
        finally:
            if device:
                self.ctl.device.release(device)
        for node in kept:
            leaves.requeue(node)
        self.stats.device_evicted_tokens += freed
        return freed
