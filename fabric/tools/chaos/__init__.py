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

Its parts: ``options`` (what a run is asked for, what it tallies), ``harness``
(the cluster, the load, the killer and the settling), ``environment`` (what a
fault does to nodes and to L3's file system, and the audits), ``verdict``
(the report and why a run is a loss).
"""

from fabric.tools.chaos.harness import Chaos, run_chaos
from fabric.tools.chaos.options import (
    FAULTS,
    ChaosOptions,
    Fault,
    chaos_config,
    percentile,
    prompt,
)
from fabric.tools.chaos.verdict import summary

__all__ = [
    "FAULTS",
    "Chaos",
    "ChaosOptions",
    "Fault",
    "chaos_config",
    "percentile",
    "prompt",
    "run_chaos",
    "summary",
]
