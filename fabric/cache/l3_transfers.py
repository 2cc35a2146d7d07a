"""L3 bookkeeping on the cache side: prefetch (L3 -> L2) and backup (L2 -> L3).

The cache never touches storage; it queues hit queries, prefetches and
backups on its controller and commits what every rank reports finished
(``Completions``). A prefetch goes QUERY (hit query in flight) -> LOADING
(host pages allocated, pages arriving) -> done, or RELEASING while ranks may
still write host pages past the committed prefix. Host protection (``host_ref``)
holds the anchor of a prefetch and the node of a backup until they end.

A hybrid model's backups carry the node's L2 components with its pages; its
prefetches are all or nothing: the hit query finds the deepest end where L3
holds every component, the prefetch loads that end's components (the mamba
state there, the sliding pages of the window before it) with the pages, and
only a prefetch that arrived whole enters the tree, its end with its
components.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.controller import Completions, Controller, StorageParts
from fabric.cache.events import EventLog, Medium
from fabric.cache.keys import TokenKey, answers_chain
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree, common_pages
from fabric.cache.results import MatchResult, check_count, transfer_series
from fabric.config import PrefetchConfig
from fabric.errors import InvalidInput
from fabric.observe.histogram import Histogram
from fabric.observe.series import Series
from policies import get_prefetch_stop_policy
from policies.prefetch import PrefetchTiming, TimeoutParams

log = logging.getLogger(__name__)


class PrefetchState(StrEnum):
    QUERY = "query"
    LOADING = "loading"
    RELEASING = "releasing"


@dataclass(eq=False)
class PrefetchOp:
    op_id: int
    req_id: Hashable
    anchor: TreeNode
    key: TokenKey
    start_page: int
    cached_pages: int
    prev_hash: bytes  # the chain hash before ``start_page``
    asked: bytes  # the packed tokens of the pages asked about (``start_page`` on)
    started_at: float
    reserved_tokens: int
    state: PrefetchState = PrefetchState.QUERY
    host_pages: Pages = field(default_factory=as_pages)
    completed_tokens: int = 0
    terminated: bool = False
    reported: bool = False
    # A hybrid model's L2 component slots the prefetch fills (all or nothing).
    parts: StorageParts | None = None
    # The chain hashes of the pages asked about, from the query's answer.
    page_hashes: list[bytes] = field(default_factory=list)
    # The store's generation and removal tick when asked (``EventLog``).
    generation: int = 0
    removal_tick: int = 0

    @property
    def num_pages(self) -> int:
        """Pages asked about: the key's from ``start_page`` on."""
        return self.key.num_pages - self.start_page


@dataclass(frozen=True)
class PrefetchStart:
    """``op_id`` of the started prefetch, or ``None`` with the ``reason`` it did not start."""

    op_id: int | None
    reason: str | None = None


@dataclass(eq=False)
class BackupOp:
    op_id: int
    node: TreeNode
    page_hashes: tuple[bytes, ...]
    # For the L3 event: the node's key when queued (a later split shortens the
    # node) and the hash of the page before it (None: the chain's start).
    tokens: bytes
    parent_hash: bytes | None
    # The store's generation when queued (``EventLog.l3_generation``): a backup
    # that a clear overtook is not announced (its write may have been erased).
    generation: int = 0
    removal_tick: int = 0  # ``EventLog.removal_tick`` when queued


# Why a prefetch was not started (each a series from the first scrape; others may come).
PREFETCH_REFUSALS = ("below prefetch threshold", "no storage attached", "rate limited")


