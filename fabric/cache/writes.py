"""L1 -> L2 copies under the write policy: which nodes to copy (hits reaching the
policy's threshold, queued once per step; evictions under write-back; pins),
the copies in flight, and what their completion or failure changes."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.controller import Controller, PartCopy
from fabric.cache.events import EventLog, Medium
from fabric.cache.node import TreeNode, WriteOp
from fabric.cache.radix import RadixTree
from fabric.cache.results import CacheStats, check_count
from policies import WritePolicy


class Writes:
    """The write-through queue of one cache. Its collaborators: the tree, the
    controller, the write policy, the event log, a way to get L2 pages (evicting
    L2 if short), what to do when a copy lands (back it up to L3) and how to
    demote a node after its write-back, the cache's op ids and counters."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        policy: WritePolicy,
        events: EventLog,
        alloc_host: Callable[[int], Pages | None],
        backup: Callable[..., None],
        demote: Callable[[TreeNode], None],
        next_op_id: Callable[[], int],
        stats: CacheStats,
    ) -> None:
        self.tree = tree
        self.ctl = ctl
        self.policy = policy
        self.events = events
        self.alloc_host = alloc_host
        self.backup = backup
        self.demote = demote
        self.next_op_id = next_op_id
        self.stats = stats
        self.reset()

    def reset(self) -> None:
        self.pending: deque[WriteOp] = deque()
        self.candidates: dict[TreeNode, None] = {}
        # Nodes already in L2 whose L1 components got new values (a hybrid fill).
        self.part_candidates: dict[TreeNode, None] = {}

    def on_parts(self, node: TreeNode) -> None:
        """``node`` got components in L1: queue their L2 copy if its pages are there
        already (else they go with its pages' copy)."""
        if node.host_value is not None:
            self.part_candidates[node] = None

    def orphan_pages(self) -> int:
        """L2 pages taken from nodes whose copy is still in flight."""
        return sum(len(op.orphan_pages) for op in self.pending)

    def on_hit(self, node: TreeNode) -> None:
        """Count a hit; queue ``node`` for the step's write-through once the policy's
        threshold is reached."""
        node.hit_count += 1
        threshold = self.policy.hit_threshold
        if threshold is not None and node.host_value is None and node.hit_count >= threshold:
            self.candidates[node] = None

    def write_through(self) -> int:
        """Queue the L1 -> L2 copies that this step's hits asked for (the write
        policy's threshold), once per step rather than inside ``insert``. Nodes
        evicted, deleted or backed up since are skipped; one that finds no room in
        L2 waits for its next hit. Returns tokens queued."""
        queued = 0
        candidates, self.candidates = self.candidates, {}
        for node in candidates:
            if (
                node.parent is not None
                and node.device_value is not None
                and node.host_value is None
            ):
                queued += self.write_backup(node)
        parts, self.part_candidates = self.part_candidates, {}
        for node in parts:
            if node.parent is None or node.device_value is None or node.host_value is None:
                continue
            if node.write_op is not None:
                self.part_candidates[node] = None  # after its pages' copy lands
            else:
                self.write_parts(node)
        return queued

    def write_parts(self, node: TreeNode) -> bool:
        """Queue an L1 -> L2 copy of the components ``node`` has in L1 and lacks in
        L2 (its pages are in L2 already); ``False`` when there are none or no room."""
        parts = self.tree.parts
        assert parts is not None
        copy: list[list[int]] = [[], [], [], []]
        parts.to_host(node, copy)
        if not copy[0] and not copy[2]:
            return False
        op = WriteOp(
            self.next_op_id(), [], node, False, part_slots=(tuple(copy[1]), tuple(copy[3]))
        )
        self.tree.inc_lock_ref(node)
        self.pending.append(op)
        self.ctl.write(op.op_id, (), (), PartCopy(*map(tuple, copy)))
        return True

    def write_backup(self, node: TreeNode, evict_after: bool = False) -> int:
        """Queue an L1 -> L2 copy of ``node`` (under write-through policies, with any
        ancestors not yet backed up, so L2 stays prefix-closed). Returns tokens
        queued; 0 when L2 has no room even after evicting."""
        chain = [node]
        if not self.policy.write_back:
            parent = node.parent
            while parent is not self.tree.root and parent.host_value is None:  # type: ignore[union-attr]
                chain.append(parent)  # type: ignore[arg-type]
                parent = parent.parent  # type: ignore[union-attr]
            chain.reverse()
        tokens = sum(self.tree.tokens(n) for n in chain)
        host = self.alloc_host(tokens)
        if host is None:
            return 0
        op = WriteOp(self.next_op_id(), chain, node, evict_after)
        device = as_pages()
        offset = 0
        parts = self.tree.parts
        copy: list[list[int]] = [[], [], [], []]
        for n in chain:
            k = len(n.device_value)  # type: ignore[arg-type]
            n.host_value = host[offset : offset + k]
            n.write_op = op
            device.extend(n.device_value)  # type: ignore[arg-type]
            offset += k
            if parts is not None:
                parts.to_host(n, copy)
        self.tree.inc_lock_ref(node)
        self.pending.append(op)
        self.ctl.write(op.op_id, device, host, PartCopy(*map(tuple, copy)) if parts else None)
        return tokens

    def complete(self, n: int, failed: Collection[int] = ()) -> None:
        """The ``n`` oldest queued writes finished; those whose op id is in ``failed``
        did not, and their nodes stay L1-only."""
        check_count("writes", n, len(self.pending))
        for _ in range(n):
            op = self.pending.popleft()
            ok = op.op_id not in failed
            if op.part_slots is not None:
                self._complete_parts(op, ok)
                continue
            written = 0
            for node in op.nodes:
                if node.write_op is not op:
                    continue
                node.write_op = None
                if node.host_value is None:
                    continue
                tokens = self.tree.tokens(node)
                if ok:
                    written += tokens
                    self.events.stored(node, Medium.HOST)
                    self.backup(node)
                else:
                    self.stats.failed_write_tokens += tokens
                    self.ctl.host.free(node.host_value)
                    node.host_value = None
                    if self.tree.parts is not None:
                        self.tree.parts.drop_host(node)
                    if not self.policy.write_back:
                        self._orphan_pending_descendants(node)
            if written:
                self.stats.written_tokens += written
                self.stats.transfer_sizes["device_to_host"].observe(written)
            if op.orphan_pages:
                self.ctl.host.free(op.orphan_pages)
            self.tree.dec_lock_ref(op.lock_node)
            node = op.lock_node
            if op.evict_after and ok and node in self.tree.device_leaves and node.host_value:
                self.demote(node)

    def _complete_parts(self, op: WriteOp, ok: bool) -> None:
        """A components-only copy ended: back the nodes holding its slots up to L3,
        or, if it failed, take the slots (which hold nothing) back from them."""
        node = op.lock_node
        self.tree.dec_lock_ref(node)
        parts = self.tree.parts
        assert parts is not None and op.part_slots is not None
        for x in self._holding(node, op.part_slots):
            if ok:
                self.backup(x, parts_only=True)
                continue
            parts.drop_host_slots(x, *op.part_slots)

    @staticmethod
    def _holding(node: TreeNode, slots: tuple[tuple[int, ...], tuple[int, ...]]):
        """``node`` and the ancestors that hold any of the L2 component ``slots`` now
        (a split since the copy was queued moves part of a sliding tail up)."""
        sliding, mamba = set(slots[0]), set(slots[1])
        out, x = [], node
        while x is not None and (sliding or mamba):
            held = set(x.host_sliding or ()) & sliding
            if held or x.host_mamba in mamba:
                out.append(x)
                sliding -= held
                mamba.discard(x.host_mamba)  # type: ignore[arg-type]
            x = x.parent  # type: ignore[assignment]
        return out

    def _orphan_pending_descendants(self, node: TreeNode) -> None:
        # A failed parent copy leaves in-flight child copies without a backed-up
        # parent: take their host pages away now, free them when their copy ends.
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            if child.write_op is not None and child.host_value is not None:
                child.write_op.orphan_pages.extend(child.host_value)
                child.host_value = None
                if self.tree.parts is not None:
                    # Copies to L2 and from it run in order on every rank: a later
                    # use of these slots comes after this copy.
                    self.tree.parts.drop_host(child)
            stack.extend(child.children.values())
