"""The coordinator's logic, without Ray: requests, the step, consensus, leases.

Each step the shell (``actors/coordinator.py``) asks ``next_batch()`` for the
commands to send — admitting waiting requests, queuing write-throughs — sends
that one batch to every rank, and hands the ranks' reports to ``on_round``,
which reduces them (MIN/MAX), commits exactly the reduced number of each kind
of operation and returns the requests that finished.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fabric.config import FabricConfig
from fabric.consensus import Consensus, Round, Topology
from fabric.controller import Completions
from fabric.errors import InvalidInput
from fabric.events import KVEvent
from fabric.fabric_controller import FabricController
from fabric.hicache import HiCache
from fabric.keys import MAX_NAMESPACE_CHARS, TOKEN_BYTES, TokenKey, check_namespace
from fabric.messages import Batch, Report
from fabric.node import TreeNode


@dataclass(frozen=True)
class Lease:
    """Holds a request's pages in L1 until released. ``device_pages`` cover the
    cached (page-aligned) part of the prompt; ``epoch`` dies with a reset."""

    request_id: str
    epoch: int
    namespace: str
    tokens: int
    device_pages: tuple[int, ...]


@dataclass(frozen=True)
class RequestResult:
    """Where a request's prompt tokens came from. ``error`` is set (and the rest
    zero) when it failed or was aborted."""

    request_id: str
    prompt_tokens: int
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    computed_tokens: int = 0
    latency_s: float = 0.0
    storage_hit_tokens: int = 0
    lease: Lease | None = None
    error: str | None = None


@dataclass(eq=False)
class _Request:
    rid: str
    key: TokenKey
    prompt_tokens: int
    priority: int
    submitted: float
    compute_cmd: int | None = None
    node: TreeNode | None = None
    device_pages: tuple[int, ...] = ()
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed: int = 0
    aborted: bool = False
    prefetch_tried: bool = False
    prefetched: int = 0


@dataclass
class FabricStats:
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    retried: int = 0
    resets: int = 0
    rounds: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    latency_s_total: float = 0.0
    bad_messages: int = 0
    core_time_s: float = 0.0
    storage_errors: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class CoordinatorCore:
    def __init__(self, config: FabricConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.topology = Topology(config.topology)
        self.ctl = FabricController(config.cache)
        self.cache = HiCache(config.cache, self.ctl, config.prefetch, clock)
        self.consensus = Consensus(self.topology.world_size)
        self.allowed_namespaces = config.runtime.allowed_namespaces()
        self.epoch = 1
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.prefetching: dict[str, _Request] = {}
        self._forget: set[int] = set()
        self.leases: dict[str, tuple[Lease, TreeNode]] = {}
        self.stats = FabricStats()
        self._failed: list[RequestResult] = []
        self._blocked = False
        self._ids = itertools.count(1)
        # KV events for a KV-aware router, oldest dropped past the bound.
        self.events: deque[KVEvent] = deque(maxlen=config.runtime.max_pending_requests * 16)

    # -- client calls ------------------------------------------------------------------

    def submit(
        self,
        tokens: bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; its packed ``tokens`` are validated here. Raises
        ``InvalidInput`` naming the problem; nothing is queued then."""
        if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("tokens must be a non-empty sequence of non-negative ints")
        check_namespace(namespace)
        if self.allowed_namespaces is not None and namespace not in self.allowed_namespaces:
            raise InvalidInput(
                f"namespace {namespace!r} is not allowed; allowed: {sorted(self.allowed_namespaces)}"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidInput(f"priority {priority!r} is refused: allowed is an int")
        prompt = len(tokens) // TOKEN_BYTES
        if prompt > self.config.cache.device_tokens:
            raise InvalidInput(
                f"prompt of {prompt} tokens is larger than L1 ({self.config.cache.device_tokens} tokens)"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_NAMESPACE_CHARS:
            raise InvalidInput(f"request_id {rid!r} is refused: allowed is a non-empty str")
        if (
            rid in self.running
            or rid in self.leases
            or rid in self.prefetching
            or any(r.rid == rid for r in self.waiting)
        ):
            raise InvalidInput(f"request_id {rid!r} is already in use")
        pending = len(self.waiting) + len(self.running) + len(self.prefetching)
        if pending >= self.config.runtime.max_pending_requests:
            raise InvalidInput("too many pending requests; retry later")
        key = TokenKey(tokens, self.config.cache.page_size, namespace)
        self.waiting.append(_Request(rid, key, prompt, priority, self.clock()))
        self._blocked = False
        self.stats.submitted += 1
        return rid

    def abort(self, request_id: str) -> RequestResult | None:
        """Abort a waiting or running request; its result (an error) is returned
        here for a waiting one, by ``on_round`` for a running one."""
        for req in self.waiting:
            if req.rid == request_id:
                self.waiting.remove(req)
                self.stats.aborted += 1
                return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.prefetching.pop(request_id, None)
        if req is not None:
            self.cache.storage.abort(request_id)
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.running.get(request_id)
        if req is not None and not req.aborted:
            req.aborted = True
            self._unlock(req)
        return None

    def release(self, lease: Lease | str) -> bool:
        """Let a finished request's pages go; ``False`` if the lease is unknown or
        died with a reset."""
        rid = lease.request_id if isinstance(lease, Lease) else lease
        held = self.leases.pop(rid, None)
        if held is None:
            return False
        self.cache.dec_lock_ref(held[1])
        self._blocked = False
        return True

    # -- the step ------------------------------------------------------------------------

    def next_batch(self) -> Batch:
        """Admit what fits, queue the step's write-throughs, and return every command
        queued since the last batch (the same batch goes to every rank)."""
        ready = []
        for rid, req in list(self.prefetching.items()):
            loaded = self.cache.storage.check_prefetch(rid)
            if loaded is not None:
                del self.prefetching[rid]
                req.prefetched = loaded
                ready.append(req)
        self.waiting.extendleft(reversed(ready))
        blocked = []
        while self.waiting:
            req = self.waiting.popleft()
            if not req.prefetch_tried and self.cache.storage.attached:
                req.prefetch_tried = True
                match = self.cache.match_prefix(req.key)
                if self.cache.storage.start_prefetch(req.rid, req.key, match).op_id is not None:
                    self.prefetching[req.rid] = req
                    continue
            if not self._admit(req):
                blocked.append(req)
                break
        self.waiting.extendleft(reversed(blocked))
        self._blocked = bool(blocked)
        if self.waiting and not self.running and not self.leases and not self.ctl.busy():
            req = self.waiting.popleft()  # nothing will ever free room for it
            self.stats.failed += 1
            self._failed.append(RequestResult(req.rid, req.prompt_tokens, error="no room in L1"))
        self.cache.write_through()
        self.events.extend(self.cache.take_events())
        forget, self._forget = tuple(sorted(self._forget)), set()
        known = self.consensus.incarnations
        incarnations = tuple(known.get(i, "") for i in range(self.topology.world_size))
        acked = self.ctl.acked()
        return Batch(
            self.epoch, self.ctl.take_commands(), self.ctl.take_stops(), forget, incarnations, acked
        )

    def start(self, reports: Sequence[Report]) -> int:
        """Open the first epoch: newer than any rank has seen (so each resets its
        counters), addressed to the incarnations the ranks report now."""
        self.epoch = max([r.epoch for r in reports] + [0]) + 1
        for r in reports:
            self.consensus.incarnations[r.rank] = r.incarnation
        return self.epoch

    def take_queries(self) -> list[tuple[int, tuple[bytes, ...]]]:
        """This step's L3 hit queries, for the storage actor: ``(op_id, page_hashes)``."""
        return self.ctl.take_queries()

    def _admit(self, req: _Request) -> bool:
        cache, key = self.cache, req.key
        match = cache.match_prefix(key)
        device_hit = match.device_tokens
        host_hit = storage_hit = 0
        if match.host_tokens:
            loaded = cache.load_back(match.last_host_node)
            if loaded is not None:
                storage_hit = min(req.prefetched, loaded.tokens)
                host_hit = loaded.tokens - storage_hit
                match = cache.match_prefix(key)
        cache.inc_lock_ref(match.last_device_node)
        new_pages = cache.alloc_device(key.num_tokens - match.device_tokens)
        if new_pages is None:
            cache.dec_lock_ref(match.last_device_node)
            return False
        req.compute_cmd = self.ctl.compute(key.namespace, key.data, match.device_tokens, new_pages)
        result = cache.insert(key, match.device_pages + new_pages, req.priority)
        cache.inc_lock_ref(result.last_node)
        cache.dec_lock_ref(match.last_device_node)
        req.node = result.last_node
        req.device_pages = match.device_pages + new_pages
        req.device_hit, req.host_hit, req.storage_hit = device_hit, host_hit, storage_hit
        req.computed = req.prompt_tokens - device_hit - host_hit - storage_hit
        self.running[req.rid] = req
        return True

    def on_round(
        self, reports: Sequence[Report], storage_hits: dict[int, int] | None = None
    ) -> list[RequestResult]:
        """Reduce one report per rank (and the storage actor's hit counts, already
        MIN over shards) and commit; returns requests that finished."""
        self.stats.rounds += 1
        rnd = self.consensus.reduce(reports, self.epoch)
        if rnd.restarted:
            return self.reset(f"rank(s) {list(rnd.restarted)} restarted")
        if not rnd.usable:
            return self._take_failed()
        return self._commit(rnd, storage_hits or {})

    def _commit(self, rnd: Round, storage_hits: dict[int, int]) -> list[RequestResult]:
        done = self.ctl.completions(rnd)
        if done.writes or done.loads or done.computes or done.backups:
            self._blocked = False  # finished work may have unlocked pages: admit again
        self.cache.apply(
            Completions(
                writes=done.writes,
                failed_writes=done.failed_writes,
                loads=done.loads,
                backups=done.backups,
                failed_backups=done.failed_backups,
                prefetch_hits=storage_hits,
                prefetch_progress=rnd.prefetch_progress,
                prefetch_terminated=rnd.prefetch_terminated,
                prefetch_released=rnd.prefetch_finished,
            )
        )
        self._forget |= rnd.prefetch_reported - set(self.cache.storage.by_op)
        self.events.extend(self.cache.take_events())
        out = self._take_failed()
        for req in list(self.running.values()):
            if req.compute_cmd is None or req.compute_cmd > self.ctl.computes_committed:
                continue
            if req.compute_cmd in done.failed_computes:
                # Its pages may hold anything on some rank: drop L1/L2, retry it.
                out.extend(self.reset(f"compute of {req.rid} failed on a rank"))
                break
            del self.running[req.rid]
            out.append(self._finish(req))
        return out

    def _finish(self, req: _Request) -> RequestResult:
        latency = self.clock() - req.submitted
        if req.aborted:
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, latency_s=latency, error="aborted")
        s = self.stats
        s.finished += 1
        s.prompt_tokens += req.prompt_tokens
        s.device_hit_tokens += req.device_hit
        s.host_hit_tokens += req.host_hit
        s.storage_hit_tokens += req.storage_hit
        s.computed_tokens += req.computed
        s.latency_s_total += latency
        lease = Lease(req.rid, self.epoch, req.key.namespace, req.key.num_tokens, req.device_pages)
        assert req.node is not None
        self.leases[req.rid] = (lease, req.node)
        return RequestResult(
            req.rid,
            req.prompt_tokens,
            device_hit_tokens=req.device_hit,
            host_hit_tokens=req.host_hit,
            storage_hit_tokens=req.storage_hit,
            computed_tokens=req.computed,
            latency_s=latency,
            lease=lease,
        )

    def take_events(self, limit: int = 10_000) -> list[KVEvent]:
        """Drain up to ``limit`` of the oldest KV events (``BlockStored``,
        ``BlockRemoved``, ``AllBlocksCleared``)."""
        return [self.events.popleft() for _ in range(min(limit, len(self.events)))]

    def _unlock(self, req: _Request) -> None:
        if req.node is not None:
            self.cache.dec_lock_ref(req.node)
            req.node = None

    def _take_failed(self) -> list[RequestResult]:
        out, self._failed = self._failed, []
        return out

    def reset(self, reason: str) -> list[RequestResult]:
        """Drop every L1/L2 page (a rank lost its pools, or a page may be bad), start a
        new epoch, invalidate leases and send running requests back to waiting."""
        self.stats.resets += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.cache.reset()
        self.events.extend(self.cache.take_events())
        self.epoch += 1
        self._blocked = False
        self.leases.clear()
        out = self._take_failed()
        for req in self.running.values():
            if req.aborted:
                self.stats.aborted += 1
                out.append(RequestResult(req.rid, req.prompt_tokens, error="aborted"))
                continue
            req.compute_cmd, req.node = None, None
            self.stats.retried += 1
            self.waiting.appendleft(req)
        self.running.clear()
        for req in self.prefetching.values():
            req.prefetch_tried, req.prefetched = False, 0
            self.waiting.appendleft(req)
        self.prefetching.clear()
        self._forget.clear()
        return out

    @property
    def idle(self) -> bool:
        """Nothing to do until a request arrives or a lease is released."""
        return (
            not self.running
            and not self.prefetching
            and not self.ctl.busy()
            and not self.cache.storage.by_op
            and (not self.waiting or self._blocked)
        )

    def snapshot(self) -> dict:
        """Counters and sizes for ``stats()``."""
        s = self.stats
        return {
            "epoch": self.epoch,
            "waiting": len(self.waiting),
            "running": len(self.running),
            "leases": len(self.leases),
            "requests": {
                "submitted": s.submitted,
                "finished": s.finished,
                "failed": s.failed,
                "aborted": s.aborted,
                "retried": s.retried,
            },
            "tokens": {
                "prompt": s.prompt_tokens,
                "device_hit": s.device_hit_tokens,
                "host_hit": s.host_hit_tokens,
                "storage_hit": s.storage_hit_tokens,
                "computed": s.computed_tokens,
            },
            "mean_latency_s": s.latency_s_total / s.finished if s.finished else 0.0,
            "resets": s.resets,
            "reset_reasons": dict(s.by_reason),
            "rounds": s.rounds,
            "cache": vars(self.cache.stats),
            "prefetching": len(self.prefetching),
            "storage_ops": {
                "attached": self.cache.storage.attached,
                "inflight_prefetches": len(self.cache.storage.by_op),
                "pending_backups": len(self.cache.storage.backups),
                **{k: v for k, v in vars(self.cache.storage.stats).items()},
            },
            "pending_writes": len(self.cache.pending_writes),
            "pending_loads": len(self.cache.pending_loads),
            "bad_messages": s.bad_messages,
            "core_time_s": s.core_time_s,
            "storage_errors": s.storage_errors,
            "device": vars(self.cache.device_sizes()),
            "host": vars(self.cache.host_sizes()),
        }

    # -- storage attach / detach ---------------------------------------------------------

    def storage_attached(self) -> None:
        """The storage actor has a backend: start prefetching and backing up."""
        self.cache.storage.attach()

    def storage_begin_detach(self) -> None:
        """Issue no new storage work; stop every prefetch (their requests go on
        without L3). Pending backups still end with their acks."""
        self.cache.storage.attached = False
        for rid, req in list(self.prefetching.items()):
            self.cache.storage.abort(rid)
            del self.prefetching[rid]
            self.waiting.appendleft(req)

    def storage_drained(self) -> bool:
        return not self.cache.storage.by_op and not self.cache.storage.backups

    def storage_force_detach(self) -> None:
        """Release whatever storage work is left. Only once no rank will touch
        its host pages any more (after a reset, say)."""
        self.cache.storage.detach()
