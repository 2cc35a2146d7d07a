"""The chaos harness: a fabric on a (local) Ray cluster, clients that submit,
decode, verify and release, a seeded killer that injects one fault at a time
(``fabric.tools.chaos`` lists them), and the settling after it."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from fabric.tools.chaos.environment import mount_l3, placement, scan_l3, unmount_l3
from fabric.tools.chaos.faults import inject
from fabric.tools.chaos.options import (
    ABSENT,
    NAMESPACES,
    ChaosOptions,
    Fault,
    chaos_config,
    prompt,
    reason,
)
from fabric.tools.chaos.state import RunState
from fabric.tools.chaos.verdict import make_report

log = logging.getLogger(__name__)


class Chaos(RunState):
    # -- the cluster and the fabric -----------------------------------------------

    def start(self, l3_path: str) -> None:
        import ray

        from actors.factory import HEAD_RESOURCE
        from fabric.client import launch

        opts = self.opts
        self.config = chaos_config(opts, l3_path)  # a bad --set is refused before any Ray
        if opts.address is None:  # a local cluster: L3's file system can be our own
            from ray.cluster_utils import Cluster

            self.l3_mount = mount_l3(l3_path)
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
        if self.l3_mount is not None:
            unmount_l3(self.l3_mount)
            self.l3_mount = None

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
                    tally.failed[reason(r.error)] += 1
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
                    self.tally.failed["append: " + reason(step.error)] += 1
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
            name += f": {reason(str(exc))}"
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
                inject(self, fault)
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
            if opts.max_faults is not None and len(self.faults) >= opts.max_faults:
                break  # enough: the run ends here (the finally of ``run`` stops it)
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

    # -- the run -------------------------------------------------------------------

    def run(self) -> dict:
        opts = self.opts
        self.placed = {"start": placement(self.fabric, self.config)}
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
        """Every fault lifted: the fabric must serve again, hold nothing and settle;
        then the audits."""
        self._lift_faults()
        out: dict[str, Any] = {"serving_again_s": self._serve_again(), "integrity_errors": []}
        out["settled"] = self._release_everything()
        assert self.config is not None
        try:
            out["l3_pages"] = scan_l3(self.config)
        except Exception as exc:  # a backend that cannot list its pages, or is gone
            out["l3_pages"] = {"skipped": f"{type(exc).__name__}: {str(exc)[:200]}"}
        try:
            self.placed["end"] = placement(self.fabric, self.config)
        except Exception as exc:
            self.placed["end"] = {"error": str(exc)[:200]}
        try:
            self.fabric.check_integrity()
        except Exception as exc:
            out["integrity_errors"] = [str(exc)[:500]]
        try:
            stats = self.fabric.stats()
        except Exception as exc:
            out["integrity_errors"].append(f"stats: {exc}")
            stats = {}
        out["stats"] = stats
        return out

    def _lift_faults(self) -> None:
        import ray

        for pid in list(self.stopped_pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        deployment = self.fabric._deployment
        for actor in (*deployment.storages, *deployment.ranks):
            with contextlib.suppress(Exception):
                ray.get(actor.set_faults.remote(), timeout=30)

    def _serve_again(self) -> float | None:
        """Seconds until a probe request was served and verified (``None``: not
        within two minutes)."""
        assert self.config is not None
        started = time.monotonic()
        probe = [7] * (4 * self.config.cache.page_size)
        while time.monotonic() - started < 120:
            submitted = self.now()
            try:
                r = self.fabric.submit(probe, timeout=20)
            except Exception:
                time.sleep(1.0)
                continue
            if r.error is None:
                self.check(r, probe)
                self.fabric.release(r.lease)
                self.tally.probe = (submitted, self.now())  # a late fault recovers by it
                return round(time.monotonic() - started, 2)
            time.sleep(0.5)
        return None

    def _release_everything(self) -> bool:
        """End the clients' sessions (a kept session holds its L1 pages on purpose),
        let the fabric settle and reclaim a dead driver's lease: whether it settled."""
        fabric = self.fabric
        for i in range(self.opts.clients):
            for k in range(4):
                with contextlib.suppress(Exception):
                    fabric.end_session(f"chat-{self.opts.seed * 1000 + i}-{k}")
        settled = False
        with contextlib.suppress(Exception):
            settled = fabric.settle(60)
        # A driver that exited holding a lease has it reclaimed once the coordinator
        # sees its job dead (it looks every few seconds): give it that long.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if fabric.stats()["now"]["leases"] == 0:
                    break
            time.sleep(0.5)
        return settled

    def report(self, end: float, after: dict) -> dict:
        return make_report(self, end, after)


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
