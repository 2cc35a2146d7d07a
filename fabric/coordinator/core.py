"""The coordinator's logic, without Ray: the driver-facing calls and the step.

Each step the shell (``actors/coordinator_actor.py``, or ``LocalFabric`` in one
process) asks ``next_batch()`` for the commands to send — admitting waiting
requests, queuing write-throughs — sends that one batch to every rank, and hands
the ranks' reports to ``rounds.on_round`` (or, when some rank did not answer,
``rounds.on_missing``), which reduces them (MIN/MAX), commits exactly the reduced
number of each kind of operation and returns the requests that finished.

The core is composed of parts, built in dependency order: the cache and its
``Admission``; the ``LeaseTable`` (leases handed out); the ``Scheduler`` (queues,
admission into L1); the ``EventQueue`` (KV events for routers); the ``RoundCommit``
(rounds, missing ranks, resets, the epoch). Nothing here may stop the fabric: an
exception while handling one request fails that request (and resets L1/L2, whose
state it may have left half changed); retries and waits are bounded and end in an
error naming why.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from fabric.cache.admission import Admission
from fabric.cache.adopt import Entry, adopt_host, common_pages
from fabric.cache.hicache import HiCache
from fabric.cache.keys import TOKEN_BYTES, TokenKey
from fabric.cache.results import PinResult
from fabric.cache.sessions import check_session_id
from fabric.config import FabricConfig
from fabric.coordinator.commands import FabricController, Query
from fabric.coordinator.engine_side import EngineSide
from fabric.coordinator.event_queue import EventQueue
from fabric.coordinator.intake import Intake
from fabric.coordinator.leases import LeaseTable
from fabric.coordinator.requests import FabricStats, Lease, RequestResult, ServingRequest
from fabric.coordinator.rounds import RoundCommit
from fabric.coordinator.scheduler import Scheduler
from fabric.errors import InvalidInput
from fabric.messages import Batch, Report, batch_header_bound
from fabric.topology import Topology

log = logging.getLogger(__name__)


class CoordinatorCore:
    def __init__(self, config: FabricConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.topology = Topology(config.topology)
        model = config.model
        # A hybrid model's component slots in one prefetch.
        parts = model.window_pages(config.cache.page_size) + ("mamba" in model.components)
        self.ctl = FabricController(
            config.cache, config.runtime.max_message_bytes, model.runs_model, parts
        )
        self.cache = HiCache(config.cache, self.ctl, config.prefetch, clock, config.model)
        self.admission = Admission(self.cache)
        self.stats = FabricStats()
        self.intake = Intake(config)
        self.leases = LeaseTable(self.admission, self.stats, clock)
        self.scheduler = Scheduler(
            config, self.cache, self.admission, self.ctl, self.leases, self.stats
        )
        # KV events for a KV-aware router, oldest dropped past the bound.
        self.events = EventQueue(self.cache, self.stats, config.runtime.max_pending_requests * 16)
        self.rounds = RoundCommit(
            config,
            self.topology,
            self.cache,
            self.ctl,
            self.scheduler,
            self.leases,
            self.events,
            self.stats,
            clock,
        )
        # What engines attached through a connector stored, and its calls.
        self.engines = EngineSide(config, self.events, clock)
        self._ids = itertools.count(1)

    # -- client calls ------------------------------------------------------------------

    def submit(
        self,
        tokens: bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        owner: str | None = None,
        session: str | None = None,
    ) -> str:
        """Queue a request; its packed ``tokens`` are validated here. ``owner`` names
        the driver (its Ray job id) whose leases are reclaimed when it exits;
        ``session``, the session that keeps its whole pages when its lease ends
        (unless ``release`` names another). Raises ``InvalidInput`` naming the
        problem; nothing is queued then."""
        return self.submit_many([tokens], namespace, priority, [request_id], owner, session)[0]

    def submit_many(
        self,
        prompts: Sequence[bytes],
        namespace: str = "default",
        priority: int = 0,
        request_ids: Sequence[str | None] | None = None,
        owner: str | None = None,
        session: str | None = None,
        release: Sequence[Lease] = (),
    ) -> list[str]:
        """Release the leases in ``release`` (a driver's earlier results: one call
        does both), then queue one request per prompt, as ``submit`` does. All or
        nothing: a bad prompt, id or lease raises ``InvalidInput`` before any lease
        is released or any request queued. Returns the request ids, in order."""
        ids = self.intake.check_submit(
            prompts, namespace, priority, request_ids, owner, session, release
        )
        held = [self.leases.check(lease) for lease in release]  # raises on a bad one
        if len({id(h) for h in held if h is not None}) < sum(h is not None for h in held):
            raise InvalidInput("release names the same lease twice")
        sched = self.scheduler
        if sched.pending() + len(prompts) > self.config.runtime.max_pending_requests:
            raise InvalidInput("too many pending requests; retry later")
        now, requests, taken = self.clock(), [], set()
        group = next(self._ids) if len(prompts) > 1 else 0
        for tokens, rid in zip(prompts, ids, strict=True):
            rid = rid if rid is not None else f"req-{next(self._ids)}"
            req = self.intake.request(tokens, namespace, priority, rid, owner, session, now)
            if sched.known(req.rid):
                raise InvalidInput(f"request_id {req.rid!r} is already in use")
            if req.rid in taken:
                raise InvalidInput(f"request_id {req.rid!r} is given twice")
            taken.add(req.rid)
            req.group = group
            requests.append(req)
        for h in held:
            if h is not None:
                self.leases.drop(h)
        sched.waiting.extend(requests)
        sched.unblock()
        self.stats.submitted += len(requests)
        return [r.rid for r in requests]

    def append(self, lease: Lease, tokens: bytes, owner: str | None = None) -> str:
        """Decode: queue the KV of packed ``tokens`` generated after a leased request.
        The lease is consumed; the request (same id) ends with a new lease on all
        its tokens. Raises ``InvalidInput`` (the lease kept) on bad input."""
        held = self.leases.check(lease)
        if held is None:
            raise InvalidInput(f"lease of {lease.request_id!r} is no longer held")
        self.intake.check_append(held.kv.num_tokens, tokens)
        sched = self.scheduler
        if sched.pending() >= self.config.runtime.max_pending_requests:
            raise InvalidInput("too many pending requests; retry later")
        self.leases.take(held)
        key = TokenKey(b"", self.config.cache.page_size, lease.namespace)
        req = ServingRequest(
            lease.request_id,
            key,
            len(tokens) // TOKEN_BYTES,
            held.kv.priority,
            self.clock(),
            owner if owner is not None else held.owner,
            appended=tokens,
            kv=held.kv,
            prefetch_tried=True,
            session=held.session,
        )
        sched.waiting.append(req)
        sched.unblock()
        self.stats.submitted += 1
        return req.rid

    def end_session(self, session: str) -> bool:
        """Drop what ``session`` keeps between turns; ``False`` if it kept nothing."""
        ended = self.admission.end_session(session)
        if ended:
            self.scheduler.unblock()
        return ended

    def pin(self, tokens: bytes, namespace: str, ttl_s: float) -> PinResult:
        """Keep the cached prefix of packed ``tokens`` in L2 for ``ttl_s`` seconds."""
        return self.admission.pin(self.intake.key(tokens, namespace), ttl_s)

    def unpin(self, tokens: bytes, namespace: str) -> int:
        """Unpin the cached prefix of packed ``tokens``; returns the tokens unpinned."""
        return self.admission.unpin(self.intake.key(tokens, namespace))

    def abort(self, request_id: str) -> RequestResult | None:
        """Abort a waiting or running request; its result (an error) is returned
        here for a waiting one, by ``on_round`` for a running one."""
        if not isinstance(request_id, str):
            raise InvalidInput(f"request_id {request_id!r} is refused: allowed is a str")
        return self.scheduler.abort(request_id)

    def release(self, lease: Lease, session: str | None = None) -> bool:
        """Let a finished request's pages go — or, with ``session`` (or the one it was
        submitted with), have that session keep its whole pages for its next turn
        (``cache.session_*``). Only the ``Lease`` itself releases: a bare id or a
        lease that does not match the one handed out raises ``InvalidInput``.
        ``False`` if it expired or died with a reset."""
        if session is not None:
            check_session_id(session)
        held = self.leases.check(lease)
        if held is None:
            return False
        self.leases.drop(held, session)
        self.scheduler.unblock()
        return True

    def renew(self, lease: Lease) -> bool:
        """Extend a held lease by its TTL from now; ``False`` if it is gone."""
        return self.leases.renew(lease)

    def next_expiry(self) -> float | None:
        """When the next lease or session expires (``clock`` time), for a loop that
        sleeps: the step after it lets that hold go."""
        times = [self.leases.next_expiry(), self.cache.sessions.next_expiry()]
        return min((t for t in times if t is not None), default=None)

    def owners(self) -> set[str]:
        """Drivers that hold leases or have requests pending."""
        return self.scheduler.owners() | self.leases.owners()

    def reclaim(self, owner: str) -> list[RequestResult]:
        """A driver exited: release its leases and abort its requests; returns the
        results of those that ended here (running ones end with their round)."""
        out = []
        for req in self.scheduler.requests():
            if req.owner == owner:
                result = self.scheduler.abort(req.rid)
                if result is not None:
                    out.append(result)
        if self.leases.reclaim(owner):
            self.scheduler.unblock()
        return out

    # -- the step ------------------------------------------------------------------------

    def start(self, reports: Sequence[Report]) -> int:
        """Open the first epoch: newer than any rank has seen (so each resets its
        counters), addressed to the incarnations the ranks report now."""
        rounds = self.rounds
        rounds.epoch = max([r.epoch for r in reports] + [0]) + 1
        for r in reports:
            rounds.consensus.incarnations[r.rank] = r.incarnation
        return rounds.epoch

    def adopt(self, inventories: Sequence[Iterable[Entry]]) -> int:
        """After ``start``, or a reset for a restarted rank (``rounds.adopt_wanted``):
        take back the L2 pages every rank still holds (one ``RankWorker.inventory``
        per rank, taken at this epoch) — then served as L2 hits instead of going to
        L3 or recomputing. Returns tokens adopted (0 when any rank gave none, or when
        the cache holds anything already: adoption is for a fresh coordinator)."""
        self.rounds.adopt_wanted = False
        if len(inventories) != self.topology.world_size or self.cache.tree.root.children:
            return 0
        tokens = adopt_host(self.cache, common_pages(inventories))
        self.stats.adopted_tokens += tokens
        if tokens:
            log.info("adopted %d tokens of L2 pages the ranks still hold", tokens)
        return tokens

    def next_batch(self) -> Batch:
        """Admit what fits, queue the step's write-throughs, and return the commands
        queued since the last batch that fit in one message (the same batch goes
        to every rank)."""
        rounds = self.rounds
        rounds.started = self.clock()
        try:
            if self.leases.expire():
                self.scheduler.unblock()
            self.admission.expire()
            self.scheduler.schedule(admit=not rounds.absent)
            self.cache.writes.write_through()
        except Exception as exc:
            failed = rounds.recover(exc)
            self.scheduler.failed.extend(failed)  # delivered with the next round
        self.events.collect()
        max_bytes = self.config.runtime.max_message_bytes
        world = self.topology.world_size
        room = (max_bytes - self.ctl.command_budget - batch_header_bound(world, 0, 0)) // 9
        stops = self.ctl.take_stops(room)
        forget = tuple(sorted(rounds.forget)[: room - len(stops)])
        rounds.forget.difference_update(forget)
        known = rounds.consensus.incarnations
        incarnations = tuple(known.get(i, "") for i in range(world))
        acked = self.ctl.acked()
        return Batch(rounds.epoch, self.ctl.take_commands(), stops, forget, incarnations, acked)

    def take_queries(self) -> list[Query]:
        """This step's L3 hit queries, for the storage actors: ``(op_id, chain hash
        before, packed tokens)``; they hash the pages and answer ``(hit pages,
        hashes)`` (``StorageService.answer``)."""
        return self.ctl.take_queries()

    def round_needed(self, batch: Batch, queries: Sequence[Query]) -> bool:
        """Whether a round would do anything: something to send (commands, stops,
        prefetches to forget, hit queries), something in flight or failed to
        deliver, or a rank to hear from again. A shell may skip the round when not
        (a release that freed pages and admitted nothing, say): the ranks hear
        nothing they do not already know."""
        if batch.commands or batch.stop or batch.forget or queries:
            return True
        rounds = self.rounds
        if self.scheduler.failed or rounds.absent or rounds.adopt_wanted or not self.idle:
            return True
        rounds.started = None  # no round: the next one is timed from its batch
        return False

    @property
    def idle(self) -> bool:
        """Nothing to do until a request arrives or a lease is released."""
        return self.scheduler.quiet and not self.ctl.busy() and self.cache.l3.idle

    # -- storage attach / detach ---------------------------------------------------------

    def storage_attached(self) -> None:
        """The storage actor has a backend: start prefetching and backing up."""
        self.cache.l3.attach()

    def storage_begin_detach(self) -> None:
        """Issue no new storage work; stop every prefetch (their requests go on
        without L3). Pending backups still end with their acks."""
        l3, sched = self.cache.l3, self.scheduler
        l3.pause()
        for rid, req in list(sched.prefetching.items()):
            l3.abort(rid)
            del sched.prefetching[rid]
            sched.waiting.appendleft(req)

    def l3_removed(self, page_hashes: Sequence[bytes]) -> None:
        """The store reports these pages gone (evicted, deleted by another process):
        ``BlockRemoved`` from L3 for those the fabric had announced."""
        self.cache.events.l3_removed(page_hashes)
        if self.cache.l3.idle:  # nothing in flight can announce a page reported gone
            self.cache.events.forget_removals()
        self.events.collect()

    def l3_cleared(self) -> None:
        """The store was cleared or detached: every L3 page announced is gone."""
        self.cache.events.l3_cleared()
        self.engines.clear()
        self.events.collect()

    def storage_drained(self) -> bool:
        return self.cache.l3.idle

    def storage_force_detach(self) -> None:
        """Release whatever storage work is left. Only once no rank will touch
        its host pages any more (after a reset, say)."""
        self.cache.l3.detach()
