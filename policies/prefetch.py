"""Prefetch stop policies: when the cache stops waiting for an L3 -> L2 prefetch.

``should_stop`` is asked once per step while a prefetch is in flight. The
operation's ``terminated`` flag (MAX over ranks: any rank may stop it) always
ends the wait. ``started`` says the ranks have reported on the transfer at
least once: even ``best_effort`` waits that one round trip, or it would stop
every prefetch before its first page could move.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.registry import unknown_name


@dataclass(frozen=True)
class PrefetchTiming:
    """What a stop policy sees of one prefetch operation."""

    tokens: int
    completed_tokens: int
    elapsed_s: float
    terminated: bool
    started: bool = True

    @property
    def complete(self) -> bool:
        return self.completed_tokens >= self.tokens


@dataclass(frozen=True)
class TimeoutParams:
    base_s: float
    per_ki_token_s: float
    max_s: float

    def limit(self, tokens: int) -> float:
        """``base + per_ki_token * tokens / 1024``, capped at ``max``."""
        return min(self.base_s + self.per_ki_token_s * tokens / 1024, self.max_s)


class PrefetchStopPolicy:
    name = ""

    def should_stop(self, op: PrefetchTiming, timeout: TimeoutParams) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchStopPolicy):
    """Wait no longer than one report: take whatever has arrived by then."""

    name = "best_effort"

    def should_stop(self, op: PrefetchTiming, timeout: TimeoutParams) -> bool:
        return op.started or op.terminated


class WaitComplete(PrefetchStopPolicy):
    name = "wait_complete"

    def should_stop(self, op: PrefetchTiming, timeout: TimeoutParams) -> bool:
        return op.complete or op.terminated


class Timeout(PrefetchStopPolicy):
    name = "timeout"

    def should_stop(self, op: PrefetchTiming, timeout: TimeoutParams) -> bool:
        return op.complete or op.terminated or op.elapsed_s > timeout.limit(op.tokens)


PREFETCH_STOP_POLICIES: dict[str, type[PrefetchStopPolicy]] = {
    cls.name: cls for cls in (BestEffort, WaitComplete, Timeout)
}


def get_prefetch_stop_policy(name: str) -> PrefetchStopPolicy:
    """A new policy object for ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return PREFETCH_STOP_POLICIES[name]()
    except (KeyError, TypeError):
        raise unknown_name("prefetch stop policy", name, PREFETCH_STOP_POLICIES) from None
