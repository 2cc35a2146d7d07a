"""A hybrid engine's pages through the connector (``vllm_groups`` has the model):
the scheduler side's loads and stores of every KV cache group (``HybridPlan``),
and the worker side as one ``WorkerSide`` per group (``HybridWorker``).

The first full-attention group is the engine's chain and goes as a model of one
group goes (``vllm_scheduler``); every other group's pages are pages of their
own (runs of one page, without a parent: a window's or a state's page names a
prefix by its hash alone), loaded and stored beside it:

- a hit of pages ``[start, end)`` loads, of each other group, the pages a hit
  at ``end`` needs (its window, its state) into the blocks vLLM gave them —
  vLLM's own manager allocates real blocks exactly there, null blocks for the
  tombstones;
- a store of pages up to ``end`` stores, of each window group, the window
  before ``end`` (blocks still in the request's table as this step scheduled
  it), and of each state group the states vLLM hands off this step at page
  boundaries (exact block ids: the state's block is not the request's
  positional one).

Loads of a hybrid engine are asynchronous: vLLM takes a failed load of an engine
of several groups only per request (``failed_recving``), and recomputes it from
its start — no block computed over a failed load is ever used.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from fabric.cache.engine_input import StoredRun
from fabric.engines.store import StoreOptions
from fabric.engines.vllm_groups import (
    STATE,
    WINDOW,
    KvGroup,
    group_tag,
    needs_of,
    primary_of,
)
from fabric.engines.vllm_moves import L2Options
from fabric.engines.vllm_pages import (
    FabricConnectorStats,
    FabricStepMeta,
    FabricWorkerMeta,
    PageLoad,
    PageSave,
    Placement,
)
from fabric.engines.vllm_worker import WorkerSide
from fabric.l3.format import Provenance

log = logging.getLogger(__name__)


class HybridPlan:
    """The scheduler side's view of a hybrid engine's other groups."""

    def __init__(self, groups: list[KvGroup]) -> None:
        self.groups = groups
        self.primary = primary_of(groups)
        self.others = [g for g in groups if g.index != self.primary.index]
        self._next_load = -1  # their loads' ids (the primary's come from its ``LoadBook``)

    def needs(self, tag: str) -> list[tuple[str, int]]:
        return needs_of(tag, self.groups)

    def tags(self, tag: str) -> dict[str, int]:
        return {group_tag(tag, g, self.primary): g.index for g in self.groups}

    def loads(
        self, state: Any, start: int, end: int, tables: Any, limit_s: float
    ) -> list[PageLoad]:
        """What a hit of pages ``[start, end)`` loads of the other groups: a page each."""
        out = []
        for g in self.others:
            table = tables[g.index]
            lo = start if g.before == 0 else max(end - g.before, start)
            tag = group_tag(state.asked_tag, g, self.primary)
            for i in range(lo, min(end, len(table))):
                if table[i] == 0:  # a tombstone vLLM does not need: not loaded
                    continue
                load_id, self._next_load = self._next_load, self._next_load - 1
                out.append(
                    PageLoad(load_id, state.rid, tag, (state.hashes[i],), (table[i],), True,
                             state.namespace, None, limit_s, g.index)
                )  # fmt: skip
        return out

    def saves(self, state: Any, end: int, tag: str) -> list[PageSave]:
        """What the request stores of the other groups with its pages up to ``end``:
        each window group's window before ``end``, each full group's pages, and the
        states handed off (``state.tables`` and ``state.offloads``: this step's)."""
        out = []
        tables, saved = state.tables, state.component_saved
        for g in self.others:
            if g.kind == STATE or tables is None or g.index >= len(tables):
                continue
            table = tables[g.index]
            lo = max(end - g.before, 0) if g.kind == WINDOW else 0
            for i in range(lo, min(end, len(table), len(state.hashes))):
                if table[i] != 0 and (g.index, i) not in saved:
                    out.append(self._save(state, g, i, table[i], tag))
        for group, block, tokens in state.offloads:
            g = self.groups[group] if 0 <= group < len(self.groups) else None
            i = tokens // g.block_size - 1 if g is not None else -1
            if g is None or g.kind != STATE or tokens % g.block_size or i < 0:
                continue
            state.hashes_to(i + 1, g.block_size)
            if i < min(end, len(state.hashes)) and (group, i) not in saved:
                out.append(self._save(state, g, i, block, tag))
        state.offloads = []
        return out

    def _save(self, state: Any, g: KvGroup, i: int, block: int, tag: str) -> PageSave:
        state.component_saved.add((g.index, i))
        run = StoredRun(state.namespace, None, (state.hashes[i],))
        return PageSave(group_tag(tag, g, self.primary), run, (block,), g.index)


def block_state(scheduler_output: Any, states: list[Any]) -> None:
    """A hybrid engine's step: each request's block tables as vLLM scheduled them
    (the blocks that hold their KV through this step) and the states it hands off."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = block_state.boundary_state_offloads if block_state is not None else {}
    for state in states:
        state.tables = block_state.get_block_ids(state.rid) if block_state is not None else None
        state.offloads = list(offloads.get(state.rid, ()))


def _part(meta: FabricStepMeta, group: int, primary: bool) -> FabricStepMeta:
    """The step's jobs of one group, for its worker."""
    orders = [o for o in meta.orders if meta.groups.get(o.tag, -1) == group]
    if primary:
        orders += [o for o in meta.orders if o.tag not in meta.groups]
    return FabricStepMeta(
        [j for j in meta.loads if j.group == group],
        [j for j in meta.saves if j.group == group],
        meta.store, meta.finished, meta.cancel, orders, meta.groups,
    )  # fmt: skip


class HybridWorker:
    """The worker side of a hybrid engine: a ``WorkerSide`` per KV cache group
    (each its own pages, page buffers and node L2 region, one store), a request's
    load done once every group's is, failed if any group's was."""

    def __init__(
        self,
        placement: Placement,
        groups: list[KvGroup],
        num_blocks: int,
        store: StoreOptions | None,
        l2: L2Options,
        timeout_s: float,
    ) -> None:
        self.placement = placement
        self.groups = groups
        self.primary = primary_of(groups)
        share = replace(l2, max_bytes=l2.max_bytes // len(groups))
        self.sides = {
            g.index: WorkerSide(placement, list(g.layer_names), num_blocks, g.block_bytes, store,
                                share, timeout_s)
            for g in groups
        }  # fmt: skip
        self._layer_group = {name: g.index for g in groups for name in g.layer_names}
        self._loading: dict[str, set[int]] = {}  # request -> groups whose load runs
        self._failed: set[str] = set()
        self._parts: tuple[int, dict[int, FabricStepMeta]] | None = None
        self._orders_done = 0  # batches of orders handed to the groups' workers

    @property
    def broken(self) -> str:
        return next((side.broken for side in self.sides.values() if side.broken), "")

    @property
    def worker_sides(self) -> list[WorkerSide]:
        return list(self.sides.values())

    def register(self, kv_caches: dict[str, Any], provenance: dict[int, Provenance]) -> None:
        for g in self.groups:
            names = set(g.layer_names)
            self.sides[g.index].register(
                {k: v for k, v in kv_caches.items() if k in names}, provenance[g.index]
            )
        if self.broken:  # one group that cannot serve: none does (a hit needs them all)
            for side in self.sides.values():
                side.pages.layers = []

    def _split(self, meta: FabricStepMeta) -> dict[int, FabricStepMeta]:
        if self._parts is None or self._parts[0] != id(meta):
            parts = {i: _part(meta, i, i == self.primary.index) for i in self.sides}
            self._parts = (id(meta), parts)
        return self._parts[1]

    def load(self, meta: FabricStepMeta) -> None:
        for job in meta.loads:
            self._loading.setdefault(job.req_id, set()).add(job.group)
        for i, part in self._split(meta).items():
            self.sides[i].load(part)

    def wait_layer(self, name: str) -> None:
        group = self._layer_group.get(name)
        if group is not None:
            self.sides[group].wait_layer(name)

    def save_layer(self, name: str) -> None:
        group = self._layer_group.get(name)
        if group is not None:
            self.sides[group].save_layer(name)

    def save(self, meta: FabricStepMeta) -> None:
        for i, part in self._split(meta).items():
            self.sides[i].save(part)
        self._parts = None
        self._orders_done += bool(meta.orders)  # (handed to the groups' writer threads)

    def finished_sends(self) -> set[str]:
        return set().union(*(side.finished_sends() for side in self.sides.values()))

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose loads every group ended, and those of them a group failed."""
        for i, side in self.sides.items():
            for rid in side.finished_loads():
                groups = self._loading.get(rid)
                if groups is not None:
                    groups.discard(i)
            side.load_errors()  # (per request instead: vLLM takes no block of a hybrid)
            self._failed |= side.failed_loads
            side.failed_loads.clear()
        done = {rid for rid, groups in self._loading.items() if not groups}
        for rid in done:
            del self._loading[rid]
        failed = done & self._failed
        self._failed -= done
        return done, failed

    def load_errors(self) -> set[int]:
        return set()  # a hybrid engine's failed loads go per request (``finished_loads``)

    def worker_meta(self) -> FabricWorkerMeta | None:
        out: FabricWorkerMeta | None = None
        for i, side in self.sides.items():
            meta = side.worker_meta()
            if meta is None:
                continue
            if i != self.primary.index:
                meta.ended = []  # (the scheduler side waits on the chain's stores only)
            meta.orders_done = 0
            out = meta if out is None else out.aggregate(meta)
        if self._orders_done:
            out = out or FabricWorkerMeta()
            out.orders_done, self._orders_done = self._orders_done, 0
        return out

    def take_stats(self) -> FabricConnectorStats | None:
        out: FabricConnectorStats | None = None
        for side in self.sides.values():
            stats = side.take_stats()
            if stats is not None:
                out = stats if out is None else out.aggregate(stats)
        return out

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
