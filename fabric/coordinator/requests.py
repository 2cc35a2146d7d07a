"""What a request is while the coordinator serves it, what it hands back (a
``RequestResult`` with a ``Lease``), and the coordinator's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fabric.cache.admission import RequestKV
from fabric.cache.keys import TokenKey
from fabric.cache.results import TierTokens
from fabric.observe.histogram import SECONDS, Histogram
from fabric.observe.series import Series


@dataclass(frozen=True)
class Lease:
    """Holds a request's pages in L1 until released or expired. ``device_pages``
    hold the KV of its ``tokens`` (prompt, then any appended), one per page, the
    last maybe partial; ``epoch`` dies with a reset. ``token`` is unguessable: only the holder of the lease itself can
    release or renew it."""

    request_id: str
    token: str
    epoch: int
    namespace: str
    tokens: int
    device_pages: tuple[int, ...]
    ttl_s: float
    # A hybrid model's other components of the leased prefix: sliding-pool pages
    # of the window before its end as (key page, pool page), the mamba state at
    # its end as (end page, slot) — what is there (see ``fabric.cache.components``).
    sliding: tuple[tuple[int, int], ...] = ()
    mamba: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RequestResult:
    """Where a request's prompt tokens came from. ``error`` is set (and the rest
    zero) when it failed or was aborted."""

    request_id: str
    prompt_tokens: int
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    computed_tokens: int = 0
    latency_s: float = 0.0
    storage_hit_tokens: int = 0
    lease: Lease | None = None
    error: str | None = None


@dataclass(eq=False)
class ServingRequest:
    """A prompt (``tokens``, all of it; ``key`` its whole pages) on its way to a
    lease — or, with ``appended``, tokens decoded after a leased request, whose
    ``kv`` it carries on. ``base`` holds ``kv``'s tallies before this request."""

    rid: str
    key: TokenKey
    prompt_tokens: int
    priority: int
    submitted: float
    owner: str | None = None
    tokens: bytes = b""
    appended: bytes = b""
    kv: RequestKV | None = None
    base: tuple[int, int, int, int] = (0, 0, 0, 0)
    compute_cmds: tuple[int, ...] = ()
    aborted: bool = False
    prefetch_tried: bool = False
    prefetched: int = 0
    retries: int = 0
    session: str | None = None
    # The ``submit_many`` call it came in (0: alone): its driver gets every
    # result of the call at once, so none of their leases is in its hands before.
    group: int = 0

    @property
    def more_chunks(self) -> bool:
        return self.kv is not None and self.kv.filled < self.kv.num_tokens

    def tallies(self) -> tuple[int, int, int, int]:
        """Tokens this request hit in L1, L2, L3 and computed (its steps only)."""
        kv = self.kv
        if kv is None:
            return (0, 0, 0, 0)
        d, h, s, c = self.base
        return (kv.device_hit - d, kv.host_hit - h, kv.storage_hit - s, kv.computed - c)


@dataclass(eq=False)
class HeldLease:
    lease: Lease
    kv: RequestKV
    owner: str | None
    expires_at: float
    session: str | None = None
    group: int = 0  # its request's ``ServingRequest.group``


def _outcome(outcome: str, help: str) -> Series:
    return Series("kvfabric_requests", "counter", help, (("outcome", outcome),))


_OUTCOMES = (
    "Requests that ended, by outcome: finished (KV leased), failed (an error "
    "returned), aborted (by the client or a timeout)."
)


@dataclass
class FabricStats:
    """The coordinator's counters. A field annotated with a ``Series`` is a Prometheus
    series too (``fabric.observe.series``); the others are in ``stats()`` only."""

    submitted: Annotated[
        int,
        Series(
            "kvfabric_requests_submitted",
            "counter",
            "Requests submitted to the coordinator (decode appends included).",
        ),
    ] = 0
    finished: Annotated[int, _outcome("finished", _OUTCOMES)] = 0
    failed: Annotated[int, _outcome("failed", _OUTCOMES)] = 0
    aborted: Annotated[int, _outcome("aborted", _OUTCOMES)] = 0
    retried: Annotated[
        int,
        Series(
            "kvfabric_request_retries",
            "counter",
            "Requests put back in the queue after a reset (rank lost or restarted).",
        ),
    ] = 0
    gave_up: int = 0
    resets: Annotated[
        int,
        Series(
            "kvfabric_resets", "counter", "L1/L2 resets (a rank lost, restarted or failing a copy)."
        ),
    ] = 0
    rounds: Annotated[
        int,
        Series("kvfabric_consensus_rounds", "counter", "Consensus rounds (coordinator steps) run."),
    ] = 0
    # Steps that sent no round: nothing to send, nothing in flight (``round_needed``).
    rounds_skipped: int = 0
    prompt_tokens: int = 0
    tokens: Annotated[
        TierTokens,
        Series(
            "kvfabric_prompt_tokens",
            "counter",
            "Prompt tokens of finished requests by where their KV came from: device "
            "(L1 hit), host (L2, loaded back), storage (L3, prefetched) or computed.",
            by="source",
        ),
    ] = field(default_factory=TierTokens)
    latency_s_total: float = 0.0
    bad_messages: Annotated[
        int, Series("kvfabric_bad_messages", "counter", "Rank reports refused as malformed.")
    ] = 0
    step_errors: Annotated[
        int,
        Series(
            "kvfabric_step_errors",
            "counter",
            "Coordinator steps that failed and were recovered from.",
        ),
    ] = 0
    core_time_s: Annotated[
        float,
        Series(
            "kvfabric_coordinator_busy_seconds",
            "counter",
            "Seconds the coordinator spent in its own logic (admission, reduction, commit).",
        ),
    ] = 0.0
    storage_errors: Annotated[
        int, Series("kvfabric_storage_errors", "counter", "Calls to the storage actor that failed.")
    ] = 0
    storage_restores: int = 0
    leases_expired: Annotated[
        int,
        Series(
            "kvfabric_leases_expired",
            "counter",
            "Leases dropped because their TTL passed unrenewed.",
        ),
    ] = 0
    leases_reclaimed: Annotated[
        int,
        Series(
            "kvfabric_leases_reclaimed",
            "counter",
            "Leases dropped because the driver that held them exited.",
        ),
    ] = 0
    # L2 tokens a restarted coordinator took back from the ranks (``adopt``).
    adopted_tokens: Annotated[
        int,
        Series(
            "kvfabric_adopted_tokens",
            "counter",
            "L2 tokens a restarted coordinator took back from what every rank still held.",
        ),
    ] = 0
    sessions_refused: int = 0
    # Device sessions let go because a waiting request had no other way into L1.
    sessions_dropped_for_room: int = 0
    # KV events dropped from a full queue nobody took them from.
    events_dropped: Annotated[
        int,
        Series(
            "kvfabric_events_dropped",
            "counter",
            "KV events dropped from a full queue that nobody took them from.",
        ),
    ] = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    # Submit to result, and batch sent to reports reduced (one consensus round).
    request_seconds: Annotated[
        Histogram,
        Series(
            "kvfabric_request_duration_seconds",
            "histogram",
            "Seconds from a request's submission to its result (queueing, prefetch, "
            "load-back and compute included).",
        ),
    ] = field(default_factory=lambda: Histogram(SECONDS))
    round_seconds: Annotated[
        Histogram,
        Series(
            "kvfabric_consensus_round_duration_seconds",
            "histogram",
            "Seconds of one consensus round: batch sent to every rank until their "
            "reports are reduced (MIN/MAX).",
        ),
    ] = field(default_factory=lambda: Histogram(SECONDS))
