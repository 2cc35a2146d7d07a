"""What a request is while the coordinator serves it, what it hands back (a
``RequestResult`` with a ``Lease``), and the coordinator's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from fabric.cache.keys import TokenKey
from fabric.cache.node import TreeNode
from fabric.cache.results import TierTokens


@dataclass(frozen=True)
class Lease:
    """Holds a request's pages in L1 until released or expired. ``device_pages``
    cover the cached (page-aligned) part of the prompt; ``epoch`` dies with a
    reset. ``token`` is unguessable: only the holder of the lease itself can
    release or renew it."""

    request_id: str
    token: str
    epoch: int
    namespace: str
    tokens: int
    device_pages: tuple[int, ...]
    ttl_s: float


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
    rid: str
    key: TokenKey
    prompt_tokens: int
    priority: int
    submitted: float
    owner: str | None = None
    compute_cmds: tuple[int, ...] = ()
    node: TreeNode | None = None
    device_pages: tuple[int, ...] = ()
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed: int = 0
    aborted: bool = False
    prefetch_tried: bool = False
    prefetched: int = 0
    retries: int = 0


@dataclass(eq=False)
class HeldLease:
    lease: Lease
    node: TreeNode
    owner: str | None
    expires_at: float


@dataclass
class FabricStats:
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    retried: int = 0
    gave_up: int = 0
    resets: int = 0
    rounds: int = 0
    prompt_tokens: int = 0
    tokens: TierTokens = field(default_factory=TierTokens)
    latency_s_total: float = 0.0
    bad_messages: int = 0
    step_errors: int = 0
    core_time_s: float = 0.0
    storage_errors: int = 0
    storage_restores: int = 0
    leases_expired: int = 0
    leases_reclaimed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
