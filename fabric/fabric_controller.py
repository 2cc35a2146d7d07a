"""The coordinator's controller: tree calls become rank commands, batched per step.

Pools are symmetric, so the one pair of allocators here decides every rank's
slots, and every rank gets the same commands in the same order. Completions
come from consensus rounds: a rank's counters are cumulative within an epoch,
so the MIN over ranks minus what was already committed is what to commit now.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from fabric.allocator import PagedAllocator
from fabric.config import CacheConfig
from fabric.consensus import Round
from fabric.controller import Completions, Controller
from fabric.messages import Backup, Compute, Load, Message, Prefetch, Write


@dataclass(frozen=True)
class RoundDone:
    writes: int
    failed_writes: frozenset[int]
    loads: int
    computes: int
    failed_computes: frozenset[int]
    backups: int
    failed_backups: frozenset[int]


class FabricController(Controller):
    def __init__(self, config: CacheConfig) -> None:
        self.device = PagedAllocator(config.device_pages, config.page_size, "L1 device pool")
        self.host = PagedAllocator(config.host_pages, config.page_size, "L2 host pool")
        self.reset()

    def reset(self) -> None:
        self.device.reset()
        self.host.reset()
        self.outbox: list[Message] = []
        self._next_cmd = 0
        self.writes: deque[tuple[int, int]] = deque()
        self.loads: deque[int] = deque()
        self.computes: deque[int] = deque()
        self.backups: deque[tuple[int, int]] = deque()
        self.queries: list[tuple[int, tuple[bytes, ...]]] = []
        self.stops: list[int] = []
        self.writes_committed = self.loads_committed = self.computes_done_committed = 0
        self.computes_committed = 0
        self.backups_committed = 0

    def _cmd_id(self) -> int:
        self._next_cmd += 1
        return self._next_cmd

    def write(self, op_id: int, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        cmd = self._cmd_id()
        self.outbox.append(Write(cmd, tuple(device_pages), tuple(host_pages)))
        self.writes.append((cmd, op_id))

    def load(self, op_id: int, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        cmd = self._cmd_id()
        self.outbox.append(Load(cmd, tuple(host_pages), tuple(device_pages)))
        self.loads.append(cmd)

    def compute(self, namespace: str, tokens: bytes, start_token: int, pages: Sequence[int]) -> int:
        """Queue filling ``pages`` with KV of ``tokens[start_token:]``; returns its command id."""
        cmd = self._cmd_id()
        self.outbox.append(Compute(cmd, namespace, tokens, start_token, tuple(pages)))
        self.computes.append(cmd)
        return cmd

    def backup(self, op_id: int, host_pages: Sequence[int], page_hashes: Sequence[bytes]) -> None:
        cmd = self._cmd_id()
        self.outbox.append(Backup(cmd, tuple(host_pages), tuple(page_hashes)))
        self.backups.append((cmd, op_id))

    def query_storage(self, op_id: int, page_hashes: Sequence[bytes]) -> None:
        self.queries.append((op_id, tuple(page_hashes)))

    def prefetch(self, op_id: int, host_pages: Sequence[int], page_hashes: Sequence[bytes]) -> None:
        cmd = self._cmd_id()
        self.outbox.append(Prefetch(cmd, op_id, tuple(host_pages), tuple(page_hashes)))

    def stop_prefetch(self, op_id: int) -> None:
        self.stops.append(op_id)

    def take_commands(self) -> tuple[Message, ...]:
        out, self.outbox = tuple(self.outbox), []
        return out

    def take_stops(self) -> tuple[int, ...]:
        out, self.stops = tuple(self.stops), []
        return out

    def take_queries(self) -> list[tuple[int, tuple[bytes, ...]]]:
        out, self.queries = self.queries, []
        return out

    def take_completions(self) -> Completions:
        return Completions()

    def acked(self) -> int:
        """The highest command id up to which every counted command is committed."""
        oldest = [q[0][0] for q in (self.writes, self.backups) if q]
        oldest += [q[0] for q in (self.loads, self.computes) if q]
        return (min(oldest) if oldest else self._next_cmd + 1) - 1

    def busy(self) -> bool:
        return bool(
            self.outbox
            or self.writes
            or self.loads
            or self.computes
            or self.backups
            or self.queries
            or self.stops
        )

    def completions(self, rnd: Round) -> RoundDone:
        """What to commit after a usable round; advances the committed counts."""
        assert rnd.computes_done is not None and rnd.writes_done is not None
        assert rnd.loads_done is not None
        n_writes = self._newly(rnd.writes_done - self.writes_committed, self.writes)
        n_loads = self._newly(rnd.loads_done - self.loads_committed, self.loads)
        n_computes = self._newly(rnd.computes_done - self.computes_done_committed, self.computes)
        self.writes_committed += n_writes
        self.loads_committed += n_loads
        self.computes_done_committed += n_computes
        writes = [self.writes.popleft() for _ in range(n_writes)]
        for _ in range(n_loads):
            self.loads.popleft()
        computes = [self.computes.popleft() for _ in range(n_computes)]
        if computes:
            self.computes_committed = computes[-1]
        n_backups = self._newly((rnd.backups_done or 0) - self.backups_committed, self.backups)
        self.backups_committed += n_backups
        backups = [self.backups.popleft() for _ in range(n_backups)]
        return RoundDone(
            n_writes,
            frozenset(op for cmd, op in writes if cmd in rnd.failed),
            n_loads,
            n_computes,
            frozenset(cmd for cmd in computes if cmd in rnd.failed),
            n_backups,
            frozenset(op for cmd, op in backups if cmd in rnd.failed),
        )

    @staticmethod
    def _newly(reported: int, pending: deque) -> int:
        # A rank cannot have finished more than was sent; clamp a bogus report.
        return max(0, min(reported, len(pending)))
