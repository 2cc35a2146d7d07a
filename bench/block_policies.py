"""Eviction policies at block level on a Mooncake-format trace: how far each
classic policy gets, and what separates them from the offline optimum.

The same model as ``kvfabric simulate``'s bounds: one cache of 512-token trace
blocks, each keyed by its whole prefix (``prefix_keys``: a block id that recurs
after another prefix is another block, as in a radix tree); a request hits the
leading run of its blocks the cache holds, then all its blocks are accessed. Policies: LRU, S3-FIFO (small queue 10%, ghost of the
cache's size), W-TinyLFU (1% window, exact counts halved every 10 cache sizes),
LIRS (1% resident HIR), 2Q with a ghost of 4x the cache (what ``2q`` does on
the tree), LRU with an oracle that never admits a block that is never used
again (what admission alone could reach), and Belady. Then the reuse profile:
how many hits are first reuses of a block, and how many each policy serves.

    python3 bench/block_policies.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import pathlib
import sys
from collections import Counter, OrderedDict, defaultdict
from dataclasses import replace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.tools.simulate import prefix_keys
from fabric.tools.workload import BLOCK_TOKENS, read_trace

NEVER = 1 << 62


class LRU:
    def __init__(self, cap: int) -> None:
        self.cap, self.d = cap, OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.d

    def access(self, blocks) -> None:
        for h in blocks:
            if h in self.d:
                self.d.move_to_end(h)
            elif self.admit(h):
                self.d[h] = None
                if len(self.d) > self.cap:
                    self.d.popitem(last=False)

    def admit(self, h: int) -> bool:
        return True


class OracleLRU(LRU):
    def __init__(self, cap: int, reused: set[int]) -> None:
        super().__init__(cap)
        self.reused = reused

    def admit(self, h: int) -> bool:
        return h in self.reused


class S3FIFO:
    def __init__(self, cap: int, small: float = 0.1) -> None:
        self.cap, self.small_cap = cap, max(1, int(cap * small))
        self.small, self.main, self.ghost, self.freq = (
            OrderedDict(),
            OrderedDict(),
            OrderedDict(),
            {},
        )

    def __contains__(self, h: int) -> bool:
        return h in self.small or h in self.main

    def access(self, blocks) -> None:
        for h in blocks:
            if h in self:
                self.freq[h] = min(3, self.freq[h] + 1)
                continue
            while len(self.small) + len(self.main) >= self.cap:
                self._evict()
            (self.main if self.ghost.pop(h, 0) is None else self.small)[h] = None
            self.freq[h] = 0

    def _evict(self) -> None:
        if len(self.small) >= self.small_cap or not self.main:
            h, _ = self.small.popitem(last=False)
            if self.freq[h] > 0:
                self.main[h] = None
                self.freq[h] = 0
            else:
                del self.freq[h]
                self.ghost[h] = None
                if len(self.ghost) > self.cap:
                    self.ghost.popitem(last=False)
            return
        while True:
            h, _ = self.main.popitem(last=False)
            if self.freq[h] > 0:
                self.freq[h] -= 1
                self.main[h] = None
            else:
                del self.freq[h]
                return


class TinyLFU:
    def __init__(self, cap: int, window: float = 0.01, reset: int = 10) -> None:
        self.cap, self.wcap = cap, max(1, int(cap * window))
        self.window, self.probation, self.protected = OrderedDict(), OrderedDict(), OrderedDict()
        self.pcap = int((cap - self.wcap) * 0.8)
        self.freq: defaultdict[int, int] = defaultdict(int)
        self.n, self.reset = 0, cap * reset

    def __contains__(self, h: int) -> bool:
        return h in self.window or h in self.probation or h in self.protected

    def _count(self, h: int) -> None:
        self.freq[h] += 1
        self.n += 1
        if self.n >= self.reset:
            self.n = 0
            for k in list(self.freq):
                self.freq[k] //= 2
                if not self.freq[k]:
                    del self.freq[k]

    def access(self, blocks) -> None:
        for h in blocks:
            self._count(h)
            if h in self.window:
                self.window.move_to_end(h)
            elif h in self.protected:
                self.protected.move_to_end(h)
            elif h in self.probation:
                del self.probation[h]
                self.protected[h] = None
                if len(self.protected) > self.pcap:
                    k, _ = self.protected.popitem(last=False)
                    self.probation[k] = None
                    self.probation.move_to_end(k, last=False)
            else:
                self.window[h] = None
                if len(self.window) > self.wcap:
                    self._admit(self.window.popitem(last=False)[0])

    def _admit(self, c: int) -> None:
        if len(self.probation) + len(self.protected) < self.cap - self.wcap:
            self.probation[c] = None
            return
        main = self.probation or self.protected
        victim = next(iter(main))
        if self.freq[c] > self.freq[victim]:
            del main[victim]
            self.probation[c] = None


class LIRS:
    def __init__(self, cap: int, hir: float = 0.01) -> None:
        self.cap = cap
        self.lir_cap = cap - max(2, int(cap * hir))
        self.stack, self.queue = OrderedDict(), OrderedDict()
        self.lir, self.resident = set(), set()

    def __contains__(self, h: int) -> bool:
        return h in self.resident

    def _prune(self) -> None:
        while self.stack and next(iter(self.stack)) not in self.lir:
            self.stack.popitem(last=False)

    def _demote_bottom(self) -> None:
        k, _ = self.stack.popitem(last=False)
        self.lir.discard(k)
        self.queue[k] = None
        self._prune()

    def access(self, blocks) -> None:
        for h in blocks:
            if h in self.lir:
                self.stack.move_to_end(h)
                self._prune()
            elif h in self.resident:
                if h in self.stack:
                    self.stack.move_to_end(h)
                    self.lir.add(h)
                    del self.queue[h]
                    self._demote_bottom()
                else:
                    self.stack[h] = None
                    self.queue.move_to_end(h)
            elif len(self.lir) < self.lir_cap:
                self.lir.add(h)
                self.resident.add(h)
                self.stack[h] = None
            else:
                if len(self.resident) >= self.cap:
                    self.resident.discard(self.queue.popitem(last=False)[0])
                self.resident.add(h)
                if h in self.stack:
                    self.stack.move_to_end(h)
                    self.lir.add(h)
                    self._demote_bottom()
                else:
                    self.stack[h] = None
                    self.queue[h] = None
                if len(self.stack) > 20 * self.cap:  # bound the non-resident history
                    for k in list(self.stack)[: len(self.stack) // 2]:
                        if k not in self.lir and k not in self.resident:
                            del self.stack[k]


class TwoQ:
    """Probation (seen once) evicted first; protected on a second use or when the
    ghost (``ghost`` x the cache, every evicted block) remembers the block."""

    def __init__(self, cap: int, ghost: int = 4) -> None:
        self.cap, self.ghost_cap = cap, ghost * cap
        self.probation, self.protected, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.probation or h in self.protected

    def _forget(self, h: int) -> None:
        self.ghost[h] = None
        if len(self.ghost) > self.ghost_cap:
            self.ghost.popitem(last=False)

    def access(self, blocks) -> None:
        for h in blocks:
            if h in self.protected:
                self.protected.move_to_end(h)
                continue
            if h in self.probation:
                del self.probation[h]
                self.protected[h] = None
            elif self.ghost.pop(h, 0) is None:
                self.protected[h] = None
            else:
                self.probation[h] = None
            while len(self.probation) + len(self.protected) > self.cap:
                queue = self.probation or self.protected
                self._forget(queue.popitem(last=False)[0])


class Belady:
    def __init__(self, cap: int, next_use: list[list[int]]) -> None:
        self.cap, self.next_use = cap, next_use
        self.cache: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []
        self.i = 0

    def __contains__(self, h: int) -> bool:
        return h in self.cache

    def access(self, blocks) -> None:
        for h, n in zip(blocks, self.next_use[self.i], strict=True):
            self.cache[h] = n
            heapq.heappush(self.heap, (-n, h))
        self.i += 1
        while len(self.cache) > self.cap:
            n, h = heapq.heappop(self.heap)
            if self.cache.get(h) == -n:
                del self.cache[h]


def replay(requests, cache) -> tuple[float, int]:
    """Token hit rate, and how many hit blocks were a block's first reuse."""
    hit = total = first = 0
    uses: Counter[int] = Counter()
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            n += 1
            first += uses[h] == 1
        hit += min(n * BLOCK_TOKENS, r.input_length)
        total += r.input_length
        cache.access(r.hash_ids)
        uses.update(r.hash_ids)
    return hit / max(1, total), first


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    ap.add_argument("--capacity", type=int, default=2 << 20, help="tokens (default 2M)")
    args = ap.parse_args()
    requests = read_trace(args.trace, None)
    keys = prefix_keys(requests)
    requests = [replace(r, hash_ids=k) for r, k in zip(requests, keys, strict=True)]
    cap = args.capacity // BLOCK_TOKENS
    later: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [later.get(h, NEVER) for h in requests[i].hash_ids]
        for h in requests[i].hash_ids:
            later[h] = i
    count = Counter(h for r in requests for h in r.hash_ids)
    reused = {h for h, n in count.items() if n > 1}
    # Every block's second use that is a prefix hit with an infinite cache.
    seen: Counter[int] = Counter()
    first_possible = 0
    for r in requests:
        for h in r.hash_ids:
            if not seen[h]:
                break
            first_possible += seen[h] == 1
        seen.update(r.hash_ids)
    policies = {
        "lru": LRU(cap),
        "s3fifo": S3FIFO(cap),
        "w_tinylfu": TinyLFU(cap),
        "lirs": LIRS(cap),
        "2q_ghost4": TwoQ(cap),
        "lru_oracle_admission": OracleLRU(cap, reused),
        "belady": Belady(cap, next_use),
    }
    rows = {}
    for name, cache in policies.items():
        rate, first = replay(requests, cache)
        rows[name] = {"hit_rate": round(rate, 4), "first_reuse_hits": first}
        print(f"{name:>22}: {rate:6.1%}  first-reuse block hits {first:,}", file=sys.stderr)
    new_blocks = len(count)
    print(
        f"{len(requests)} requests, {new_blocks:,} blocks, {len(reused) / new_blocks:.1%} of them "
        f"used again; {first_possible:,} first-reuse block hits possible",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "capacity_tokens": args.capacity,
                "blocks": new_blocks,
                "reused_share": round(len(reused) / new_blocks, 4),
                "first_reuse_hits_possible": first_possible,
                "policies": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
