"""The cache in one process, without ranks: a controller that moves no bytes
(only bookkeeping, with an in-memory stand-in for L3) for tests, and
``CoreReplay``, which serves prompts through the request lifecycle
(``fabric.cache.admission``) synchronously — the core-only demo and the tree
benchmark run the code that serves."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fabric.cache.admission import Admission
from fabric.cache.allocator import PagedAllocator
from fabric.cache.components import Components
from fabric.cache.controller import (
    Completions,
    Controller,
    HitAnswer,
    PartCopy,
    StorageParts,
)
from fabric.cache.hicache import HiCache
from fabric.cache.keys import TOKEN_BYTES, TokenKey, chain_hashes
from fabric.cache.results import TierTokens
from fabric.config import FabricConfig


@dataclass
class _Queued:
    op_id: int
    host_pages: Sequence[int] = ()
    page_hashes: Sequence[bytes] = ()
    parts: StorageParts | None = None


@dataclass
class _Query:
    op_id: int
    prev: bytes
    tokens: bytes


class InProcessController(Controller):
    """A controller for tests and the core-only demo: no bytes, only bookkeeping.

    With ``immediate=True`` every queued operation is reported finished at the
    next ``take_completions``; otherwise nothing is, and the test tells the
    cache of completions itself (``Writes.complete`` and the rest).
    ``storage`` stands in for L3: the set of page hashes that backups stored
    (and ``(component, hash)`` pairs for a hybrid model's other components: set
    ``components`` to the cache's, so hit queries find the deepest end where
    every component is stored).
    ``busy_s`` sums the time spent in ``take_completions`` (what ranks and the
    storage actor would do elsewhere: storing hashes, answering hit queries —
    hashing the pages asked about).
    """

    def __init__(
        self, device_pages: int, host_pages: int, page_size: int, immediate: bool = True
    ) -> None:
        self.device = PagedAllocator(device_pages, page_size, "L1 device pool")
        self.host = PagedAllocator(host_pages, page_size, "L2 host pool")
        self.page_size = page_size
        self.immediate = immediate
        self.storage: set[bytes] = set()
        self.part_storage: set[tuple[str, bytes]] = set()
        self.components: Components | None = None
        self.busy_s = 0.0
        self.reset_queues()

    def reset_queues(self) -> None:
        self.writes: list[int] = []
        self.loads: list[int] = []
        self.backups: list[_Queued] = []
        self.queries: list[_Query] = []
        self.prefetches: dict[int, _Queued] = {}
        self.stopped: list[int] = []

    def write(self, op_id, device_pages, host_pages, parts: PartCopy | None = None) -> None:
        self.writes.append(op_id)

    def load(self, op_id, host_pages, device_pages, parts: PartCopy | None = None) -> None:
        self.loads.append(op_id)

    def backup(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
    ) -> None:
        self.backups.append(_Queued(op_id, host_pages, page_hashes, parts))  # kept, not copied

    def query_storage(self, op_id: int, prev: bytes, tokens: bytes) -> None:
        self.queries.append(_Query(op_id, prev, tokens))

    def prefetch(
        self,
        op_id: int,
        host_pages: Sequence[int],
        page_hashes: Sequence[bytes],
        parts: StorageParts | None = None,
        names: tuple[str, bytes, bytes] | None = None,
    ) -> None:
        self.prefetches[op_id] = _Queued(op_id, tuple(host_pages), tuple(page_hashes), parts)

    def stop_prefetch(self, op_id: int) -> None:
        self.prefetches.pop(op_id, None)
        self.stopped.append(op_id)

    def answer(self, prev: bytes, tokens: bytes) -> HitAnswer:
        """A hit query's answer, as the storage actor gives it: the pages' chain
        hashes, and how many of them the stand-in L3 holds."""
        hashes = chain_hashes(prev, tokens, self.page_size * TOKEN_BYTES)
        return HitAnswer(self.hit_pages(hashes), hashes)

    def hit_pages(self, page_hashes: Sequence[bytes]) -> int:
        n = 0
        for h in page_hashes:
            if h not in self.storage:
                break
            n += 1
        comps = self.components
        if comps is None:
            return n
        stored = self.part_storage
        while n > 0:  # a hybrid model's deepest end with every component stored
            window = page_hashes[max(0, n - comps.window_pages) : n]
            if (not comps.mamba or ("mamba", page_hashes[n - 1]) in stored) and all(
                ("sliding", h) in stored for h in window
            ):
                break
            n -= 1
        return n

    def take_completions(self) -> Completions:
        if not self.immediate:
            return Completions()
        t0 = time.perf_counter()
        for b in self.backups:
            self.storage.update(b.page_hashes)
            if b.parts:
                self.part_storage.update(("sliding", h) for h in b.parts.sliding_hashes)
                self.part_storage.update(("mamba", h) for h in b.parts.mamba_hashes)
        done = Completions(
            writes=len(self.writes),
            loads=len(self.loads),
            backups=len(self.backups),
            prefetch_hits={q.op_id: self.answer(q.prev, q.tokens) for q in self.queries},
            prefetch_progress={
                op: len(q.host_pages) * self.page_size for op, q in self.prefetches.items()
            },
            prefetch_released=frozenset(self.stopped),
        )
        self.reset_queues()
        self.busy_s += time.perf_counter() - t0
        return done

    def reset(self) -> None:
        self.device.reset()
        self.host.reset()
        self.reset_queues()


@dataclass
class ReplayStats:
    requests: int = 0
    prompt_tokens: int = 0
    refused_requests: int = 0
    refused_at: list[int] = field(default_factory=list)  # each refused prompt's index
    tokens: TierTokens = field(default_factory=TierTokens)
    tree_us: list[float] = field(default_factory=list)
    request_us: list[float] = field(default_factory=list)
    stand_in_us: list[float] = field(default_factory=list)
    # A hybrid model's other components (``fabric.tools.simulate.component_report``).
    components: dict = field(default_factory=dict)


class ReplayClock:
    """A replay's clock: each reading a microsecond after the last, the same on
    every run. (On a real clock a run's figures would depend on its timing: an
    adaptive eviction policy measures ages with it.) A replay reads it far less
    than a million times a second of any timeout it could trip."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


