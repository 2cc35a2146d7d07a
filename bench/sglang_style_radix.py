"""A baseline for bench/tree_ops.py: a pure-Python paged radix cache written the way
SGLang's ``RadixCache`` works (list keys, children keyed by the first page as a
tuple, page-by-page key comparison, torch tensors as values cloned on insert and
split, concatenated on match, LRU eviction from a heap of leaves). Written here
from its behaviour, for timing only; it has one tier and no locking traffic.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from array import array

import torch


class _Node:
    __slots__ = ("children", "hashes", "key", "last_access", "parent", "value")

    def __init__(self, key, value, parent):
        self.children = {}
        self.key = key
        self.value = value
        self.parent = parent
        self.last_access = time.monotonic()
        self.hashes = None


class SGLangStyleRadixCache:
    def __init__(self, page_size: int, capacity_tokens: int, page_hashes: bool = False):
        self.page = page_size
        self.capacity = capacity_tokens
        self.page_hashes = page_hashes
        self.root = _Node([], torch.empty(0, dtype=torch.int64), None)
        self.size = 0
        self._next_slot = 0

    def _match_len(self, k0, k1) -> int:
        p, n, i = self.page, min(len(k0), len(k1)), 0
        while i < n:
            if k0[i : i + p] != k1[i : i + p]:
                break
            i += p
        return i

    def _split(self, child: _Node, at: int) -> _Node:
        upper = _Node(child.key[:at], child.value[:at].clone(), child.parent)
        upper.children = {tuple(child.key[at : at + self.page]): child}
        child.parent.children[tuple(child.key[: self.page])] = upper
        child.key = child.key[at:]
        child.value = child.value[at:].clone()
        child.parent = upper
        return upper

    def match_prefix(self, key: list[int]) -> torch.Tensor:
        key = key[: len(key) // self.page * self.page]
        node, values = self.root, []
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                break
            child.last_access = time.monotonic()
            n = self._match_len(child.key, key)
            if n < len(child.key):
                values.append(self._split(child, n).value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        key = key[: len(key) // self.page * self.page]
        node, cached = self.root, 0
        while key:
            child = node.children.get(tuple(key[: self.page]))
            if child is None:
                break
            child.last_access = time.monotonic()
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            cached += n
            node, key, value = child, key[n:], value[n:]
        if key:
            leaf = _Node(key, value.clone(), node)
            node.children[tuple(key[: self.page])] = leaf
            self.size += len(key)
            if self.page_hashes:
                data = array("I", key).tobytes()
                prev = node.hashes[-1] if node.hashes else b""
                out = []
                for i in range(0, len(data), self.page * 4):
                    prev = hashlib.sha256(prev + data[i : i + self.page * 4]).digest()
                    out.append(prev)
                leaf.hashes = out
        return cached

    def new_value(self, n: int) -> torch.Tensor:
        start = self._next_slot
        self._next_slot += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def evict_to_fit(self, incoming: int) -> None:
        excess = self.size + incoming - self.capacity
        if excess <= 0:
            return
        leaves, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                leaves.append((n.last_access, id(n), n))
            stack.extend(n.children.values())
        heapq.heapify(leaves)
        while excess > 0 and leaves:
            _, _, n = heapq.heappop(leaves)
            del n.parent.children[tuple(n.key[: self.page])]
            self.size -= len(n.key)
            excess -= len(n.key)
            if not n.parent.children and n.parent is not self.root:
                heapq.heappush(leaves, (n.parent.last_access, id(n.parent), n.parent))
