"""Stragglers: a rank that answers every round but finishes its commands late
holds every request back (the coordinator commits only what every rank has
done) without ever failing. ``Progress`` measures, each round, how long after
the first rank each rank finished what it newly reports done (computes, L1 <->
L2 copies: its own work; L3 traffic queues at the one storage actor, where some
rank is always served last, and is left out); the coordinator's
shell adds how long each rank took to reply. A rank is slow in a round when that
lag passes the others' (their latest) median by more than ``straggler_lag_s``
and is more than ``straggler_factor`` times it. After ``straggler_rounds`` slow
rounds of its own in a row it is a straggler: named in the log, the status and
the metrics, counted, and — with ``straggler_policy=restart`` — handed to the
shell to be treated as failed (its actor restarted, the epoch reset). It stops
being one after as many rounds in a row that are not slow.

With a single rank there is nobody to compare with: nothing is detected.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fabric.config import STRAGGLER_POLICIES
from fabric.observe.histogram import SECONDS, Histogram


@dataclass(slots=True)
class Straggler:
    since: float  # clock time it was named
    latency_s: float  # its last slow round's lag
    others_s: float  # the median of the others' latest


class Progress:
    """When each rank finished each command, against the first rank to. Reports
    carry cumulative counts per epoch; a command count every rank reaches in turn
    marks, for the first to reach it, the time it was done."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.reset(None)

    def reset(self, epoch: int | None) -> None:
        self.epoch = epoch
        self.done = [0] * self.world
        self.marks: list[tuple[int, float]] = []  # (count first reached, when), rising
        self.lead = 0

    def lags(self, totals: Sequence[int], epoch: int, now: float) -> list[float | None]:
        """Per rank, how long after the first rank it finished what it newly
        reports done (``None``: nothing new)."""
        if epoch != self.epoch:
            self.reset(epoch)
        lead = max(totals)
        if lead > self.lead:
            self.marks.append((lead, now))
            self.lead = lead
        out: list[float | None] = []
        for i, total in enumerate(totals):
            if total <= self.done[i]:
                out.append(None)
                continue
            # The first mark at or past the first count it newly finished.
            at = bisect_left(self.marks, (self.done[i] + 1, -math.inf))
            out.append(now - self.marks[at][1])
            self.done[i] = total
        floor = min(self.done)
        keep = bisect_left(self.marks, (floor + 1, -math.inf))
        if keep:
            del self.marks[:keep]
        return out


@dataclass
class Stragglers:
    names: Sequence[str]
    lag_s: float
    factor: float
    rounds: int
    policy: str
    clock: Callable[[], float]
    on_named: Callable[[str, Straggler], None] = lambda name, s: None
    slow: list[int] = field(init=False)
    fine: list[int] = field(init=False)
    last: list[float] = field(init=False)
    current: dict[int, Straggler] = field(init=False, default_factory=dict)
    named: int = field(init=False, default=0)
    seconds: list[Histogram] = field(init=False)
    to_restart: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in STRAGGLER_POLICIES:
            raise ValueError(f"straggler policy {self.policy!r}: allowed is {STRAGGLER_POLICIES}")
        n = len(self.names)
        self.slow, self.fine, self.last = [0] * n, [0] * n, [0.0] * n
        self.seconds = [Histogram(SECONDS) for _ in range(n)]

    def observe(self, lags: Sequence[float | None]) -> list[int]:
        """One round's lags (``None``: nothing measured for that rank); returns the
        ranks named in this round that the policy treats as failed (also queued
        for ``take_restart``)."""
        assert len(lags) == len(self.names), (len(lags), len(self.names))
        for i, t in enumerate(lags):
            if t is not None:
                self.last[i] = t
                self.seconds[i].observe(t)
        if len(self.names) < 2:
            return []
        failed = []
        for i, t in enumerate(lags):
            if t is None:
                continue
            others = statistics.median(u for j, u in enumerate(self.last) if j != i)
            if t - others > self.lag_s and t > self.factor * others:
                self.slow[i] += 1
                self.fine[i] = 0
                if i in self.current:
                    self.current[i].latency_s, self.current[i].others_s = t, others
                elif self.slow[i] >= self.rounds:
                    self.current[i] = Straggler(self.clock(), t, others)
                    self.named += 1
                    self.on_named(self.names[i], self.current[i])
                    if self.policy == "restart":
                        failed.append(i)
            else:
                self.slow[i] = 0
                self.fine[i] += 1
                if i in self.current and self.fine[i] >= self.rounds:
                    del self.current[i]
        self.to_restart += failed
        return failed

    def take_restart(self) -> list[int]:
        """The stragglers to treat as failed, once each."""
        out, self.to_restart = self.to_restart, []
        return out

    def forget(self, index: int) -> None:
        """The rank was restarted: its new actor starts with a clean record."""
        self.slow[index] = self.fine[index] = 0
        self.last[index] = 0.0
        self.current.pop(index, None)

    def status(self) -> dict[str, dict]:
        """The current stragglers by rank name: since when, and how late."""
        return {
            self.names[i]: {
                "since": s.since,
                "latency_s": round(s.latency_s, 4),
                "others_s": round(s.others_s, 4),
            }
            for i, s in sorted(self.current.items())
        }
