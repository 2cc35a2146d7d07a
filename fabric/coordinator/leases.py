"""The leases the coordinator has handed out: who holds which, until when, and what
ending one does to the cache.

A lease holds a finished request's pages in L1 until its driver releases it, it
expires (``runtime.lease_ttl_s`` after it was granted or last renewed), its driver
exits (``reclaim``) or a reset ends every lease. Only the ``Lease`` itself names one:
its token is unguessable, and a lease that differs from the one handed out is
refused (``check``)."""

from __future__ import annotations

import heapq
import logging
import secrets
from collections.abc import Callable

from fabric.cache.admission import Admission, RequestKV
from fabric.coordinator.requests import FabricStats, HeldLease, Lease, ServingRequest
from fabric.errors import InvalidInput

log = logging.getLogger(__name__)


class LeaseTable:
    def __init__(
        self, admission: Admission, stats: FabricStats, clock: Callable[[], float]
    ) -> None:
        self.admission = admission
        self.stats = stats
        self.clock = clock
        self.by_token: dict[str, HeldLease] = {}
        self._request_ids: set[str] = set()  # of the leases held, for a new request's id
        self._expiry: list[tuple[float, str]] = []  # (expires_at, token), stale ones too

    def __len__(self) -> int:
        return len(self.by_token)

    def __contains__(self, token: object) -> bool:
        return token in self.by_token

    def get(self, token: str) -> HeldLease | None:
        return self.by_token.get(token)

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._request_ids

    def check(self, lease: Lease) -> HeldLease | None:
        """The lease held under ``lease``, or ``None`` if it expired or died with a
        reset. Raises ``InvalidInput`` for what is not a ``Lease``, or one that does
        not match the one handed out (a forged or altered lease)."""
        if not isinstance(lease, Lease):
            raise InvalidInput(f"a lease is the Lease of a result, not {type(lease).__name__}")
        held = self.by_token.get(lease.token) if isinstance(lease.token, str) else None
        if held is not None and held.lease != lease:
            raise InvalidInput(f"lease of {lease.request_id!r} does not match the one handed out")
        return held

    def grant(self, req: ServingRequest, kv: RequestKV, epoch: int, ttl_s: float) -> Lease:
        """A new lease on a finished request's pages, expiring ``ttl_s`` from now."""
        sliding, mamba = kv.parts_held  # what the leased prefix has of the other components
        lease = Lease(
            req.rid,
            secrets.token_hex(16),
            epoch,
            kv.namespace,
            kv.filled,
            tuple(kv.device_pages),  # the lease crosses to drivers
            ttl_s,
            sliding,
            mamba,
        )
        held = HeldLease(lease, kv, req.owner, self.clock() + ttl_s, req.session, req.group)
        self.by_token[lease.token] = held
        self._request_ids.add(req.rid)
        heapq.heappush(self._expiry, (held.expires_at, lease.token))
        return lease

    def take(self, held: HeldLease) -> None:
        """Stop holding ``held`` without letting its pages go: its request carries its
        KV on (a decode appended to it)."""
        del self.by_token[held.lease.token]
        self._request_ids.discard(held.lease.request_id)

    def drop(self, held: HeldLease, session: str | None = None) -> None:
        """End ``held``: its pages go, or ``session`` (else the one its request named)
        keeps its whole pages for the next turn."""
        self.take(held)
        session = session if session is not None else held.session
        refused = self.admission.finish(held.kv, session)
        if refused is not None:
            self.stats.sessions_refused += 1
            log.info("session %r keeps nothing: %s", session, refused)

    def renew(self, lease: Lease) -> bool:
        """Extend a held lease by its TTL from now; ``False`` if it is gone."""
        held = self.check(lease)
        if held is None:
            return False
        held.expires_at = self.clock() + lease.ttl_s
        heapq.heappush(self._expiry, (held.expires_at, lease.token))
        return True

    def expire(self) -> int:
        """End every lease past its TTL; returns how many."""
        now, n = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, token = heapq.heappop(self._expiry)
            held = self.by_token.get(token)
            if held is not None and held.expires_at == expires_at:
                self.drop(held)
                n += 1
        self.stats.leases_expired += n
        return n

    def next_expiry(self) -> float | None:
        """When the next lease expires (``clock`` time)."""
        while self._expiry and self._expiry[0][1] not in self.by_token:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None

    def owners(self) -> set[str]:
        """Drivers that hold leases."""
        return {h.owner for h in self.by_token.values() if h.owner}

    def reclaim(self, owner: str) -> int:
        """A driver exited: end its leases; returns how many."""
        mine = [h for h in self.by_token.values() if h.owner == owner]
        for held in mine:
            self.drop(held)
        self.stats.leases_reclaimed += len(mine)
        return len(mine)

    def in_hand(self, pending_groups: set[int]) -> bool:
        """Whether a driver holds a lease it can release: any lease but those of a
        ``submit_many`` call some of whose requests are still pending
        (``pending_groups``: its driver has none of the call's results yet)."""
        return any(h.group == 0 or h.group not in pending_groups for h in self.by_token.values())

    def clear(self) -> None:
        """Forget every lease (a reset: their pages are gone with L1)."""
        self.by_token.clear()
        self._request_ids.clear()
        self._expiry.clear()
