"""The scheduler side of ``KvFabricConnector``: a driver of the coordinator inside
vLLM's engine-core process.

Per step:

1. ``new_request`` (vLLM's ``on_new_request``) queues a request's lookup; the
   step's first ``matched`` (``get_num_new_matched_tokens``) sends every queued
   lookup in one coordinator call (split past the coordinator's bound) and
   takes the answers — one call per step for every request added since the
   last. A hit is the leading pages every rank of the engine stored (the
   coordinator's MIN), less what vLLM's own prefix cache holds; the last token
   is computed. A request whose tokens have pages this engine is still storing
   waits (``None``: vLLM asks again next step) until the workers report those
   stores ended, so it loads them rather than computing them again. A request
   that resumes after a preemption asks again, over its output tokens too.
2. ``allocated``: the blocks vLLM gave a hit are the load's destination.
3. ``step_meta`` (``build_connector_meta``): what each worker loads before the
   forward, and which whole pages of real tokens it stores after it.
4. ``worker_output`` (``update_connector_output``): each rank reports how many
   pages of each load it loaded, which stores ended and what it stored; the
   stored pages go to the coordinator, which makes a page visible once every
   rank stored its shard; pages a rank failed to load are forgotten.

**No page computed over a failed load is stored.** A load's outcome is known
only once every rank reported it, a step or more after the forward that used
its blocks. Until then, every request whose blocks include a block of that load
(the loading request, and any other that shares the block through vLLM's prefix
cache) stores nothing; its pages are stored once the outcome is known good. A
load that failed on any rank leaves the request's save cursor where vLLM rolls
the request back (the first page that failed), so the pages vLLM recomputes are
stored then. A request that finishes while pages of it wait keeps its blocks
(vLLM's delayed free) until they are stored or known bad.

The coordinator's index lives in its memory; L3 outlives it. Where its answer
stops short, the pages that follow count as well while every rank's shard of
them is in L3 (the same MIN, taken over the store's keys), and the coordinator
is told of them: a restarted coordinator, or an engine that died before its
report arrived, loses no page. While the fabric is down the store alone answers.
No step waits on the fabric or the store longer than ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, namespace_seed, pack_tokens
from fabric.coordinator.engine_pages import MAX_LEASES, MAX_PAGES_PER_CALL, StoredRun
from fabric.engines.fabric_link import FabricLink
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.engines.vllm_pages import (
    ConnectorOptions,
    FabricHandshake,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    PageSave,
    engine_tag,
    lora_identity,
    request_namespace,
)
from fabric.l3.format import page_key

log = logging.getLogger(__name__)

# Stores the workers were asked for and have not reported ended keep the engine
# stepping (so their report arrives); past this long without one ending, the
# engine is let go quiet (a worker that will never report).
WRITE_STALL_S = 60.0


@dataclass
class _Tracked:
    """What the connector knows of a request it serves."""

    request: Any
    namespace: str
    seed: bytes
    tag: str  # the engine's tag when the request came: it stores only while it holds
    hashes: list[bytes] = field(default_factory=list)  # whole pages of real tokens
    fabric_pages: int | None = None  # the fabric's answer: leading pages loadable
    asked_tag: str = ""  # the tag the answer is under
    load: tuple[int, int] | None = None  # pages [start, end) to load when scheduled
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0  # pages below this are in the fabric or being stored
    waiting_on: set[int] = field(default_factory=set)  # loads its blocks depend on
    scheduled: bool = False  # in a step since its last lookup (a later lookup: resumed)
    no_save: bool = False  # its KV cannot be vouched for (a load never reported)
    async_loading: bool = False  # an asynchronous load is writing its blocks


@dataclass
class _Load:
    """A load the workers run, until every rank reported its outcome."""

    req_id: str
    start: int  # the request's first page it loads
    pages: int
    block_ids: tuple[int, ...]
    synchronous: bool
    since: float
    reports: dict[int, int] = field(default_factory=dict)  # rank -> pages loaded
    waiters: set[str] = field(default_factory=set)  # requests that wait on its outcome


class SchedulerSide:
    def __init__(
        self,
        options: ConnectorOptions,
        suffixes: list[str],
        block_size: int,
        link: FabricLink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.suffixes = suffixes  # every rank's key suffix, by rank
        self.world = len(suffixes)
        self.block_size = block_size
        self.link = link
        self.clock = clock
        # The engine's page tag: known once every worker has said what its pages are
        # (``handshake``); until then nothing is looked up or stored.
        self.tag: str | None = None
        self._ranks: list[str] = []
        self._epoch = ""
        self._store: PageStore | None = None
        self._store_checks: ThreadPoolExecutor | None = None
        self._store_busy: Future | None = None
        self.tracked: dict[str, _Tracked] = {}
        self._questions: list[str] = []
        self._store_sent = False
        self._async_loads: list[PageLoad] = []
        # Loads whose outcome not every rank has reported, and the blocks of the
        # synchronous ones (a request using one stores nothing until it is known).
        self._loads: dict[int, _Load] = {}
        self._next_load = 0
        self._sync_blocks: dict[int, int] = {}
        # Finished requests whose blocks vLLM keeps until their last pages are
        # stored (or known bad), and those the next step releases.
        self._finishing: dict[str, _Tracked] = {}
        # Pages the workers were asked to store: how many ranks have not reported
        # the store ended. A request whose tokens have one waits for it.
        self._writing: dict[bytes, int] = {}
        self._write_progress = 0.0
        # Leases on the pages a lookup matched, by request, until they are loaded:
        # named for this engine; released as soon as the load's outcome is known.
        self._engine = os.urandom(6).hex()
        self._leased: set[str] = set()
        self._release: list[str] = []
        self._loras: dict[tuple, str] = {}

    # -- the engine's identity ----------------------------------------------------------

    def handshake(self, ranks: dict[int, FabricHandshake]) -> None:
        """Every worker's identity (vLLM's connector handshake): the engine's tag is
        named from all of them. A worker that cannot serve, or one missing, keeps
        the engine off the fabric (logged): its prompts are computed."""
        digests = [ranks[r].identity if r in ranks else "" for r in range(self.world)]
        if not all(digests):
            missing = [r for r, d in enumerate(digests) if not d]
            log.error(
                "kvfabric connector: ranks %s cannot serve their KV cache (or did not say); "
                "this engine computes every prompt",
                missing,
            )
            self.tag = None
            return
        self._ranks = digests
        self.tag = engine_tag(digests, self._epoch)
        log.info("kvfabric connector: this engine's pages are tagged %s", self.tag)

    def reset(self) -> bool:
        """vLLM's ``reset_cache`` (after a weight update, say): a new epoch, so that
        no page this engine stored before is served to it after; requests it
        serves now store nothing more (their KV may be the old weights')."""
        self._epoch = os.urandom(16).hex()
        for state in self.tracked.values():
            state.no_save = True
        if self._ranks:
            self.tag = engine_tag(self._ranks, self._epoch)
            log.info("kvfabric connector: cache reset; this engine's pages are now %s", self.tag)
        return True

    # -- on_new_request, get_num_new_matched_tokens ----------------------------------

    def new_request(self, request: Any) -> None:
        """vLLM added ``request``: its lookup joins the next step's one call."""
        if self.tag is None or _unkeyed(request):
            return  # (images, prompt embeddings: token ids would not name their KV)
        state = self.tracked[request.request_id] = self._track(request)
        self._question(state)

    def _question(self, state: _Tracked) -> None:
        state.fabric_pages = None
        state.scheduled = False
        if getattr(state.request, "skip_reading_prefix_cache", False) or self._whole(state) <= 0:
            state.fabric_pages = 0
        else:
            self._questions.append(state.request.request_id)

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
        if state is None:  # added before the connector saw it, or not keyed by tokens
            if _unkeyed(request):
                return 0
            self.new_request(request)
            state = self.tracked[request.request_id]
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

    def _whole(self, state: _Tracked) -> int:
        """Pages of the request's tokens so far a load may cover: whole, the last
        token computed."""
        return max((state.request.num_tokens - 1) // self.block_size, 0)

    def _track(self, request: Any) -> _Tracked:
        lora = None
        if request.lora_request:
            lora = self._lora(request.lora_request)
        namespace = request_namespace(self.options.namespace, request.cache_salt, lora)
        assert self.tag is not None
        return _Tracked(request, namespace, namespace_seed(namespace), self.tag)

    def _lora(self, lora_request: Any) -> str:
        """The adapter's identity, remembered while none of its files changed."""
        path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", "")
        try:
            key: tuple = (path, *sorted(
                (e.name, e.stat().st_ino, e.stat().st_size, e.stat().st_mtime_ns,
                 e.stat().st_ctime_ns)
                for e in os.scandir(path)
            ))  # fmt: skip
        except OSError:
            key = (path, lora_request.lora_name, os.urandom(8))  # not remembered
        if key not in self._loras:
            if len(self._loras) > 1024:
                self._loras.clear()
            self._loras[key] = lora_identity(lora_request)
        return self._loras[key]

    def _hashes_to(self, state: _Tracked, pages: int) -> None:
        """Extend ``state.hashes`` to ``pages`` pages of the request's real tokens (a
        page not yet whole, or not yet known — async scheduling's placeholders,
        draft tokens — is never hashed)."""
        pages = min(pages, state.request.num_tokens // self.block_size)
        have = len(state.hashes)
        if pages <= have:
            return
        tokens = state.request.all_token_ids[have * self.block_size : pages * self.block_size]
        prev = state.hashes[-1] if state.hashes else state.seed
        state.hashes += chain_hashes(prev, pack_tokens(tokens), self.block_size * TOKEN_BYTES)

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
            whole = min(self._whole(state), MAX_PAGES_PER_CALL)
            self._hashes_to(state, whole)
            if self._writing and any(h in self._writing for h in state.hashes[:whole]):
                waiting.append(rid)  # asked once this engine has stored those pages
                continue
            states.append(state)
            chains.append(state.hashes[:whole])
        self._questions = waiting
        answers = None
        assert self.tag is not None
        if chains:
            leases = [f"{self._engine}/{s.request.request_id}" for s in states]
            release, self._release = self._release, []
            answers = self.link.lookup(
                self.tag, self.world, chains, leases, self.options.lease_s, release, deadline
            )
            if answers is not None and self.options.lease_s > 0:
                self._leased.update(
                    s.request.request_id for s, hit in zip(states, answers, strict=True) if hit
                )
        extended = self._in_store(states, answers, deadline)
        for state, hit in zip(states, extended, strict=True):
            state.fabric_pages = hit
            state.asked_tag = self.tag

    def _in_store(
        self, states: list[_Tracked], answers: list[int] | None, deadline: float
    ) -> list[int]:
        """Each answer extended over the pages after it that every rank's shard of is
        in L3 (reported to the coordinator when it answered). The store is asked on
        a thread of its own, waited for until ``deadline``: a wedged store costs
        hits, never a stalled step."""
        hits = list(answers) if answers is not None else [0] * len(states)
        store = self._open_store()
        todo = [
            (i, s) for i, s in enumerate(states) if store is not None and hits[i] < self._whole(s)
        ]
        if not todo:
            return hits
        assert store is not None and self.tag is not None
        if self._store_busy is not None and not self._store_busy.done():
            return hits  # the last check has not come back: the store is not asked now
        if self._store_checks is None:
            self._store_checks = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-l3-check")
        tag, suffixes = self.tag, self.suffixes
        jobs = [(i, s.hashes[hits[i] : self._whole(s)]) for i, s in todo]

        def found() -> list[int]:
            out = []
            for _, hashes in jobs:
                n = len(hashes)
                for suffix in suffixes:
                    present = store.present([page_key(h, tag, suffix) for h in hashes[:n]])
                    n = present.index(False) if False in present else n
                    if not n:
                        break
                out.append(n)
            return out

        self._store_busy = self._store_checks.submit(found)
        try:
            counts = self._store_busy.result(timeout=max(deadline - self.clock(), 0.0))
        except FutureTimeout:
            log.warning(
                "kvfabric connector: L3 did not answer within %.1f s; served without it",
                self.options.timeout_s,
            )
            return hits
        except Exception as exc:
            log.warning("kvfabric connector: L3 lookup failed: %s", exc)
            return hits
        reports: dict[int, list[StoredRun]] = {r: [] for r in range(self.world)}
        for (i, hashes), n in zip(jobs, counts, strict=True):
            if not n:
                continue
            state, hit = states[i], hits[i]
            if answers is not None:
                parent = state.hashes[hit - 1] if hit else None
                run = StoredRun(state.namespace, parent, tuple(hashes[:n]))
                for r in range(self.world):
                    reports[r].append(run)
            hits[i] = hit + n
        if any(reports.values()):
            self.link.report(self.tag, self.world, reports)
        return hits

    def _open_store(self) -> PageStore | None:
        """The L3 the workers use, opened here to see which pages it holds."""
        if self._store is None:
            options = self.link.store
            if self.options.path:
                options = StoreOptions(path=self.options.path)
            if options is not None:
                try:
                    self._store = open_store(options, "vllm")
                except Exception as exc:
                    log.warning(
                        "kvfabric connector: L3 at %r cannot be opened: %s", options.path, exc
                    )
                    self.link.store = None
        return self._store

    def close(self) -> None:
        if self._store_checks is not None:
            self._store_checks.shutdown(wait=False, cancel_futures=True)
            self._store_checks = None
        if self._store is not None and (self._store_busy is None or self._store_busy.done()):
            self._store.close()
        self._store = None
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
            self._end_leases([request.request_id])
            return
        state.load = (start, end)
        if self.options.load_async:
            state.load = None
            block_ids = blocks.get_block_ids()[0]
            end = min(end, len(block_ids))
            self._async_loads.append(self._new_load(state, start, end, block_ids, sync=False))
            state.async_loading = True

    def _new_load(
        self, state: _Tracked, start: int, end: int, block_ids: Any, sync: bool
    ) -> PageLoad:
        load_id, self._next_load = self._next_load, self._next_load + 1
        blocks = tuple(block_ids[start:end])
        rid = state.request.request_id
        record = _Load(rid, start, end - start, blocks, sync, self.clock())
        self._loads[load_id] = record
        if sync:
            for block in blocks:
                self._sync_blocks[block] = load_id
        return PageLoad(load_id, rid, state.asked_tag, tuple(state.hashes[start:end]), blocks,
                        asynchronous=not sync)  # fmt: skip

    # -- build_connector_meta ---------------------------------------------------------

    def step_meta(self, scheduler_output: Any) -> FabricStepMeta:
        meta = FabricStepMeta(loads=self._async_loads)
        self._async_loads = []
        if not self._store_sent and self.link.store is not None:
            meta.store = self.link.store
            self._store_sent = True
        self._abandon_stalled_loads()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.tracked.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                self._plan(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.tracked.get(rid)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids += new_blocks[0]
            self._plan(state, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        for rid, state in list(self._finishing.items()):
            if not state.waiting_on:
                del self._finishing[rid]
                done = state.request.num_computed_tokens - getattr(
                    state.request, "num_in_flight_tokens", 0
                )
                if not state.no_save and state.tag == self.tag:
                    self._save(state, done, meta)
                meta.finished.append(rid)
        return meta

    def _plan(self, state: _Tracked, computed_after: int, meta: FabricStepMeta) -> None:
        """Add the request's load (if any) and the whole pages of real tokens whose
        KV is computed once this step is — unless the request's blocks depend on a
        load whose outcome is not known yet."""
        state.scheduled = True
        if state.load is not None:
            start, end = state.load
            state.load = None
            end = min(end, len(state.block_ids))
            if end > start:
                load = self._new_load(state, start, end, state.block_ids, sync=True)
                meta.loads.append(load)
        if self._sync_blocks:
            for block in state.block_ids:
                load_id = self._sync_blocks.get(block)
                if load_id is not None and load_id not in state.waiting_on:
                    state.waiting_on.add(load_id)
                    self._loads[load_id].waiters.add(state.request.request_id)
        if state.waiting_on or state.no_save or state.tag != self.tag:
            return
        self._save(state, computed_after, meta)

    def _save(self, state: _Tracked, computed: int, meta: FabricStepMeta) -> None:
        """Store the request's whole pages of real tokens below ``computed`` that the
        fabric does not have yet."""
        start = max(state.saved_pages, state.fabric_pages or 0)
        end = min(computed, state.request.num_tokens) // self.block_size
        end = min(end, len(state.block_ids))
        if end <= start:
            return
        self._hashes_to(state, end)
        assert self.tag is not None and len(state.hashes) >= end
        parent = state.hashes[start - 1] if start else None
        run = StoredRun(state.namespace, parent, tuple(state.hashes[start:end]))
        meta.saves.append(PageSave(self.tag, run, tuple(state.block_ids[start:end])))
        state.saved_pages = end
        if not self._writing:
            self._write_progress = self.clock()
        for page_hash in run.hashes:
            self._writing[page_hash] = self._writing.get(page_hash, 0) + self.world

    # -- update_connector_output, request_finished -----------------------------------

    def pending_writes(self) -> bool:
        """Whether stores the workers were asked for have not all been reported
        ended, or finished requests' last pages wait: vLLM keeps stepping while so
        (``has_pending_push_work``)."""
        if self._writing and self.clock() - self._write_progress > WRITE_STALL_S:
            log.warning(
                "kvfabric connector: %d page stores not reported in %.0f s; not waiting for them",
                len(self._writing),
                WRITE_STALL_S,
            )
            self._writing.clear()
        return bool(self._writing) or bool(self._finishing)

    def worker_output(self, worker_meta: Any) -> None:
        """A step's outcome: the loads the ranks ended and how far each got, the
        stores they ended, the pages they stored and could not load."""
        if isinstance(worker_meta, FabricWorkerMeta):
            self._worker_output(worker_meta)
        if self._release:
            release, self._release = self._release, []
            self.link.release(self.tag or "", self.world, release)

    def _worker_output(self, worker_meta: FabricWorkerMeta) -> None:
        if worker_meta.ended:
            self._write_progress = self.clock()
        for _, page_hash in worker_meta.ended:
            left = self._writing.get(page_hash, 0) - 1
            if left > 0:
                self._writing[page_hash] = left
            else:
                self._writing.pop(page_hash, None)
        for rank, load_id, pages in worker_meta.loaded:
            record = self._loads.get(load_id)
            if record is None:
                continue
            record.reports[rank] = min(pages, record.reports.get(rank, pages))
            if len(record.reports) == self.world:
                self._resolve(load_id)
        by_tag: dict[str, dict[int, list[StoredRun]]] = {}
        for tag, rank, run in worker_meta.stored:
            by_tag.setdefault(tag, {}).setdefault(rank, []).append(run)
        for tag, reports in by_tag.items():
            self.link.report(tag, self.world, reports)
        failed: dict[str, set[bytes]] = {}
        for tag, _, page_hash in worker_meta.failed:
            failed.setdefault(tag, set()).add(page_hash)
        for tag, hashes in failed.items():
            log.warning(
                "kvfabric connector: %d pages failed to load on some rank; vLLM recomputes them",
                len(hashes),
            )
            self.link.forget(tag, self.world, sorted(hashes))
            if self._store is not None:  # and not found in L3 again until stored anew
                self._store.mark_failed(
                    [page_key(h, tag, suffix) for h in hashes for suffix in self.suffixes]
                )

    def _resolve(self, load_id: int, abandoned: bool = False) -> None:
        """Every rank reported the load (or it was given up on): where it failed, the
        request's save cursor goes back to vLLM's rollback (its first page that
        failed); the requests that waited for it store again."""
        record = self._loads.pop(load_id)
        for block in record.block_ids:
            if self._sync_blocks.get(block) == load_id:
                del self._sync_blocks[block]
        loaded = min(record.reports.values(), default=0)
        failed = loaded < record.pages
        state = self.tracked.get(record.req_id) or self._finishing.get(record.req_id)
        if state is not None:
            state.async_loading = False
            if failed:
                bad = record.start + loaded
                state.fabric_pages = min(state.fabric_pages or 0, bad)
                state.saved_pages = min(state.saved_pages, bad)
        for rid in record.waiters | {record.req_id}:
            waiter = self.tracked.get(rid) or self._finishing.get(rid)
            if waiter is not None:
                waiter.waiting_on.discard(load_id)
                # A finished request is not rolled back by vLLM: over a failed load,
                # what it computed is never stored.
                waiter.no_save |= abandoned or (failed and rid in self._finishing)
        self._end_leases([record.req_id])

    def _abandon_stalled_loads(self) -> None:
        """Loads not every rank reported within ``WRITE_STALL_S`` (a worker that will
        never say): the requests that depend on them never store."""
        now = self.clock()
        stalled = [i for i, r in self._loads.items() if now - r.since > WRITE_STALL_S]
        for load_id in stalled:
            log.warning(
                "kvfabric connector: load %d was not reported by every rank in %.0f s; "
                "the requests that use its blocks store nothing",
                load_id,
                WRITE_STALL_S,
            )
            record = self._loads[load_id]
            state = self.tracked.get(record.req_id) or self._finishing.get(record.req_id)
            if state is not None:
                state.no_save = True
            self._resolve(load_id, abandoned=True)

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """vLLM is done with ``request``; whether its blocks must wait (vLLM's delayed
        free): while an asynchronous load still writes them, or while its last
        whole pages are still to be stored."""
        rid = request.request_id
        self._questions = [q for q in self._questions if q != rid]
        state = self.tracked.pop(rid, None)
        if state is None:
            self._end_leases([rid])
            return False
        if state.async_loading:
            return True  # freed once the load is reported done (finished_recving)
        self._end_leases([rid])
        if state.no_save or state.tag != self.tag:
            return False
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        end = min(done, request.num_tokens) // self.block_size
        if min(end, len(block_ids)) <= max(state.saved_pages, state.fabric_pages or 0):
            return False
        state.block_ids = list(block_ids)
        self._finishing[rid] = state
        return True

    def _end_leases(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._leased:
                self._leased.discard(rid)
                self._release.append(f"{self._engine}/{rid}")
        if len(self._release) > MAX_LEASES:  # a fabric away for long: they expire there
            del self._release[: len(self._release) - MAX_LEASES]


def _unkeyed(request: Any) -> bool:
    """Whether a request's KV is not named by its token ids: images and other
    multimodal inputs, prompt embeddings (whose token ids are placeholders)."""
    return bool(getattr(request, "mm_features", None)) or (
        getattr(request, "prompt_embeds", None) is not None
    )
