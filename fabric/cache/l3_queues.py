"""L3 bookkeeping on the cache side: prefetch (L3 -> L2) and backup (L2 -> L3).

The cache never touches storage; it queues hit queries, prefetches and
backups on its controller and commits what every rank reports finished
(``Completions``). A prefetch goes QUERY (hit query in flight) -> LOADING
(host pages allocated, pages arriving) -> done, or RELEASING while ranks may
still write host pages past the committed prefix. Host protection (``host_ref``)
holds the anchor of a prefetch and the node of a backup until they end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from enum import StrEnum

from fabric.cache.allocator import Pages, as_pages
from fabric.cache.controller import Completions, Controller
from fabric.cache.events import EventLog, Medium
from fabric.cache.keys import TokenKey
from fabric.cache.node import TreeNode
from fabric.cache.radix import RadixTree, common_pages
from fabric.cache.results import MatchResult, check_count
from fabric.config import PrefetchConfig
from fabric.errors import InvalidInput
from fabric.histogram import Histogram
from policies import get_prefetch_stop_policy
from policies.prefetch import PrefetchTiming, TimeoutParams


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
    page_hashes: list[bytes]
    started_at: float
    reserved_tokens: int
    state: PrefetchState = PrefetchState.QUERY
    host_pages: Pages = field(default_factory=as_pages)
    completed_tokens: int = 0
    terminated: bool = False
    reported: bool = False


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


@dataclass
class StorageStats:
    prefetch_started: int = 0
    prefetch_revoked: int = 0
    prefetched_tokens: int = 0
    backed_up_tokens: int = 0
    failed_backups: int = 0
    refusals: dict[str, int] = field(default_factory=dict)


class L3Queues:
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

    def snapshot(self) -> dict:
        """Counters and queue lengths for ``stats()``."""
        return {
            "attached": self.attached,
            "inflight_prefetches": len(self.by_op),
            "pending_backups": len(self.backups),
            **vars(self.stats),
        }

    def held_host_pages(self) -> int:
        """L2 pages allocated to prefetches and not yet in the tree."""
        return sum(len(op.host_pages) for op in self.by_op.values())

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
            self._drop(op)
        self.attached = False

    # -- backup --------------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Queue an L2 -> L3 copy of a node whose host copy just completed. Not for a
        hybrid model: L3 holds no components yet, so its pages could serve nothing
        (and its shards' page shapes differ by pipeline stage)."""
        if not self.attached or self.tree.parts is not None:
            return
        hashes = tuple(self.tree.page_hashes(node))  # hashes the path too
        parent = node.parent
        prev = parent.page_hashes[-1] if parent is not None and parent.page_hashes else None
        op = BackupOp(self.next_op_id(), node, hashes, node.key, prev)
        node.host_ref += 1
        self.backups.append(op)
        self.ctl.backup(op.op_id, node.host_value, op.page_hashes)  # type: ignore[arg-type]

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
        self.stats.backed_up_tokens += tokens
        self.to_storage.observe(tokens)
        self.events.stored_hashes(
            op.page_hashes, Medium.STORAGE, op.node.namespace, op.parent_hash, op.tokens
        )

    # -- prefetch --------------------------------------------------------------------

    def start_prefetch(self, req_id: Hashable, key: TokenKey, match: MatchResult) -> PrefetchStart:
        """Start fetching from L3 what ``match`` leaves uncached of ``key``, from the
        end of ``match.last_host_node`` on. Refusals are a result, not an error."""
        if req_id in self.prefetches:
            raise InvalidInput(f"request {req_id!r} already has a prefetch in flight")
        tree = self.tree
        if not self.attached:
            return self._refuse("no storage attached")
        if key.num_tokens - match.matched_tokens < max(self.config.threshold_tokens, 1):
            return self._refuse("below prefetch threshold")
        anchor = match.last_host_node
        start_page = tree.depth_pages(anchor)
        requested = (key.num_pages - start_page) * self.page_size
        if self.inflight_tokens + requested > self.max_inflight_tokens:
            return self._refuse("rate limited")
        hashes = key.chain_from(start_page, tree.chain_hash(anchor, key.namespace))
        op = PrefetchOp(
            op_id=self.next_op_id(),
            req_id=req_id,
            anchor=anchor,
            key=key,
            start_page=start_page,
            cached_pages=match.matched_tokens // self.page_size - start_page,
            page_hashes=hashes,
            started_at=self.clock(),
            reserved_tokens=requested,
        )
        if anchor is not tree.root:
            anchor.host_ref += 1
        self.inflight_tokens += requested
        self.prefetches[req_id] = self.by_op[op.op_id] = op
        self.stats.prefetch_started += 1
        self.ctl.query_storage(op.op_id, hashes)
        return PrefetchStart(op.op_id)

    def _refuse(self, reason: str) -> PrefetchStart:
        self.stats.refusals[reason] = self.stats.refusals.get(reason, 0) + 1
        return PrefetchStart(None, reason)

    def complete_query(self, op_id: int, hit_pages: int) -> None:
        """Every shard holds the first ``hit_pages`` pages (MIN over ranks)."""
        op = self.by_op.get(op_id)
        if op is None or op.state is not PrefetchState.QUERY:
            return
        size = self.page_size
        pages = max(0, min(int(hit_pages), len(op.page_hashes)))
        if self.ctl.max_prefetch_pages is not None:
            pages = min(pages, self.ctl.max_prefetch_pages)
        threshold = max(self.config.threshold_tokens, 1)
        if (pages - op.cached_pages) * size < threshold:
            self._revoke(op)
            return
        host = self.ctl.host
        got = host.alloc(pages)
        if got is None:
            self.evict_host((pages - host.available_pages) * size)
            pages = min(pages, host.available_pages)
            if (pages - op.cached_pages) * size < threshold:
                self._revoke(op)
                return
            got = host.alloc(pages)
            assert got is not None
        op.host_pages = got
        self._reserve(op, pages * size)
        op.state = PrefetchState.LOADING
        self.ctl.prefetch(op.op_id, got, op.page_hashes[:pages])

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
        committed, tail = op.host_pages[:done_pages], op.host_pages[done_pages:]
        added = self._insert_host(op.anchor, op.key, op.start_page, committed) if committed else 0
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
        self._drop(op)

    def apply(self, done: Completions) -> None:
        self.complete_backups(done.backups, done.failed_backups)
        for op_id, pages in done.prefetch_hits.items():
            self.complete_query(op_id, pages)
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
        self._release_anchor(op)
        self._reserve(op, 0)
        del self.by_op[op.op_id]

    def _insert_host(
        self, anchor: TreeNode, key: TokenKey, start_page: int, host_pages: Pages
    ) -> int:
        """Insert ``host_pages`` (L2, filled by a prefetch) for the key's pages from
        ``start_page`` on, below ``anchor``. Existing L1-only nodes on the way get
        them as their host copy; pages already in L2 are freed. Returns tokens
        added as new L2-only nodes."""
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
            leaf.host_value = host_pages[used:]
            tree.refresh(leaf)
            tree.refresh(node)
            self.events.stored(leaf, Medium.HOST)
            added = len(host_pages) - used
            used = len(host_pages)
        duplicates.extend(host_pages[used:])
        if duplicates:
            self.ctl.host.free(duplicates)
        return added * self.page_size
