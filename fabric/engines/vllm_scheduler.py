"""The scheduler side of ``KvFabricConnector``: a driver of the coordinator inside
vLLM's engine-core process (docs/engines.md has the whole story).

Per step: the queued lookups go in one coordinator call (``matched``); a hit is
the leading pages every rank stored (the coordinator's MIN, extended over L3),
less vLLM's own prefix cache. ``step_meta`` says what each worker loads before
the forward and which whole pages of real tokens it stores after it;
``worker_output`` takes each rank's load outcomes, ended stores and stored
pages (reported to the coordinator's tree, whose orders go back to the workers).

No page computed over a failed load is stored: until every rank reported a load
(``vllm_loads``), a request whose blocks include one of the load's stores
nothing; where any rank failed, its save cursor goes back to vLLM's rollback,
and blocks left stale taint whoever uses them until computed anew. No step
waits on the fabric or the store longer than ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fabric.cache.engine_input import MAX_LEASES, MAX_PAGES_PER_CALL, StoredRun
from fabric.cache.keys import namespace_seed
from fabric.engines.fabric_link import FabricLink
from fabric.engines.store import StoreOptions
from fabric.engines.vllm_groups import KvGroup, hybrid
from fabric.engines.vllm_hybrid import HybridPlan, block_state
from fabric.engines.vllm_identity import EngineTag
from fabric.engines.vllm_l3_answers import L3Answers
from fabric.engines.vllm_loads import Leases, LoadBook, LoadOutcomes, StoresInFlight
from fabric.engines.vllm_pages import (
    ConnectorOptions,
    FabricHandshake,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    PageSave,
    request_namespace,
)
from fabric.engines.vllm_requests import LoraIdentities, TrackedRequest, ask_holds, unkeyed

log = logging.getLogger(__name__)

# Stores and loads not reported by every rank within this long are given up on.
WRITE_STALL_S = 60.0


class SchedulerSide(LoadOutcomes):
    def __init__(
        self,
        options: ConnectorOptions,
        suffixes: list[str],
        block_size: int,
        link: FabricLink,
        clock: Callable[[], float] = time.monotonic,
        groups: list[KvGroup] | None = None,
    ) -> None:
        # A hybrid engine's other groups (``vllm_hybrid``): its loads asynchronous.
        self.hybrid = HybridPlan(groups) if groups and hybrid(groups) else None
        self.primary = self.hybrid.primary.index if self.hybrid is not None else 0
        if self.hybrid is not None:
            options = options.model_copy(update={"load_async": True})
        self.options = options
        self.suffixes = suffixes  # every rank's key suffix, by rank
        self.world = len(suffixes)
        self.block_size = block_size
        self.link = link
        self.clock = clock
        self.engine = EngineTag(self.world)
        self.l3 = L3Answers(suffixes, clock)
        self.tracked: dict[str, TrackedRequest] = {}
        self._unserved: set[str] = set()  # requests the fabric does not serve
        self._questions: dict[str, None] = {}  # requests to ask about, in order
        self._store_sent = False
        self._async_loads: list[PageLoad] = []
        self._cancel: list[str] = []  # requests whose asynchronous loads are given up
        self.loads = LoadBook(self.world)
        # Finished requests whose blocks vLLM keeps until their last pages are stored.
        self._finishing: dict[str, TrackedRequest] = {}
        self.stores = StoresInFlight(self.world, WRITE_STALL_S, clock)
        # Leases on the pages a lookup matched, released once every rank loaded them.
        self.leases = Leases(MAX_LEASES)
        self._loras = LoraIdentities()

    # -- the engine's identity ----------------------------------------------------------

    def handshake(self, ranks: dict[int, FabricHandshake]) -> None:
        """Every worker's identity (vLLM's connector handshake): the engine's tag is
        named from all of them. A worker that cannot serve, or one missing, keeps
        the engine off the fabric (logged): its prompts are computed."""
        self.engine.handshake({r: meta.identity for r, meta in ranks.items()})

    def reset(self) -> bool:
        """vLLM's ``reset_cache`` (after a weight update, say): a new epoch, so that
        no page this engine stored before is served to it after; requests it
        serves now store nothing more (their KV may be the old weights')."""
        self.engine.renew()
        for state in self.tracked.values():
            state.no_save = True
            if state.async_loading:
                self._cancel.append(state.rid)  # its load would serve the old pages
            elif not state.scheduled:
                state.load = None
                self._question(state)  # its answer was the old pages': asked again
        return True

    @property
    def tag(self) -> str | None:
        return self.engine.tag

    # -- on_new_request, get_num_new_matched_tokens ----------------------------------

    def new_request(self, request: Any) -> None:
        """vLLM added ``request``: its lookup joins the next step's one call."""
        state = None
        if self.tag is not None and not unkeyed(request):
            state = self._track(request)  # (images, prompt embeddings: tokens would not
        if state is None:  # name their KV; an adapter that cannot be read)
            self._unserved.add(request.request_id)
            return
        self.tracked[request.request_id] = state
        self._question(state)

    def _question(self, state: TrackedRequest) -> None:
        state.fabric_pages = None
        state.scheduled = False
        state.first_computed = None
        skip = getattr(state.request, "skip_reading_prefix_cache", False)
        if skip or state.whole(self.block_size) <= 0:
            state.fabric_pages = 0
        else:
            self._questions[state.rid] = None

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` the workers can load for ``request``
        (``None``: ask again next step — this engine is still storing pages of it),
        and whether they load them asynchronously."""
        tokens = self._matched(request, num_computed_tokens)
        return tokens, bool(tokens) and self.options.load_async

    def _matched(self, request: Any, num_computed_tokens: int) -> int | None:
        if self.tag is None:
            return 0
        state = self.tracked.get(request.request_id)
        if state is None:  # added before the connector saw it, or not served
            if request.request_id not in self._unserved:
                self.new_request(request)
            state = self.tracked.get(request.request_id)
            if state is None:
                return 0
        elif state.scheduled:  # preempted and resumed: its pages may be anywhere now
            self._question(state)
        if state.fabric_pages is None:
            self._ask()
        if state.fabric_pages is None:
            return None
        hit_tokens = state.fabric_pages * self.block_size
        state.load = None
        if hit_tokens <= num_computed_tokens:
            return 0
        state.load = (num_computed_tokens // self.block_size, state.fabric_pages)
        return hit_tokens - num_computed_tokens

    def _track(self, request: Any) -> TrackedRequest | None:
        """What is kept of a new request (``None``: its LoRA adapter cannot be read,
        and the fabric does not serve it)."""
        lora = None
        if request.lora_request:
            lora = self._loras.identity(request.lora_request)
            if lora is None:
                return None
        namespace = request_namespace(self.options.namespace, request.cache_salt, lora)
        assert self.tag is not None
        return TrackedRequest(request, namespace, namespace_seed(namespace), self.tag)

    def _ask(self) -> None:
        """Ask the fabric about every request waiting for an answer, in one call
        (several past the coordinator's bound), and take its answers (waiting at
        most ``timeout_s`` in all: a fabric that does not answer is down, and the
        store alone answers)."""
        deadline = self.clock() + self.options.timeout_s
        states, waiting, chains = [], [], []
        self.pending_writes()  # (gives up on stores that stalled)
        for rid in self._questions:
            state = self.tracked.get(rid)
            if state is None or state.fabric_pages is not None:
                continue
            whole = min(state.whole(self.block_size), MAX_PAGES_PER_CALL)
            state.hashes_to(whole, self.block_size)
            if self.stores.any_of(state.hashes[:whole]):
                waiting.append(rid)  # asked once this engine has stored those pages
                continue
            states.append(state)
            chains.append(state.hashes[:whole])
        self._questions = dict.fromkeys(waiting)
        answers = None
        assert self.tag is not None
        if chains:
            leases = [self.leases.name(s.rid) for s in states]
            release = self.leases.take_ended()
            needs = self.hybrid.needs(self.tag) if self.hybrid is not None else None
            answers = self.link.lookup(
                self.tag, self.world, chains, leases, self.options.lease_s, release, deadline,
                needs,
            )  # fmt: skip
            if answers is not None and self.options.lease_s > 0:
                self.leases.hold(s.rid for s, hit in zip(states, answers, strict=True) if hit)
        options = StoreOptions(path=self.options.path) if self.options.path else self.link.store
        self.l3.open(options)
        if self.hybrid is not None:  # (the store alone cannot say where its components are)
            extended = list(answers) if answers is not None else [0] * len(states)
        else:
            extended = self.l3.extend(
                self.tag, states, answers, deadline, self.block_size, self.link
            )
        for state, hit in zip(states, extended, strict=True):
            state.fabric_pages = hit
            state.asked_tag = self.tag

    def close(self) -> None:
        self.l3.close()
        self.link.close()

    # -- update_state_after_alloc -----------------------------------------------------

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM gave the request its blocks and took ``num_external_tokens`` of the
        hit: those pages are the load (an asynchronous one starts with the next
        step's metadata; the request is not scheduled until it is done)."""
        state = self.tracked.get(request.request_id)
        if state is None or state.load is None:
            return
        start, _ = state.load
        end = start + num_external_tokens // self.block_size
        if end <= start:
            state.load = None
            self.leases.end([request.request_id])
            return
        state.load = (start, end)
        if self.options.load_async:
            state.load = None
            tables = blocks.get_block_ids()
            block_ids = tables[self.primary]
            end = min(end, len(block_ids))
            job = self._new_load(state, start, end, block_ids, sync=False)
            self._async_loads.append(job)
            if self.hybrid is not None:
                self._async_loads += self.hybrid.loads(state, start, end, tables, job.limit_s)
            state.async_loading = True
            state.scheduled = True  # a load that fails is asked anew (vLLM retries from 0)

    def _new_load(
        self, state: TrackedRequest, start: int, end: int, block_ids: Any, sync: bool
    ) -> PageLoad:
        blocks = tuple(block_ids[start:end])
        rid = state.request.request_id
        load_id = self.loads.open(rid, start, blocks, sync, self.clock())
        state.waiting_on.add(load_id)
        parent, store = state.hashes[start - 1] if start else None, self.link.store
        limit_s = store.limit_s((end - start) * self.block_size) if store else 0.0
        return PageLoad(load_id, rid, state.asked_tag, tuple(state.hashes[start:end]), blocks,
                        not sync, state.namespace, parent, limit_s, self.primary)  # fmt: skip

    # -- build_connector_meta ---------------------------------------------------------

    def step_meta(self, scheduler_output: Any) -> FabricStepMeta:
        meta = FabricStepMeta(self._async_loads, cancel=self._cancel)
        meta.orders, self._async_loads, self._cancel = self.link.take_orders(self.world), [], []
        if not self._store_sent and self.link.store is not None:
            meta.store = self.link.store
            self._store_sent = True
        for record in self.loads.stalled(self.clock(), WRITE_STALL_S):  # a worker gone mute:
            log.warning("kvfabric connector: a load not reported by every rank: given up")
            self._resolve(record, abandoned=True)  # what depends on it never stores
        steps = []  # (request, tokens computed before the step, after it)
        scheduled = scheduler_output.num_scheduled_tokens
        p = self.primary
        for new in scheduler_output.scheduled_new_reqs:
            state = self.tracked.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[p])
                before = new.num_computed_tokens
                steps.append((state, before, before + scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.tracked.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[p]) if new_blocks else []
            elif new_blocks:
                state.block_ids += new_blocks[p]
            before = cached.num_computed_tokens[i]
            steps.append((state, before, before + scheduled.get(rid, 0)))
        if self.hybrid is not None:
            meta.groups = self.hybrid.tags(self.tag or "")
            block_state(scheduler_output, [s for s, _, _ in steps])
        # Every load of the step first (a request planned before one whose load fills
        # a block it shares would not see that block pending).
        for state, _, _ in steps:
            self._open_load(state, meta)
        renewing: dict[str, set[int]] = {}
        renewed: set[int] = set()
        for state, before, after in steps:
            mine, done = self.loads.recompute(state.block_ids, before, after, self.block_size)
            renewing[state.rid], renewed = mine, renewed | done
        for state, before, after in steps:
            self._plan(state, before, after, renewing[state.rid], meta)
        self.loads.clean(renewed)
        for rid, state in list(self._finishing.items()):
            if not state.waiting_on:
                del self._finishing[rid]
                done = _done_tokens(state.request)
                self._check_poisoned(state, done, set())
                if not state.no_save and state.tag == self.tag:
                    self._save(state, done, meta)
                meta.finished.append(rid)
        return meta

    def _open_load(self, state: TrackedRequest, meta: FabricStepMeta) -> None:
        """The request's synchronous load, if it has one this step."""
        state.scheduled = True
        if state.load is None:
            return
        start, end = state.load
        state.load = None
        end = min(end, len(state.block_ids))
        if end > start:
            meta.loads.append(self._new_load(state, start, end, state.block_ids, sync=True))

    def _plan(
        self, state: TrackedRequest, before: int, after: int, renewing: set[int],
        meta: FabricStepMeta,
    ) -> None:  # fmt: skip
        """Store the whole pages of real tokens whose KV is computed once this step
        is — unless the request's blocks depend on a load whose outcome is not
        known yet, or it uses a block a failed load left stale (it never stores)."""
        if state.first_computed is None:
            state.first_computed = before
        state.waiting_on |= self.loads.depend(state.rid, state.block_ids)
        self._check_poisoned(state, before, renewing)
        if state.waiting_on or state.no_save or state.tag != self.tag:
            return
        self._save(state, after, meta)

    def _save(self, state: TrackedRequest, computed: int, meta: FabricStepMeta) -> None:
        """Store the request's whole pages of real tokens below ``computed`` that the
        fabric does not have yet."""
        start = max(state.saved_pages, state.fabric_pages or 0)
        end = min(computed, state.request.num_tokens) // self.block_size
        end = min(end, len(state.block_ids))
        if end <= start:
            return
        state.hashes_to(end, self.block_size)
        assert self.tag is not None and len(state.hashes) >= end
        self.link.names.learn(state.request, state.hashes, start, end, self.block_size)
        parent = state.hashes[start - 1] if start else None
        run = StoredRun(state.namespace, parent, tuple(state.hashes[start:end]))
        meta.saves.append(PageSave(self.tag, run, tuple(state.block_ids[start:end]), self.primary))
        state.saved_pages = end
        self.stores.add(run.hashes)
        if self.hybrid is not None:
            meta.saves += self.hybrid.saves(state, end, self.tag)

    # -- update_connector_output, request_finished -----------------------------------

    def pending_writes(self) -> bool:
        """Whether stores, finished requests' pages or the fabric's orders wait."""
        return self.stores.pending() or bool(self._finishing) or self.link.busy

    def worker_output(self, worker_meta: Any) -> None:
        """A step's outcome: loads ended, stores ended, pages stored and not loaded."""
        if isinstance(worker_meta, FabricWorkerMeta):
            self._worker_output(worker_meta)
        self.link.release(self.tag or "", self.world, self.leases.take_ended())  # (none: none)

    def _worker_output(self, worker_meta: FabricWorkerMeta) -> None:
        self.link.orders_done(worker_meta.orders_done)
        if worker_meta.ended:
            self.stores.ended(h for _, h in worker_meta.ended)
        for rank, load_id, pages in worker_meta.loaded:
            record = self.loads.report(rank, load_id, pages)
            if record is not None:
                self._resolve(record)
        self.link.report_stored(self.world, worker_meta.stored)
        failed: dict[str, set[bytes]] = {}
        for tag, _, page_hash in worker_meta.failed:
            failed.setdefault(tag, set()).add(page_hash)
        for tag, hashes in failed.items():
            log.warning("kvfabric connector: %d pages failed to load; recomputed", len(hashes))
            self.link.forget(tag, self.world, sorted(hashes))
            self.l3.mark_failed(tag, sorted(hashes))  # not found in L3 again until stored anew

    def finished(
        self, request: Any, block_ids: list[int], tables: tuple[list[int], ...] | None = None
    ) -> bool:
        """vLLM is done with ``request``; whether its blocks must wait (vLLM's delayed
        free): while an asynchronous load still writes them, or while its last
        whole pages are still to be stored."""
        rid = request.request_id
        self._unserved.discard(rid)
        self._questions.pop(rid, None)
        state = self.tracked.pop(rid, None)
        if state is None:
            self.leases.end([rid])
            return False
        if tables is not None:  # a hybrid engine's, as vLLM frees them
            state.tables, state.offloads = tables, []
        ask_holds(state, _done_tokens(request), self.block_size, self.link, self.world)
        if state.async_loading:
            return True  # freed once the load is reported done (finished_recving)
        self.leases.end([rid])
        if state.waiting_on:  # its blocks are poisoned if the load fails: kept till then
            state.block_ids = list(block_ids)
            self._finishing[rid] = state
            return True
        done = _done_tokens(request)
        self._check_poisoned(state, done, set())
        if state.no_save or state.tag != self.tag:
            return False
        end = min(done, request.num_tokens) // self.block_size
        if min(end, len(block_ids)) <= max(state.saved_pages, state.fabric_pages or 0):
            return False
        state.block_ids = list(block_ids)
        self._finishing[rid] = state
        return True


def _done_tokens(request: Any) -> int:
    """Tokens whose KV the steps vLLM has taken the output of computed."""
    return request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
