"""The consensus rules, as pure functions over rank reports.

What only ranks can know is decided by a reduction over every rank: MIN for
progress (commit only what every rank has done), MAX for flags (any rank may
fail or stop an operation). One round reduces one report from each rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fabric.errors import InvalidInput
from fabric.messages import Report


def reduce_min(values: Iterable[int]) -> int:
    """Progress every rank has made."""
    return min(values)


def reduce_max(flags: Iterable[bool]) -> bool:
    """Whether any rank raised the flag."""
    return any(flags)


@dataclass(frozen=True)
class Round:
    """The result of one consensus round. ``restarted`` lists rank indices whose
    incarnation changed (their pools are empty); when it is non-empty, or a report
    is from another epoch, the counters are ``None`` and nothing may be committed."""

    computes_done: int | None
    writes_done: int | None
    loads_done: int | None
    failed: frozenset[int]
    restarted: tuple[int, ...]
    backups_done: int | None = None
    prefetch_progress: dict[int, int] = field(default_factory=dict)
    prefetch_terminated: frozenset[int] = frozenset()
    prefetch_finished: frozenset[int] = frozenset()
    prefetch_reported: frozenset[int] = frozenset()

    @property
    def usable(self) -> bool:
        return self.computes_done is not None


class Consensus:
    """Reduces one report per rank per round and tracks rank incarnations."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.incarnations: dict[int, str] = {}

    def reduce(self, reports: Sequence[Report], epoch: int) -> Round:
        ranks = sorted(r.rank for r in reports)
        if ranks != list(range(self.world_size)):
            raise InvalidInput(
                f"a round needs one report from each of {self.world_size} ranks, got {ranks}"
            )
        restarted = []
        for r in reports:
            known = self.incarnations.get(r.rank)
            if known is not None and known != r.incarnation:
                restarted.append(r.rank)
            self.incarnations[r.rank] = r.incarnation
        failed = frozenset().union(*(r.failed for r in reports))
        if restarted or any(r.epoch != epoch for r in reports):
            return Round(None, None, None, failed, tuple(sorted(restarted)))
        per_rank = [{p.op_id: p for p in r.prefetch} for r in reports]
        ops = frozenset().union(*per_rank)
        return Round(
            reduce_min(r.computes_done for r in reports),
            reduce_min(r.writes_done for r in reports),
            reduce_min(r.loads_done for r in reports),
            failed,
            (),
            backups_done=reduce_min(r.backups_done for r in reports),
            # Progress counts once every rank has reported on the op (a batch done,
            # or the op over); before that its MIN is "nothing known yet".
            prefetch_progress={
                op: reduce_min(m[op].completed_tokens for m in per_rank)
                for op in ops
                if all(op in m for m in per_rank)
            },
            prefetch_terminated=frozenset(
                op for op in ops if reduce_max(op in m and m[op].terminated for m in per_rank)
            ),
            prefetch_finished=frozenset(
                op for op in ops if all(op in m and m[op].finished for m in per_rank)
            ),
            prefetch_reported=ops,
        )
