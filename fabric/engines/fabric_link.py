"""An engine connector's line to a running fabric's coordinator: every Ray call
the connector's scheduler side makes goes through here.

The engine must serve whatever happens to the fabric. A fabric that cannot be
reached at start, or whose calls fail or take longer than ``timeout_s``, is
*down*: one log line says so, every lookup answers "nothing cached" (the engine
computes), and the link tries again after ``retry_s``. No call waits longer than
``timeout_s``; reports of stored pages are sent without waiting for their reply,
and a lookup waits for the engine's earlier reports to land first (the
coordinator's calls run concurrently, so without it a lookup could overtake
the report of the pages it asks for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from fabric.coordinator.engine_pages import StoredRun
from fabric.engines.store import StoreOptions

log = logging.getLogger(__name__)

# Reports in flight before the oldest is waited for (a bound on what a slow
# coordinator can make an engine hold).
MAX_REPORTS_IN_FLIGHT = 64


class FabricLink:
    def __init__(
        self,
        name: str,
        address: str,
        ray_namespace: str,
        timeout_s: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.address = address
        self.ray_namespace = ray_namespace
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.clock = clock
        self.coordinator: Any = None
        self.store: StoreOptions | None = None
        self._retry_at = 0.0
        self._said_down = False
        self._reports: list[Any] = []

    @property
    def up(self) -> bool:
        """Whether calls go to the fabric now (connecting first when it is time to try)."""
        if self.coordinator is None and self.clock() >= self._retry_at:
            self._connect()
        return self.coordinator is not None

    def _connect(self) -> None:
        from fabric.client import connect

        try:
            fabric = connect(self.name, self.address, self.ray_namespace)
        except Exception as exc:
            self._down(f"cannot be reached ({exc})")
            return
        self.coordinator = fabric.coordinator
        self.store = store_options(fabric.config)
        log.info(
            "kvfabric connector: attached to fabric %r (L3 %s)",
            self.name,
            self.store.path if self.store else "none the workers can open",
        )
        self._said_down = False

    def _down(self, why: str) -> None:
        self.coordinator = None
        self._reports.clear()
        self._retry_at = self.clock() + self.retry_s
        if not self._said_down:
            log.warning(
                "kvfabric connector: fabric %r %s; serving without it (every prompt "
                "computed) and trying again every %.0f s",
                self.name,
                why,
                self.retry_s,
            )
            self._said_down = True

    def ask(
        self,
        tag: str,
        world: int,
        chains: list[list[bytes]],
        leases: list[str] | None = None,
        lease_s: float = 0.0,
        release: list[str] | None = None,
    ) -> Any:
        """Send one step's lookups (their matches leased under ``leases`` for
        ``lease_s``, the leases ``release`` names ended); a handle for
        ``answer``, or ``None`` when down."""
        if not chains or not self.up:
            return None
        self._check_reports(in_flight=0)
        if not self.up:
            return None
        try:
            return self.coordinator.engine_lookup.remote(
                tag, world, chains, leases, lease_s, release
            )
        except Exception as exc:
            self._down(f"failed a lookup ({exc})")
            return None

    def answer(self, handle: Any) -> list[int] | None:
        """The hits of a step's lookups; ``None`` when the fabric failed them."""
        import ray

        if handle is None:
            return None
        try:
            return ray.get(handle, timeout=self.timeout_s)
        except Exception as exc:
            self._down(f"failed a lookup ({type(exc).__name__}: {exc})")
            return None

    def report(self, tag: str, world: int, stored: dict[int, list[StoredRun]]) -> None:
        """Send ranks' reports of stored pages (their reply is not waited for)."""
        if not stored or not self.up:
            return
        try:
            self._reports.append(self.coordinator.engine_report.remote(tag, world, stored))
        except Exception as exc:
            self._down(f"failed a report ({exc})")
            return
        self._check_reports()

    def forget(self, tag: str, world: int, hashes: Sequence[bytes]) -> None:
        """Tell the fabric pages failed to load (sent without waiting)."""
        if not hashes or not self.up:
            return
        try:
            self._reports.append(self.coordinator.engine_forget.remote(tag, world, list(hashes)))
        except Exception as exc:
            self._down(f"failed a report ({exc})")

    def _check_reports(self, in_flight: int = MAX_REPORTS_IN_FLIGHT) -> None:
        """Collect replies that came; wait for the oldest until no more than
        ``in_flight`` are left."""
        import ray

        if not self._reports:
            return
        ready, pending = ray.wait(self._reports, num_returns=len(self._reports), timeout=0)
        if len(pending) > in_flight:
            more, pending = ray.wait(
                pending, num_returns=len(pending) - in_flight, timeout=self.timeout_s
            )
            ready += more
            if len(pending) > in_flight:
                self._down(f"did not answer a report within {self.timeout_s} s")
                return
        self._reports = pending
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:
                self._down(f"failed a report ({type(exc).__name__}: {exc})")
                return


def store_options(config: Any) -> StoreOptions | None:
    """Where workers read and write a fabric's L3 themselves (its directory, with
    the fabric's own backend, cap and authentication); ``None`` for an L3 they
    cannot open (none, Redis, a dynamic backend)."""
    storage = config.storage
    if storage.backend not in ("segment", "file"):
        return None
    return StoreOptions(
        path=storage.path,
        backend=storage.backend,
        max_bytes=storage.max_bytes,
        fsync=storage.fsync,
        auth_key_file=storage.auth_key_file,
    )
