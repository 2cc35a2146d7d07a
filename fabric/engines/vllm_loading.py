"""A vLLM worker's loads on its step and load threads: a step's synchronous loads
layer by layer (each layer's event set once its blocks are filled, so the
forward starts on the first layer while later ones are copied) or whole, and
one load a batch at a time. Each load writes blocks only while its guard is not
cancelled (``vllm_moves.LoadGuard``). An outcome is ``(pages loaded, seconds,
pages of them from the node's L2)``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from fabric.engines.vllm_moves import Cancelled, Fetched, LoadGuard, PageMoves
from fabric.engines.vllm_pages import PageLoad

log = logging.getLogger(__name__)

Outcome = tuple[int, float, int]


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
        fetched = [pages.fetch(job.tag, job.hashes, job.block_ids) for job in step.jobs]
        for layer, event in enumerate(step.events):
            with step.guard.lock:
                if step.guard.cancelled:
                    raise Cancelled
                for f in fetched:
                    pages.scatter_layer(f, layer)
            event.set()
        done = [(pages.settle(f), f.l2) for f in fetched]
    except Cancelled:
        done = [(0, 0)] * len(step.jobs)
    except Exception as exc:  # a load that fails is recomputed, never fatal
        log.warning("kvfabric connector: loading a step's pages failed: %s", exc)
        done = [(0, 0)] * len(step.jobs)
    finally:
        for event in step.events:
            event.set()  # a forward never waits on a load that failed
        for f in fetched:
            pages.release(f)
    seconds = time.perf_counter() - started
    return [(n, seconds / len(step.jobs), l2) for n, l2 in done]


def load_whole(pages: PageMoves, step: StepLoad) -> list[Outcome]:
    """The step's loads one after another, each a batch at a time."""
    return [timed_load(pages, job, step.guard) for job in step.jobs]


def timed_load(pages: PageMoves, job: PageLoad, guard: LoadGuard) -> Outcome:
    """One load, its failures and a cancelled guard counted as pages not loaded."""
    started = time.perf_counter()
    try:
        n, l2 = pages.load_one(job.tag, job.hashes, job.block_ids, guard)
    except Cancelled:
        n, l2 = 0, 0
    except Exception as exc:  # a load that fails is recomputed, never fatal
        log.warning("kvfabric connector: loading %d pages failed: %s", len(job.hashes), exc)
        n, l2 = 0, 0
    return n, time.perf_counter() - started, l2
