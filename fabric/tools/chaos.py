"""``kvfabric chaos``: a workload against a fabric while a seeded killer injects
faults, then proof that nothing was lost or corrupted.

The fabric runs on a local multi-node Ray (``ray.cluster_utils.Cluster``: a
head node for the coordinator and the storage actor, worker nodes for the
ranks) or on an existing cluster (``address``). Clients submit prompts that
share prefixes (so L1, L2 and L3 all serve), verify every served lease on every
rank and release it. After a fault-free warm-up, a killer injects one fault at a
time, at random moments drawn from the seed, from ``FAULTS``:

- ``rank_kill``: a rank actor killed; Ray restarts it;
- ``rank_kill_no_restart``: a rank actor killed for good; the harness makes a
  new one under its name, which the coordinator finds;
- ``rank_sigkill``: a rank's worker process SIGKILLed (Ray restarts it);
- ``rank_sigstop``: a rank's process stopped for longer than the rank timeout,
  then continued;
- ``rank_kill_in_collective``: a rank stalls before its next command, so that
  with a sharded model (``model.filler=llama``) its peers wait for it inside a
  collective of the next compute, then it is killed (Ray restarts it): the
  compute fails, the epoch resets and the ranks form a new group;
- ``storage_kill``: the storage actor killed while it holds a backup or a
  prefetch batch (the batches are held until one arrives, then it is killed);
- ``coordinator_kill``: the coordinator killed; its successor adopts the L2
  pages every rank holds;
- ``node_loss``: a worker node removed, and a new one added after a while (its
  ranks come back on it; local clusters only);
- ``node_lost_for_good``: a worker node removed with no replacement until the
  fabric refuses requests naming the absent rank (it must fail fast, not hold
  them), then capacity returns; those refusals are counted apart
  (``refused_rank_absent``), not against the failure bound;
- ``l3_read_only``, ``l3_full``: L3 refuses every write for a while — as
  root on a local cluster, for real: L3 lives on a tmpfs of its own, remounted
  read-only (EROFS) or filled by a ballast file (ENOSPC); else a flag in the
  storage actor;
- ``duplicate_messages``, ``delayed_messages``: a rank takes every step's
  message twice, or replies to every round later than ``runtime.rank_timeout_s``
  (so it counts as absent), for a while;
- ``slow_rank``: a rank runs every command 0.6 s late for a while — alive,
  answering, a straggler (the report says whether it was named);
- ``l3_latency``: every L3 batch a second late, for a while;
- ``storage_sigkill``: the storage actor's process SIGKILLed at whatever it was
  doing (Ray restarts it);
- ``overlapping``: two of the faults above at once (``OVERLAPPABLE``), on the
  same rank where both take one;
- ``client_exit``: a driver process submits a prompt and exits holding its
  lease (the coordinator must reclaim it).

After the run every fault is lifted, the fabric must serve again, every lease
is released, and it must settle: then ``check_integrity`` on the coordinator,
no lease or L1/L2 slot left held (``leaked_slots``), no request left waiting
(``stuck_requests``), and every lease served during the run verified on every
rank (``wrong_pages``: pages some rank held wrongly). The report gives requests
served and failed (with reasons), recovery time per fault kind (from the fault,
or a lasting fault's end, to the first request submitted after it being
served), throughput with and without faults, where the actors ran, and every L3
page checked as a read would check it. The verdict is strict: ``ok`` is false,
``loss`` says why, and the CLI exits 1 on a wrong page (any rank answering no,
whatever the others say), anything left held or stuck, an integrity error, a
fault that was not injected or not recovered from, an L3 page the audit
refused, or more unverifiable leases or failed requests than
``max_unverifiable_fraction`` / ``max_failed_fraction`` allow. Counters
(``resets``, ``leases_reclaimed``, ...) are sums over every coordinator of the
run. A backend that cannot list its pages has its audit reported as skipped;
a crash of the harness itself is exit 3, never taken for a verdict. Ray is
imported inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fabric.config import FabricConfig
from fabric.errors import InvalidInput
from fabric.topology import Topology

log = logging.getLogger(__name__)

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


class Chaos:
    def __init__(self, opts: ChaosOptions, progress: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.progress = progress
        self.rng = random.Random(opts.seed)
        self.tally = Tally()
        self.faults: list[Fault] = []
        self.stop = threading.Event()
        self.cluster: Any = None
        self.fabric: Any = None
        self.config: FabricConfig | None = None
        self.t0 = 0.0
        self.stopped_pids: set[int] = set()
        self.placed: dict[str, dict] = {}
        # The last stats of each coordinator killed: its counters end with it, and
        # the report's are sums over every incarnation.
        self.incarnations: list[dict] = []
        self.l3_mount: str | None = None  # L3's own tmpfs (mount_l3)

    # -- the cluster and the fabric -----------------------------------------------

    def start(self, l3_path: str) -> None:
        import ray

        from actors.factory import HEAD_RESOURCE
        from fabric.client import launch

        opts = self.opts
        self.config = chaos_config(opts, l3_path)  # a bad --set is refused before any Ray
        self.mount_l3(l3_path)
        if opts.address is None:
            from ray.cluster_utils import Cluster

            # The head runs the coordinator and the storage actor (no CPU for
            # ranks); the ranks run on the worker nodes, a stage packed on one.
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 0, "resources": {HEAD_RESOURCE: 100}},
            )
            for _ in range(opts.nodes - 1):
                self.cluster.add_node(num_cpus=2)
            ray.init(address=self.cluster.address, namespace="kvfabric-chaos", log_to_driver=False)
        self.fabric = launch(self.config, address=opts.address, announce=False)

    def close(self) -> None:
        import ray

        for pid in list(self.stopped_pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        if self.fabric is not None:
            with contextlib.suppress(Exception):
                self.fabric.shutdown()  # its actors only: nothing else on a given cluster
        with contextlib.suppress(Exception):
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
        self.unmount_l3()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the workload --------------------------------------------------------------

    def client(self, seed: int) -> None:
        """Prompts in several namespaces, some continued by decoding (``append``),
        some kept by a session between turns, some pinned or unpinned after: every
        lease served, a prompt's or a decode step's, verified on every rank."""
        rng = random.Random(seed)
        fabric, tally = self.fabric, self.tally
        assert self.config is not None
        ps = self.config.cache.page_size
        model = self.config.model
        vocab = model.vocab_size if model.runs_model else None
        while not self.stop.is_set():
            tokens = prompt(rng, ps, vocab)
            namespace = rng.choice(NAMESPACES)
            session = (
                f"chat-{seed}-{rng.randrange(4)}" if rng.random() < 0.25 else None
            )  # settle ends them
            started, submitted = time.monotonic(), self.now()
            try:
                r = fabric.submit(
                    tokens,
                    namespace=namespace,
                    timeout=self.opts.request_timeout_s,
                    session=session,
                )
            except Exception as exc:  # the coordinator restarting, a timeout
                self.failed("", exc)
                time.sleep(0.2)
                continue
            if r.error is not None:
                with tally.lock:
                    tally.failed[_reason(r.error)] += 1
                    if ABSENT in r.error:
                        tally.refused_absent += 1
                time.sleep(0.1)
                continue
            self.check(r, tokens)
            with tally.lock:
                tally.spans.append((submitted, self.now()))
                tally.latencies.append(time.monotonic() - started)
                tally.load["submit"] += 1
                tally.load["namespace " + namespace] += 1
            lease = r.lease
            if rng.random() < 0.3:
                lease, tokens = self.decode(r, tokens, rng, vocab)
            with contextlib.suppress(Exception):
                fabric.release(lease, session=session)
                if session is not None:
                    with tally.lock:
                        tally.load["session kept"] += 1
            draw = rng.random()
            with contextlib.suppress(Exception):
                if draw < 0.05:
                    fabric.pin(tokens, ttl_s=5.0, namespace=namespace)
                    with tally.lock:
                        tally.load["pin"] += 1
                elif draw < 0.08:
                    fabric.unpin(tokens, namespace=namespace)
                    with tally.lock:
                        tally.load["unpin"] += 1

    def decode(
        self, r: Any, tokens: list[int], rng: random.Random, vocab: int | None
    ) -> tuple[Any, list[int]]:
        """Decode a few tokens onto a served lease, verifying each step's lease;
        returns the lease to release and the tokens it covers."""
        assert self.config is not None
        lease = r.lease
        for _ in range(rng.randint(1, 2 * self.config.cache.page_size)):
            token = rng.randrange(vocab or 100_000)
            try:
                step = self.fabric.append(lease, [token], timeout=self.opts.request_timeout_s)
            except Exception as exc:
                self.failed("append: ", exc)
                break
            if step.error is not None:  # a reset fails a decode in flight
                with self.tally.lock:
                    self.tally.failed["append: " + _reason(step.error)] += 1
                break
            tokens = [*tokens, token]
            self.check(step, tokens)
            lease = step.lease
            with self.tally.lock:
                self.tally.load["append"] += 1
        return lease, tokens

    def failed(self, prefix: str, exc: Exception) -> None:
        name = type(exc).__name__
        if not type(exc).__module__.startswith("ray"):  # ours: say what it was
            name += f": {_reason(str(exc))}"
        with self.tally.lock:
            self.tally.failed[prefix + name] += 1

    def check(self, r: Any, tokens: list[int]) -> None:
        """Verify a served lease on every rank: a rank that says no holds wrong pages
        (whatever the others answer); a lease no rank denies but one cannot answer
        for (a fault) is unverifiable."""
        try:
            ok = self.fabric.verify(r, tokens)
        except Exception:
            with self.tally.lock:
                self.tally.unverifiable += 1
            return
        assert self.config is not None
        pages = -(-r.lease.tokens // self.config.cache.page_size)
        with self.tally.lock:
            wrong = sum(1 for x in ok if x is False)
            if wrong:  # a rank that answers no holds wrong pages, whatever the others say
                self.tally.verified += 1
                self.tally.wrong_pages += pages * wrong
            elif None in ok:  # a rank restarted since: the lease is ending, not wrong
                self.tally.unverifiable += 1
            else:
                self.tally.verified += 1

    # -- the killer ----------------------------------------------------------------

    def killer(self) -> None:
        opts = self.opts
        start = opts.warmup_fraction * opts.duration_s
        while not self.stop.wait(max(0.0, start - self.now())):
            if self.now() >= start:
                break
        order: list[str] = []
        # No fault in the last tenth (at least 5 s): the last one is seen recovered.
        last = opts.duration_s - max(5.0, 0.1 * opts.duration_s)
        while not self.stop.is_set() and self.now() < last:
            if not order:  # every kind once, in a seeded order, then again
                order = list(opts.faults)
                self.rng.shuffle(order)
            kind = order.pop()
            fault = Fault(kind, self.now())
            try:
                self.inject(fault)
                fault.injected = True
            except Exception as exc:
                log.warning("chaos: %s could not be injected: %s", kind, exc)
                fault.target += f" (not injected: {type(exc).__name__}: {str(exc)[:120]})"
            if fault.ended is None:  # a lasting fault ends when it is lifted
                fault.ended = self.now()
            self.faults.append(fault)
            self.progress(f"{fault.at:7.1f}s  {kind} {fault.target}")
            # The next fault comes once this one is recovered from (a request
            # submitted after it ended was served; at most a minute) and a seeded gap.
            self.wait_served_after(fault.ended, 60.0)
            gap = self.rng.expovariate(1.0 / opts.fault_every_s)
            if self.stop.wait(max(0.5, gap)):
                break

    def wait_served_after(self, t: float, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            with self.tally.lock:
                if any(start >= t for start, _ in self.tally.spans[-50:]):
                    return
            self.stop.wait(0.1)

    def inject(self, fault: Fault, index: int | None = None) -> None:
        import ray

        from actors.factory import recreate_rank

        fabric, rng, hold = self.fabric, self.rng, self.opts.fault_hold_s
        deployment = fabric._deployment
        if index is None:
            index = rng.randrange(len(deployment.ranks))
        rank = deployment.ranks[index]
        kind = fault.kind
        if kind == "overlapping":
            self.overlap(fault, index)
            return
        on_rank = kind.startswith(("rank", "dup", "del", "slow"))
        fault.target = f"rank {index}" if on_rank else ""
        if kind == "rank_kill":
            ray.kill(rank, no_restart=False)
            fault.ended = self.now()
        elif kind == "rank_kill_no_restart":
            ray.kill(rank, no_restart=True)
            fault.ended = self.now()
            time.sleep(1.0)
            recreate_rank(deployment, self.config, index)
        elif kind in ("rank_sigkill", "rank_sigstop"):
            pid, node = ray.get(rank.where.remote(), timeout=10)
            if not self._local(node):
                raise RuntimeError("signals need the rank on this machine")
            if kind == "rank_sigkill":
                os.kill(pid, signal.SIGKILL)
                fault.ended = self.now()
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stopped_pids.add(pid)
                self.stop.wait(hold + self.config.runtime.rank_timeout_s)
                os.kill(pid, signal.SIGCONT)
                self.stopped_pids.discard(pid)
        elif kind == "rank_kill_in_collective":
            ray.get(rank.set_faults.remote(delay_s=3600.0), timeout=10)
            # Its peers reach the next compute and wait for it in a collective.
            self.stop.wait(min(hold, 1.5))
            ray.kill(rank, no_restart=False)  # the restarted actor has no faults
            fault.ended = self.now()
        elif kind == "storage_kill":
            storage = self.pick_storage(deployment)
            ray.get(storage.set_faults.remote(hold=True), timeout=10)
            deadline, held = time.monotonic() + 5.0, 0
            while time.monotonic() < deadline and not held:
                held = ray.get(storage.holding.remote(), timeout=10)
                time.sleep(0.05)
            fault.target = f"mid-transfer ({held} page batches held)" if held else "idle"
            if len(deployment.storages) > 1:
                fault.target += f", storage actor {deployment.storages.index(storage)}"
            ray.kill(storage, no_restart=False)  # the restarted actor holds nothing
            fault.ended = self.now()
        elif kind == "client_exit":
            fault.target = self.client_exits()
            fault.ended = self.now()
        elif kind == "coordinator_kill":
            last = fabric.stats()
            before = last["epoch"]
            ray.kill(fabric.coordinator, no_restart=False)
            self.incarnations.append(last)
            fault.ended = self.now()
            fault.adopted_tokens = self.adopted_after(before)
        elif kind == "node_loss":
            self.lose_node(rank, hold)
        elif kind == "node_lost_for_good":
            self.lose_node_for_good(rank, index, fault)
        elif kind in ("l3_full", "l3_read_only") and self.l3_mount is not None:
            failed = self.l3_writes_failed()
            (self.fill_l3 if kind == "l3_full" else self.read_only_l3)(fault, hold)
            failed = max(0, self.l3_writes_failed() - failed)
            fault.target += f" ({failed} page writes failed)"
        elif kind in ("l3_read_only", "l3_full"):
            l3 = kind.removeprefix("l3_")  # the store: every storage actor sees it
            ray.get([s.set_faults.remote(l3=l3) for s in deployment.storages], timeout=10)
            self.stop.wait(hold)
            ray.get([s.set_faults.remote() for s in deployment.storages], timeout=10)
        elif kind == "storage_sigkill":  # the process, at whatever it was doing
            storage = self.pick_storage(deployment)
            pid, node = ray.get(storage.where.remote(), timeout=10)
            if not self._local(node):
                raise RuntimeError("signals need the storage actor on this machine")
            os.kill(pid, signal.SIGKILL)
            fault.ended = self.now()
            if len(deployment.storages) > 1:
                fault.target = f"storage actor {deployment.storages.index(storage)}"
        elif kind == "l3_latency":  # every L3 batch a second late, for a while
            ray.get([s.set_faults.remote(delay_s=1.0) for s in deployment.storages], timeout=10)
            self.stop.wait(hold)
            ray.get([s.set_faults.remote() for s in deployment.storages], timeout=10)
        elif kind == "slow_rank":  # every command late: a straggler, alive
            named = fabric.stats()["ranks"]["stragglers_named"]
            self.rank_call(lambda: rank.set_faults.remote(delay_s=0.6), 10)
            self.stop.wait(max(hold, 6.0))
            self.rank_call(lambda: rank.set_faults.remote(), 10)
            if fabric.stats()["ranks"]["stragglers_named"] > named:
                fault.target += " (named a straggler)"
        else:
            # A duplicated message, or replies later than runtime.rank_timeout_s:
            # the rank counts as absent each round until it is lifted.
            assert self.config is not None
            late = 1.5 * self.config.runtime.rank_timeout_s
            what = {"duplicate": True} if kind == "duplicate_messages" else {"reply_delay_s": late}
            self.rank_call(lambda: rank.set_faults.remote(**what), 10)
            self.stop.wait(hold)
            self.rank_call(lambda: rank.set_faults.remote(), 10 + late)

    def rank_call(self, call: Callable[[], Any], timeout_s: float) -> Any:
        """``ray.get(call())`` on a rank that an overlapping fault may be restarting
        (a restarting actor is unavailable for a while): tried again until it
        answers, for up to a minute."""
        import ray

        deadline = time.monotonic() + 60.0
        while True:
            try:
                return ray.get(call(), timeout=timeout_s)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def overlap(self, fault: Fault, index: int) -> None:
        """Two faults at once, each on its own thread (on the same rank where both
        take one); the fault ends when both have."""
        first, second = self.rng.sample(
            [k for k in OVERLAPPABLE if k in self.opts.faults] or list(OVERLAPPABLE), 2
        )
        parts = [Fault(first, fault.at), Fault(second, fault.at)]
        errors: list[str] = []

        def run(part: Fault) -> None:
            try:
                self.inject(part, index)
                part.injected = True
            except Exception as exc:
                errors.append(f"{part.kind}: {type(exc).__name__}: {str(exc)[:100]}")
            part.ended = part.ended if part.ended is not None else self.now()

        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fault.target = " + ".join(f"{p.kind} {p.target}".strip() for p in parts)
        fault.ended = max(p.ended or p.at for p in parts)
        if errors:
            raise RuntimeError("; ".join(errors))

    def client_exits(self) -> str:
        """Another driver submits a prompt and exits (``os._exit``) holding its lease."""
        import subprocess
        import sys

        import ray

        assert self.config is not None
        rt = self.config.runtime
        address = ray.get_runtime_context().gcs_address
        code = (
            "import os\n"
            "from fabric.client import connect\n"
            f"f = connect({rt.name!r}, {address!r}, {rt.ray_namespace!r})\n"
            f"r = f.submit([9] * {4 * self.config.cache.page_size}, timeout=30)\n"
            "print('held' if r.lease is not None else r.error, flush=True)\n"
            "os._exit(0)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        said = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-200:]]
        return f"a driver exited holding a lease: {said[0]}"

    def adopted_after(self, epoch: int, limit_s: float = 60.0) -> int | None:
        """The L2 tokens the coordinator that follows ``epoch`` adopted."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not self.stop.is_set():
            with contextlib.suppress(Exception):
                stats = self.fabric.stats()
                if stats["epoch"] > epoch:
                    return int(stats["counters"]["adopted_tokens"])
            time.sleep(0.2)
        return None

    def _local(self, node_id: str) -> bool:
        """The node is this machine (a process there can be signalled from here)."""
        import ray

        here = ray.util.get_node_ip_address()
        return any(
            n["NodeID"] == node_id and n["Alive"] and n["NodeManagerAddress"] == here
            for n in ray.nodes()
        )

    def lose_node(self, rank: Any, hold: float) -> None:
        """Remove the worker node a rank runs on; add a new one after ``hold``."""
        import ray

        if self.cluster is None:
            raise RuntimeError("node loss needs a local cluster")
        _, node_id = ray.get(rank.where.remote(), timeout=10)
        victim = next(
            (n for n in self.cluster.worker_nodes if n.node_id == node_id),
            None,
        )
        if victim is None:
            raise RuntimeError("that rank is on the head node")
        self.cluster.remove_node(victim, allow_graceful=False)
        self.stop.wait(hold)
        self.cluster.add_node(num_cpus=2)

    def mount_l3(self, path: str) -> None:
        """L3 on a tmpfs of its own where this process may mount one (root on a
        local cluster), so that ``l3_full`` fills a real file system (writes fail
        with ENOSPC) instead of setting a flag in the storage actor."""
        import subprocess

        if self.opts.address is not None or os.geteuid() != 0:
            return
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "kvfabric-chaos-l3", path],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            self.l3_mount = path
        else:
            log.info("chaos: L3 on the directory as it is (no tmpfs: %s)", done.stderr.strip())

    def unmount_l3(self) -> None:
        import subprocess

        if self.l3_mount is not None:
            subprocess.run(["umount", "-l", self.l3_mount], capture_output=True)
            self.l3_mount = None

    def fill_l3(self, fault: Fault, hold: float) -> None:
        """Fill L3's file system for ``hold`` seconds: every write fails for real."""
        assert self.l3_mount is not None
        ballast = os.path.join(self.l3_mount, ".chaos-ballast")
        fd = os.open(ballast, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            st = os.statvfs(self.l3_mount)
            free = st.f_bavail * st.f_frsize
            while free > 0:  # metadata takes a little: the largest that fits
                try:
                    os.posix_fallocate(fd, 0, free)
                    break
                except OSError:
                    free -= 1 << 20
            fault.target = f"tmpfs filled ({free >> 20} MiB of ballast)"
            self.stop.wait(hold)
        finally:
            os.close(fd)
            os.unlink(ballast)

    def pick_storage(self, deployment: Any) -> Any:
        """The storage actor a fault hits: one of ``storage.actors``, drawn (a
        single one draws nothing, so a seed's schedule stays what it was)."""
        storages = deployment.storages
        return storages[0] if len(storages) == 1 else self.rng.choice(storages)

    def l3_writes_failed(self) -> int:
        """Page writes L3 refused so far (the storage actors' counts: one that is
        down counts 0, so a difference across a storage restart may undercount)."""
        import ray

        total = 0
        for storage in self.fabric._deployment.storages:
            try:
                total += int(ray.get(storage.stats.remote(), timeout=10).get("set_failed", 0))
            except Exception:
                continue
        return total

    def read_only_l3(self, fault: Fault, hold: float) -> None:
        """Remount L3's file system read-only under the running fabric for ``hold``
        seconds: every write fails with EROFS, reads go on. The store holds no
        file open for writing between appends; one in flight makes the remount
        busy for a moment, so it is tried again."""
        import subprocess

        assert self.l3_mount is not None

        def remount(mode: str) -> None:
            cmd = ["mount", "-o", f"remount,bind,{mode}", self.l3_mount]
            deadline = time.monotonic() + 10.0
            while True:
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode == 0:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"remount {mode}: {done.stderr.strip()[:200]}")
                time.sleep(0.05)

        remount("ro")
        fault.target = "L3 file system remounted read-only"
        try:
            self.stop.wait(hold)
        finally:
            remount("rw")

    def lose_node_for_good(self, rank: Any, index: int, fault: Fault) -> None:
        """Remove the worker node a rank runs on with no replacement: the fabric
        must say it cannot serve that shard — requests refused naming the rank
        once it is absent past ``runtime.rank_absent_timeout_s`` — rather than
        hold them; then capacity returns (a new node) and it must serve again."""
        import ray

        if self.cluster is None:
            raise RuntimeError("node loss needs a local cluster")
        assert self.config is not None
        _, node_id = ray.get(rank.where.remote(), timeout=10)
        victim = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if victim is None:
            raise RuntimeError("that rank is on the head node")
        with self.tally.lock:
            before = self.tally.refused_absent
        removed = self.now()
        self.cluster.remove_node(victim, allow_graceful=False)
        limit = self.config.runtime.rank_absent_timeout_s
        deadline = time.monotonic() + limit + 30
        refused_at = replaced_at = None
        while not self.stop.is_set() and time.monotonic() < deadline:
            with self.tally.lock:
                if self.tally.refused_absent > before:
                    refused_at = self.now()
                    break
            try:  # spare capacity: Ray places the stage again on a node that is left
                if ray.get(rank.where.remote(), timeout=1.0)[1] != node_id:
                    replaced_at = self.now()
                    break
            except Exception:
                pass
            self.stop.wait(0.2)
        self.stop.wait(1.0)  # a few more refused at once
        self.cluster.add_node(num_cpus=2)  # capacity returns
        fault.ended = self.now()
        if replaced_at is not None:
            fault.target = (
                f"rank {index}'s node removed; the cluster had room: its stage was placed "
                f"again {replaced_at - removed:.1f} s after, nothing to refuse"
            )
            return
        if refused_at is None:
            raise RuntimeError(f"rank {index}'s node removed: no request was refused naming it")
        fault.target = (
            f"rank {index}'s node removed for {fault.ended - removed:.1f} s; requests refused "
            f"naming the rank {refused_at - removed:.1f} s after (rank_absent_timeout_s {limit})"
        )

    def placement(self) -> dict:
        """Where the actors are: the coordinator and the storage actor on the nodes
        with ``runtime.control_resource``, each pipeline stage's ranks on one node."""
        import ray

        assert self.config is not None
        deployment = self.fabric._deployment
        resource = self.config.runtime.control_resource
        control = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)}
        coordinator = ray.get(self.fabric.coordinator.where.remote(), timeout=30)[1]
        storages = [ray.get(s.where.remote(), timeout=30)[1] for s in deployment.storages]
        nodes = [ray.get(r.where.remote(), timeout=30)[1] for r in deployment.ranks]
        topo = Topology(self.config.topology)
        stages = [
            {nodes[topo.ranks.index(r)] for r in topo.stage(pp)}
            for pp in range(self.config.topology.pp)
        ]
        return {
            "coordinator_on_control_node": coordinator in control,
            "storage_on_control_node": all(node in control for node in storages),
            "stages_packed": all(len(s) == 1 for s in stages),
            "rank_nodes": len(set(nodes)),
        }

    def scan_l3(self) -> dict:
        """Every page in L3, read back as a prefetch reads it (through a backend of
        the fabric's kind on the same directory): valid, or the reason the read
        refuses it (a counted miss, never served)."""
        import numpy as np

        from fabric.l3 import make_backend
        from fabric.l3.service import StorageService, backend_spec, provenance_bytes

        assert self.config is not None
        off = self.config.replace(storage={**self.config.storage.model_dump(), "backend": "none"})
        shapes = StorageService(off).shapes
        by_tag = {(prov.tag, suffix): prov for (_, suffix), prov in shapes.items()}
        name, options = backend_spec(self.config.storage)
        any_prov = next(iter(shapes.values()))
        backend = make_backend(name, any_prov, provenance_bytes(any_prov), options)
        out: Counter[str] = Counter()
        try:
            for key in backend.page_keys():
                _, tag, suffix = key.split(".")
                prov = by_tag.get((tag, suffix))
                if prov is None:
                    out["foreign"] += 1
                    continue
                row = np.empty((1, provenance_bytes(prov)), dtype=np.uint8)
                out["valid"] += backend.get([key], row, prov)
            refused = backend.stats()
        finally:
            backend.close()
        for reason, n in refused.items():
            if reason.startswith("refused_") or reason == "get_miss":
                out[reason.removeprefix("refused_")] += n
        return dict(out)

    # -- the run -------------------------------------------------------------------

    def run(self) -> dict:
        opts = self.opts
        self.placed = {"start": self.placement()}
        self.t0 = time.monotonic()
        threads = [
            threading.Thread(target=self.client, args=(opts.seed * 1000 + i,), daemon=True)
            for i in range(opts.clients)
        ]
        for t in threads:
            t.start()
        timer = threading.Timer(opts.duration_s, self.stop.set)
        timer.start()
        try:
            # In this thread: adding and removing nodes needs the main thread.
            self.killer()
        finally:
            self.stop.set()
            timer.cancel()
        for t in threads:
            t.join(timeout=opts.request_timeout_s + 10)
        end = self.now()
        return self.report(end, self.settle())

    def settle(self) -> dict:
        """Every fault lifted: the fabric must serve again, hold nothing and settle."""
        import ray

        for pid in list(self.stopped_pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        fabric = self.fabric
        for storage in fabric._deployment.storages:
            with contextlib.suppress(Exception):
                ray.get(storage.set_faults.remote(), timeout=30)
        for rank in fabric._deployment.ranks:
            with contextlib.suppress(Exception):
                ray.get(rank.set_faults.remote(), timeout=30)
        out: dict[str, Any] = {"serving_again_s": None, "integrity_errors": []}
        started = time.monotonic()
        assert self.config is not None
        probe = [7] * (4 * self.config.cache.page_size)
        while time.monotonic() - started < 120:
            submitted = self.now()
            try:
                r = fabric.submit(probe, timeout=20)
            except Exception:
                time.sleep(1.0)
                continue
            if r.error is None:
                self.check(r, probe)
                fabric.release(r.lease)
                out["serving_again_s"] = round(time.monotonic() - started, 2)
                self.tally.probe = (submitted, self.now())  # a late fault recovers by it
                break
            time.sleep(0.5)
        # The clients' sessions end (a kept session holds its L1 pages on purpose).
        for i in range(self.opts.clients):
            for k in range(4):
                with contextlib.suppress(Exception):
                    fabric.end_session(f"chat-{self.opts.seed * 1000 + i}-{k}")
        settled = False
        with contextlib.suppress(Exception):
            settled = fabric.settle(60)
        out["settled"] = settled
        # A driver that exited holding a lease has it reclaimed once the coordinator
        # sees its job dead (it looks every few seconds): give it that long.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if fabric.stats()["now"]["leases"] == 0:
                    break
            time.sleep(0.5)
        try:
            out["l3_pages"] = self.scan_l3()
        except Exception as exc:  # a backend that cannot list its pages, or is gone
            out["l3_pages"] = {"skipped": f"{type(exc).__name__}: {str(exc)[:200]}"}
        try:
            self.placed["end"] = self.placement()
        except Exception as exc:
            self.placed["end"] = {"error": str(exc)[:200]}
        try:
            fabric.check_integrity()
        except Exception as exc:
            out["integrity_errors"] = [str(exc)[:500]]
        try:
            stats = fabric.stats()
        except Exception as exc:
            out["integrity_errors"].append(f"stats: {exc}")
            stats = {}
        out["stats"] = stats
        return out

    def report(self, end: float, after: dict) -> dict:
        opts, tally = self.opts, self.tally
        stats = after.get("stats", {})
        warm = opts.warmup_fraction * opts.duration_s
        served = sorted(end for _, end in tally.spans)
        spans = [*tally.spans, *([tally.probe] if tally.probe else [])]
        injected = [f for f in self.faults if f.injected]
        for fault in injected:
            after_fault = fault.ended if fault.ended is not None else fault.at
            done = [end for start, end in spans if start >= after_fault]
            fault.recovered_at = min(done) if done else None
        recovery: dict[str, list[float]] = defaultdict(list)
        for f in injected:
            if f.recovered_at is not None:
                recovery[f.kind].append(f.recovered_at - (f.ended or f.at))
        all_rec = [x for xs in recovery.values() for x in xs]
        # At idle with every lease released, nothing holds an L1 page; L2 and L1
        # pages owned by nothing at all are integrity errors (free + owned == pool).
        assert self.config is not None
        now = stats.get("now", {})
        leaked_leases = int(now.get("leases", 0))
        ps = self.config.cache.page_size
        leaked_slots = int(stats.get("device", {}).get("protected", 0)) // ps
        stuck = sum(int(now.get(stage, 0)) for stage in ("waiting", "running", "prefetching"))
        stuck += sum(int(n) for n in now.get("inflight", {}).values())  # every direction
        unrecovered = [f.kind for f in injected if f.recovered_at is None]
        in_warmup = sum(1 for t in served if t < warm)
        report = {
            "seed": opts.seed,
            "duration_s": round(end, 1),
            "nodes": opts.nodes if opts.address is None else None,
            "requests": {
                "served": len(served),
                "failed": sum(tally.failed.values()),
                "failed_by_reason": dict(tally.failed),
                "verified": tally.verified,
                "unverifiable": tally.unverifiable,
                "load": dict(sorted(tally.load.items())),
                "latency_s_p50": round(percentile(tally.latencies, 0.5), 3),
                "latency_s_p99": round(percentile(tally.latencies, 0.99), 3),
            },
            "faults_injected": len(injected),
            "faults": dict(Counter(f.kind for f in injected)),
            "faults_not_injected": dict(Counter(f.kind for f in self.faults if not f.injected)),
            "fault_log": [
                {
                    "kind": f.kind,
                    "at_s": round(f.at, 2),
                    "lasted_s": round((f.ended or f.at) - f.at, 2),
                    "target": f.target,
                    "injected": f.injected,
                    **(
                        {"adopted_tokens": f.adopted_tokens} if f.kind == "coordinator_kill" else {}
                    ),
                }
                for f in self.faults
            ],
            "recovery_s": {
                k: {
                    "n": len(v),
                    "p50": round(percentile(v, 0.5), 2),
                    "p99": round(percentile(v, 0.99), 2),
                }
                for k, v in sorted(recovery.items())
            },
            "recovery_s_p50": round(percentile(all_rec, 0.5), 2),
            "recovery_s_p99": round(percentile(all_rec, 0.99), 2),
            "unrecovered_faults": unrecovered,
            "throughput_rps": {
                "no_faults": round(in_warmup / warm, 2) if warm else None,
                "with_faults": round((len(served) - in_warmup) / max(1e-9, end - warm), 2),
            },
            "serving_again_s": after["serving_again_s"],
            "settled": after.get("settled", False),
            "wrong_pages": tally.wrong_pages,
            "leaked_slots": leaked_slots,
            "leaked_leases": leaked_leases,
            "stuck_requests": stuck,
            "integrity_errors": after["integrity_errors"],
            "adopted_tokens_after_coordinator_kills": [
                f.adopted_tokens for f in injected if f.kind == "coordinator_kill"
            ],
            # Whole-run counters: the coordinators killed during the run, and this one.
            "coordinators": len(self.incarnations) + 1,
            **{
                name: sum(
                    int(s.get("counters", {}).get(name, 0)) for s in (*self.incarnations, stats)
                )
                for name in COUNTED
            },
            "placement": self.placed,
            # On a tmpfs of L3's own, l3_full fills it and l3_read_only remounts it
            # read-only: the store fails for real. Else a flag in the storage actor.
            "l3_faults": (
                "tmpfs filled (real ENOSPC), remounted read-only (real EROFS)"
                if self.l3_mount
                else "storage actor flag"
            ),
            "l3_pages": after.get("l3_pages", {}),
            "l3_refused": {
                k: v for k, v in stats.get("l3", {}).items() if k.startswith("refused_")
            },
        }
        tried = len(served) + tally.load["append"] + sum(tally.failed.values())
        report["requests"]["refused_rank_absent"] = tally.refused_absent
        failed = sum(tally.failed.values()) - tally.refused_absent
        report["requests"]["failed_fraction"] = round(failed / max(1, tried), 4)
        asked = tally.verified + tally.unverifiable
        report["requests"]["unverifiable_fraction"] = round(tally.unverifiable / max(1, asked), 4)
        report["loss"] = self.verdict(report, after)
        report["ok"] = not report["loss"]
        return report

    def verdict(self, report: dict, after: dict) -> list[str]:
        """Why the run is a loss (empty: it is not). Strict: a wrong page, anything
        left held or stuck, an integrity error, a fault that was not injected or not
        recovered from, an L3 page the audit refused, or more failed or unverifiable
        requests than the bounds allow."""
        opts, req = self.opts, report["requests"]
        loss = []
        for name, what in (
            ("wrong_pages", "wrong pages served"),
            ("leaked_slots", "L1 slots left held"),
            ("leaked_leases", "leases left held"),
            ("stuck_requests", "requests left in flight"),
        ):
            if report[name]:
                loss.append(f"{report[name]} {what}")
        if report["integrity_errors"]:
            loss.append(f"integrity errors: {report['integrity_errors'][0][:200]}")
        if after["serving_again_s"] is None:
            loss.append("never served again after the faults")
        if not req["served"]:
            loss.append("no request served")
        if report["faults_not_injected"]:
            loss.append(f"faults not injected: {report['faults_not_injected']}")
        if report["unrecovered_faults"]:
            loss.append(f"faults not recovered from: {report['unrecovered_faults']}")
        refused = {
            k: v
            for k, v in report["l3_pages"].items()
            if k not in ("valid", "foreign", "get_miss", "miss", "skipped")
        }
        if refused:
            loss.append(f"L3 pages the audit refused: {refused}")
        if req["unverifiable_fraction"] > opts.max_unverifiable_fraction:
            loss.append(
                f"{req['unverifiable']} leases unverifiable ({req['unverifiable_fraction']:.1%} "
                f"> {opts.max_unverifiable_fraction:.1%})"
            )
        if req["failed_fraction"] > opts.max_failed_fraction:
            loss.append(
                f"{req['failed']} requests failed ({req['failed_fraction']:.1%} > "
                f"{opts.max_failed_fraction:.1%})"
            )
        return loss


# What a request refused for an absent rank says (CoordinatorCore._fail_if_absent_too_long).
ABSENT = "has not answered for"


def _reason(error: str) -> str:
    """A request error's kind, for counting (the text before any detail, times and
    ids as N so that one kind counts once)."""
    head = re.sub(r"[0-9a-f]{16,}|\d+\.\d+", "N", error.split(":")[0].strip())
    return head[:80] or "error"


def run_chaos(opts: ChaosOptions, progress: Callable[[str], None] = print) -> dict:
    """Run a seeded chaos test (see the module docstring) and return its report."""
    chaos = Chaos(opts, progress)
    with tempfile.TemporaryDirectory(prefix="kvfabric-chaos-l3-") as l3:
        try:
            chaos.start(l3)
            where = opts.address or f"a local cluster of {opts.nodes} nodes"
            progress(
                f"chaos: seed {opts.seed}, {opts.duration_s:.0f} s on {where}; "
                f"faults {', '.join(opts.faults)}"
            )
            return chaos.run()
        finally:
            chaos.close()


def summary(report: dict) -> str:
    r = report["requests"]
    lines = [
        f"served {r['served']} requests, {r['failed']} failed "
        f"({', '.join(f'{k} {v}' for k, v in r['failed_by_reason'].items()) or 'none'}); "
        f"verified {r['verified']} leases on every rank",
        f"{report['faults_injected']} faults: "
        + ", ".join(f"{k} {v}" for k, v in report["faults"].items()),
    ]
    for kind, rec in report["recovery_s"].items():
        lines.append(f"  recovery {kind:<22} p50 {rec['p50']:6.2f} s  p99 {rec['p99']:6.2f} s")
    t = report["throughput_rps"]
    lines.append(f"throughput {t['no_faults']} req/s without faults, {t['with_faults']} with")
    lines.append(
        f"wrong pages {report['wrong_pages']}, leaked slots {report['leaked_slots']}, "
        f"leaked leases {report['leaked_leases']}, stuck requests {report['stuck_requests']}, "
        f"integrity errors {len(report['integrity_errors'])}: "
        + ("nothing lost" if report["ok"] else "LOSS")
    )
    lines += [f"  loss: {why}" for why in report["loss"]]
    audit = report["l3_pages"]
    if "skipped" in audit:
        lines.append(f"L3 audit skipped: {audit['skipped']}")
    return "\n".join(lines)