class CoreReplay:
    """One ``HiCache`` with an immediate in-process controller and, with
    ``storage=True``, an in-memory L3 that backups fill. Each prompt goes through
    ``Admission`` (prefetch, load-back, alloc and evict, insert) and is released
    at once. ``tree_us`` times the admission and the release of each served
    prompt (match, load-back, locks, allocation with eviction, insert);
    ``request_us`` everything the core does for it (the key and its page hashes,
    the prefetch, the admission, the release, the step's write-throughs,
    backups and completions, the events); ``stand_in_us`` the part of it spent
    in the in-process controller (the in-memory L3 and completions, which ranks
    and the storage actor do in their own processes in a fabric)."""

    def __init__(self, config: FabricConfig, storage: bool = True, namespace: str = "default"):
        cc = config.cache
        self.ctl = InProcessController(cc.device_pages, cc.host_pages, cc.page_size)
        self.cache = HiCache(cc, self.ctl, config.prefetch, ReplayClock(), config.model)
        self.admission = Admission(self.cache)
        self.ctl.components = self.cache.parts
        if storage:
            self.cache.l3.attach()
        self.namespace = namespace
        self.stats = ReplayStats()

    def serve(self, packed: bytes, answer: bytes | None = None) -> None:
        """Serve one prompt's whole pages — or, given its ``answer`` (packed, maybe
        empty), the whole prompt and then the answer decoded into the cache, as
        an engine caches a finished turn. Hits and computed tokens count the
        prompt's whole pages only."""
        cache, stats = self.cache, self.stats
        t0, busy = time.perf_counter(), self.ctl.busy_s
        key = TokenKey(packed, cache.page_size, self.namespace)
        stats.requests += 1
        stats.prompt_tokens += key.num_tokens
        if key.num_tokens > cache.config.device_tokens:
            self._refuse()
            return
        prefetched = 0
        if self.admission.start_prefetch(stats.requests, key):
            done = None
            while done is None:  # the hit query, then the pages, arrive with polls
                cache.poll()
                done = self.admission.check_prefetch(stats.requests)
            prefetched = done
        t1 = time.perf_counter()
        adm = self.admission
        if answer is None:
            req = adm.begin(key, prefetched=prefetched)
            fill = adm.prefill(req, key.num_tokens)
        else:
            req = adm.begin(packed, self.namespace, prefetched=prefetched, key=key)
            fill = adm.prefill(req, req.num_tokens)
        if fill is None:
            self._refuse()
            return
        device, host, storage = req.device_hit, req.host_hit, req.storage_hit
        if answer and key.num_tokens + len(answer) // 4 <= cache.config.device_tokens:
            cache.poll()  # the prompt's steps complete before the decode
            adm.append(req, answer)
        adm.release(req)
        t2 = time.perf_counter()
        stats.tokens.add(device, host, storage, key.num_tokens - device - host - storage)
        cache.poll()
        cache.events.take()
        stats.tree_us.append((t2 - t1) * 1e6)
        stats.request_us.append((time.perf_counter() - t0) * 1e6)
        stats.stand_in_us.append((self.ctl.busy_s - busy) * 1e6)

    def _refuse(self) -> None:
        """The prompt being served (the ``requests``-th) is refused."""
        self.stats.refused_requests += 1
        self.stats.refused_at.append(self.stats.requests - 1)

    def run(
        self, prompts: Iterable[bytes], progress: Callable[[int], None] | None = None
    ) -> ReplayStats:
        for i, packed in enumerate(prompts, 1):
            self.serve(packed)
            if progress is not None:
                progress(i)
        return self.stats
