"""An engine connector's line to a running fabric's coordinator: every call the
connector's scheduler side makes goes through here — over the coordinator's
call socket where it answers from here (``link_socket``: a Ray actor call costs
the coordinator several times the tree's own work), else as Ray calls.

The engine must serve whatever happens to the fabric. A fabric that cannot be
reached at start, or whose calls fail or take longer than ``timeout_s``, is
*down*: one log line says so, every lookup answers "nothing cached" (the engine
computes), and the link tries again after ``retry_s`` — on a thread of its own,
so that no engine step waits for a connection. No step waits on the fabric
longer than ``timeout_s`` in all. Reports of stored pages and releases of
leases are sent without waiting for their reply, and a lookup waits for the
engine's earlier reports to land first (the coordinator's calls run
concurrently, so without it a lookup could overtake the report of the pages it
asks for). Calls larger than the coordinator takes are split.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from fabric.cache.engine_input import MAX_CHAINS_PER_CALL, MAX_PAGES_PER_CALL, StoredRun
from fabric.cache.engine_places import Order
from fabric.engines.link_socket import SocketCalls, open_socket
from fabric.engines.store import StoreOptions, store_options
from fabric.engines.vllm_names import PageNames

log = logging.getLogger(__name__)

# Reports in flight before the oldest is waited for (a bound on what a slow
# coordinator can make an engine hold).
MAX_REPORTS_IN_FLIGHT = 64
# Orders handed to the workers and not reported carried out within this long are
# given up on (the engine stops stepping for them).
ORDERS_STALL_S = 60.0


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
        # This engine's node's L2 place (``""``: none): its lookups count pages
        # whole there, and the evictions it is handed include that place's.
        self.place = ""
        self.place_bytes = 0  # what this engine's regions there hold (its ranks' l2_bytes)
        # Whether the fabric's lookups count this node's L2 only, prefetching what
        # only L3 holds there (its prefetch.stop_policy is best_effort).
        self.l2_only = False
        self.names = PageNames()  # vLLM's names of the pages reported (for KV events)
        # Evictions the fabric handed this engine to carry out (``take_orders``).
        self.orders: list[Order] = []
        self._orders_out = 0  # batches handed to the workers, times ranks, not done
        self._orders_since = 0.0
        self._retry_at = 0.0
        self._said_down = False
        self._reports: list[Any] = []
        self._connecting: threading.Thread | None = None
        self._connected: tuple[Any, StoreOptions | None, SocketCalls | None, Any] | None = None
        self._lock = threading.Lock()
        # The coordinator's call socket, where it answers from here (else Ray calls).
        self.calls: SocketCalls | None = None

    def start(self) -> None:
        """Attach at start-up, waiting at most ``timeout_s`` (so the first requests
        can hit); a fabric not there by then is tried again later."""
        self._try_connect()
        thread = self._connecting
        if thread is not None:
            thread.join(self.timeout_s)
        self._take_connection()

    @property
    def up(self) -> bool:
        """Whether calls go to the fabric now (a connection is tried, on a thread of
        its own, when it is time to; never waited for here)."""
        self._take_connection()
        if self.coordinator is None and self.clock() >= self._retry_at:
            self._try_connect()
        return self.coordinator is not None

    def _try_connect(self) -> None:
        if self._connecting is not None:
            return
        self._retry_at = self.clock() + self.retry_s
        self._connecting = threading.Thread(
            target=self._connect, name="kvfabric-connect", daemon=True
        )
        self._connecting.start()

    def _connect(self) -> None:
        from fabric.client import connect

        try:
            fabric = connect(self.name, self.address, self.ray_namespace)
            calls = None
            if fabric.config.runtime.submit_transport == "zmq":
                calls = open_socket(
                    lambda: fabric.result(fabric.coordinator.call_endpoint.remote(), 30),
                    fabric.config.runtime.max_message_bytes, self.timeout_s, self.clock,
                )  # fmt: skip
            config = fabric.config
            flags = (config.prefetch.stop_policy == "best_effort", config.events.enabled)
            result: Any = (fabric.coordinator, store_options(config), calls, flags)
        except Exception as exc:
            result = exc
        with self._lock:
            self._connected = result

    def _take_connection(self) -> None:
        with self._lock:
            result, self._connected = self._connected, None
        if result is None:
            return
        self._connecting = None
        if isinstance(result, Exception):
            self._down(f"cannot be reached ({result})")
            return
        self.coordinator, self.store, self.calls, (self.l2_only, self.names.wanted) = result
        log.info(
            "kvfabric connector: attached to fabric %r (L3 %s; calls %s)",
            self.name,
            self.store.path if self.store else "none the workers can open",
            "over its socket" if self.calls else "over Ray",
        )
        self._said_down = False

    def _down(self, why: str) -> None:
        self.coordinator = None
        self._reports.clear()
        if self.calls is not None:
            self.orders += self.calls.orders  # taken already: still carried out
            self.calls.close()
            self.calls = None
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

    def lookup(
        self,
        tag: str,
        world: int,
        chains: list[list[bytes]],
        leases: list[str] | None,
        lease_s: float,
        release: list[str],
        deadline: float,
        needs: list[tuple[str, int]] | None = None,
    ) -> Answers | None:
        """One step's lookups (their matches leased under ``leases`` for ``lease_s``;
        the leases ``release`` names ended first), in as many calls as the
        coordinator's bound asks, all answered by ``deadline``; ``None`` when the
        fabric is down or failed them. ``needs``: a hybrid engine's component
        groups (``EngineTree.lookup``)."""
        import ray

        if not chains or not self.up:
            return None
        if self.calls is not None:
            try:
                return decode_answers(self.calls.lookup(
                    tag, world, chains, leases, lease_s, release[:MAX_CHAINS_PER_CALL],
                    self.place, deadline, needs,
                ))  # fmt: skip
            except Exception as exc:
                self._down(f"failed a lookup ({type(exc).__name__}: {exc})")
                return None
            finally:
                if len(release) > MAX_CHAINS_PER_CALL:
                    self.release(tag, world, release[MAX_CHAINS_PER_CALL:])
        if not self._check_reports(in_flight=0, deadline=deadline):
            return None
        handles = []
        try:
            for at in range(0, len(chains), MAX_CHAINS_PER_CALL):
                part = slice(at, at + MAX_CHAINS_PER_CALL)
                handles.append(
                    self.coordinator.engine_lookup.remote(
                        tag, world, chains[part], leases[part] if leases else None, lease_s,
                        release[:MAX_CHAINS_PER_CALL] if at == 0 else [], self.place,
                        **({"needs": needs} if needs else {}),
                    )
                )  # fmt: skip
            rest = release[MAX_CHAINS_PER_CALL:]
            if rest:
                self.release(tag, world, rest)
            answers = ray.get(handles, timeout=max(deadline - self.clock(), 0.001))
        except Exception as exc:
            self._down(f"failed a lookup ({type(exc).__name__}: {exc})")
            return None
        for _, orders in answers:  # (among them, the room made for the pages asked)
            self.orders += orders
        return decode_answers([hit for hits, _ in answers for hit in hits])

    def release(self, tag: str, world: int, names: Sequence[str]) -> None:
        """End leases (their pages are loaded): sent without waiting."""
        if not names or not tag or not self.up:
            return
        try:
            for at in range(0, len(names), MAX_CHAINS_PER_CALL):
                part = list(names[at : at + MAX_CHAINS_PER_CALL])
                if self.calls is not None:
                    self.calls.release(tag, world, part, self.place)
                    continue
                self._reports.append(
                    self.coordinator.engine_lookup.remote(tag, world, [], None, 0.0, part)
                )
        except Exception as exc:
            self._down(f"failed a release ({exc})")
            return
        self._check_reports()

    def report(self, tag: str, world: int, stored: dict[int, list[StoredRun]]) -> None:
        """Send ranks' reports of stored pages (their reply is not waited for), in
        parts the coordinator takes, each with vLLM's names of its pages."""
        if not stored or not self.up:
            return
        try:
            for part in _report_parts(stored):
                named = self.names.take(h for runs in part.values() for r in runs for h in r.hashes)
                if self.calls is not None:
                    self.calls.report(tag, world, part, self.place, self.place_bytes, named)
                    continue
                self._reports.append(
                    self.coordinator.engine_report.remote(
                        tag, world, part, self.place, self.place_bytes, named
                    )
                )
        except Exception as exc:
            self._down(f"failed a report ({exc})")
            return
        self._check_reports()

    def report_stored(self, world: int, stored: Sequence[tuple[str, int, StoredRun]]) -> None:
        """Send ``(tag, rank, run)`` reports of stored pages, a report per tag."""
        by_tag: dict[str, dict[int, list[StoredRun]]] = {}
        for tag, rank, run in stored:
            by_tag.setdefault(tag, {}).setdefault(rank, []).append(run)
        for tag, reports in by_tag.items():
            self.report(tag, world, reports)

    def hold(
        self,
        tag: str,
        world: int,
        chain: Sequence[bytes],
        name: str,
        kind: str,
        ttl_s: float | None = None,
    ) -> None:
        """Keep a request's prefix in the fabric as a session or a pin (sent without
        waiting: the coordinator holds what it knows and waits for the rest)."""
        if not chain or not self.up:
            return
        chain = list(chain[:MAX_PAGES_PER_CALL])
        try:
            if self.calls is not None:
                self.calls.hold(tag, world, chain, name, kind, ttl_s)
            else:
                self._reports.append(
                    self.coordinator.engine_hold.remote(tag, world, chain, name, kind, ttl_s)
                )
        except Exception as exc:
            self._down(f"failed a hold ({exc})")
            return
        self._check_reports()

    def drop(
        self, tag: str, world: int, place: str, hashes: Sequence[bytes], everything: bool = False
    ) -> None:
        """Tell the fabric pages left this replica's blocks (``place``), or all did
        (sent without waiting)."""
        if not (hashes or everything) or not self.up:
            return
        try:
            for at in range(0, max(len(hashes), 1), MAX_PAGES_PER_CALL):
                part = list(hashes[at : at + MAX_PAGES_PER_CALL])
                if self.calls is not None:
                    self.calls.drop(tag, world, place, part, everything)
                    continue
                self._reports.append(
                    self.coordinator.engine_drop.remote(tag, world, place, part, everything)
                )
        except Exception as exc:
            self._down(f"failed a report ({exc})")
            return
        self._check_reports()

    def forget(self, tag: str, world: int, hashes: Sequence[bytes]) -> None:
        """Tell the fabric pages failed to load (sent without waiting)."""
        if not hashes or not self.up:
            return
        try:
            for at in range(0, len(hashes), MAX_PAGES_PER_CALL):
                part = list(hashes[at : at + MAX_PAGES_PER_CALL])
                if self.calls is not None:
                    self.calls.forget(tag, world, part)
                    continue
                self._reports.append(self.coordinator.engine_forget.remote(tag, world, part))
        except Exception as exc:
            self._down(f"failed a report ({exc})")
            return
        self._check_reports()

    def _check_reports(
        self, in_flight: int = MAX_REPORTS_IN_FLIGHT, deadline: float | None = None
    ) -> bool:
        """Collect replies that came; wait for the oldest until no more than
        ``in_flight`` are left (at most until ``deadline``, or ``timeout_s``).
        Whether the fabric is still up."""
        import ray

        if self.calls is not None:
            return self._check_socket(in_flight, deadline)
        if not self._reports:
            return True
        ready, pending = ray.wait(self._reports, num_returns=len(self._reports), timeout=0)
        if len(pending) > in_flight:
            wait_s = self.timeout_s if deadline is None else max(deadline - self.clock(), 0.0)
            more, pending = ray.wait(pending, num_returns=len(pending) - in_flight, timeout=wait_s)
            ready += more
            if len(pending) > in_flight:
                self._down(f"did not answer a report within {self.timeout_s} s")
                return False
        self._reports = pending
        for ref in ready:
            try:
                reply = ray.get(ref, timeout=0)
            except Exception as exc:
                self._down(f"failed a report ({type(exc).__name__}: {exc})")
                return False
            if isinstance(reply, tuple):  # a report's or release's: the orders to carry out
                self.orders += reply[1]
        return True

    def _check_socket(self, in_flight: int, deadline: float | None) -> bool:
        calls = self.calls
        assert calls is not None
        try:
            calls.settle(in_flight, self.clock() + self.timeout_s if deadline is None else deadline)
        except Exception as exc:
            self._down(f"failed a report ({type(exc).__name__}: {exc})")
            return False
        self.orders += calls.orders
        calls.orders = []
        return True

    def take_orders(self, ranks: int = 1) -> list[Order]:
        """The orders handed back since the last call (replies that came), for the
        engine's ``ranks`` workers to carry out (``orders_done`` counts them in)."""
        if self.coordinator is not None and (self._reports or self.calls is not None):
            self._check_reports()
        orders, self.orders = self.orders, []
        if orders:
            self._orders_out += ranks
            self._orders_since = self.clock()
        return orders

    def orders_done(self, batches: int) -> None:
        """Workers carried out ``batches`` of the orders handed to them."""
        self._orders_out = max(0, self._orders_out - batches)

    @property
    def busy(self) -> bool:
        """Whether the engine has fabric work to step for while it serves nothing:
        orders that came back and are not yet handed to the workers, or handed
        ones not reported carried out (given up after ``ORDERS_STALL_S``). Replies
        still on their way are not waited for (a step spinning for them takes the
        CPU the coordinator answers with): orders they bring go with the next step,
        and a page held for L3 stays held until then."""
        if self._orders_out and self.clock() - self._orders_since > ORDERS_STALL_S:
            self._orders_out = 0
        if self.coordinator is not None and (self._reports or self.calls is not None):
            self._check_reports()
        return bool(self.orders) or self._orders_out > 0

    def close(self) -> None:
        """Wait (at most ``timeout_s``) for the reports in flight to land."""
        if self.coordinator is not None and (self._reports or self.calls is not None):
            self._check_reports(in_flight=0)
        if self.calls is not None:
            self.orders += self.calls.orders  # taken already: still carried out
            self.calls.close()
            self.calls = None


class Answers(list):
    """A step's lookup answers (pages per chain), and per chain whether the answer
    is ``final``: the page after it is one the fabric's tree evicted from L3, so
    the store is not to be searched beyond it."""

    final: list[bool]


def decode_answers(wire: list[int]) -> Answers:
    """The coordinator's answers (``EngineSide.lookup``: ``-1 - pages`` when final)."""
    out = Answers(n if n >= 0 else -1 - n for n in wire)
    out.final = [n < 0 for n in wire]
    return out


def _report_parts(stored: dict[int, list[StoredRun]]) -> list[dict[int, list[StoredRun]]]:
    """``stored`` cut into reports of at most ``MAX_CHAINS_PER_CALL`` runs per rank."""
    parts: list[dict[int, list[StoredRun]]] = []
    for rank, runs in stored.items():
        for n, at in enumerate(range(0, len(runs), MAX_CHAINS_PER_CALL)):
            if n == len(parts):
                parts.append({})
            parts[n][rank] = list(runs[at : at + MAX_CHAINS_PER_CALL])
    return parts
