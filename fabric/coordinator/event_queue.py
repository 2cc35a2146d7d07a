"""The KV events waiting for a router: collected from the cache after each change,
taken by ``take_events`` (or drained to ZMQ each step), the oldest dropped, counted,
past the cap."""

from __future__ import annotations

import logging
from collections import deque

from fabric.cache.events import KVEvent
from fabric.cache.hicache import HiCache
from fabric.cache.keys import check_namespace
from fabric.coordinator.requests import FabricStats
from fabric.errors import InvalidInput

log = logging.getLogger(__name__)


class EventQueue:
    def __init__(self, cache: HiCache, stats: FabricStats, maxlen: int) -> None:
        self.cache = cache
        self.stats = stats
        self.events: deque[KVEvent] = deque(maxlen=maxlen)

    @property
    def maxlen(self) -> int:
        return self.events.maxlen or 0

    def __len__(self) -> int:
        return len(self.events)

    def collect(self) -> None:
        """Queue the cache's new KV events; past the cap the oldest go, counted
        (``events_dropped``) and said once."""
        self.add(self.cache.events.take())

    def add(self, new: list[KVEvent]) -> None:
        """Queue ``new`` events (the oldest dropped, counted, past the cap)."""
        if not new:
            return
        over = len(self.events) + len(new) - self.maxlen
        if over > 0:
            if not self.stats.events_dropped:
                log.warning(
                    "KV events: the queue of %d is full and nobody takes them (take_events, "
                    "or events.endpoint); the oldest are dropped, counted in events_dropped",
                    self.maxlen,
                )
            self.stats.events_dropped += over
        self.events.extend(new)

    def drain(self) -> list[KVEvent]:
        """Every queued event, oldest first (for the ZMQ publisher, each step)."""
        events = list(self.events)
        self.events.clear()
        return events

    def take(self, limit: int = 10_000, namespace: str | None = None) -> list[KVEvent]:
        """Up to ``limit`` of the oldest events (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``) — of one ``namespace`` only when given (the others stay
        queued for their consumers; a clear of every namespace goes to whoever takes
        first)."""
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise InvalidInput(f"limit {limit!r} is refused: allowed is an int >= 0")
        if namespace is None:
            return [self.events.popleft() for _ in range(min(limit, len(self.events)))]
        check_namespace(namespace)
        taken, kept = [], deque(maxlen=self.events.maxlen)
        for event in self.events:
            # A clear of every namespace (a new coordinator's first event) is theirs too.
            if len(taken) < limit and event.namespace in (namespace, ""):
                taken.append(event)
            else:
                kept.append(event)
        self.events = kept
        return taken
