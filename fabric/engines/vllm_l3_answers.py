"""The L3 beside the coordinator's answers, as the connector's scheduler side sees
it: the pages every rank of the engine has stored in the store, looked for
where the coordinator's answer stops short (a coordinator restarted empty, an
engine that died before its report arrived) or alone while the fabric is down.

The store is asked on a thread of its own and waited for at most until the
step's deadline: a wedged store (a hung mount) costs hits, never a stalled
engine step; while one check has not come back, the store is not asked again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from fabric.cache.engine_input import StoredRun
from fabric.engines.store import PageStore, StoreOptions, open_store
from fabric.l3.format import page_key

log = logging.getLogger(__name__)


class L3Answers:
    def __init__(self, suffixes: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.suffixes = suffixes  # every rank's key suffix
        self.clock = clock
        self.store: PageStore | None = None
        self._failed_to_open = False
        self._checks: ThreadPoolExecutor | None = None
        self._busy: Future | None = None

    def open(self, options: StoreOptions | None) -> PageStore | None:
        """The store the workers use (opened once), or ``None`` where there is none
        to open here."""
        if self.store is None and options is not None and not self._failed_to_open:
            try:
                self.store = open_store(options, "vllm")
            except Exception as exc:
                log.warning("kvfabric connector: L3 at %r cannot be opened: %s", options.path, exc)
                self._failed_to_open = True
        return self.store

    def stored(self, tag: str, runs: Sequence[Sequence[bytes]], deadline: float) -> list[int]:
        """Per run of page hashes, how many leading pages every rank's shard of is in
        the store (all zeros when the store is not there or did not answer by
        ``deadline``)."""
        store = self.store
        if store is None or not runs:
            return [0] * len(runs)
        if self._busy is not None and not self._busy.done():
            return [0] * len(runs)  # the last check has not come back
        if self._checks is None:
            self._checks = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-l3-check")
        suffixes = self.suffixes

        def found() -> list[int]:
            out = []
            for hashes in runs:
                n = len(hashes)
                for suffix in suffixes:
                    present = store.present([page_key(h, tag, suffix) for h in hashes[:n]])
                    n = present.index(False) if False in present else n
                    if not n:
                        break
                out.append(n)
            return out

        self._busy = self._checks.submit(found)
        try:
            return self._busy.result(timeout=max(deadline - self.clock(), 0.0))
        except FutureTimeout:
            log.warning("kvfabric connector: L3 did not answer in time; served without it")
        except Exception as exc:
            log.warning("kvfabric connector: L3 lookup failed: %s", exc)
        return [0] * len(runs)

    def extend(
        self,
        tag: str,
        states: Sequence[Any],
        answers: list[int] | None,
        deadline: float,
        block_size: int,
        link: Any,
    ) -> list[int]:
        """Each request's answer (``answers``; ``None``: the fabric is down)
        extended over the pages after it that every rank's shard of is in the store;
        those are reported to the coordinator (``link``) when it answered — but not
        past a final answer (the fabric evicted the next page: what the store
        still holds of it is on its way out). Under
        best_effort (``link.l2_only``) the fabric answers from the node's L2 and
        prefetches the rest: those pages are reported, not taken into the hit."""
        hits = list(answers) if answers is not None else [0] * len(states)
        only_told = answers is not None and link.l2_only
        final = getattr(answers, "final", None) or [False] * len(states)
        if self.store is None:
            return hits
        todo = [i for i, s in enumerate(states) if hits[i] < s.whole(block_size) and not final[i]]
        runs = [states[i].hashes[hits[i] : states[i].whole(block_size)] for i in todo]
        world = len(self.suffixes)
        reports: dict[int, list[StoredRun]] = {r: [] for r in range(world)}
        for i, hashes, n in zip(todo, runs, self.stored(tag, runs, deadline), strict=True):
            if not n:
                continue
            state, hit = states[i], hits[i]
            if answers is not None:
                parent = state.hashes[hit - 1] if hit else None
                run = StoredRun(state.namespace, parent, tuple(hashes[:n]))
                for r in range(world):
                    reports[r].append(run)
            hits[i] = hit if only_told else hit + n
        if any(reports.values()):
            link.report(tag, world, reports)
        return hits

    def mark_failed(self, tag: str, hashes: Sequence[bytes]) -> None:
        """Pages a rank failed to load: absent here until stored anew."""
        if self.store is not None:
            self.store.mark_failed([page_key(h, tag, s) for h in hashes for s in self.suffixes])

    def close(self) -> None:
        if self._checks is not None:
            self._checks.shutdown(wait=False, cancel_futures=True)
            self._checks = None
        if self.store is not None and (self._busy is None or self._busy.done()):
            self.store.close()  # (one still in use by a wedged check is left to the process)
        self.store = None
