"""What a chaos run is asked for (``ChaosOptions``, the fault kinds), the small
fabric it runs (``chaos_config``), the prompts its clients send and what it
tallies while it runs."""

from __future__ import annotations

import random
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from fabric.config import FabricConfig
from fabric.errors import InvalidInput

# The clients' prompts go to these namespaces (tenants).
NAMESPACES = ("default", "tenant-a", "tenant-b")

# Coordinator counters the report sums over every coordinator of the run.
COUNTED = (
    "resets",
    "leases_reclaimed",
    "leases_expired",
    "adopted_tokens",
    "bad_messages",
    "step_errors",
    "storage_errors",
)

FAULTS = (
    "rank_kill",
    "rank_kill_no_restart",
    "rank_sigkill",
    "rank_sigstop",
    "rank_kill_in_collective",
    "storage_kill",
    "coordinator_kill",
    "node_loss",
    "node_lost_for_good",
    "l3_read_only",
    "l3_full",
    "duplicate_messages",
    "delayed_messages",
    "slow_rank",
    "l3_latency",
    "storage_sigkill",
    "overlapping",
    "client_exit",
)
# Faults ``overlapping`` injects two of at once (on the same rank when both take one).
OVERLAPPABLE = (
    "rank_kill",
    "rank_sigstop",
    "storage_kill",
    "l3_full",
    "duplicate_messages",
    "delayed_messages",
    "slow_rank",
    "l3_latency",
)


@dataclass
class ChaosOptions:
    seed: int = 0
    duration_s: float = 60.0
    nodes: int = 2  # a local cluster's nodes (head included)
    address: str | None = None  # an existing cluster instead
    faults: tuple[str, ...] = FAULTS
    fault_every_s: float = 4.0  # the mean gap between faults
    fault_hold_s: float = 3.0  # how long lasting faults last (SIGSTOP, L3, messages)
    warmup_fraction: float = 0.2  # the first part of the run has no faults
    clients: int = 2
    request_timeout_s: float = 30.0
    overrides: tuple[str, ...] = ()
    # The verdict's bounds on what faults may cost without it being a loss: leases
    # no rank could be asked about (a rank restarted between serve and verify),
    # and requests that failed, each a share of those tried.
    max_unverifiable_fraction: float = 0.05
    max_failed_fraction: float = 0.2
    # End the run once this many faults were tried and each waited out (recovered
    # from, or a minute passed), if that comes before ``duration_s`` (none: the
    # whole duration).
    max_faults: int | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise InvalidInput(
                f"fault kind(s) {', '.join(unknown)} refused: allowed are {', '.join(FAULTS)}"
            )
        if self.duration_s <= 0 or self.clients < 1:
            raise InvalidInput(
                f"duration_s={self.duration_s}, clients={self.clients} refused: allowed are "
                "a positive duration and at least one client"
            )
        for name in ("max_unverifiable_fraction", "max_failed_fraction"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise InvalidInput(f"{name}={value!r} refused: allowed is a number in [0, 1]")
        if self.max_faults is not None and (
            isinstance(self.max_faults, bool)
            or not isinstance(self.max_faults, int)
            or self.max_faults < 1
        ):
            raise InvalidInput(
                f"max_faults={self.max_faults!r} refused: allowed is a whole number >= 1, or none"
            )
        if self.address is None and self.nodes < 2:
            raise InvalidInput(
                f"nodes={self.nodes} refused: a local cluster needs at least 2 (the head "
                "node holds the coordinator and storage actor, the others the ranks)"
            )


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the start
    ended: float | None = None
    target: str = ""
    recovered_at: float | None = None
    injected: bool = False
    adopted_tokens: int | None = None  # coordinator_kill: what its successor took back


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (submitted, completed) of each served request: recovery counts only
    # requests submitted after a fault.
    spans: list[tuple[float, float]] = field(default_factory=list)
    probe: tuple[float, float] | None = None  # the request served after the run
    failed: Counter[str] = field(default_factory=Counter)
    wrong_pages: int = 0
    verified: int = 0
    unverifiable: int = 0
    latencies: list[float] = field(default_factory=list)
    load: Counter[str] = field(default_factory=Counter)  # what the clients did
    # Requests refused because a rank was absent past rank_absent_timeout_s: the
    # fabric saying it cannot serve a shard (expected while a node is lost for
    # good), not a failure of the harness's bound.
    refused_absent: int = 0


def chaos_config(opts: ChaosOptions, l3_path: str) -> FabricConfig:
    """A small fabric (TP=2 x PP=2, CPU pools, the default L3) with short timeouts, so
    faults are seen and recovered from within seconds."""
    return FabricConfig().with_overrides(
        [
            f"runtime.name=kvfabric-chaos-{opts.seed}",
            "runtime.ray_namespace=kvfabric-chaos",
            "runtime.dashboard=false",
            "runtime.rank_timeout_s=2",
            "runtime.rank_absent_timeout_s=20",
            "runtime.lease_ttl_s=60",
            "topology.tp=2",
            "topology.pp=2",
            "cache.page_size=4",
            "cache.device_tokens=256",
            "cache.host_tokens=512",
            "cache.load_back_threshold=0",
            "model.layers=2",
            "model.kv_heads=2",
            "model.head_dim=8",
            "prefetch.threshold_tokens=4",
            "cache.chunk_tokens=8",  # longer prompts are placed in chunks of two pages
            f"storage.path={l3_path}",
            *opts.overrides,
        ]
    )


def prompt(rng: random.Random, page_size: int, vocab: int | None = None) -> list[int]:
    """A prompt from a few shared prefixes and a unique tail (whole pages); with
    ``vocab`` (a model behind the ranks), every token within ``[0, vocab)``."""
    family = rng.randrange(6)
    shared = [family * 1000 + t for t in range(page_size * rng.randint(1, 6))]
    own = [rng.randrange(100_000, 200_000) for _ in range(page_size * rng.randint(0, 4))]
    if vocab is not None:  # spread over the vocabulary; the families stay apart
        shared = [(family * 7919 + i * 104_729 + i * i) % vocab for i in range(len(shared))]
        own = [rng.randrange(vocab) for _ in own]
    return shared + own


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linearly interpolated between the nearest ranks (of two
    values, the median is their mean and p99 nearly the larger)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    at = q * (len(s) - 1)
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


# What a request refused for an absent rank says (CoordinatorCore._fail_if_absent_too_long).
ABSENT = "has not answered for"


def reason(error: str) -> str:
    """A request error's kind, for counting (the text before any detail, times and
    ids as N so that one kind counts once)."""
    head = re.sub(r"[0-9a-f]{16,}|\d+\.\d+", "N", error.split(":")[0].strip())
    return head[:80] or "error"
