"""What a rank's threads share, under one lock: the epoch, the queued commands,
the counters a report carries, and the bytes each direction moved.

The message thread queues commands (``RankWorker.accept``), the transfer thread
and the storage thread take them and count them once done. They meet only
here, only under ``lock``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from fabric.messages import Backup, Command, Compute, Load, Prefetch, PrefetchProgress, Report


def run_all(run_one: Callable[..., bool]) -> int:
    """Call ``run_one(block=False)`` until it finds nothing queued: how many ran."""
    n = 0
    while run_one(block=False):
        n += 1
    return n


DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host")


class Ledger:
    def __init__(self, page_bytes: int) -> None:
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)  # a command was queued
        self.idle = threading.Condition(self.lock)  # the copy in flight finished
        # Bumped (and ``news`` notified) whenever the report would change: a
        # command done, prefetch progress, a new epoch (``wait_for_news``).
        self.news = threading.Condition(self.lock)
        self.news_seq = 0
        self.copying = False  # the transfer thread runs a command
        self.storing = False  # the storage thread runs a command
        self.epoch = 0
        self.page_bytes = page_bytes
        # Bytes copied, by direction, since the rank started (never reset): what
        # its actor's repr and Ray metrics show.
        self.moved_bytes = dict.fromkeys(DIRECTIONS, 0)
        # (direction, seconds) of each finished copy (a merged L1<->L2 group, a
        # backup, a prefetch batch), for a latency histogram; the oldest go first.
        self.transfer_seconds: deque[tuple[str, float]] = deque(maxlen=4096)
        self.reset()

    def reset(self) -> None:
        """Under the lock: an epoch's queues and counters, empty."""
        self.queue: deque[Command] = deque()
        self.storage_queue: deque[Command] = deque()
        # Computes and L2 -> L1 loads queued or running: what a request's result
        # waits on (writes and backups run behind it).
        self.awaited = 0
        self.last_cmd_id = 0
        self.computes_done = self.writes_done = self.loads_done = self.backups_done = 0
        self.failed: list[int] = []
        # op_id -> [completed_tokens, finished, terminated], from the first batch on
        self.prefetch: dict[int, list] = {}
        self.prefetch_ops: set[int] = set()
        self.stopping: set[int] = set()
        # The mesh generation each queued compute runs in (from its batch).
        self.mesh_keys: dict[int, str] = {}

    def enqueue(self, cmd: Command) -> None:
        """Under the lock: queue a new command (``last_cmd_id`` moves to it) for
        the transfer thread, or for the storage thread (prefetches, backups)."""
        self.last_cmd_id = cmd.cmd_id
        if isinstance(cmd, (Compute, Load)):
            self.awaited += 1
        if isinstance(cmd, Prefetch):
            self.prefetch_ops.add(cmd.op_id)
        (self.storage_queue if isinstance(cmd, (Prefetch, Backup)) else self.queue).append(cmd)

    def announce(self) -> None:
        """Under the lock: the report changed."""
        self.news_seq += 1
        self.news.notify_all()

    def open_epoch(self, epoch: int) -> bool:
        """Under the lock: a newer ``epoch`` starts counting afresh (``True``). Pages
        of the old epoch may already belong to new data: the copy in flight
        finishes first (the storage thread checks the epoch before it writes), and
        the old epoch's queued commands are dropped."""
        if epoch <= self.epoch:
            return False
        self.epoch = epoch
        while self.copying:
            self.idle.wait()
        self.reset()
        self.announce()
        return True

    def moved(self, direction: str, pages: int, started: float) -> None:
        """Under the lock: a copy of ``pages`` pages in ``direction`` finished, begun
        at ``started`` (``time.perf_counter``)."""
        self.moved_bytes[direction] += pages * self.page_bytes
        self.transfer_seconds.append((direction, time.perf_counter() - started))

    def progress(self, op_id: int, tokens: int) -> list:
        """Under the lock: prefetch ``op_id``'s entry, created at ``tokens``."""
        return self.prefetch.setdefault(op_id, [tokens, False, False])

    def wait_for_news(
        self, timeout: float, since: int | None = None, settle_s: float = 0.0
    ) -> None:
        """Return once the report has changed since ``since`` (a ``news_seq`` read
        earlier; default: now), once nothing is in flight, or after ``timeout``
        seconds: a round's reply then carries what finished rather than the same
        report again. With ``settle_s``, news is not enough while a compute or a
        load is still queued or running (``awaited``: what requests wait on): the
        wait goes on up to ``settle_s`` after the news (within ``timeout``) for
        them to finish, so that a round's own requests are reported in its reply
        rather than needing a round of their own. Writes and backups do not hold
        it: no result waits on them."""
        deadline = time.monotonic() + timeout
        with self.lock:
            seen = self.news_seq if since is None else since
            while self.news_seq == seen and self._in_flight():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.news.wait(left)
            if settle_s <= 0:
                return
            settled = min(deadline, time.monotonic() + settle_s)
            while self.awaited:
                left = settled - time.monotonic()
                if left <= 0:
                    return
                self.news.wait(left)

    def _in_flight(self) -> bool:
        """Under the lock: whether a command is queued or running."""
        return bool(self.queue or self.storage_queue or self.copying or self.storing)

    def report(self, index: int, incarnation: str) -> Report:
        with self.lock:
            return Report(
                index,
                incarnation,
                self.epoch,
                self.computes_done,
                self.writes_done,
                self.loads_done,
                tuple(self.failed),
                self.backups_done,
                tuple(PrefetchProgress(op, c, f, t) for op, (c, f, t) in self.prefetch.items()),
            )