@dataclass
class StorageStats:
    """The L3 side's counters. A field annotated with a ``Series`` is a Prometheus
    series too (``fabric.observe.series``)."""

    prefetch_started: Annotated[
        int, Series("kvfabric_prefetches_started", "counter", "L3 -> L2 prefetches started.")
    ] = 0
    prefetch_revoked: int = 0
    prefetched_tokens: Annotated[int, transfer_series("storage_to_host")] = 0
    backed_up_tokens: Annotated[int, transfer_series("host_to_storage")] = 0
    failed_backups: Annotated[
        int,
        Series(
            "kvfabric_failed_backups",
            "counter",
            "L2 -> L3 backups that failed on some rank or in the storage actor.",
        ),
    ] = 0
    # Hit answers whose page hashes failed the check.
    bad_answers: Annotated[
        int,
        Series(
            "kvfabric_bad_hit_answers",
            "counter",
            "Hit answers from the storage actor refused because their page hashes are "
            "not the chain of the pages asked about (the prefetch is revoked).",
        ),
    ] = 0
    refusals: Annotated[
        dict[str, int],
        Series(
            "kvfabric_prefetches_refused",
            "counter",
            "L3 prefetches not started, by reason.",
            by="reason",
            keys=PREFETCH_REFUSALS,
        ),
    ] = field(default_factory=dict)


