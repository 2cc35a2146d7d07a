"""A vLLM worker carrying out the fabric tree's orders for its shards
(``fabric.cache.engine_places.Order``): delete them from L3 or from its node's
L2 (the tree evicted the page), copy them from its node's L2 into L3 (the
write policy wants the page there: ``BACKUP``), deleting them from L2 after
(``MOVE``: write-back, the page leaves L2), or read them from L3 into its
node's L2 (``PREFETCH``: a lookup found them in L3 only). It runs on the
worker's writer thread, after the stores queued before it.

A copy reads each page from the node's L2 checked (its CRC, and its slot not
rewritten while read), so a page another writer replaced meanwhile is skipped,
never copied; a read from L3 is checked as every L3 read is. What reached a
place is reported stored there, in runs of consecutive pages, as the worker's
stores are. Nothing here raises into the engine: an
order that fails is logged and counted, and the page stays where it was until
its place's bound or a later order.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from fabric.cache.engine_input import L3, StoredRun, stored_runs
from fabric.cache.engine_places import BACKUP, MOVE, PREFETCH, Order
from fabric.engines.vllm_moves import L2_PIN_MS, PageMoves

log = logging.getLogger(__name__)


@dataclass
class Carried:
    """What a batch of orders did: runs stored (``(tag, run)``, in L3 or the node's
    L2 as ``run.place`` says) and counts."""

    stored: list[tuple[str, StoredRun]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


def mine(orders: list[Order], rank: int, place: str) -> list[Order]:
    """The orders for this rank's shards in places it reaches (L3, its node's L2)."""
    return [o for o in orders if o.mask >> rank & 1 and o.hashes and o.place in (L3, place)]


def carry_out(pages: PageMoves, orders: list[Order]) -> Carried:
    done = Carried()
    for order in orders:
        keys = pages.keys(order.tag, order.hashes)
        try:
            if order.kind in (BACKUP, MOVE):
                copied = _copy_to_l3(pages, order, keys, done)
                if order.kind == MOVE and pages.l2 is not None:  # what is in L3 now leaves L2
                    moved = [k for k, ok in zip(keys, copied, strict=True) if ok]
                    done.counts["l2_dropped_pages"] += pages.l2.remove(moved)
            elif order.kind == PREFETCH:
                _copy_to_l2(pages, order, keys, done)
            elif order.place == L3 and pages.store is not None:
                done.counts["l3_deleted_pages"] += pages.store.delete(keys)
            elif order.place != L3 and pages.l2 is not None:
                done.counts["l2_dropped_pages"] += pages.l2.remove(keys)
        except Exception as exc:  # the page stays where it is: a cache, never an error
            log.warning(
                "kvfabric connector: a %s of %d pages failed: %s", order.kind, len(keys), exc
            )
            done.counts["orders_failed"] += 1
    return done


def _copy_to_l3(pages: PageMoves, order: Order, keys: list[str], done: Carried) -> list[bool]:
    """Copy the order's pages this node's L2 holds whole into L3, a page buffer at a
    time; per page, whether it is in L3 now."""
    stored = [False] * len(keys)
    if pages.l2 is None or pages.store is None or pages.provenance is None:
        return stored
    for start in range(0, len(keys), pages.batch_pages):
        end = min(start + pages.batch_pages, len(keys))
        for i, ok in _copy_batch(pages, keys[start:end]):
            stored[start + i] = ok
    run = StoredRun(order.namespace, order.parent, order.hashes, L3, pages.page_bytes)
    done.stored += [(order.tag, r) for r in stored_runs(run, stored)]
    done.counts["l3_copied_pages"] += sum(stored)
    return stored


def _copy_to_l2(pages: PageMoves, order: Order, keys: list[str], done: Carried) -> None:
    """Read the order's leading pages L3 holds into this node's L2, a page buffer at
    a time (a page L3 lacks ends it: the ones after would not be reachable)."""
    if pages.l2 is None or pages.store is None or pages.provenance is None:
        return
    kept: list[bool] = []
    for start in range(0, len(keys), pages.batch_pages):
        end = min(start + pages.batch_pages, len(keys))
        buffer = pages.buffer(end - start)
        try:
            n = pages.store.load(keys[start:end], buffer[: end - start].numpy(), pages.provenance)
            kept += pages.l2_put(keys[start : start + n], buffer[:n]) if n else []
        finally:
            pages.give(buffer)
        if n < end - start:
            break
    run = StoredRun(order.namespace, order.parent, order.hashes, pages.l2_place, pages.page_bytes)
    done.stored += [(order.tag, r) for r in stored_runs(run, kept)]
    done.counts["l2_prefetched_pages"] += sum(kept)


def _copy_batch(pages: PageMoves, keys: list[str]) -> list[tuple[int, bool]]:
    """``(index, stored)`` for the pages of ``keys`` read whole from the node's L2."""
    l2, store = pages.l2, pages.store
    assert l2 is not None and store is not None and pages.provenance is not None
    found = l2.find(keys, pin_ms=L2_PIN_MS)
    buffer = pages.buffer(len(keys))
    try:
        good = []
        try:
            for i, f in enumerate(found):
                if f is not None and l2.check(f):
                    buffer[i].copy_(l2.pool[f[0]])
                    if l2.unchanged(f):
                        good.append(i)
        finally:
            l2.unpin([f for f in found if f is not None])
        if not good:
            return []
        rows = buffer[torch.tensor(good, dtype=torch.long)]
        ok = store.store([keys[i] for i in good], rows.numpy(), pages.provenance)
        l2.release([keys[i] for i, stored in zip(good, ok, strict=True) if stored])  # in L3 now
        return list(zip(good, ok, strict=True))
    finally:
        pages.give(buffer)
