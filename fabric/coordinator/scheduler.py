"""The coordinator's queues and what enters L1 each step.

A request waits (``waiting``), may first prefetch its prefix from L3
(``prefetching``), then runs (``running``) one step at a time — its prompt, its next
chunk (``cache.chunk_tokens``) or the tokens appended to it — until its round
commits. ``schedule`` admits what fits in order; the first request that does not
fit blocks those behind it until something frees room (``unblock``)."""

from __future__ import annotations

import logging
from collections import deque

from fabric.cache.admission import Admission, Fill, RequestKV
from fabric.cache.hicache import HiCache
from fabric.cache.keys import TOKEN_BYTES, namespace_seed
from fabric.config import FabricConfig
from fabric.coordinator.commands import FabricController
from fabric.coordinator.leases import LeaseTable
from fabric.coordinator.requests import FabricStats, RequestResult, ServingRequest
from fabric.messages import MambaPart, SlidingPart

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: FabricConfig,
        cache: HiCache,
        admission: Admission,
        ctl: FabricController,
        leases: LeaseTable,
        stats: FabricStats,
    ) -> None:
        self.config = config
        self.cache = cache
        self.admission = admission
        self.ctl = ctl
        self.leases = leases
        self.stats = stats
        self.clock = cache.clock
        self.waiting: deque[ServingRequest] = deque()
        self.running: dict[str, ServingRequest] = {}
        self.prefetching: dict[str, ServingRequest] = {}
        self.blocked = False  # the first waiting request did not fit: wait for room
        self.current: ServingRequest | None = None  # the one being placed (for recover)
        self.failed: list[RequestResult] = []  # delivered with the next round

    # -- what is pending -------------------------------------------------------------

    def pending(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefetching)

    def requests(self) -> list[ServingRequest]:
        return [*self.waiting, *self.running.values(), *self.prefetching.values()]

    def known(self, rid: str) -> bool:
        """Whether ``rid`` names a pending request or a held lease."""
        return (
            rid in self.running
            or rid in self.prefetching
            or any(r.rid == rid for r in self.waiting)
            or self.leases.holds_request(rid)
        )

    def owners(self) -> set[str]:
        """Drivers with requests pending."""
        return {r.owner for r in self.requests() if r.owner}

    def unblock(self) -> None:
        """Room may have been freed: the next step tries the waiting requests again."""
        self.blocked = False

    @property
    def quiet(self) -> bool:
        """Nothing runs or prefetches, and nothing waiting can go in."""
        return not self.running and not self.prefetching and (not self.waiting or self.blocked)

    # -- one step ----------------------------------------------------------------------

    def schedule(self, admit: bool) -> None:
        """Move finished prefetches back to the head of the queue; then, if ``admit``
        (every rank answers), start prefetches and admit what fits, in order."""
        ready = []
        for rid, req in list(self.prefetching.items()):
            self.current = req
            loaded = self.admission.check_prefetch(rid)
            if loaded is not None:
                del self.prefetching[rid]
                req.prefetched = loaded
                ready.append(req)
        self.waiting.extendleft(reversed(ready))
        self.current = None
        if not admit:
            return
        blocked = []
        while self.waiting:
            req = self.current = self.waiting.popleft()
            if not req.prefetch_tried:
                req.prefetch_tried = True
                if self.admission.start_prefetch(req.rid, req.key):
                    self.prefetching[req.rid] = req
                    continue
            if not self._admit(req):
                blocked.append(req)
                break
        self.current = None
        self.waiting.extendleft(reversed(blocked))
        self.blocked = bool(blocked)
        if self.waiting and not self.running and not self.ctl.busy() and not self._in_hand():
            self._make_room()

    def _in_hand(self) -> bool:
        pending = {r.group for r in self.requests()}
        return self.leases.in_hand(pending)

    def _make_room(self) -> None:
        """Nothing in flight will free L1 for the first waiting request: a device
        session lets go, or else the request fails."""
        sessions = self.cache.sessions
        if sessions.tier == "device" and sessions.held:
            # Sessions are a preference, not a lock against other requests: the
            # least recently kept lets go, and the next step tries again.
            sessions.end(next(iter(sessions.held)))
            self.stats.sessions_dropped_for_room += 1
            self.blocked = False  # not idle: the next step admits again
            return
        req = self.waiting.popleft()  # nothing will ever free room for it
        self.release_kv(req)
        if len(self.leases):  # only the leases of calls not yet answered hold L1
            self.fail(
                req,
                f"no room in L1 beside the {len(self.leases)} leases of requests "
                "submitted with it (submit_many): submit fewer prompts at once",
            )
        else:
            self.fail(req, "no room in L1")

    def _admit(self, req: ServingRequest) -> bool:
        """Place the request's next step — its prompt, its next chunk or its appended
        tokens — and queue the compute."""
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
            *self._state_at(fill),
        )
        self.running[req.rid] = req
        return True

    def _state_at(self, fill: Fill) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A hybrid fill's L1 state where it starts (ranks that compute from the
        cache start there): the mamba slot holding it, and the sliding pages of the
        window before it — each empty when not all there. Ranks run commands in
        order: a later reuse of a slot or page comes after this compute."""
        node, tree, parts = fill.prefix_node, self.cache.tree, self.cache.parts
        if parts is None or not fill.start or (node.mamba is None and not parts.window_pages):
            return (), ()
        end = fill.start // tree.page_size
        if tree.depth_pages(node) != end:
            return (), ()  # no state that ends at the fill's start: computed without one
        window: tuple[int, ...] = ()
        if parts.window_pages:
            sliding, _ = parts.held(node, tree.pages, end)
            if [key for key, _ in sliding] == list(range(end - min(parts.window_pages, end), end)):
                window = tuple(page for _, page in sliding)
        return ((node.mamba,) if node.mamba is not None else ()), window

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

    # -- ending requests -----------------------------------------------------------------

    def abort(self, request_id: str) -> RequestResult | None:
        """Abort a waiting, prefetching or running request; its result (an error) is
        returned here for the first two, with its round for a running one."""
        for req in self.waiting:
            if req.rid == request_id:
                self.waiting.remove(req)
                self.release_kv(req)  # between chunks, or a decode not yet admitted
                self.stats.aborted += 1
                return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.prefetching.pop(request_id, None)
        if req is not None:
            self.cache.l3.abort(request_id)
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, error="aborted")
        req = self.running.get(request_id)
        if req is not None and not req.aborted:
            req.aborted = True
            self.release_kv(req)
        return None

    def release_kv(self, req: ServingRequest) -> None:
        """Let go of everything the request holds in the cache (it ends here)."""
        if req.kv is not None and not req.kv.ended:
            self.admission.release(req.kv)

    def fail(self, req: ServingRequest, error: str) -> None:
        """End ``req`` with ``error``; its result goes out with the next round."""
        self.stats.failed += 1
        self.failed.append(
            RequestResult(
                req.rid, req.prompt_tokens, latency_s=self.clock() - req.submitted, error=error
            )
        )

    def fail_waiting(self, error: str) -> None:
        """Fail every waiting and prefetching request with ``error``."""
        while self.waiting:
            self.fail(self.waiting.popleft(), error)
        for rid in list(self.prefetching):
            self.cache.l3.abort(rid)
            self.fail(self.prefetching.pop(rid), error)

    def take_failed(self) -> list[RequestResult]:
        out, self.failed = self.failed, []
        return out
