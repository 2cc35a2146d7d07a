"""The radix tree's structure: walk, split, attach, detach, tier values, locks and
the evictable-leaf sets. No tier policy lives here (see ``fabric.cache.hicache``).

Keys are packed page-aligned bytes (``fabric.cache.keys``); a child is found by
``(namespace, first page bytes)``, so two namespaces never share a node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, namespace_seed
from fabric.cache.leaves import LeafQueue
from fabric.cache.node import TreeNode
from fabric.errors import InvalidInput
from policies import EvictionPolicy

if TYPE_CHECKING:
    from fabric.cache.components import Components


def common_pages(node_key: bytes, data: bytes, start: int, end: int, page_bytes: int) -> int:
    """How many leading whole pages of ``node_key`` equal ``data[start:end]``."""
    if data.startswith(node_key, start, end):
        return len(node_key) // page_bytes
    lo, hi = 0, len(node_key) // page_bytes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if data.startswith(node_key[: mid * page_bytes], start, end):
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree:
    """Nodes, their L1/L2 values and the bookkeeping derived from them.

    ``evictable_size`` and ``protected_size`` count device tokens of unlocked
    and locked nodes. ``device_leaves``: nodes on device, unlocked, with no
    child on device (L1 eviction candidates). ``host_leaves``: nodes off device
    with no children (L2 eviction candidates).
    """

    def __init__(
        self, page_size: int, eviction: EvictionPolicy, parts: Components | None = None
    ) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * TOKEN_BYTES
        self.eviction = eviction
        self.parts = parts  # a hybrid model's other components, or None
        self.clear()

    def clear(self) -> None:
        """Forget every node (the object stays: collaborators keep their reference)."""
        self.root = TreeNode(b"", "", None, 0.0)
        self.evictable_size = 0
        self.protected_size = 0
        policy = self.eviction
        self.device_leaves = LeafQueue(policy.key, policy.monotone, lambda: policy.version)
        self.host_leaves = LeafQueue(self.eviction.host_order(), self.eviction.monotone)
        if self.parts is not None:
            self.parts.clear(self.root)

    def tokens(self, node: TreeNode) -> int:
        return len(node.key) // TOKEN_BYTES

    def pages(self, node: TreeNode) -> int:
        return len(node.key) // self.page_bytes

    # -- walking -----------------------------------------------------------------

    def descend(
        self, node: TreeNode, namespace: str, data: bytes, start: int, end: int, now: float
    ) -> list[TreeNode]:
        """The nodes matching ``data[start:end]`` below ``node``, in order, splitting the
        last one where the match ends inside it. Refreshes their access times."""
        path = []
        pb = self.page_bytes
        children = node.children
        while start < end:
            child = children.get((namespace, data[start : start + pb]))
            if child is None:
                break
            if not data.startswith(child.key, start, end):
                child = self.split(child, common_pages(child.key, data, start, end, pb) * pb)
            child.last_access = now
            path.append(child)
            start += len(child.key)
            children = child.children
        return path

    def peek_device_pages(self, namespace: str, data: bytes) -> int:
        """How many leading pages of ``data`` are on device, without changing anything."""
        pb = self.page_bytes
        node, start, end = self.root, 0, len(data)
        while start < end:
            child = node.children.get((namespace, data[start : start + pb]))
            if child is None or child.device_value is None:
                break
            n = common_pages(child.key, data, start, end, pb)
            start += n * pb
            if n * pb < len(child.key):
                break
            node = child
        return start // pb

    # -- structure ----------------------------------------------------------------

    def split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child`` after ``at`` bytes (whole pages); return the new upper node."""
        pb = self.page_bytes
        assert 0 < at < len(child.key) and at % pb == 0, (at, len(child.key))
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:at], child.namespace, parent, child.created, child.priority)
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
        upper.lock_ref = child.lock_ref
        pages = at // pb
        if child.device_value is not None:
            upper.device_value = child.device_value[:pages]
            child.device_value = child.device_value[pages:]
            upper.device_children = 1
        if child.host_value is not None:
            upper.host_value = child.host_value[:pages]
            child.host_value = child.host_value[pages:]
        if child.page_hashes is not None:
            upper.page_hashes = child.page_hashes[:pages]
            child.page_hashes = child.page_hashes[pages:]
        if child.pinned:
            upper.pin_expiry, upper.pin_ttl = child.pin_expiry, child.pin_ttl
            upper.host_ref += 1
        if child.write_op is not None:
            upper.write_op = child.write_op
            child.write_op.nodes.append(upper)
        parent.children[(child.namespace, child.key[:pb])] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[(child.namespace, child.key[:pb])] = child
        self.refresh(upper)
        if self.parts is not None:
            self.parts.on_split(upper, child, self.pages(child))
        return upper

    def attach(
        self, parent: TreeNode, namespace: str, key: bytes, now: float, priority: int
    ) -> TreeNode:
        """A new leaf under ``parent`` with no tier value yet (the caller sets one)."""
        node = TreeNode(key, namespace, parent, now, priority)
        parent.children[(namespace, key[: self.page_bytes])] = node
        return node

    def detach_leaf(self, node: TreeNode) -> None:
        """Remove a childless, unlocked node; the caller has freed its pages."""
        assert not node.children and node.lock_ref == 0 and node is not self.root
        parent = node.parent
        assert parent is not None
        del parent.children[(node.namespace, node.key[: self.page_bytes])]
        if node.device_value is not None:
            self.evictable_size -= self.tokens(node)
            parent.device_children -= 1
            if self.eviction.remembers:
                self.eviction.evicted(node, self._name(node), self.tokens(node))
        node.device_value = node.host_value = None
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        node.parent = None
        self.refresh(parent)

    # -- tier values ----------------------------------------------------------------

    def _name(self, node: TreeNode) -> int:
        """What an eviction policy's history knows a node by: its namespace and
        first page (no hashing of the prefix: a collision only reorders eviction)."""
        return hash((node.namespace, node.key[: self.page_bytes]))

    def set_device(self, node: TreeNode, pages: tuple[int, ...]) -> None:
        assert node.device_value is None and node.lock_ref == 0
        assert len(pages) == self.pages(node)
        node.device_value = pages
        self.evictable_size += self.tokens(node)
        parent = node.parent
        assert parent is not None
        parent.device_children += 1
        if self.eviction.remembers:
            self.eviction.admitted(node, self._name(node))
        self.refresh(node)
        self.refresh(parent)

    def clear_device(self, node: TreeNode) -> tuple[int, ...]:
        pages = node.device_value
        assert pages is not None and node.lock_ref == 0 and node.device_children == 0
        node.device_value = None
        self.evictable_size -= self.tokens(node)
        parent = node.parent
        assert parent is not None
        parent.device_children -= 1
        if self.eviction.remembers:
            self.eviction.evicted(node, self._name(node), self.tokens(node))
        self.refresh(node)
        self.refresh(parent)
        return pages

    # -- locks -----------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors in L1; they must be on device."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                assert node.device_value is not None, f"locking {node} that is not on device"
                n = self.tokens(node)
                self.evictable_size -= n
                self.protected_size += n
                node.lock_ref = 1
                self.device_leaves.discard(node)
            else:
                node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; ``InvalidInput`` (and no change) when
        ``node`` is not locked or not in this tree."""
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise InvalidInput(f"dec_lock_ref below zero on {node}")
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise InvalidInput(f"{node} is not a node of this tree")
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = self.tokens(node)
                self.evictable_size += n
                self.protected_size -= n
                self.refresh(node)
            node = node.parent  # type: ignore[assignment]

    # -- derived sets ----------------------------------------------------------------

    def refresh(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of the two evictable-leaf sets."""
        if node is self.root:
            return
        if node.device_value is not None and node.lock_ref == 0 and node.device_children == 0:
            self.device_leaves.add(node)
        else:
            self.device_leaves.discard(node)
        if node.device_value is None and not node.children:
            self.host_leaves.add(node)
        else:
            self.host_leaves.discard(node)

    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """``node``'s page hashes, computing (and keeping) any missing along its path."""
        missing = []
        while node is not self.root and node.page_hashes is None:
            missing.append(node)
            node = node.parent  # type: ignore[assignment]
        for n in reversed(missing):
            parent = n.parent
            assert parent is not None
            prev = (
                parent.page_hashes[-1] if parent is not self.root else namespace_seed(n.namespace)
            )  # type: ignore[index]
            n.page_hashes = chain_hashes(prev, n.key, self.page_bytes)
        return (missing[0] if missing else node).page_hashes  # type: ignore[return-value]

    def chain_hash(self, node: TreeNode, namespace: str) -> bytes:
        """The page-hash chain up to the end of ``node`` (the namespace's seed at the
        root), computing any missing hashes along its path once."""
        return namespace_seed(namespace) if node is self.root else self.page_hashes(node)[-1]

    def depth_pages(self, node: TreeNode) -> int:
        """Pages from the root to the end of ``node``."""
        total = 0
        while node is not self.root:
            total += len(node.key)
            node = node.parent  # type: ignore[assignment]
        return total // self.page_bytes

    def host_pages(self) -> tuple[int, int]:
        """L2 pages the tree holds, and how many of them L2 eviction may take
        (those of L2-only nodes without host protection)."""
        owned = evictable = 0
        for node in self.walk():
            if node.host_value is not None:
                owned += len(node.host_value)
                if node.device_value is None and node.host_ref == 0:
                    evictable += len(node.host_value)
        return owned, evictable

    def walk(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
