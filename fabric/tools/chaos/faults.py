"""What each chaos fault kind does: one function per kind, given the harness,
the fault (its record, filled in as it goes) and the rank drawn for it; and
the helpers they share. Each returns once its fault is over (a lasting one
lifted), or, for an instant one, done. Ray is imported inside them."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from fabric.tools.chaos.environment import (
    fill_l3,
    is_local,
    l3_writes_failed,
    lose_node,
    node_of,
    read_only_l3,
)
from fabric.tools.chaos.options import OVERLAPPABLE, Fault
from fabric.tools.chaos.state import RunState


def rank_kill(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    import ray

    ray.kill(rank, no_restart=False)
    fault.ended = chaos.now()


def rank_kill_no_restart(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    import ray

    from actors.factory import recreate_rank

    ray.kill(rank, no_restart=True)
    fault.ended = chaos.now()
    time.sleep(1.0)
    recreate_rank(chaos.fabric._deployment, chaos.config, index)


def rank_signal(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """``rank_sigkill``: the rank's process killed; ``rank_sigstop``: stopped for
    longer than the rank timeout, then continued."""
    import ray

    assert chaos.config is not None
    pid, node = ray.get(rank.where.remote(), timeout=10)
    if not is_local(node):
        raise RuntimeError("signals need the rank on this machine")
    if fault.kind == "rank_sigkill":
        os.kill(pid, signal.SIGKILL)
        fault.ended = chaos.now()
        return
    os.kill(pid, signal.SIGSTOP)
    chaos.stopped_pids.add(pid)
    chaos.stop.wait(chaos.opts.fault_hold_s + chaos.config.runtime.rank_timeout_s)
    os.kill(pid, signal.SIGCONT)
    chaos.stopped_pids.discard(pid)


def rank_kill_in_collective(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    import ray

    ray.get(rank.set_faults.remote(delay_s=3600.0), timeout=10)
    # Its peers reach the next compute and wait for it in a collective.
    chaos.stop.wait(min(chaos.opts.fault_hold_s, 1.5))
    ray.kill(rank, no_restart=False)  # the restarted actor has no faults
    fault.ended = chaos.now()


def storage_kill(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """The storage actor killed while it holds a backup or a prefetch batch."""
    import ray

    storages = chaos.fabric._deployment.storages
    storage = pick_storage(chaos, storages)
    ray.get(storage.set_faults.remote(hold=True), timeout=10)
    deadline, held = time.monotonic() + 5.0, 0
    while time.monotonic() < deadline and not held:
        held = ray.get(storage.holding.remote(), timeout=10)
        time.sleep(0.05)
    fault.target = f"mid-transfer ({held} page batches held)" if held else "idle"
    if len(storages) > 1:
        fault.target += f", storage actor {storages.index(storage)}"
    ray.kill(storage, no_restart=False)  # the restarted actor holds nothing
    fault.ended = chaos.now()


def storage_sigkill(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """The storage actor's process, at whatever it was doing."""
    import ray

    storages = chaos.fabric._deployment.storages
    storage = pick_storage(chaos, storages)
    pid, node = ray.get(storage.where.remote(), timeout=10)
    if not is_local(node):
        raise RuntimeError("signals need the storage actor on this machine")
    os.kill(pid, signal.SIGKILL)
    fault.ended = chaos.now()
    if len(storages) > 1:
        fault.target = f"storage actor {storages.index(storage)}"


