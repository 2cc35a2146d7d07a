"""The baseline for bench/tree_ops.py: SGLang's ``RadixCache`` algorithm, one tier,
re-written here from its behaviour (SGLang 0.5.20) so the comparison runs
without SGLang installed. It does what the real one does per request, at its speed:

- keys are ``array('q')`` token ids; a child is found by the tuple of its first
  page; a key is compared with doubling slice compares and a binary search of
  the window that differs (C-level compares, no per-token Python loop);
- values are int64 token-index tensors, cloned on insert and split and
  concatenated on match;
- evictable leaves are a kept set (updated on insert, lock, unlock and delete);
  an eviction heapifies that set by last access time and pops it, pushing a
  parent that becomes an unlocked leaf;
- the allocator is SGLang's paged one: free pages in an int64 tensor, an
  allocation is a slice, a free concatenates the freed pages in front;
- with ``events``, every stored page gets a chained SHA-256 hash and a
  ``BlockStored``-like record, and every evicted page a removal record.

``bench/tree_ops.py --peer sglang`` runs the real ``RadixCache`` instead when
SGLang is installed, to check that this stand-in is not slower than it.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from array import array

import torch


class Key:
    __slots__ = ("ids",)

    def __init__(self, ids: array) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, s: slice) -> Key:
        return Key(self.ids[s])

    def child_key(self, page: int) -> tuple[int, ...]:
        return tuple(self.ids[:page])

    def match(self, other: Key, page: int) -> int:
        t0, t1 = self.ids, other.ids
        n = min(len(t0), len(t1))
        matched, lo, step = n, 0, 1
        while lo < n:
            hi = min(lo + step, n)
            if t0[lo:hi] != t1[lo:hi]:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if t0[lo:mid] == t1[lo:mid]:
                        lo = mid
                    else:
                        hi = mid
                matched = lo
                break
            lo = hi
            step *= 2
        return matched // page * page


class Node:
    __slots__ = (
        "children",
        "hashes",
        "hit_count",
        "key",
        "last_access_time",
        "lock_ref",
        "parent",
        "value",
    )

    def __init__(self) -> None:
        self.children: dict = {}
        self.parent: Node | None = None
        self.key: Key | None = None
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0
        self.hashes: list[bytes] | None = None

    def __lt__(self, other: Node) -> bool:
        return self.last_access_time < other.last_access_time


class PagedAllocator:
    """SGLang's paged token-to-KV allocator on CPU: slices and concatenations of one
    int64 tensor of free page ids (page 0 is reserved, as there)."""

    def __init__(self, size: int, page: int) -> None:
        self.page = page
        self.free_pages = torch.arange(1, size // page + 1, dtype=torch.int64)
        self._offsets = torch.arange(page)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page

    def alloc(self, need: int) -> torch.Tensor | None:
        n = need // self.page
        if n > len(self.free_pages):
            return None
        out = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return (out[:, None] * self.page + self._offsets).reshape(-1)

    def free_segment(self, index: torch.Tensor) -> None:
        if index.numel():
            self.free_pages = torch.cat((index[:: self.page] // self.page, self.free_pages))


class SGLangStyleRadixCache:
    def __init__(self, page: int, capacity_tokens: int, events: bool = False) -> None:
        self.page = page
        self.allocator = PagedAllocator(capacity_tokens, page)
        self.events = events
        self.event_log: list[tuple] = []
        self.root = Node()
        self.root.key = Key(array("q"))
        self.root.value = torch.empty(0, dtype=torch.int64)
        self.root.lock_ref = 1
        self.root.hashes = []
        self.evictable_leaves: set[Node] = set()
        self.evictable_size = 0
        self.protected_size = 0
        self._empty = torch.empty(0, dtype=torch.int64)

    # -- the scheduler's use of it, per request --------------------------------------

    def serve(self, ids: array) -> int | None:
        """Match, lock, evict if short, allocate, insert, unlock: what a prefill does
        with the cache. Returns the hit in tokens, ``None`` when L1 cannot hold it."""
        key = Key(ids[: len(ids) // self.page * self.page])
        prefix, node = self.match_prefix(key)
        self.inc_lock_ref(node)
        need = len(key) - len(prefix)
        short = need - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        new = self.allocator.alloc(need)
        if new is None:
            self.dec_lock_ref(node)
            return None
        _, last = self.insert(key, torch.cat((prefix, new)))
        self.inc_lock_ref(last)
        self.dec_lock_ref(node)
        self.dec_lock_ref(last)
        if self.events:
            self.event_log.clear()
        return len(prefix)

    # -- RadixCache ----------------------------------------------------------------

    def match_prefix(self, key: Key) -> tuple[torch.Tensor, Node]:
        if not len(key):
            return self._empty, self.root
        page, node, now = self.page, self.root, time.monotonic()
        node.last_access_time = now
        values = []
        child_key = key.child_key(page)
        while len(key) and child_key in node.children:
            child = node.children[child_key]
            child.last_access_time = now
            n = child.key.match(key, page)
            if n < len(child.key):
                node = self._split(child.key, child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
            if len(key):
                child_key = key.child_key(page)
        return (torch.cat(values) if values else self._empty), node

    def insert(self, key: Key, value: torch.Tensor) -> tuple[int, Node]:
        page, node, now = self.page, self.root, time.monotonic()
        node.last_access_time = now
        if not len(key):
            return 0, node
        child_key = key.child_key(page)
        total = 0
        while len(key) and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = now
            n = node.key.match(key, page)
            total += n
            key, value = key[n:], value[n:]
            if n < len(node.key):
                node = self._split(node.key, node, n)
            node.hit_count += 1
            if len(key):
                child_key = key.child_key(page)
        if len(key):
            leaf = Node()
            leaf.parent = node
            leaf.key = key
            leaf.value = value.clone()
            leaf.hit_count += 1
            node.children[child_key] = leaf
            self.evictable_size += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(leaf)
            if self.events:
                self._record_store(leaf)
            node = leaf
        return total, node

    def _split(self, key: Key, child: Node, at: int) -> Node:
        page = self.page
        upper = Node()
        upper.hit_count = child.hit_count
        upper.children = {key[at:].child_key(page): child}
        upper.parent = child.parent
        upper.lock_ref = child.lock_ref
        upper.key = child.key[:at]
        upper.value = child.value[:at].clone()
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:].clone()
        upper.parent.children[key.child_key(page)] = upper
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[: at // page], child.hashes[at // page :]
        return upper

    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access_time, n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, x = heapq.heappop(heap)
            self.allocator.free_segment(x.value)
            evicted += len(x.value)
            self._delete_leaf(x)
            parent = x.parent
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent))
            if self.events:
                self.event_log.append(("removed", x.hashes))
        return evicted

    def _delete_leaf(self, node: Node) -> None:
        del node.parent.children[node.key.child_key(self.page)]
        self.evictable_size -= len(node.key)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)

    def _update_leaf_status(self, node: Node) -> None:
        if node.value is None or node.lock_ref > 0 or node.children:
            self.evictable_leaves.discard(node)
        elif node is not self.root:
            self.evictable_leaves.add(node)

    def _record_store(self, node: Node) -> None:
        # One record per page, chained SHA-256 over the page's tokens.
        prev = node.parent.hashes[-1] if node.parent.hashes else b""
        ids, page, out = node.key.ids, self.page, []
        for start in range(0, len(ids), page):
            prev = hashlib.sha256(prev + ids[start : start + page].tobytes()).digest()
            out.append(prev)
            self.event_log.append(("stored", prev, ids[start : start + page].tolist()))
        node.hashes = out
