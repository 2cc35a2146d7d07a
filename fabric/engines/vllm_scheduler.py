"""The scheduler side of ``KvFabricConnector``: a driver of the coordinator inside
vLLM's engine-core process.

Per step:

1. ``new_request`` (vLLM's ``on_new_request``) queues a request's lookup; the
   step's first ``matched`` (``get_num_new_matched_tokens``) sends every queued
   lookup in one coordinator call and takes the answers — one call per step for
   every request added since the last, and no step lost waiting. A hit is the
   leading pages every rank of the engine stored (the coordinator's MIN), less
   what vLLM's own prefix cache holds; the prompt's last token is computed. A
   request whose prompt has pages this engine is still storing waits (``None``:
   vLLM asks again next step) until the workers report those stores ended, so it
   loads them rather than computing them again.
2. ``allocated``: the blocks vLLM gave a hit are the load's destination.
3. ``step_meta`` (``build_connector_meta``): what each worker loads before the
   forward, and what it stores after it — every block of a request that this
   step completes and that the fabric does not have whole already.
4. ``worker_output`` (``update_connector_output``): the ranks' reports of what
   they stored go to the coordinator, which makes a page visible once every
   rank stored its shard; pages a rank failed to load are forgotten.

The coordinator's index lives in its memory; L3 outlives it. Where its answer
stops short, the pages that follow count as well while every rank's shard of
them is in L3 (the same MIN, taken over the store's keys), and the coordinator
is told of them: a restarted coordinator, or an engine that died before its
report arrived, loses no page. While the fabric is down the store alone answers.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from fabric.cache.keys import TOKEN_BYTES, chain_hashes, namespace_seed, pack_tokens
from fabric.coordinator.engine_pages import MAX_CHAINS_PER_CALL, MAX_LEASES, StoredRun
from fabric.engines.fabric_link import FabricLink
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.engines.vllm_pages import (
    ConnectorOptions,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    PageSave,
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
    hashes: list[bytes] = field(default_factory=list)
    fabric_pages: int | None = None  # the fabric's answer: leading pages whole there
    load: tuple[int, int] | None = None  # pages [start, end) to load this step
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0  # pages below this are in the fabric or being stored


class SchedulerSide:
    def __init__(
        self,
        options: ConnectorOptions,
        tag: str,
        suffixes: list[str],
        block_size: int,
        link: FabricLink,
    ) -> None:
        self.options = options
        self.tag = tag
        self.suffixes = suffixes  # every rank's key suffix, by rank
        self.world = len(suffixes)
        self.block_size = block_size
        self.link = link
        self._store: PageStore | None = None
        self.tracked: dict[str, _Tracked] = {}
        self._questions: list[str] = []
        self._store_sent = False
        self._async_loads: list[PageLoad] = []
        # Pages the workers were asked to store: how many ranks have not reported
        # the store ended. A request whose prompt has one waits for it.
        self._writing: dict[bytes, int] = {}
        self._write_progress = 0.0
        # Leases on the pages a lookup matched, by request, until they are loaded:
        # named for this engine; their release goes with the next lookup call.
        self._engine = os.urandom(6).hex()
        self._leased: set[str] = set()
        self._loading_now: list[str] = []  # requests whose loads this step runs
        self._release: list[str] = []

    # -- on_new_request, get_num_new_matched_tokens ----------------------------------

    def new_request(self, request: Any) -> None:
        """vLLM added ``request``: its lookup joins the next step's one call."""
        if getattr(request, "mm_features", None):
            return  # the pages' tokens would not name their KV (images)
        state = self.tracked[request.request_id] = self._track(request)
        if self._whole(state) > 0:
            self._questions.append(request.request_id)
        else:
            state.fabric_pages = 0

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` the workers can load for ``request``
        (``None``: ask again next step — this engine is still storing pages of its
        prompt), and whether they load them asynchronously."""
        tokens = self._matched(request, num_computed_tokens)
        return tokens, bool(tokens) and self.options.load_async

    def _matched(self, request: Any, num_computed_tokens: int) -> int | None:
        state = self.tracked.get(request.request_id)
        if state is None:  # added before the connector saw it, or multimodal
            if getattr(request, "mm_features", None):
                return 0
            self.new_request(request)
            state = self.tracked[request.request_id]
        if state.fabric_pages is None:
            self._ask()
        if state.fabric_pages is None:
            return None
        hit_tokens = (state.fabric_pages or 0) * self.block_size
        state.load = None
        if hit_tokens <= num_computed_tokens:
            return 0
        state.load = (num_computed_tokens // self.block_size, state.fabric_pages or 0)
        return hit_tokens - num_computed_tokens

    def _whole(self, state: _Tracked) -> int:
        """Pages of the prompt a load may cover: whole, the last token computed."""
        return max((len(state.request.prompt_token_ids or ()) - 1) // self.block_size, 0)

    def _track(self, request: Any) -> _Tracked:
        lora = request.lora_request.lora_name if request.lora_request else None
        namespace = request_namespace(self.options.namespace, request.cache_salt, lora)
        return _Tracked(request, namespace, namespace_seed(namespace))

    def _hashes_to(self, state: _Tracked, pages: int) -> None:
        """Extend ``state.hashes`` to ``pages`` pages of the request's tokens so far."""
        have = len(state.hashes)
        if pages <= have:
            return
        tokens = state.request.all_token_ids[have * self.block_size : pages * self.block_size]
        prev = state.hashes[-1] if state.hashes else state.seed
        state.hashes += chain_hashes(prev, pack_tokens(tokens), self.block_size * TOKEN_BYTES)

    def _ask(self) -> None:
        """Ask the fabric about every request waiting for an answer, in one call,
        and take its answers (at most ``timeout_s``: a fabric that does not answer
        is down, and the store alone answers)."""
        states, waiting, chains = [], [], []
        self.pending_writes()  # (gives up on stores that stalled)
        for rid in self._questions:
            state = self.tracked.get(rid)
            if state is None:
                continue
            whole = self._whole(state)
            self._hashes_to(state, whole)
            if any(h in self._writing for h in state.hashes[:whole]):
                waiting.append(rid)  # asked once this engine has stored those pages
                continue
            states.append(state)
            chains.append(state.hashes[:whole])
        self._questions = waiting
        answers = None
        if chains and self.link.up:
            leases = [f"{self._engine}/{s.request.request_id}" for s in states]
            cut = MAX_CHAINS_PER_CALL
            release, self._release = self._release[:cut], self._release[cut:]
            answers = self.link.answer(
                self.link.ask(self.tag, self.world, chains, leases, self.options.lease_s, release)
            )
            if answers is not None and self.options.lease_s > 0:
                self._leased.update(
                    s.request.request_id for s, hit in zip(states, answers, strict=False) if hit
                )
        for i, state in enumerate(states):
            hit = answers[i] if answers is not None and i < len(answers) else 0
            report = answers is not None
            state.fabric_pages = self._in_store(state, hit, self._whole(state), report=report)

    def _in_store(self, state: _Tracked, hit: int, upto: int, report: bool) -> int:
        """``hit`` extended over the pages after it that every rank's shard of is in
        L3; those are reported to the coordinator when ``report``."""
        store = self._open_store()
        if store is None or hit >= upto:
            return hit
        hashes = state.hashes[hit:upto]
        found = len(hashes)
        for suffix in self.suffixes:
            present = store.present([page_key(h, self.tag, suffix) for h in hashes[:found]])
            found = present.index(False) if False in present else found
            if not found:
                return hit
        if report:
            parent = state.hashes[hit - 1] if hit else None
            run = StoredRun(state.namespace, parent, tuple(hashes[:found]))
            self.link.report(self.tag, self.world, {r: [run] for r in range(self.world)})
        return hit + found

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
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- update_state_after_alloc -----------------------------------------------------

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM gave the request its blocks. An asynchronous load starts with the
        next step's metadata (the request is not scheduled until it is done)."""
        state = self.tracked.get(request.request_id)
        if state is None or state.load is None:
            return
        if num_external_tokens == 0:
            state.load = None
        elif self.options.load_async:
            start, end = state.load
            state.load = None
            block_ids = blocks.get_block_ids()[0]
            end = min(end, len(block_ids))
            self._async_loads.append(
                PageLoad(
                    state.request.request_id,
                    tuple(state.hashes[start:end]),
                    tuple(block_ids[start:end]),
                    asynchronous=True,
                )
            )

    # -- build_connector_meta ---------------------------------------------------------

    def step_meta(self, scheduler_output: Any) -> FabricStepMeta:
        meta = FabricStepMeta(loads=self._async_loads)
        self._async_loads = []
        if not self._store_sent and self.link.store is not None:
            meta.store = self.link.store
            self._store_sent = True
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
        return meta

    def _plan(self, state: _Tracked, computed_after: int, meta: FabricStepMeta) -> None:
        """Add the request's load (if any) and the pages this step completes."""
        rid = state.request.request_id
        if state.load is not None:
            start, end = state.load
            state.load = None
            end = min(end, len(state.block_ids))
            if end > start:
                meta.loads.append(
                    PageLoad(rid, tuple(state.hashes[start:end]), tuple(state.block_ids[start:end]))
                )
                self._loading_now.append(rid)
        start = max(state.saved_pages, state.fabric_pages or 0)
        end = min(computed_after // self.block_size, len(state.block_ids))
        if end <= start:
            return
        self._hashes_to(state, end)
        parent = state.hashes[start - 1] if start else None
        run = StoredRun(state.namespace, parent, tuple(state.hashes[start:end]))
        meta.saves.append(PageSave(run, tuple(state.block_ids[start:end])))
        state.saved_pages = end
        if not self._writing:
            self._write_progress = time.monotonic()
        for page_hash in run.hashes:
            self._writing[page_hash] = self._writing.get(page_hash, 0) + self.world

    # -- update_connector_output, request_finished -----------------------------------

    def pending_writes(self) -> bool:
        """Whether stores the workers were asked for have not all been reported
        ended: vLLM keeps stepping while so (``has_pending_push_work``)."""
        if self._writing and time.monotonic() - self._write_progress > WRITE_STALL_S:
            log.warning(
                "kvfabric connector: %d page stores not reported in %.0f s; not waiting for them",
                len(self._writing),
                WRITE_STALL_S,
            )
            self._writing.clear()
        return bool(self._writing)

    def worker_output(self, worker_meta: Any, finished_loading: set[str] | None = None) -> None:
        """A step's outcome: the stores the workers ended, the pages they stored and
        could not load; the requests whose loads are done (the step's own, and
        ``finished_loading``, asynchronous ones) release their leases."""
        done, self._loading_now = self._loading_now, []
        self._end_leases([*done, *(finished_loading or ())])
        if not isinstance(worker_meta, FabricWorkerMeta):
            return
        for hashes in worker_meta.ended.values():
            self._write_progress = time.monotonic()
            for page_hash in hashes:
                left = self._writing.get(page_hash, 0) - 1
                if left > 0:
                    self._writing[page_hash] = left
                else:
                    self._writing.pop(page_hash, None)
        self.link.report(self.tag, self.world, worker_meta.stored)
        failed = sorted({h for hashes in worker_meta.failed.values() for h in hashes})
        if failed:
            log.warning(
                "kvfabric connector: %d pages failed to load on some rank; vLLM recomputes them",
                len(failed),
            )
            self.link.forget(self.tag, self.world, failed)
            if self._store is not None:  # and not found in L3 again until stored anew
                self._store.mark_failed(
                    [page_key(h, self.tag, suffix) for h in failed for suffix in self.suffixes]
                )

    def finished(self, request: Any) -> None:
        self.tracked.pop(request.request_id, None)
        self._end_leases([request.request_id])

    def _end_leases(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if rid in self._leased:
                self._leased.discard(rid)
                self._release.append(f"{self._engine}/{rid}")
        if len(self._release) > MAX_LEASES:  # a fabric away for long: they expire there
            del self._release[: len(self._release) - MAX_LEASES]
