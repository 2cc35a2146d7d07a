"""L2 -> L1 load-back: a whole L1-evicted chain or nothing, and its completion."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.controller import Controller, PartCopy
from fabric.cache.events import EventLog, Medium
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree
from fabric.cache.results import CacheStats, LoadBack, check_count


class LoadBacks:
    """The load-back queue of one cache. Its collaborators: the tree, the
    controller, the threshold below which a chain is recomputed rather than
    loaded, a way to get L1 pages (evicting if short), the event log, op ids and
    counters."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        threshold: int,
        alloc_device: Callable[[int], Pages | None],
        events: EventLog,
        next_op_id: Callable[[], int],
        stats: CacheStats,
    ) -> None:
        self.tree = tree
        self.ctl = ctl
        self.threshold = threshold
        self.alloc_device = alloc_device
        self.events = events
        self.next_op_id = next_op_id
        self.stats = stats
        self.reset()

    def reset(self) -> None:
        self.pending: deque[tuple[int, TreeNode]] = deque()

    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> LoadBack | None:
        """Queue an L2 -> L1 load of the whole L1-evicted chain ending at ``node``, or
        nothing: ``None`` when ``node`` is on device, the chain is shorter than the
        threshold or longer than ``mem_quota`` tokens, or L1 has no room even after
        evicting. ``node`` stays locked until the load completes."""
        tree = self.tree
        chain = []
        top = node
        while top is not tree.root and top.device_value is None:
            chain.append(top)
            top = top.parent  # type: ignore[assignment]
        if not chain:
            return None
        chain.reverse()
        tokens = sum(tree.tokens(n) for n in chain)
        if tokens < self.threshold or (mem_quota is not None and tokens > mem_quota):
            return None
        # Making room in L1 may write back to L2 (write_back), which may evict L2:
        # the chain being loaded must survive both.
        tree.inc_lock_ref(top)
        node.host_ref += 1
        device = self.alloc_device(tokens)
        node.host_ref -= 1
        tree.dec_lock_ref(top)
        if device is None:
            return None
        host = as_pages()
        offset = 0
        for n in chain:
            k = tree.pages(n)
            host.extend(n.host_value)  # type: ignore[arg-type]
            tree.set_device(n, device[offset : offset + k])
            self.events.stored(n, Medium.DEVICE)
            offset += k
        tree.inc_lock_ref(node)
        parts, copy = tree.parts, [[], [], [], []]
        if parts is not None:  # the chain is locked: making room spares it
            for n in chain:
                parts.to_device(n, copy)
        op_id = self.next_op_id()
        self.pending.append((op_id, node))
        self.ctl.load(op_id, host, device, PartCopy(*map(tuple, copy)) if parts else None)
        self.stats.loaded_back_tokens += tokens
        self.stats.transfer_sizes["host_to_device"].observe(tokens)
        return LoadBack(op_id, tokens, device, node)

    def complete(self, n: int) -> None:
        """The ``n`` oldest queued loads finished on every rank."""
        check_count("loads", n, len(self.pending))
        for _ in range(n):
            _, node = self.pending.popleft()
            self.tree.dec_lock_ref(node)
