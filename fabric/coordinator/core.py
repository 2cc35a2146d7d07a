"""The coordinator's logic, without Ray: requests, the step, consensus, leases.

Each step the shell (``actors/coordinator_actor.py``) asks ``next_batch()`` for the
commands to send — admitting waiting requests, queuing write-throughs — sends
that one batch to every rank, and hands the ranks' reports to ``on_round``
(or, when some rank did not answer, ``on_missing``), which reduces them
(MIN/MAX), commits exactly the reduced number of each kind of operation and
returns the requests that finished.

Nothing here may stop the fabric: an exception while handling one request
fails that request (and resets L1/L2, whose state it may have left half
changed); retries and waits are bounded and end in an error naming why.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from fabric.cache.admission import Admission, Fill, RequestKV
from fabric.cache.adopt import Entry, adopt_host, common_pages
from fabric.cache.events import KVEvent
from fabric.cache.hicache import HiCache
from fabric.cache.keys import (
    MAX_NAMESPACE_CHARS,
    TOKEN_BYTES,
    TokenKey,
    check_namespace,
    check_vocab,
    namespace_seed,
)
from fabric.cache.results import PinResult
from fabric.cache.sessions import check_session_id
from fabric.config import FabricConfig
from fabric.coordinator.commands import Answer, FabricController, Query
from fabric.coordinator.consensus import Consensus, Round
from fabric.coordinator.requests import FabricStats, HeldLease, Lease, RequestResult, ServingRequest
from fabric.coordinator.stragglers import Progress, Straggler, Stragglers
from fabric.errors import InvalidInput
from fabric.messages import Batch, MambaPart, Report, SlidingPart, batch_header_bound
from fabric.topology import Topology

log = logging.getLogger(__name__)


class CoordinatorCore:
    def __init__(self, config: FabricConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._round_started: float | None = None  # when the last batch went out
        self.topology = Topology(config.topology)
        model = config.model
        # A hybrid model's component slots in one prefetch.
        parts = model.window_pages(config.cache.page_size) + ("mamba" in model.components)
        self.ctl = FabricController(
            config.cache, config.runtime.max_message_bytes, model.runs_model, parts
        )
        self.cache = HiCache(config.cache, self.ctl, config.prefetch, clock, config.model)
        self.admission = Admission(self.cache)
        self.l3 = self.cache.storage
        self.consensus = Consensus(self.topology.world_size)
        self.allowed_namespaces = config.runtime.allowed_namespaces()
        self.epoch = 1
        self.waiting: deque[ServingRequest] = deque()
        self.running: dict[str, ServingRequest] = {}
        self.prefetching: dict[str, ServingRequest] = {}
        self._forget: set[int] = set()
        self.leases: dict[str, HeldLease] = {}
        self._leased_ids: set[str] = set()  # request ids of self.leases, for submit
        self._expiry: list[tuple[float, str]] = []
        self.absent: dict[int, float] = {}
        self._absent_reason: dict[int, str] = {}
        self.stats = FabricStats()
        self._failed: list[RequestResult] = []
        self._blocked = False
        self._current: ServingRequest | None = None
        self._ids = itertools.count(1)
        # KV events for a KV-aware router, oldest dropped past the bound.
        self.events: deque[KVEvent] = deque(maxlen=config.runtime.max_pending_requests * 16)
        rt = config.runtime
        self.stragglers = Stragglers(
            [str(r) for r in self.topology.ranks],
            rt.straggler_lag_s,
            rt.straggler_factor,
            rt.straggler_rounds,
            rt.straggler_policy,
            clock,
            self._straggler_named,
        )
        self.progress = Progress(self.topology.world_size)
        self.adopt_wanted = False  # after a rank restart: adopt what the ranks still hold
        self._reply_s: list[float | None] | None = None

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
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidInput("prompts must be a non-empty list of packed token bytes")
        if not isinstance(release, (list, tuple)):
            raise InvalidInput(f"release takes a list of Leases, not {type(release).__name__}")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if len(ids) != len(prompts):
            raise InvalidInput(
                f"{len(ids)} request ids for {len(prompts)} prompts: give one per prompt or none"
            )
        for tokens in prompts:
            if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
                raise InvalidInput("tokens must be a non-empty sequence of non-negative ints")
        if session is not None:
            check_session_id(session)
        check_namespace(namespace)
        if self.allowed_namespaces is not None and namespace not in self.allowed_namespaces:
            raise InvalidInput(
                f"namespace {namespace!r} is not allowed; allowed: {sorted(self.allowed_namespaces)}"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidInput(f"priority {priority!r} is refused: allowed is an int")
        if owner is not None and not (isinstance(owner, str) and 0 < len(owner) <= 64):
            raise InvalidInput(f"owner {owner!r} is refused: allowed is a Ray job id")
        held = [self._held(lease) for lease in release]  # raises on a bad one
        if len({id(h) for h in held if h is not None}) < sum(h is not None for h in held):
            raise InvalidInput("release names the same lease twice")
        pending = len(self.waiting) + len(self.running) + len(self.prefetching)
        if pending + len(prompts) > self.config.runtime.max_pending_requests:
            raise InvalidInput("too many pending requests; retry later")
        now, requests, taken = self.clock(), [], set()
        group = next(self._ids) if len(prompts) > 1 else 0
        for tokens, rid in zip(prompts, ids, strict=True):
            req = self._request(tokens, namespace, priority, rid, owner, session, now)
            if req.rid in taken:
                raise InvalidInput(f"request_id {req.rid!r} is given twice")
            taken.add(req.rid)
            req.group = group
            requests.append(req)
        for h in held:
            if h is not None:
                self._drop_lease(h)
        self.waiting.extend(requests)
        self._blocked = False
        self.stats.submitted += len(requests)
        return [r.rid for r in requests]

    def _request(
        self,
        tokens: bytes,
        namespace: str,
        priority: int,
        request_id: str | None,
        owner: str | None,
        session: str | None,
        now: float,
    ) -> ServingRequest:
        """A checked request for the packed ``tokens`` (their format checked already;
        not yet queued)."""
        self._check_vocab(tokens)
        prompt = len(tokens) // TOKEN_BYTES
        if prompt > self.config.cache.device_tokens:
            raise InvalidInput(
                f"prompt of {prompt} tokens is larger than L1 ({self.config.cache.device_tokens} "
                "tokens): raise cache.device_tokens to serve it"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_NAMESPACE_CHARS:
            raise InvalidInput(f"request_id {rid!r} is refused: allowed is a non-empty str")
        check_namespace(rid)  # the same rules: it travels in results and logs
        if self._known(rid):
            raise InvalidInput(f"request_id {rid!r} is already in use")
        key = TokenKey(tokens, self.config.cache.page_size, namespace)
        return ServingRequest(
            rid, key, prompt, priority, now, owner, tokens=tokens, session=session
        )

    def append(self, lease: Lease, tokens: bytes, owner: str | None = None) -> str:
        """Decode: queue the KV of packed ``tokens`` generated after a leased request.
        The lease is consumed; the request (same id) ends with a new lease on all
        its tokens. Raises ``InvalidInput`` (the lease kept) on bad input."""
        held = self._held(lease)
        if held is None:
            raise InvalidInput(f"lease of {lease.request_id!r} is no longer held")
        if not isinstance(tokens, bytes) or not tokens or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("append takes a non-empty sequence of non-negative ints")
        self._check_vocab(tokens)
        total = held.kv.num_tokens + len(tokens) // TOKEN_BYTES
        if total > self.config.cache.device_tokens:
            raise InvalidInput(
                f"request of {total} tokens would be larger than L1 "
                f"({self.config.cache.device_tokens} tokens): raise cache.device_tokens"
            )
        if len(self.waiting) + len(self.running) + len(self.prefetching) >= (
            self.config.runtime.max_pending_requests
        ):
            raise InvalidInput("too many pending requests; retry later")
        del self.leases[lease.token]
        self._leased_ids.discard(lease.request_id)
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
        self.waiting.append(req)
        self._blocked = False
        self.stats.submitted += 1
        return req.rid

    def _check_vocab(self, tokens: bytes) -> None:
        """A model behind the ranks embeds every token: one outside its vocabulary
        would fail every rank's compute (and reset the epoch), so it is refused here."""
        if self.config.model.runs_model:
            check_vocab(tokens, self.config.model.vocab_size)

    def end_session(self, session: str) -> bool:
        """Drop what ``session`` keeps between turns; ``False`` if it kept nothing."""
        ended = self.admission.end_session(session)
        self._blocked = self._blocked and not ended
        return ended

    def pin(self, tokens: bytes, namespace: str, ttl_s: float) -> PinResult:
        """Keep the cached prefix of packed ``tokens`` in L2 for ``ttl_s`` seconds."""
        return self.admission.pin(self._key(tokens, namespace), ttl_s)

    def unpin(self, tokens: bytes, namespace: str) -> int:
        """Unpin the cached prefix of packed ``tokens``; returns the tokens unpinned."""
        return self.admission.unpin(self._key(tokens, namespace))

    def _key(self, tokens: bytes, namespace: str) -> TokenKey:
        if not isinstance(tokens, bytes) or len(tokens) % TOKEN_BYTES:
            raise InvalidInput("tokens must be a sequence of non-negative ints")
        check_namespace(namespace)
        if self.allowed_namespaces is not None and namespace not in self.allowed_namespaces:
            raise InvalidInput(f"namespace {namespace!r} is not allowed")
        return TokenKey(tokens, self.config.cache.page_size, namespace)

    def _known(self, rid: str) -> bool:
        return (
            rid in self.running
            or rid in self.prefetching
            or any(r.rid == rid for r in self.waiting)
            or rid in self._leased_ids
        )

    def abort(self, request_id: str) -> RequestResult | None:
        """Abort a waiting or running request; its result (an error) is returned
        here for a waiting one, by ``on_round`` for a running one."""
        if not isinstance(request_id, str):
            raise InvalidInput(f"request_id {request_id!r} is refused: allowed is a str")
        for req in self.waiting:
            if req.rid == request_id:
                self.waiting.remove(req)
                self._release_kv(req)  # between chunks, or a decode not yet admitted
                self.stats.aborted += 1
                return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.prefetching.pop(request_id, None)
        if req is not None:
            self.l3.abort(request_id)
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.running.get(request_id)
        if req is not None and not req.aborted:
            req.aborted = True
            self._release_kv(req)
        return None

    def release(self, lease: Lease, session: str | None = None) -> bool:
        """Let a finished request's pages go — or, with ``session`` (or the one it was
        submitted with), have that session keep its whole pages for its next turn
        (``cache.session_*``). Only the
        ``Lease`` itself releases: a bare id or a lease that does not match the one
        handed out raises ``InvalidInput``. ``False`` if it expired or died with a
        reset."""
        if session is not None:
            check_session_id(session)
        held = self._held(lease)
        if held is None:
            return False
        self._drop_lease(held, session)
        return True

    def renew(self, lease: Lease) -> bool:
        """Extend a held lease by its TTL from now; ``False`` if it is gone."""
        held = self._held(lease)
        if held is None:
            return False
        held.expires_at = self.clock() + lease.ttl_s
        heapq.heappush(self._expiry, (held.expires_at, lease.token))
        return True

    def _held(self, lease: Lease) -> HeldLease | None:
        if not isinstance(lease, Lease):
            raise InvalidInput(
                f"release and renew take the Lease of a result, not {type(lease).__name__}"
            )
        held = self.leases.get(lease.token) if isinstance(lease.token, str) else None
        if held is not None and held.lease != lease:
            raise InvalidInput(f"lease of {lease.request_id!r} does not match the one handed out")
        return held

    def _drop_lease(self, held: HeldLease, session: str | None = None) -> None:
        del self.leases[held.lease.token]
        self._leased_ids.discard(held.lease.request_id)
        session = session if session is not None else held.session
        refused = self.admission.finish(held.kv, session)
        if refused is not None:
            self.stats.sessions_refused += 1
            log.info("session %r keeps nothing: %s", session, refused)
        self._blocked = False

    def expire_leases(self) -> int:
        """Release every lease past its TTL; returns how many."""
        now, n = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, token = heapq.heappop(self._expiry)
            held = self.leases.get(token)
            if held is not None and held.expires_at == expires_at:
                self._drop_lease(held)
                n += 1
        self.stats.leases_expired += n
        return n

    def next_expiry(self) -> float | None:
        """When the next lease or session expires (``clock`` time), for a loop that
        sleeps: the step after it lets that hold go."""
        while self._expiry and self._expiry[0][1] not in self.leases:
            heapq.heappop(self._expiry)
        times = [self._expiry[0][0]] if self._expiry else []
        session = self.cache.sessions.next_expiry()
        if session is not None:
            times.append(session)
        return min(times) if times else None

    def owners(self) -> set[str]:
        """Drivers that hold leases or have requests pending."""
        reqs = [*self.waiting, *self.running.values(), *self.prefetching.values()]
        return {r.owner for r in reqs if r.owner} | {
            h.owner for h in self.leases.values() if h.owner
        }

    def reclaim(self, owner: str) -> list[RequestResult]:
        """A driver exited: release its leases and abort its requests; returns the
        results of those that ended here (running ones end with their round)."""
        out = []
        for req in [*self.waiting, *self.running.values(), *self.prefetching.values()]:
            if req.owner == owner:
                result = self.abort(req.rid)
                if result is not None:
                    out.append(result)
        mine = [h for h in self.leases.values() if h.owner == owner]
        for held in mine:
            self._drop_lease(held)
        self.stats.leases_reclaimed += len(mine)
        return out

    # -- the step ------------------------------------------------------------------------

    def next_batch(self) -> Batch:
        """Admit what fits, queue the step's write-throughs, and return the commands
        queued since the last batch that fit in one message (the same batch goes
        to every rank)."""
        self._round_started = self.clock()
        try:
            self.expire_leases()
            self.admission.expire()
            self._schedule()
            self.cache.write_through()
        except Exception as exc:
            failed = self.recover(exc)
            self._failed.extend(failed)  # delivered with the next round
        self._queue_events()
        max_bytes = self.config.runtime.max_message_bytes
        world = self.topology.world_size
        room = (max_bytes - self.ctl.command_budget - batch_header_bound(world, 0, 0)) // 9
        stops = self.ctl.take_stops(room)
        forget = tuple(sorted(self._forget)[: room - len(stops)])
        self._forget.difference_update(forget)
        known = self.consensus.incarnations
        incarnations = tuple(known.get(i, "") for i in range(world))
        acked = self.ctl.acked()
        return Batch(self.epoch, self.ctl.take_commands(), stops, forget, incarnations, acked)

    def round_needed(self, batch: Batch, queries: Sequence[Query]) -> bool:
        """Whether a round would do anything: something to send (commands, stops,
        prefetches to forget, hit queries), something in flight or failed to
        deliver, or a rank to hear from again. A shell may skip the round when not
        (a release that freed pages and admitted nothing, say): the ranks hear
        nothing they do not already know."""
        if batch.commands or batch.stop or batch.forget or queries:
            return True
        if self._failed or self.absent or self.adopt_wanted or not self.idle:
            return True
        self._round_started = None  # no round: the next one is timed from its batch
        return False

    def _schedule(self) -> None:
        ready = []
        for rid, req in list(self.prefetching.items()):
            self._current = req
            loaded = self.admission.check_prefetch(rid)
            if loaded is not None:
                del self.prefetching[rid]
                req.prefetched = loaded
                ready.append(req)
        self.waiting.extendleft(reversed(ready))
        self._current = None
        if self.absent:
            return  # nothing is admitted until every rank answers again
        blocked = []
        while self.waiting:
            req = self._current = self.waiting.popleft()
            if not req.prefetch_tried:
                req.prefetch_tried = True
                if self.admission.start_prefetch(req.rid, req.key):
                    self.prefetching[req.rid] = req
                    continue
            if not self._admit(req):
                blocked.append(req)
                break
        self._current = None
        self.waiting.extendleft(reversed(blocked))
        self._blocked = bool(blocked)
        if self.waiting and not self.running and not self.ctl.busy() and not self._in_hand():
            sessions = self.cache.sessions
            if sessions.tier == "device" and sessions.held:
                # Sessions are a preference, not a lock against other requests:
                # the least recently kept lets go, and the next step tries again.
                sessions.end(next(iter(sessions.held)))
                self.stats.sessions_dropped_for_room += 1
                self._blocked = False  # not idle: the next step admits again
                return
            req = self.waiting.popleft()  # nothing will ever free room for it
            self._release_kv(req)
            if self.leases:  # only the leases of calls not yet answered hold L1
                self._fail(
                    req,
                    f"no room in L1 beside the {len(self.leases)} leases of requests "
                    "submitted with it (submit_many): submit fewer prompts at once",
                )
            else:
                self._fail(req, "no room in L1")

    def _in_hand(self) -> bool:
        """Whether a driver holds a lease it can release: any lease but those of a
        ``submit_many`` call some of whose requests are still pending (its driver
        has none of the call's results yet)."""
        pending = {r.group for r in (*self.waiting, *self.running.values())}
        pending |= {r.group for r in self.prefetching.values()}
        return any(h.group == 0 or h.group not in pending for h in self.leases.values())

    def start(self, reports: Sequence[Report]) -> int:
        """Open the first epoch: newer than any rank has seen (so each resets its
        counters), addressed to the incarnations the ranks report now."""
        self.epoch = max([r.epoch for r in reports] + [0]) + 1
        for r in reports:
            self.consensus.incarnations[r.rank] = r.incarnation
        return self.epoch

    def adopt(self, inventories: Sequence[Iterable[Entry]]) -> int:
        """After ``start``, or a reset for a restarted rank (``adopt_wanted``): take
        back the L2 pages every rank still holds (one ``RankWorker.inventory`` per
        rank, taken at this epoch) — then served as L2 hits instead of going to L3
        or recomputing. Returns tokens adopted (0 when any rank gave none, or when
        the cache holds anything already: adoption is for a fresh coordinator)."""
        self.adopt_wanted = False
        if len(inventories) != self.topology.world_size or self.cache.tree.root.children:
            return 0
        tokens = adopt_host(self.cache, common_pages(inventories))
        self.stats.adopted_tokens += tokens
        if tokens:
            log.info("adopted %d tokens of L2 pages the ranks still hold", tokens)
        return tokens

    def take_queries(self) -> list[Query]:
        """This step's L3 hit queries, for the storage actor: ``(op_id, chain hash
        before, packed tokens)``; it hashes the pages and answers ``(hit pages,
        hashes)`` (``StorageService.answer``)."""
        return self.ctl.take_queries()

    def _admit(self, req: ServingRequest) -> bool:
        """Place the request's next step — its prompt, its next chunk
        (``cache.chunk_tokens``) or its appended tokens — and queue the compute."""
        adm, kv = self.admission, req.kv
        if req.appended:
            assert kv is not None
            req.base = (kv.device_hit, kv.host_hit, kv.storage_hit, kv.computed)
            fill = adm.append(kv, req.appended)  # on no room nothing changed: retried
        else:
            if kv is None:
                kv = adm.begin(req.tokens, req.key.namespace, req.priority, req.prefetched, req.key)
            chunk = self.config.cache.chunk_tokens
            fill = adm.prefill(
                kv, min(kv.num_tokens, kv.filled + chunk) if chunk else kv.num_tokens
            )
            if fill is not None:
                req.kv = kv
        if fill is None:
            return False
        ns = kv.namespace
        prev = self.cache.tree.chain_hash(fill.prefix_node, ns)
        start, end = fill.start * TOKEN_BYTES, fill.end * TOKEN_BYTES
        prefix, held = b"", kv.pages[:0]
        if self.ctl.with_prefix:
            prefix, held = bytes(kv.tokens[:start]), kv.pages[: fill.start // kv.page_size]
        sliding, mamba = self._parts(kv, fill)
        req.compute_cmds = self.ctl.compute(
            ns,
            bytes(kv.tokens[start:end]),
            fill.start,
            fill.pages,
            prev,
            prefix,
            held,
            sliding,
            mamba,
            fill.first_new - fill.start,
        )
        self.running[req.rid] = req
        return True

    def _parts(self, kv: RequestKV, fill: Fill) -> tuple[list[SlidingPart], list[MambaPart]]:
        """A hybrid fill's other components as command parts: each sliding page with
        its tokens and the chain before it, each mamba state with the chain
        through its end (what a rank needs to compute them alone)."""
        parts = fill.parts
        if parts is None or parts.empty:
            return [], []
        pb = kv.page_size * TOKEN_BYTES
        # ``before[k]``: the chain before page k, i.e. the hash of page k - 1 — the
        # tree's own page hashes (kept on its nodes), read from the request's end up
        # only as far as the first part needs: the prefix is not hashed again.
        first = min([*parts.sliding_at, *parts.mamba_at])
        before = {0: namespace_seed(kv.namespace)}
        tree, node, end = self.cache.tree, kv.node, len(kv.pages)
        while node is not tree.root and end >= first:
            hashes = tree.page_hashes(node)
            start = end - len(hashes)
            before.update(
                (start + i + 1, h) for i, h in enumerate(hashes) if start + i + 1 >= first
            )
            end = start
            node = node.parent  # type: ignore[assignment]
        sliding = [
            SlidingPart(k, page, before[k], bytes(kv.tokens[k * pb : (k + 1) * pb]))
            for k, page in zip(parts.sliding_at, parts.sliding, strict=True)
        ]
        mamba = [
            MambaPart(e, slot, before[e])
            for e, slot in zip(parts.mamba_at, parts.mamba, strict=True)
        ]
        return sliding, mamba

    def on_round(
        self, reports: Sequence[Report], storage_hits: Mapping[int, Answer] | None = None
    ) -> list[RequestResult]:
        """Reduce one report per rank (and the storage actor's answers to the hit
        queries: hit counts, already MIN over shards, and the pages' hashes) and
        commit; returns requests that finished."""
        self._count_round()
        self.absent.clear()
        self._absent_reason.clear()
        try:
            rnd = self.consensus.reduce(reports, self.epoch)
            if rnd.restarted:
                out = self.reset(f"rank(s) {self._names(rnd.restarted)} restarted")
                # A rank restarted on its node may have found its L2 as it was
                # (fabric.rank.shared_l2): the shell asks every rank what it holds
                # before the next step, and ``adopt`` takes back what all name alike.
                self.adopt_wanted = True
                return out
            if not rnd.usable:
                return self._take_failed()
            self._watch_progress(reports)
            return self._commit(rnd, storage_hits or {})
        except Exception as exc:
            return self.recover(exc)

    def _count_round(self) -> None:
        self.stats.rounds += 1
        if self._round_started is not None:
            self.stats.round_seconds.observe(self.clock() - self._round_started)
            self._round_started = None

    def on_missing(self, missing: Mapping[int, str]) -> list[RequestResult]:
        """A round in which the ranks ``missing`` (index -> why) gave no usable
        report. The first such round resets L1/L2 (their pools may be gone); until
        every rank answers again nothing is admitted, and past
        ``runtime.rank_absent_timeout_s`` requests fail with an error naming the rank."""
        self._count_round()
        now = self.clock()
        first = not self.absent
        for index, why in missing.items():
            self.absent.setdefault(index, now)
            self._absent_reason[index] = why
        out = []
        if first:
            names = self._names(sorted(missing))
            out = self.reset(f"rank(s) {names} did not answer", count_retry=False)
        return out + self._fail_if_absent_too_long()

    def _fail_if_absent_too_long(self) -> list[RequestResult]:
        now, limit = self.clock(), self.config.runtime.rank_absent_timeout_s
        late = sorted(i for i, since in self.absent.items() if now - since >= limit)
        if late:
            index = late[0]
            why = (
                f"rank {self._names([index])} (index {index}) has not answered for "
                f"{now - self.absent[index]:.1f} s: {self._absent_reason.get(index, 'no reply')}"
            )
            while self.waiting:
                self._fail(self.waiting.popleft(), why)
            for rid in list(self.prefetching):
                self.l3.abort(rid)
                self._fail(self.prefetching.pop(rid), why)
        return self._take_failed()

    def _names(self, indices: Sequence[int]) -> str:
        ranks = self.topology.ranks
        return ", ".join(str(ranks[i]) if 0 <= i < len(ranks) else str(i) for i in indices)

    def _commit(self, rnd: Round, storage_hits: Mapping[int, Answer]) -> list[RequestResult]:
        done = self.ctl.completions(rnd, storage_hits)
        if done.writes or done.loads or done.computes or done.backups:
            self._blocked = False  # finished work may have unlocked pages: admit again
        self.cache.apply(done)
        self._forget |= rnd.prefetch_reported - set(self.l3.by_op)
        self._queue_events()
        if done.failed_computes or done.failed_loads:
            # Those pages may hold anything on some rank: drop L1/L2, retry.
            what = "compute" if done.failed_computes else "load"
            return self.reset(f"a {what} failed on a rank")
        out = self._take_failed()
        more = []
        for req in list(self.running.values()):
            if req.compute_cmds[-1] > self.ctl.computes_committed:
                continue
            del self.running[req.rid]
            if req.more_chunks and not req.aborted:
                more.append(req)  # its next chunk goes first in the next step
            else:
                out.append(self._finish(req))
        self.waiting.extendleft(reversed(more))
        return out

    def _finish(self, req: ServingRequest) -> RequestResult:
        latency = self.clock() - req.submitted
        if req.aborted:
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, latency_s=latency, error="aborted")
        device, host, storage, computed = req.tallies()
        s = self.stats
        s.finished += 1
        s.prompt_tokens += req.prompt_tokens
        s.tokens.add(device, host, storage, computed)
        s.latency_s_total += latency
        s.request_seconds.observe(latency)
        ttl = self.config.runtime.lease_ttl_s
        kv = req.kv
        assert kv is not None
        sliding, mamba = kv.parts_held  # what the leased prefix has of the other components
        lease = Lease(
            req.rid,
            secrets.token_hex(16),
            self.epoch,
            kv.namespace,
            kv.filled,
            tuple(kv.device_pages),  # the lease crosses to drivers
            ttl,
            sliding,
            mamba,
        )
        held = HeldLease(lease, kv, req.owner, self.clock() + ttl, req.session, req.group)
        self.leases[lease.token] = held
        self._leased_ids.add(req.rid)
        heapq.heappush(self._expiry, (held.expires_at, lease.token))
        return RequestResult(
            req.rid,
            req.prompt_tokens,
            device_hit_tokens=device,
            host_hit_tokens=host,
            storage_hit_tokens=storage,
            computed_tokens=computed,
            latency_s=latency,
            lease=lease,
        )

    def drain_events(self) -> list[KVEvent]:
        """Every queued KV event, oldest first (for the ZMQ publisher, each step)."""
        events = list(self.events)
        self.events.clear()
        return events

    def rank_latencies(self, latencies: Sequence[float | None]) -> None:
        """How long each rank took to reply to this round (``None``: not measured),
        from the shell, before ``on_round``: a rank's lag in the round is the larger
        of that and how late it finished its commands (``Progress``)."""
        self._reply_s = list(latencies)

    def _watch_progress(self, reports: Sequence[Report]) -> None:
        # A rank's own work only: backups and prefetches queue at the one storage
        # actor, where some rank is always served last.
        totals = [
            r.computes_done + r.writes_done + r.loads_done
            for r in sorted(reports, key=lambda r: r.rank)
        ]
        lags = self.progress.lags(totals, self.epoch, self.clock())
        reply, self._reply_s = self._reply_s or [None] * len(lags), None
        slow_reply = self.config.runtime.straggler_lag_s
        # A round counts for a rank when it finished something (how late, or how
        # slowly it replied if that was later), or when its reply alone was slow:
        # the many rounds in which a rank only waits say nothing either way.
        self.stragglers.observe(
            [
                max(lag, reply_s or 0.0)
                if lag is not None
                else (reply_s if reply_s is not None and reply_s > slow_reply else None)
                for lag, reply_s in zip(lags, reply, strict=True)
            ]
        )

    def _straggler_named(self, rank: str, s: Straggler) -> None:
        log.warning(
            "rank %s is a straggler: it finishes its commands %.3f s after the first rank, "
            "the others %.3f s (runtime.straggler_policy=%s)",
            rank,
            s.latency_s,
            s.others_s,
            self.config.runtime.straggler_policy,
        )

    def _queue_events(self) -> None:
        """Queue the cache's new KV events for ``take_events``; past the queue's cap
        the oldest go, counted (``events_dropped``) and said once."""
        new = self.cache.take_events()
        if not new:
            return
        over = len(self.events) + len(new) - (self.events.maxlen or 0)
        if over > 0:
            if not self.stats.events_dropped:
                log.warning(
                    "KV events: the queue of %d is full and nobody takes them (take_events, "
                    "or events.endpoint); the oldest are dropped, counted in events_dropped",
                    self.events.maxlen,
                )
            self.stats.events_dropped += over
        self.events.extend(new)

    def take_events(self, limit: int = 10_000, namespace: str | None = None) -> list[KVEvent]:
        """Drain up to ``limit`` of the oldest KV events (``BlockStored``,
        ``BlockRemoved``, ``AllBlocksCleared``) — of one ``namespace`` only when
        given (the others stay queued for their consumers; a clear of every
        namespace goes to whoever takes first)."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise InvalidInput(f"limit {limit!r} is refused: allowed is an int >= 0")
        if namespace is None:
            return [self.events.popleft() for _ in range(min(limit, len(self.events)))]
        check_namespace(namespace)
        taken, kept = [], deque(maxlen=self.events.maxlen)
        for event in self.events:
            # A clear of every namespace (a new coordinator's first event) is theirs too.
            if len(taken) < limit and event.namespace in (namespace, ""):
                taken.append(event)
            else:
                kept.append(event)
        self.events = kept
        return taken

    def _release_kv(self, req: ServingRequest) -> None:
        """Let go of everything the request holds in the cache (it ends here)."""
        if req.kv is not None and not req.kv.ended:
            self.admission.release(req.kv)

    def _fail(self, req: ServingRequest, error: str) -> None:
        self.stats.failed += 1
        self._failed.append(
            RequestResult(
                req.rid, req.prompt_tokens, latency_s=self.clock() - req.submitted, error=error
            )
        )

    def _take_failed(self) -> list[RequestResult]:
        out, self._failed = self._failed, []
        return out

    def recover(self, exc: BaseException) -> list[RequestResult]:
        """An unexpected error in a step: fail the request it concerns (if one was
        being handled), then reset L1/L2, which it may have left half changed; the
        others are retried. Never raises."""
        self.stats.step_errors += 1
        req, self._current = self._current, None
        log.error("coordinator step failed; resetting L1/L2", exc_info=exc)
        error = f"internal error: {type(exc).__name__}: {exc}"
        if req is not None:
            if req in self.waiting:
                self.waiting.remove(req)
            self.running.pop(req.rid, None)
            self.prefetching.pop(req.rid, None)
            req.kv = None  # the reset below drops what it held
            self._fail(req, error)
        return self.reset(f"internal error: {type(exc).__name__}")

    def reset(self, reason: str, count_retry: bool = True) -> list[RequestResult]:
        """Drop every L1/L2 page (a rank lost its pools, or a page may be bad), start a
        new epoch, end leases and send running requests back to waiting — each at
        most ``runtime.max_request_retries`` times, then it fails naming ``reason``."""
        self.stats.resets += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.cache.reset()
        self._queue_events()
        self.epoch += 1
        self._blocked = False
        self.leases.clear()
        self._leased_ids.clear()
        self._expiry.clear()
        out = self._take_failed()
        limit = self.config.runtime.max_request_retries
        back = []
        for req in list(self.waiting):  # between chunks, or decodes: their KV is gone
            if req.appended:
                self.waiting.remove(req)
                self._fail(req, f"the request's KV was lost ({reason}); submit it again")
            elif req.kv is not None:
                req.kv, req.prefetch_tried, req.prefetched = None, False, 0
        for req in [*self.running.values(), *self.prefetching.values()]:
            if req.aborted:
                self.stats.aborted += 1
                out.append(RequestResult(req.rid, req.prompt_tokens, error="aborted"))
                continue
            if req.appended:
                self._fail(req, f"the request's KV was lost ({reason}); submit it again")
                continue
            req.compute_cmds, req.kv = (), None
            req.prefetch_tried, req.prefetched = False, 0
            if count_retry:
                req.retries += 1
            if req.retries > limit:
                self.stats.gave_up += 1
                self._fail(req, f"gave up after {limit} retries: {reason}")
                continue
            self.stats.retried += 1
            back.append(req)
        self.running.clear()
        self.prefetching.clear()
        self.waiting.extendleft(reversed(back))
        self._forget.clear()
        return out + self._take_failed()

    @property
    def idle(self) -> bool:
        """Nothing to do until a request arrives or a lease is released."""
        return (
            not self.running
            and not self.prefetching
            and not self.ctl.busy()
            and self.l3.idle
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
            "absent_ranks": self._names(sorted(self.absent)) if self.absent else "",
            "requests": self._request_counts(),
            "tokens": {"prompt": s.prompt_tokens, **s.tokens.as_dict()},
            "mean_latency_s": s.latency_s_total / s.finished if s.finished else 0.0,
            "resets": s.resets,
            "reset_reasons": dict(s.by_reason),
            "rounds": s.rounds,
            "rounds_skipped": s.rounds_skipped,
            "cache": self.cache.stats.counters(),
            "prefetching": len(self.prefetching),
            "storage_ops": self.l3.snapshot(),
            "pending_writes": len(self.cache.pending_writes),
            "pending_loads": len(self.cache.pending_loads),
            "bad_messages": s.bad_messages,
            "step_errors": s.step_errors,
            "leases_expired": s.leases_expired,
            "leases_reclaimed": s.leases_reclaimed,
            "adopted_tokens": s.adopted_tokens,
            "events_queued": len(self.events),
            "events_dropped": s.events_dropped,
            "stragglers": self.stragglers.status(),
            "stragglers_named": self.stragglers.named,
            "core_time_s": s.core_time_s,
            "storage_errors": s.storage_errors,
            "storage_restores": s.storage_restores,
            "device": vars(self.cache.device_sizes()),
            "host": vars(self.cache.host_sizes()),
            "sessions": {
                "held": len(self.cache.sessions.held),
                "held_tokens": self.cache.sessions.held_tokens,
                "budget_tokens": self.cache.sessions.budget,
                "refused": s.sessions_refused,
            },
            "pinned_tokens": self.cache.pinned_size,
        }

    def _request_counts(self) -> dict[str, int]:
        s = self.stats
        return {
            "submitted": s.submitted,
            "finished": s.finished,
            "failed": s.failed,
            "aborted": s.aborted,
            "retried": s.retried,
            "gave_up": s.gave_up,
        }

    def figures(self) -> dict:
        """What the metrics export: counters, gauges and histograms, read without
        walking the tree (cheap enough for every scrape)."""
        s, cache, l3 = self.stats, self.cache, self.l3
        device = cache.device_sizes()
        host = cache.ctl.host
        transfers = {
            "device_to_host": cache.stats.written_tokens,
            "host_to_device": cache.stats.loaded_back_tokens,
            "host_to_storage": l3.stats.backed_up_tokens,
            "storage_to_host": l3.stats.prefetched_tokens,
        }
        return {
            "epoch": self.epoch,
            "requests": self._request_counts(),
            "prompt_tokens": s.tokens.as_dict(),
            "evicted_tokens": {
                "device": cache.stats.device_evicted_tokens,
                "host": cache.stats.host_evicted_tokens,
            },
            "transfer_tokens": transfers,
            "failed_write_tokens": cache.stats.failed_write_tokens,
            "failed_backups": l3.stats.failed_backups,
            "bad_hit_answers": l3.stats.bad_answers,
            "transfer_sizes": cache.stats.transfer_sizes,
            "kv_bytes_per_token": self.config.model.kv_bytes_per_token,
            "request_seconds": s.request_seconds,
            "round_seconds": s.round_seconds,
            "rounds": s.rounds,
            "resets": s.resets,
            "bad_messages": s.bad_messages,
            "step_errors": s.step_errors,
            "storage_errors": s.storage_errors,
            "leases_expired": s.leases_expired,
            "leases_reclaimed": s.leases_reclaimed,
            "adopted_tokens": s.adopted_tokens,
            "events_queued": len(self.events),
            "events_dropped": s.events_dropped,
            "stragglers": self.stragglers.status(),
            "stragglers_named": self.stragglers.named,
            "rank_lag_seconds": dict(
                zip(self.stragglers.names, self.stragglers.seconds, strict=True)
            ),
            "sessions_refused": s.sessions_refused,
            "core_seconds": s.core_time_s,
            "prefetch_started": l3.stats.prefetch_started,
            "prefetch_revoked": l3.stats.prefetch_revoked,
            "prefetch_refusals": dict(l3.stats.refusals),
            "pool": {
                "device": {
                    "capacity": device.capacity,
                    "free": device.free,
                    "evictable": device.evictable,
                    "protected": device.protected,
                },
                "host": {
                    "capacity": host.capacity_tokens,
                    "free": host.available_pages * cache.page_size,
                },
            },
            "requests_now": {
                "waiting": len(self.waiting),
                "prefetching": len(self.prefetching),
                "running": len(self.running),
            },
            "inflight_transfers": {
                "device_to_host": len(cache.pending_writes),
                "host_to_device": len(cache.pending_loads),
                "host_to_storage": len(l3.backups),
                "storage_to_host": len(l3.by_op),
            },
            "leases": len(self.leases),
            "sessions": len(cache.sessions.held),
            "session_tokens": cache.sessions.held_tokens,
            "pinned_tokens": cache.pinned_size,
            "ranks": {str(r): i not in self.absent for i, r in enumerate(self.topology.ranks)},
        }

    # -- storage attach / detach ---------------------------------------------------------

    def storage_attached(self) -> None:
        """The storage actor has a backend: start prefetching and backing up."""
        self.l3.attach()

    def storage_begin_detach(self) -> None:
        """Issue no new storage work; stop every prefetch (their requests go on
        without L3). Pending backups still end with their acks."""
        self.l3.pause()
        for rid, req in list(self.prefetching.items()):
            self.l3.abort(rid)
            del self.prefetching[rid]
            self.waiting.appendleft(req)

    def l3_removed(self, page_hashes: Sequence[bytes]) -> None:
        """The store reports these pages gone (evicted, deleted by another process):
        ``BlockRemoved`` from L3 for those the fabric had announced."""
        self.cache.events.l3_removed(page_hashes)
        if self.l3.idle:  # nothing in flight can announce a page reported gone
            self.cache.events.forget_removals()
        self._queue_events()

    def l3_cleared(self) -> None:
        """The store was cleared or detached: every L3 page announced is gone."""
        self.cache.events.l3_cleared()
        self._queue_events()

    def storage_drained(self) -> bool:
        return self.l3.idle

    def storage_force_detach(self) -> None:
        """Release whatever storage work is left. Only once no rank will touch
        its host pages any more (after a reset, say)."""
        self.l3.detach()
