"""Rounds: what the ranks' reports commit, what a missing rank does, and the resets
that end an epoch.

Each round, the ranks' reports are reduced (MIN/MAX, ``Consensus``) and exactly the
reduced number of each kind of operation commits; requests whose last command
committed finish with a lease, or go on with their next chunk. A rank that gives no
usable report resets L1/L2 (its pools may be gone) and stops admission until every
rank answers again; past ``runtime.rank_absent_timeout_s`` the waiting requests fail
naming it. A reset starts a new epoch: leases end, and running requests go back to
waiting, each at most ``runtime.max_request_retries`` times."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from fabric.cache.hicache import HiCache
from fabric.config import FabricConfig
from fabric.coordinator.commands import Answer, FabricController
from fabric.coordinator.consensus import Consensus, Round
from fabric.coordinator.event_queue import EventQueue
from fabric.coordinator.leases import LeaseTable
from fabric.coordinator.requests import FabricStats, RequestResult, ServingRequest
from fabric.coordinator.scheduler import Scheduler
from fabric.coordinator.stragglers import Progress, Straggler, Stragglers
from fabric.messages import Report
from fabric.topology import Topology

log = logging.getLogger(__name__)


class RoundCommit:
    def __init__(
        self,
        config: FabricConfig,
        topology: Topology,
        cache: HiCache,
        ctl: FabricController,
        scheduler: Scheduler,
        leases: LeaseTable,
        events: EventQueue,
        stats: FabricStats,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.topology = topology
        self.cache = cache
        self.ctl = ctl
        self.scheduler = scheduler
        self.leases = leases
        self.events = events
        self.stats = stats
        self.clock = clock
        self.consensus = Consensus(topology.world_size)
        self.epoch = 1
        self.absent: dict[int, float] = {}  # rank index -> since when
        self._absent_reason: dict[int, str] = {}
        self.forget: set[int] = set()  # prefetch ops the ranks may drop
        self.started: float | None = None  # when this round's batch went out
        self.adopt_wanted = False  # after a rank restart: adopt what the ranks still hold
        rt = config.runtime
        self.stragglers = Stragglers(
            [str(r) for r in topology.ranks],
            rt.straggler_lag_s,
            rt.straggler_factor,
            rt.straggler_rounds,
            rt.straggler_policy,
            clock,
            self._straggler_named,
        )
        self.progress = Progress(topology.world_size)
        self._reply_s: list[float | None] | None = None

    # -- a round's outcome -----------------------------------------------------------

    def on_round(
        self, reports: Sequence[Report], storage_hits: Mapping[int, Answer] | None = None
    ) -> list[RequestResult]:
        """Reduce one report per rank (and the storage actors' answers to the hit
        queries) and commit; returns requests that finished."""
        self._count_round()
        self.absent.clear()
        self._absent_reason.clear()
        try:
            rnd = self.consensus.reduce(reports, self.epoch)
            if rnd.restarted:
                out = self.reset(f"rank(s) {self.names(rnd.restarted)} restarted")
                # A rank restarted on its node may have found its L2 as it was
                # (fabric.rank.shared_l2): the shell asks every rank what it holds
                # before the next step, and ``adopt`` takes back what all name alike.
                self.adopt_wanted = True
                return out
            if not rnd.usable:
                return self.scheduler.take_failed()
            self._watch_progress(reports)
            return self._commit(rnd, storage_hits or {})
        except Exception as exc:
            return self.recover(exc)

    def on_missing(self, missing: Mapping[int, str]) -> list[RequestResult]:
        """A round in which the ranks ``missing`` (index -> why) gave no usable
        report. The first such round resets L1/L2; until every rank answers again
        nothing is admitted, and past ``runtime.rank_absent_timeout_s`` requests fail
        with an error naming the rank."""
        self._count_round()
        now = self.clock()
        first = not self.absent
        for index, why in missing.items():
            self.absent.setdefault(index, now)
            self._absent_reason[index] = why
        out = []
        if first:
            names = self.names(sorted(missing))
            out = self.reset(f"rank(s) {names} did not answer", count_retry=False)
        return out + self._fail_if_absent_too_long()

    def _count_round(self) -> None:
        self.stats.rounds += 1
        if self.started is not None:
            self.stats.round_seconds.observe(self.clock() - self.started)
            self.started = None

    def _fail_if_absent_too_long(self) -> list[RequestResult]:
        now, limit = self.clock(), self.config.runtime.rank_absent_timeout_s
        late = sorted(i for i, since in self.absent.items() if now - since >= limit)
        if late:
            index = late[0]
            self.scheduler.fail_waiting(
                f"rank {self.names([index])} (index {index}) has not answered for "
                f"{now - self.absent[index]:.1f} s: {self._absent_reason.get(index, 'no reply')}"
            )
        return self.scheduler.take_failed()

    def names(self, indices: Sequence[int]) -> str:
        ranks = self.topology.ranks
        return ", ".join(str(ranks[i]) if 0 <= i < len(ranks) else str(i) for i in indices)

    def _commit(self, rnd: Round, storage_hits: Mapping[int, Answer]) -> list[RequestResult]:
        sched = self.scheduler
        done = self.ctl.completions(rnd, storage_hits)
        if done.writes or done.loads or done.computes or done.backups:
            sched.unblock()  # finished work may have unlocked pages: admit again
        self.cache.apply(done)
        self.forget |= rnd.prefetch_reported - set(self.cache.l3.by_op)
        self.events.collect()
        if done.failed_computes or done.failed_loads:
            # Those pages may hold anything on some rank: drop L1/L2, retry.
            what = "compute" if done.failed_computes else "load"
            return self.reset(f"a {what} failed on a rank")
        out = sched.take_failed()
        more = []
        for req in list(sched.running.values()):
            if req.compute_cmds[-1] > self.ctl.computes_committed:
                continue
            del sched.running[req.rid]
            if req.more_chunks and not req.aborted:
                more.append(req)  # its next chunk goes first in the next step
            else:
                out.append(self._finish(req))
        sched.waiting.extendleft(reversed(more))
        return out

    def _finish(self, req: ServingRequest) -> RequestResult:
        latency = self.clock() - req.submitted
        if req.aborted:
            self.stats.aborted += 1
            return RequestResult(req.rid, req.prompt_tokens, latency_s=latency, error="aborted")
        device, host, storage, computed = req.tallies()
        s = self.stats
        s.finished += 1
        s.prompt_tokens += req.prompt_tokens
        s.tokens.add(device, host, storage, computed)
        s.latency_s_total += latency
        s.request_seconds.observe(latency)
        assert req.kv is not None
        lease = self.leases.grant(req, req.kv, self.epoch, self.config.runtime.lease_ttl_s)
        return RequestResult(
            req.rid,
            req.prompt_tokens,
            device_hit_tokens=device,
            host_hit_tokens=host,
            storage_hit_tokens=storage,
            computed_tokens=computed,
            latency_s=latency,
            lease=lease,
        )

    # -- stragglers --------------------------------------------------------------------

    def rank_latencies(self, latencies: Sequence[float | None]) -> None:
        """How long each rank took to reply to this round (``None``: not measured),
        from the shell, before ``on_round``: a rank's lag in the round is the larger
        of that and how late it finished its commands (``Progress``)."""
        self._reply_s = list(latencies)

    def _watch_progress(self, reports: Sequence[Report]) -> None:
        # A rank's own work only: backups and prefetches queue at the storage
        # actors, where some rank is always served last.
        totals = [
            r.computes_done + r.writes_done + r.loads_done
            for r in sorted(reports, key=lambda r: r.rank)
        ]
        lags = self.progress.lags(totals, self.epoch, self.clock())
        reply, self._reply_s = self._reply_s or [None] * len(lags), None
        slow_reply = self.config.runtime.straggler_lag_s
        # A round counts for a rank when it finished something (how late, or how
        # slowly it replied if that was later), or when its reply alone was slow:
        # the many rounds in which a rank only waits say nothing either way.
        self.stragglers.observe(
            [
                max(lag, reply_s or 0.0)
                if lag is not None
                else (reply_s if reply_s is not None and reply_s > slow_reply else None)
                for lag, reply_s in zip(lags, reply, strict=True)
            ]
        )

    def _straggler_named(self, rank: str, s: Straggler) -> None:
        log.warning(
            "rank %s is a straggler: it finishes its commands %.3f s after the first rank, "
            "the others %.3f s (runtime.straggler_policy=%s)",
            rank,
            s.latency_s,
            s.others_s,
            self.config.runtime.straggler_policy,
        )

    # -- resets ------------------------------------------------------------------------

    def recover(self, exc: BaseException) -> list[RequestResult]:
        """An unexpected error in a step: fail the request it concerns (if one was
        being handled), then reset L1/L2, which it may have left half changed; the
        others are retried. Never raises."""
        self.stats.step_errors += 1
        sched = self.scheduler
        req, sched.current = sched.current, None
        log.error("coordinator step failed; resetting L1/L2", exc_info=exc)
        if req is not None:
            if req in sched.waiting:
                sched.waiting.remove(req)
            sched.running.pop(req.rid, None)
            sched.prefetching.pop(req.rid, None)
            req.kv = None  # the reset below drops what it held
            sched.fail(req, f"internal error: {type(exc).__name__}: {exc}")
        return self.reset(f"internal error: {type(exc).__name__}")

    def reset(self, reason: str, count_retry: bool = True) -> list[RequestResult]:
        """Drop every L1/L2 page (a rank lost its pools, or a page may be bad), start a
        new epoch, end leases and send running requests back to waiting — each at
        most ``runtime.max_request_retries`` times, then it fails naming ``reason``."""
        sched = self.scheduler
        self.stats.resets += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.cache.reset()
        self.events.collect()
        self.epoch += 1
        sched.unblock()
        self.leases.clear()
        out = sched.take_failed()
        lost = f"the request's KV was lost ({reason}); submit it again"
        for req in list(sched.waiting):  # between chunks, or decodes: their KV is gone
            if req.appended:
                sched.waiting.remove(req)
                sched.fail(req, lost)
            elif req.kv is not None:
                req.kv, req.prefetch_tried, req.prefetched = None, False, 0
        back = []
        for req in [*sched.running.values(), *sched.prefetching.values()]:
            if req.aborted:
                self.stats.aborted += 1
                out.append(RequestResult(req.rid, req.prompt_tokens, error="aborted"))
            elif req.appended:
                sched.fail(req, lost)
            elif self._retry(req, reason, count_retry):
                back.append(req)
        sched.running.clear()
        sched.prefetching.clear()
        sched.waiting.extendleft(reversed(back))
        self.forget.clear()
        return out + sched.take_failed()

    def _retry(self, req: ServingRequest, reason: str, count_retry: bool) -> bool:
        """Send ``req`` back to waiting after a reset, unless it has used up its
        retries (then it fails naming ``reason``)."""
        limit = self.config.runtime.max_request_retries
        req.compute_cmds, req.kv = (), None
        req.prefetch_tried, req.prefetched = False, 0
        if count_retry:
            req.retries += 1
        if req.retries > limit:
            self.stats.gave_up += 1
            self.scheduler.fail(req, f"gave up after {limit} retries: {reason}")
            return False
        self.stats.retried += 1
        return True