def client_exit(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    fault.target = client_exits(chaos)
    fault.ended = chaos.now()


def coordinator_kill(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    import ray

    last = chaos.fabric.stats()
    ray.kill(chaos.fabric.coordinator, no_restart=False)
    chaos.incarnations.append(last)
    fault.ended = chaos.now()
    fault.adopted_tokens = adopted_after(chaos, last["epoch"])


def node_loss(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    lose_node(chaos.cluster, rank, chaos.stop.wait, chaos.opts.fault_hold_s)


def l3_refuses(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """``l3_full``, ``l3_read_only``: on L3's own tmpfs, for real; else a flag
    in every storage actor (the store: each of them sees it)."""
    import ray

    hold, storages = chaos.opts.fault_hold_s, chaos.fabric._deployment.storages
    if chaos.l3_mount is not None:
        failed = l3_writes_failed(storages)
        lift = fill_l3 if fault.kind == "l3_full" else read_only_l3
        fault.target = lift(chaos.l3_mount, chaos.stop.wait, hold)
        failed = max(0, l3_writes_failed(storages) - failed)
        fault.target += f" ({failed} page writes failed)"
        return
    l3 = fault.kind.removeprefix("l3_")
    ray.get([s.set_faults.remote(l3=l3) for s in storages], timeout=10)
    chaos.stop.wait(hold)
    ray.get([s.set_faults.remote() for s in storages], timeout=10)


def l3_latency(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """Every L3 batch a second late, for a while."""
    import ray

    storages = chaos.fabric._deployment.storages
    ray.get([s.set_faults.remote(delay_s=1.0) for s in storages], timeout=10)
    chaos.stop.wait(chaos.opts.fault_hold_s)
    ray.get([s.set_faults.remote() for s in storages], timeout=10)


def slow_rank(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """Every command late: a straggler, alive."""
    named = chaos.fabric.stats()["ranks"]["stragglers_named"]
    rank_call(lambda: rank.set_faults.remote(delay_s=0.6), 10)
    chaos.stop.wait(max(chaos.opts.fault_hold_s, 6.0))
    rank_call(lambda: rank.set_faults.remote(), 10)
    if chaos.fabric.stats()["ranks"]["stragglers_named"] > named:
        fault.target += " (named a straggler)"


def messages(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """A duplicated message, or replies later than ``runtime.rank_timeout_s``:
    the rank counts as absent each round until it is lifted."""
    assert chaos.config is not None
    late = 1.5 * chaos.config.runtime.rank_timeout_s
    what = {"duplicate": True} if fault.kind == "duplicate_messages" else {"reply_delay_s": late}
    rank_call(lambda: rank.set_faults.remote(**what), 10)
    chaos.stop.wait(chaos.opts.fault_hold_s)
    rank_call(lambda: rank.set_faults.remote(), 10 + late)


def node_lost_for_good(chaos: RunState, fault: Fault, rank: Any, index: int) -> None:
    """Remove the worker node a rank runs on with no replacement: the fabric
    must say it cannot serve that shard — requests refused naming the rank
    once it is absent past ``runtime.rank_absent_timeout_s`` — rather than
    hold them; then capacity returns (a new node) and it must serve again."""
    import ray

    assert chaos.config is not None
    victim, node_id = node_of(chaos.cluster, rank)
    with chaos.tally.lock:
        before = chaos.tally.refused_absent
    removed = chaos.now()
    chaos.cluster.remove_node(victim, allow_graceful=False)
    limit = chaos.config.runtime.rank_absent_timeout_s
    deadline = time.monotonic() + limit + 30
    refused_at = replaced_at = None
    while not chaos.stop.is_set() and time.monotonic() < deadline:
        with chaos.tally.lock:
            if chaos.tally.refused_absent > before:
                refused_at = chaos.now()
                break
        try:  # spare capacity: Ray places the stage again on a node that is left
            if ray.get(rank.where.remote(), timeout=1.0)[1] != node_id:
                replaced_at = chaos.now()
                break
        except Exception:
            pass
        chaos.stop.wait(0.2)
    chaos.stop.wait(1.0)  # a few more refused at once
    chaos.cluster.add_node(num_cpus=2)  # capacity returns
    fault.ended = chaos.now()
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


def rank_call(call: Callable[[], Any], timeout_s: float) -> Any:
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


def overlap(chaos: RunState, fault: Fault, index: int) -> None:
    """Two faults at once, each on its own thread (on the same rank where both
    take one); the fault ends when both have."""
    first, second = chaos.rng.sample(
        [k for k in OVERLAPPABLE if k in chaos.opts.faults] or list(OVERLAPPABLE), 2
    )
    parts = [Fault(first, fault.at), Fault(second, fault.at)]
    errors: list[str] = []

    def run(part: Fault) -> None:
        try:
            inject(chaos, part, index)
            part.injected = True
        except Exception as exc:
            errors.append(f"{part.kind}: {type(exc).__name__}: {str(exc)[:100]}")
        part.ended = part.ended if part.ended is not None else chaos.now()

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fault.target = " + ".join(f"{p.kind} {p.target}".strip() for p in parts)
    fault.ended = max(p.ended or p.at for p in parts)
    if errors:
        raise RuntimeError("; ".join(errors))


def client_exits(chaos: RunState) -> str:
    """Another driver submits a prompt and exits (``os._exit``) holding its lease."""
    import subprocess
    import sys

    import ray

    assert chaos.config is not None
    rt = chaos.config.runtime
    address = ray.get_runtime_context().gcs_address
    code = (
        "import os\n"
        "from fabric.client import connect\n"
        f"f = connect({rt.name!r}, {address!r}, {rt.ray_namespace!r})\n"
        f"r = f.submit([9] * {4 * chaos.config.cache.page_size}, timeout=30)\n"
        "print('held' if r.lease is not None else r.error, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    said = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-200:]]
    return f"a driver exited holding a lease: {said[0]}"


def adopted_after(chaos: RunState, epoch: int, limit_s: float = 60.0) -> int | None:
    """The L2 tokens the coordinator that follows ``epoch`` adopted."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not chaos.stop.is_set():
        with contextlib.suppress(Exception):
            stats = chaos.fabric.stats()
            if stats["epoch"] > epoch:
                return int(stats["counters"]["adopted_tokens"])
        time.sleep(0.2)
    return None


def pick_storage(chaos: RunState, storages: list[Any]) -> Any:
    """The storage actor a fault hits: one of ``storage.actors``, drawn (a
    single one draws nothing, so a seed's schedule stays what it was)."""
    return storages[0] if len(storages) == 1 else chaos.rng.choice(storages)


INJECTORS: dict[str, Callable[[RunState, Fault, Any, int], None]] = {
    "rank_kill": rank_kill,
    "rank_kill_no_restart": rank_kill_no_restart,
    "rank_sigkill": rank_signal,
    "rank_sigstop": rank_signal,
    "rank_kill_in_collective": rank_kill_in_collective,
    "storage_kill": storage_kill,
    "storage_sigkill": storage_sigkill,
    "client_exit": client_exit,
    "coordinator_kill": coordinator_kill,
    "node_loss": node_loss,
    "node_lost_for_good": node_lost_for_good,
    "l3_read_only": l3_refuses,
    "l3_full": l3_refuses,
    "l3_latency": l3_latency,
    "slow_rank": slow_rank,
    "duplicate_messages": messages,
    "delayed_messages": messages,
}


def inject(chaos: RunState, fault: Fault, index: int | None = None) -> None:
    """Inject ``fault`` (on rank ``index`` where it takes a rank; default: one
    drawn); it returns once the fault is over, or, for an instant one, done."""
    ranks = chaos.fabric._deployment.ranks
    if index is None:
        index = chaos.rng.randrange(len(ranks))
    if fault.kind == "overlapping":
        overlap(chaos, fault, index)
        return
    if fault.kind.startswith(("rank", "dup", "del", "slow")):
        fault.target = f"rank {index}"
    INJECTORS[fault.kind](chaos, fault, ranks[index], index)
