"""A vLLM worker's loads on its step and load threads: a step's synchronous loads
layer by layer (each layer's event set once its blocks are filled, so the
forward starts on the first layer while later ones are copied) or whole, and
one load a batch at a time. Each load writes blocks only while its guard is not
cancelled (``vllm_moves.LoadGuard``). An outcome is ``(pages loaded, seconds,
pages of them from the node's L2, checked)``: ``checked`` when the first page not
loaded was found missing or bad by the store's checks — a verdict the fabric
acts on (it forgets the page) — and not when the load was given up (timed out,
cancelled, failed on an error, a node L2 slot rewritten meanwhile).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fabric.engines.vllm_moves import Cancelled, Fetched, LoadGuard, PageMoves
from fabric.engines.vllm_pages import PageLoad

log = logging.getLogger(__name__)

Outcome = tuple[int, float, int, bool]
GIVEN_UP: Outcome = (0, 0.0, 0, False)


@dataclass
class StepLoad:
    """One step's synchronous loads on the step thread: layer by layer (the forward
    waits for each layer's event, ``wait_for_layer_load``), or whole before the
    forward. ``guard`` stops its block writes once the step gives up on it."""

    jobs: list[PageLoad]
    events: list[threading.Event]
    deadline: float
    layerwise: bool
    guard: LoadGuard = field(default_factory=LoadGuard)
    waited: set[int] = field(default_factory=set)
    future: Future | None = None
    timed_out: bool = False


def load_layers(pages: PageMoves, step: StepLoad) -> list[Outcome]:
    """Fetch the step's pages, then fill their blocks one layer at a time, setting
    each layer's event once it is filled (every event, whatever happens)."""
    started = time.perf_counter()
    fetched: list[Fetched] = []
    try:
        fetched = [pages.fetch(job, deadline=_deadline(job)) for job in step.jobs]
        for layer, event in enumerate(step.events):
            with step.guard.lock:
                if step.guard.cancelled:
                    raise Cancelled
                for f in fetched:
                    pages.scatter_layer(f, layer)
                pages.sync()
            event.set()
        done = [(pages.settle(f), f.l2, f.checked) for f in fetched]
    except Cancelled:
        done = [(0, 0, False)] * len(step.jobs)
    except Exception as exc:  # a load that fails is recomputed, never fatal
        log.warning("kvfabric connector: loading a step's pages failed: %s", exc)
        done = [(0, 0, False)] * len(step.jobs)
    finally:
        for event in step.events:
            event.set()  # a forward never waits on a load that failed
        for f in fetched:
            pages.release(f)
    seconds = time.perf_counter() - started
    return [(n, seconds / len(step.jobs), l2, checked) for n, l2, checked in done]


def load_whole(pages: PageMoves, step: StepLoad) -> list[Outcome]:
    """The step's loads one after another, each a batch at a time."""
    return [timed_load(pages, job, step.guard) for job in step.jobs]


def timed_load(pages: PageMoves, job: PageLoad, guard: LoadGuard) -> Outcome:
    """One load, its failures and a cancelled guard counted as pages not loaded."""
    started = time.perf_counter()
    try:
        n, l2, checked = pages.load_one(job, guard, _deadline(job))
    except Cancelled:
        n, l2, checked = 0, 0, False
    except Exception as exc:  # a load that fails is recomputed, never fatal
        log.warning("kvfabric connector: loading %d pages failed: %s", len(job.hashes), exc)
        n, l2, checked = 0, 0, False
    return n, time.perf_counter() - started, l2, checked


class AsyncLoads:
    """A worker's asynchronous loads, read in order on a load thread of their own
    while the engine steps on. A load not done within ``timeout_s`` is given up:
    reported done with nothing loaded (its blocks are load errors), and no block
    is written by it after; while the thread is still in such a load, new ones
    fail at once rather than queue behind it."""

    def __init__(self, pages: PageMoves, timeout_s: float, clock: Callable[[], float]) -> None:
        self.pages = pages
        self.timeout_s = timeout_s
        self.clock = clock
        self.timeouts = 0
        self._thread: ThreadPoolExecutor | None = None
        self._loading: dict[str, tuple[PageLoad, Future, LoadGuard, float]] = {}
        self._stuck: Future | None = None

    def start(self, job: PageLoad) -> None:
        guard = LoadGuard()
        if not self.pages.layers or (self._stuck is not None and not self._stuck.done()):
            self._loading[job.req_id] = (job, _done(GIVEN_UP), guard, self.clock())
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-load")
        future = self._thread.submit(timed_load, self.pages, job, guard)
        self._loading[job.req_id] = (job, future, guard, self.clock())

    def cancel(self, req_ids: list[str]) -> None:
        """Give these requests' loads up now (reported done, nothing loaded)."""
        for rid in req_ids:
            if rid in self._loading:
                job, _, guard, since = self._loading[rid]
                guard.cancel()
                self._loading[rid] = (job, _done(GIVEN_UP), guard, since)

    def finished(self) -> list[tuple[PageLoad, Outcome]]:
        """The loads done, or given up after ``timeout_s``, with their outcomes."""
        now, out = self.clock(), []
        for rid, (job, future, guard, since) in list(self._loading.items()):
            if future.done():
                outcome = future.result()
            elif now - since > self.timeout_s:
                guard.cancel()
                self._stuck = future
                self.timeouts += 1
                log.warning(
                    "kvfabric connector: a load of %d pages took longer than %.1f s; recomputed",
                    len(job.hashes), self.timeout_s,
                )  # fmt: skip
                outcome = (0, now - since, 0, False)
            else:
                continue
            del self._loading[rid]
            out.append((job, outcome))
        return out

    def stop(self) -> bool:
        """Cancel every load and stop the thread; whether one is still running."""
        busy = False
        for _, future, guard, _ in self._loading.values():
            guard.cancel()
            busy |= not future.done()
        if self._thread is not None:
            self._thread.shutdown(wait=not busy, cancel_futures=True)
            self._thread = None
        return busy


def _deadline(job: PageLoad) -> float | None:
    """When the job's L3 reads stop starting (its ``limit_s`` from now), if ever."""
    return time.monotonic() + job.limit_s if job.limit_s > 0 else None


def _done(result: object) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