class L3Transfers:
    """The prefetch and backup queues of one cache. Its collaborators: the tree, the
    controller (L2 slots, storage commands), the cache's event log, a way to evict
    L2 when a prefetch needs room, and the cache's operation ids."""

    def __init__(
        self,
        tree: RadixTree,
        ctl: Controller,
        config: PrefetchConfig,
        host_tokens: int,
        clock: Callable[[], float],
        events: EventLog,
        evict_host: Callable[[int], int],
        next_op_id: Callable[[], int],
        transfer_sizes: dict[str, Histogram],
    ) -> None:
        self.tree = tree
        self.to_storage = transfer_sizes["host_to_storage"]
        self.from_storage = transfer_sizes["storage_to_host"]
        self.ctl = ctl
        self.config = config
        self.clock = clock
        self.events = events
        self.evict_host = evict_host
        self.next_op_id = next_op_id
        self.page_size = tree.page_size
        self.stop_policy = get_prefetch_stop_policy(config.stop_policy)
        self.timeout = TimeoutParams(
            config.timeout_base_s, config.timeout_per_ki_token_s, config.timeout_max_s
        )
        self.max_inflight_tokens = int(config.max_inflight_fraction * host_tokens)
        self.attached = False
        self.stats = StorageStats()  # counters survive resets
        self.reset()

    def reset(self) -> None:
        self.prefetches: dict[Hashable, PrefetchOp] = {}
        self.by_op: dict[int, PrefetchOp] = {}
        self.backups: deque[BackupOp] = deque()
        self.inflight_tokens = 0

    @property
    def idle(self) -> bool:
        """No prefetch and no backup in flight."""
        return not self.by_op and not self.backups

    def held_host_pages(self) -> int:
        """L2 pages allocated to prefetches and not yet in the tree."""
        return sum(len(op.host_pages) for op in self.by_op.values())

    def held_host_parts(self) -> tuple[list[int], list[int]]:
        """L2 sliding pages and mamba slots allocated to prefetches, not yet in the tree."""
        sliding, mamba = [], []
        for op in self.by_op.values():
            if op.parts is not None:
                sliding.extend(op.parts.sliding_pages)
                mamba.extend(op.parts.mamba_slots)
        return sliding, mamba

    # -- attach / detach -----------------------------------------------------------

    def attach(self) -> None:
        self.attached = True

    def pause(self) -> None:
        """Start no new prefetch or backup (those in flight go on): before a detach."""
        self.attached = False

    def detach(self) -> None:
        """Forget storage. Call only once the controller has stopped every storage
        transfer: pending backups count as failed, prefetches end with nothing
        inserted, and all their host pages and protections are released."""
        while self.backups:
            self._end_backup(self.backups.popleft(), ok=False)
        for op in list(self.by_op.values()):
            if op.host_pages:
                self.ctl.host.free(op.host_pages)
                op.host_pages = as_pages()
            self._free_parts(op)
            self._drop(op)
        self.attached = False

    # -- backup --------------------------------------------------------------------

    def backup(self, node: TreeNode, parts_only: bool = False) -> None:
        """Queue an L2 -> L3 copy of a node whose host copy just completed (and of
        its L2 components, for a hybrid model; only those with ``parts_only``:
        they reached L2 after its pages)."""
        if not self.attached:
            return
        hashes = tuple(self.tree.page_hashes(node))  # hashes the path too
        parts = None
        if self.tree.parts is not None:
            # A node's sliding tail is its last pages; its mamba state is at its end.
            tail = node.host_sliding or ()
            state = () if node.host_mamba is None else (node.host_mamba,)
            parts = StorageParts(
                tuple(tail),
                hashes[len(hashes) - len(tail) :] if tail else (),
                state,
                hashes[-1:] if state else (),
            )
        if parts_only and not parts:
            return
        parent = node.parent
        prev = parent.page_hashes[-1] if parent is not None and parent.page_hashes else None
        stored = () if parts_only else hashes
        op = BackupOp(self.next_op_id(), node, stored, node.key, prev, self.events.l3_generation)
        node.host_ref += 1
        self.backups.append(op)
        pages = () if parts_only else node.host_value
        self.ctl.backup(op.op_id, pages, op.page_hashes, parts)  # type: ignore[arg-type]

    def complete_backups(self, n: int, failed: Collection[int] = ()) -> None:
        """The ``n`` oldest backups ended; those in ``failed`` stored nothing."""
        check_count("backups", n, len(self.backups))
        for _ in range(n):
            op = self.backups.popleft()
            self._end_backup(op, ok=op.op_id not in failed)

    def _end_backup(self, op: BackupOp, ok: bool) -> None:
        op.node.host_ref -= 1
        if not ok:
            self.stats.failed_backups += 1
            return
        tokens = len(op.page_hashes) * self.page_size
        if not tokens:
            return  # a hybrid node's components alone
        self.stats.backed_up_tokens += tokens
        self.to_storage.observe(tokens)
        if op.generation != self.events.l3_generation:
            return  # a clear overtook it: the store may not hold these pages
        self.events.stored_hashes(
            op.page_hashes,
            Medium.STORAGE,
            op.node.namespace,
            op.parent_hash,
            op.tokens,
            op.removal_tick,
        )

    # -- prefetch --------------------------------------------------------------------

    def start_prefetch(self, req_id: Hashable, key: TokenKey, match: MatchResult) -> PrefetchStart:
        """Start fetching from L3 what ``match`` leaves uncached of ``key``, from the
        end of ``match.last_host_node`` on. Refusals are a result, not an error."""
        if req_id in self.prefetches:
            raise InvalidInput(f"request {req_id!r} already has a prefetch in flight")
        tree = self.tree
        if not self.attached:
            return self._refuse(PREFETCH_REFUSALS[1])
        if key.num_tokens - match.matched_tokens < max(self.config.threshold_tokens, 1):
            return self._refuse(PREFETCH_REFUSALS[0])
        anchor = match.last_host_node
        start_page = tree.depth_pages(anchor)
        requested = (key.num_pages - start_page) * self.page_size
        if self.inflight_tokens + requested > self.max_inflight_tokens:
            return self._refuse(PREFETCH_REFUSALS[2])
        prev = tree.chain_hash(anchor, key.namespace)
        asked = key.data[start_page * tree.page_bytes :]
        op = PrefetchOp(
            op_id=self.next_op_id(),
            req_id=req_id,
            anchor=anchor,
            key=key,
            start_page=start_page,
            cached_pages=match.matched_tokens // self.page_size - start_page,
            prev_hash=prev,
            asked=asked,
            started_at=self.clock(),
            reserved_tokens=requested,
            generation=self.events.l3_generation,
            removal_tick=self.events.removal_tick,
        )
        if anchor is not tree.root:
            anchor.host_ref += 1
        self.inflight_tokens += requested
        self.prefetches[req_id] = self.by_op[op.op_id] = op
        self.stats.prefetch_started += 1
        self.ctl.query_storage(op.op_id, prev, asked)
        return PrefetchStart(op.op_id)

    def _refuse(self, reason: str) -> PrefetchStart:
        self.stats.refusals[reason] = self.stats.refusals.get(reason, 0) + 1
        return PrefetchStart(None, reason)

    def complete_query(
        self, op_id: int, hit_pages: int, hashes: Sequence[bytes] | None = None
    ) -> None:
        """Every shard holds the first ``hit_pages`` pages (MIN over ranks);
        ``hashes``: the chain hashes of the pages asked about, as the answerer
        computed them — checked (``answers_chain``) and kept on the key, so the
        cache does not hash these pages itself. An answer whose hashes fail the
        check is refused (the prefetch is revoked); none given (a test, or a
        storage call that failed): the pages are hashed here if they are fetched."""
        op = self.by_op.get(op_id)
        if op is None or op.state is not PrefetchState.QUERY:
            return
        key, pb = op.key, self.tree.page_bytes
        if hashes and not self._accept_hashes(op, hashes):
            return
        size = self.page_size
        pages = max(0, min(int(hit_pages), op.num_pages))
        if hashes and pages > 0 and op.generation == self.events.l3_generation:
            # The store holds these (no clear since it was asked): a router may learn of them.
            self._announce_stored(op, hashes[:pages])
        # A hybrid prefix serves only at the end the query found: all or nothing.
        whole = self.tree.parts is not None
        cap = self.ctl.max_prefetch_pages
        if cap is not None and pages > cap:
            pages = 0 if whole else cap
        threshold = max(self.config.threshold_tokens, 1)
        if pages <= 0 or (pages - op.cached_pages) * size < threshold:
            self._revoke(op)
            return
        host = self.ctl.host
        got = host.alloc(pages)
        if got is None:
            self.evict_host((pages - host.available_pages) * size)
            fits = min(pages, host.available_pages)
            if (whole and fits < pages) or (fits - op.cached_pages) * size < threshold:
                self._revoke(op)
                return
            pages, got = fits, host.alloc(fits)
            assert got is not None
        op.page_hashes = key.chain_from(op.start_page, op.prev_hash)  # kept, or hashed here
        if whole:
            op.parts = self._alloc_parts(op.page_hashes[:pages], op.anchor)
            if op.parts is None:
                host.free(got)
                self._revoke(op)
                return
        op.host_pages = got
        self._reserve(op, pages * size)
        op.state = PrefetchState.LOADING
        tokens = op.asked[: pages * pb]
        names = (key.namespace, op.prev_hash, tokens)
        self.ctl.prefetch(op.op_id, got, op.page_hashes[:pages], op.parts, names)

    def _accept_hashes(self, op: PrefetchOp, hashes: Sequence[bytes]) -> bool:
        """Keep an answer's page hashes on the key if they are the chain of the pages
        asked about; else count a bad answer and revoke the prefetch."""
        if answers_chain(op.prev_hash, op.asked, self.tree.page_bytes, hashes):
            op.key.keep_hashes(op.start_page, hashes)
            return True
        self.stats.bad_answers += 1
        log.warning(
            "hit query %d: the answer's %d page hashes are not the chain of the "
            "%d pages asked about; prefetch revoked",
            op.op_id,
            len(hashes),
            op.num_pages,
        )
        self._revoke(op)
        return False

    def _announce_stored(self, op: PrefetchOp, hashes: Sequence[bytes]) -> None:
        """KV events for the pages a hit query found in L3, ``hashes`` of them."""
        self.events.stored_hashes(
            tuple(hashes),
            Medium.STORAGE,
            op.key.namespace,
            op.prev_hash if op.start_page else None,
            op.asked[: len(hashes) * self.tree.page_bytes],
            op.removal_tick,
        )

    def _alloc_parts(self, hashes: list[bytes], anchor: TreeNode) -> StorageParts | None:
        """L2 slots for the components of the end after ``hashes`` (the sliding pages
        of the window before it that these pages reach, the mamba state there).
        Short, it evicts L2-only values of the component short of room, then L2's
        full leaves (which take their components); never on ``anchor``'s path, whose
        tails the window before the end may need. ``None`` when there is no room."""
        parts = self.tree.parts
        assert parts is not None
        n = min(parts.window_pages, len(hashes)) if parts.sliding else 0
        for attempt in range(3):
            sliding = parts.host_sliding_pool.alloc(n) if n else as_pages()
            mamba = parts.host_mamba_pool.alloc(1) if parts.mamba else as_pages()
            if sliding is not None and mamba is not None:
                return StorageParts(
                    tuple(sliding),
                    tuple(hashes[len(hashes) - n :]) if n else (),
                    tuple(mamba),
                    tuple(hashes[-1:]) if parts.mamba else (),
                )
            if sliding:
                parts.host_sliding_pool.release(sliding)
            if mamba:
                parts.host_mamba_pool.release(mamba)
            if attempt == 0:
                if sliding is None and n <= parts.host_sliding_pool.num_pages:
                    short = n - parts.host_sliding_pool.available_pages
                    parts.evict_host_sliding(short, anchor)
                if mamba is None:
                    parts.evict_host_mamba(1, anchor)
            elif attempt == 1:
                self.evict_host(len(hashes) * self.page_size)
        self.stats.refusals["no L2 room for components"] = (
            self.stats.refusals.get("no L2 room for components", 0) + 1
        )
        return None

    def _free_parts(self, op: PrefetchOp) -> None:
        parts, op.parts = op.parts, None
        comps = self.tree.parts
        if parts is None or comps is None:
            return
        if parts.sliding_pages:
            comps.host_sliding_pool.release(parts.sliding_pages)
        if parts.mamba_slots:
            comps.host_mamba_pool.release(parts.mamba_slots)

    def update_progress(self, op_id: int, completed_tokens: int, terminated: bool = False) -> None:
        """Cumulative tokens every rank has (MIN), and whether any rank stopped (MAX)."""
        op = self.by_op.get(op_id)
        if op is None or op.state is not PrefetchState.LOADING:
            return
        cap = len(op.host_pages) * self.page_size
        op.completed_tokens = max(op.completed_tokens, min(int(completed_tokens), cap))
        op.terminated = op.terminated or bool(terminated)
        op.reported = True

    def check_prefetch(self, req_id: Hashable) -> int | None:
        """``None`` while the stop policy says wait; else the prefetch ends — its
        MIN-completed prefix enters the tree as L2 nodes — and the tokens it added
        are returned (0 for no prefetch, or one that was revoked)."""
        op = self.prefetches.get(req_id)
        if op is None:
            return 0
        size = self.page_size
        tokens = len(op.host_pages) * size if op.host_pages else op.reserved_tokens
        timing = PrefetchTiming(
            tokens,
            op.completed_tokens,
            self.clock() - op.started_at,
            op.terminated,
            started=op.reported,
        )
        if not self.stop_policy.should_stop(timing, self.timeout):
            return None
        if op.state is PrefetchState.QUERY:
            self._revoke(op)
            return 0
        done_pages = op.completed_tokens // size
        if op.parts is not None and done_pages < len(op.host_pages):
            done_pages = 0  # a hybrid prefetch enters the tree whole or not at all
        committed, tail = op.host_pages[:done_pages], op.host_pages[done_pages:]
        added = 0
        if committed:
            parts, op.parts = op.parts, None
            added = self._insert_host(op.anchor, op.key, op.start_page, committed, parts)
        self.stats.prefetched_tokens += added
        if added:
            self.from_storage.observe(added)
        op.host_pages = tail
        self._reserve(op, len(tail) * size)
        if tail:
            self._start_release(op)
        else:
            self._drop(op)
        return added

    def abort(self, req_id: Hashable) -> None:
        """Stop a request's prefetch; nothing of it enters the tree."""
        op = self.prefetches.get(req_id)
        if op is None:
            return
        if op.state is PrefetchState.QUERY:
            self._revoke(op)
        else:
            self._start_release(op)

    def complete_release(self, op_id: int) -> None:
        """No rank writes the stopped prefetch's host pages any more: free them."""
        op = self.by_op.get(op_id)
        if op is None or op.state is not PrefetchState.RELEASING:
            return
        self.ctl.host.free(op.host_pages)
        op.host_pages = as_pages()
        self._free_parts(op)
        self._drop(op)

    def apply(self, done: Completions) -> None:
        self.complete_backups(done.backups, done.failed_backups)
        for op_id, (pages, hashes) in done.prefetch_hits.items():
            self.complete_query(op_id, pages, hashes)
        for op_id, tokens in done.prefetch_progress.items():
            self.update_progress(op_id, tokens, op_id in done.prefetch_terminated)
        for op_id in done.prefetch_terminated:
            self.update_progress(op_id, 0, True)
        for op_id in done.prefetch_released:
            self.complete_release(op_id)

    # -- internals -------------------------------------------------------------------

    def _reserve(self, op: PrefetchOp, tokens: int) -> None:
        self.inflight_tokens += tokens - op.reserved_tokens
        op.reserved_tokens = tokens

    def _release_anchor(self, op: PrefetchOp) -> None:
        if self.prefetches.get(op.req_id) is op:
            del self.prefetches[op.req_id]
            if op.anchor is not self.tree.root:
                op.anchor.host_ref -= 1

    def _start_release(self, op: PrefetchOp) -> None:
        self._release_anchor(op)
        op.state = PrefetchState.RELEASING
        self.ctl.stop_prefetch(op.op_id)

    def _revoke(self, op: PrefetchOp) -> None:
        self.stats.prefetch_revoked += 1
        self._drop(op)

    def _drop(self, op: PrefetchOp) -> None:
        assert not op.host_pages
        self._free_parts(op)  # none left once its pages are: they went with them
        self._release_anchor(op)
        self._reserve(op, 0)
        del self.by_op[op.op_id]

    def _insert_host(
        self,
        anchor: TreeNode,
        key: TokenKey,
        start_page: int,
        host_pages: Pages,
        parts: StorageParts | None = None,
    ) -> int:
        """Insert ``host_pages`` (L2, filled by a prefetch) for the key's pages from
        ``start_page`` on, below ``anchor``. Existing L1-only nodes on the way get
        them as their host copy; pages already in L2 are freed. A hybrid model's
        ``parts`` go to the node ending where the pages end and the nodes above it
        (those that lack them). Returns tokens added as new L2-only nodes."""
        tree, now = self.tree, self.clock()
        pb, data = tree.page_bytes, key.data
        start, end = start_page * pb, (start_page + len(host_pages)) * pb
        node, used, duplicates = anchor, 0, as_pages()
        while start < end:
            child = node.children.get((key.namespace, data[start : start + pb]))
            if child is None or child.write_op is not None:
                break
            if not data.startswith(child.key, start, end):
                child = tree.split(child, common_pages(child.key, data, start, end, pb) * pb)
            k = tree.pages(child)
            child.last_access = now
            if child.host_value is None:
                child.host_value = host_pages[used : used + k]
                self.events.stored(child, Medium.HOST)
            else:
                duplicates.extend(host_pages[used : used + k])
            used += k
            start += len(child.key)
            node = child
        added = 0
        if start < end and (node.children.get((key.namespace, data[start : start + pb])) is None):
            leaf = tree.attach(node, key.namespace, data[start:end], now, node.priority)
            known = key.known_hashes(start // pb)  # the query's answer: not hashed again
            if known is not None:
                leaf.page_hashes = known[: (end - start) // pb]
            leaf.host_value = host_pages[used:]
            tree.refresh(leaf)
            tree.refresh(node)
            self.events.stored(leaf, Medium.HOST)
            added = len(host_pages) - used
            used = len(host_pages)
            node, start = leaf, end
        duplicates.extend(host_pages[used:])
        if duplicates:
            self.ctl.host.free(duplicates)
        if parts is not None:
            self._place_parts(node if start == end else None, parts)
        return added * self.page_size

    def _place_parts(self, end: TreeNode | None, parts: StorageParts) -> None:
        """Give the prefetched components to the node ``end`` (where they were read
        for) and, for sliding pages reaching above it, to the nodes above; a node
        that has them already (or no end: the insert stopped short) frees them."""
        comps = self.tree.parts
        assert comps is not None
        spare_states = list(parts.mamba_slots)
        if end is not None and spare_states and end.host_mamba is None:
            end.host_mamba = spare_states.pop()
            comps.refresh(end)
        tail, spare = list(parts.sliding_pages), []
        x = end
        while tail and x is not None and x is not self.tree.root:
            take = min(self.tree.pages(x), len(tail))
            mine, tail = tail[len(tail) - take :], tail[: len(tail) - take]
            if x.host_sliding is None and x.host_value is not None:
                x.host_sliding = as_pages(mine)
                comps.refresh(x)
            else:
                spare.extend(mine)
            x = x.parent
        spare.extend(tail)
        if spare:
            comps.host_sliding_pool.release(spare)
        if spare_states:
            comps.host_mamba_pool.release(spare_states)
