"""The fabric's own cost under load: driver processes submitting at once.

Launches one local fabric per mode (the default config, TP=2 on CPU pools; and
``model.filler=constant``, ranks that allocate and copy but compute nothing, so
the figures are the fabric's own ceiling apart from KV production). For each
driver count, that many separate driver processes connect to it and submit and
release multi-turn chat prompts (``fabric.tools.workload.synthetic_trace``: one set
of conversations, each driver cycling through it from its own point; mostly L1
hits) for ``--seconds``. Reports
per count: requests/s, latency p50/p99 (submit to result), the coordinator
process's CPU per request (utime + stime from ``/proc``; the actor runs on this
machine) and its core's time per request (``stats()["counters"]["core_time_s"]``: every
core call the actor makes — submits, releases, each round's batch and commit),
and their ratio: what the actor shell costs beyond the core's own work.

    python3 bench/fabric_load.py --quick
    python3 bench/fabric_load.py --drivers 1,2,4,8 --no-compute-drivers 1,2,4,8,16 --seconds 30
    python3 bench/fabric_load.py --batch 1,8,32,128     # the engine-step curve
    python3 bench/fabric_load.py --engine-steps 1,2,4   # engines through the connector's link

The last line is one JSON object: ``coordinator_cpu_over_core`` and
``requests_per_s`` at the largest driver count of the default mode, and
``no_compute_requests_per_s`` (the best of that mode's curve), beside both curves.

With ``--batch`` above 1, or several sizes (prompts a driver sends in one
call, as an engine sends a step's requests), only the no-compute mode runs, at
``--batch-drivers`` drivers (default 2), once per size, on prompts of up to 1,024
tokens (a chat prompt's first and last 512) and an L1 and L2 that hold all
of them, or every driver's largest batch twice if that is more (as an engine's
step fits its KV cache), warmed and settled first: ``by_batch`` holds each
size's row, and ``no_compute_requests_per_s`` and ``coordinator_cpu_over_core``
are those at batch 32 (or the largest size below it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.cli.exit import finish
from fabric.config import FabricConfig

NS = "kvfabric-bench-load"
PROMPT_TOKENS = 1024  # the longest prompt of the batch curve (--batch with several sizes)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of process ``pid``'s threads, summed by thread name
    (Python's threads, Ray's and ZeroMQ's own carry names)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def prompts_for(seed: int, max_tokens: int, cut: bool = False) -> list[bytes]:
    """The chats' prompts of up to ``max_tokens`` tokens; with ``cut``, every
    prompt of 300 chats cut to its first and last ``max_tokens / 2`` (a shared
    system prompt's start and the newest turn)."""
    from fabric.tools.workload import iter_packed, synthetic_trace

    packed = [p for _, p in iter_packed(synthetic_trace(300 if cut else 60, seed=seed), seed=seed)]
    if cut:
        half = 4 * max_tokens // 2
        return [p if len(p) <= 2 * half else p[:half] + p[-half:] for p in packed]
    return [p for p in packed if 0 < len(p) // 4 <= max_tokens]


def driver(
    address: str,
    name: str,
    seed: int,
    max_tokens: int,
    cut: bool,
    seconds: float,
    separate: bool,
    batch: int,
    ready,
    go,
    out,
) -> None:
    """One driver process: connect, wait for the start, then submit and release
    for ``seconds``, ``batch`` prompts a call (each lease let go with the next
    submit, or in a call of its own with ``separate``); put (requests, latencies,
    tokens by tier) on ``out``."""
    from fabric.client import connect

    fabric = connect(name, address=address, ray_namespace=NS)
    prompts = prompts_for(0, max_tokens, cut)  # every driver the same chats, from its own point
    fabric.release(fabric.submit(prompts[0], timeout=120).lease)  # connected, warm
    ready.put(seed)
    go.wait()
    latencies: list[float] = []
    tiers = {"device": 0, "host": 0, "storage": 0, "computed": 0}
    end = time.monotonic() + seconds
    i = 7 * seed
    held: list = []  # leases to let go with the next submit (or on their own: separate)
    failed = 0
    while time.monotonic() < end:
        group = [prompts[(i + k) % len(prompts)] for k in range(batch)]
        i += batch
        started = time.perf_counter()
        if batch == 1:
            results = [fabric.submit(group[0], timeout=120, release=held)]
        else:
            results = fabric.submit_many(group, timeout=120, release=held)
        took = time.perf_counter() - started
        held = []
        for r in results:
            if r.error is not None:  # no room in L1 beside a whole call's leases
                failed += 1
                continue
            latencies.append(took)
            tiers["device"] += r.device_hit_tokens
            tiers["host"] += r.host_hit_tokens
            tiers["storage"] += r.storage_hit_tokens
            tiers["computed"] += r.computed_tokens
            held.append(r.lease)
        if separate:
            for lease in held:
                fabric.release(lease)
            held = []
    for lease in held:
        fabric.release(lease)
    out.put((seed, latencies, tiers, failed))
    import ray

    from fabric.cli.exit import exit_process

    ray.shutdown()
    exit_process(0)


def phase(
    fabric: Any,
    drivers: int,
    seconds: float,
    first_seed: int,
    profile: str | None = None,
    separate: bool = False,
    batch: int = 1,
    max_tokens: int | None = None,
    cut: bool = False,
) -> dict[str, Any]:
    """``drivers`` processes at once against ``fabric`` for ``seconds``; with
    ``profile``, py-spy samples the coordinator's process meanwhile (collapsed
    stacks written there); ``max_tokens`` and ``cut``: the prompts
    (``prompts_for``)."""
    import ray

    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    max_tokens = max_tokens or fabric.config.cache.device_tokens // 2
    procs = [
        ctx.Process(
            target=driver,
            args=(
                fabric.cluster_address,
                fabric.config.runtime.name,
                first_seed + k,
                max_tokens,
                cut,
                seconds,
                separate,
                batch,
                ready,
                go,
                out,
            ),
            daemon=True,
        )
        for k in range(drivers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    pid = ray.get(fabric.coordinator.where.remote(), timeout=30)[0]
    before, cpu_before, threads_before = fabric.stats(), cpu_s(pid), thread_cpu_s(pid)
    started = time.monotonic()
    go.set()
    spy = None
    if profile:
        cmd = ["py-spy", "record", "--nonblocking", "-p", str(pid), "-d", str(int(seconds))]
        spy = subprocess.Popen([*cmd, "-f", "raw", "-o", profile], stdout=subprocess.DEVNULL)
    results = [out.get(timeout=seconds + 300) for _ in procs]
    if spy is not None:
        spy.wait(timeout=60)
    elapsed = time.monotonic() - started
    cpu, after = cpu_s(pid) - cpu_before, fabric.stats()
    threads = thread_cpu_s(pid)
    by_thread = {n: t - threads_before.get(n, 0.0) for n, t in threads.items()}
    for p in procs:
        p.join(timeout=60)
    latencies = sorted(x for _, lat, _, _ in results for x in lat)
    n = len(latencies)
    finished = after["counters"]["finished"] - before["counters"]["finished"]
    core = after["counters"]["core_time_s"] - before["counters"]["core_time_s"]
    tiers = {k: sum(t[k] for _, _, t, _ in results) for k in results[0][2]}
    failed = sum(f for *_, f in results)
    tokens = max(1, sum(tiers.values()))
    return {
        "drivers": drivers,
        "requests": n,
        "failed": failed,
        "requests_per_s": round(n / elapsed, 1),
        "latency_ms_p50": round(1e3 * latencies[n // 2], 2),
        "latency_ms_p99": round(1e3 * latencies[int(0.99 * (n - 1))], 2),
        "coordinator_cpu_ms_per_request": round(1e3 * cpu / max(1, finished), 3),
        "core_ms_per_request": round(1e3 * core / max(1, finished), 3),
        "coordinator_cpu_over_core": round(cpu / core, 2) if core else None,
        "coordinator_cpu_share": round(cpu / elapsed, 2),
        "rounds_per_request": round(
            (after["counters"]["rounds"] - before["counters"]["rounds"]) / max(1, finished), 3
        ),
        "l1_hit_fraction": round(tiers["device"] / tokens, 3),
        # Where the coordinator's CPU went, by thread: ms per request.
        "coordinator_ms_per_request_by_thread": {
            name: round(1e3 * t / max(1, finished), 4)
            for name, t in sorted(by_thread.items(), key=lambda kv: -kv[1])
            if t > 0
        },
    }


def run_mode(
    config: FabricConfig,
    counts: list[int],
    seconds: float,
    label: str,
    profile: str | None,
    separate: bool,
) -> list[dict]:
    from fabric.client import launch

    fabric = launch(config, address="local", announce=False)
    curve = []
    try:
        for i, drivers in enumerate(counts):
            last = i == len(counts) - 1
            where = f"{profile}-{label.replace(' ', '-')}.txt" if profile and last else None
            row = phase(fabric, drivers, seconds, 100 * i, where, separate, 1)
            curve.append(row)
            print(
                f"{label:>10} {drivers:>3} drivers: {row['requests_per_s']:>7} req/s, "
                f"p50 {row['latency_ms_p50']} ms, p99 {row['latency_ms_p99']} ms, coordinator "
                f"{row['coordinator_cpu_ms_per_request']} ms CPU/request (core "
                f"{row['core_ms_per_request']} ms, x{row['coordinator_cpu_over_core']}), "
                f"L1 hits {row['l1_hit_fraction']:.0%}",
                file=sys.stderr,
                flush=True,
            )
            fabric.settle(60)
    finally:
        fabric.shutdown()
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--drivers", default="1,2,4,8", help="driver counts, default mode")
    ap.add_argument("--no-compute-drivers", default="1,2,4,8,16", help="and with no compute")
    ap.add_argument("--seconds", type=float, default=30.0, help="per driver count")
    ap.add_argument("--quick", action="store_true", help="1 and 4 drivers, 6 s each")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument(
        "--profile",
        metavar="PREFIX",
        help="py-spy (on PATH) samples the coordinator at each mode's largest driver "
        "count: collapsed stacks in PREFIX-<mode>.txt",
    )
    ap.add_argument(
        "--separate-release",
        action="store_true",
        help="release each lease in a call of its own (by default it rides on the next submit)",
    )
    ap.add_argument(
        "--batch",
        default="1",
        help="prompts a driver sends in one call (submit_many; 1: submit, by driver "
        "count in both modes); above 1 or several sizes (1,8,32,128): the no-compute mode "
        "once per size, at --batch-drivers drivers",
    )
    ap.add_argument("--batch-drivers", type=int, default=2, help="drivers at once, per size")
    ap.add_argument(
        "--engine-steps",
        metavar="COUNTS",
        help="engine processes calling as vLLM's connector does (1,2,4): bench/engine_steps.py",
    )
    ap.add_argument("--engine-batch", type=int, default=16, help="requests an engine step asks")
    args = ap.parse_args()
    if args.engine_steps:
        from engine_steps import engine_curve

        counts = [int(n) for n in args.engine_steps.split(",")]
        engine_curve(
            counts, 6.0 if args.quick else args.seconds, args.engine_batch, args.set, cpu_s
        )
        return
    sizes = [int(n) for n in args.batch.split(",")]
    if len(sizes) > 1 or sizes[0] > 1:
        # Engine-sized steps need an L1 that holds every driver's call twice over
        # (a driver keeps a call's leases until its next): the batch curve sizes
        # it; the driver-count modes keep the default L1, where they would wait.
        batch_curve(args, sizes)
        return
    counts = [int(n) for n in args.drivers.split(",")]
    free = [int(n) for n in args.no_compute_drivers.split(",")]
    seconds = args.seconds
    if args.quick:
        counts, free, seconds = [1, 4], [1, 4], 6.0
    l3 = tempfile.mkdtemp(prefix="kvfabric-bench-load-")
    base = [
        f"storage.path={l3}",
        "storage.backend=segment",
        f"runtime.ray_namespace={NS}",
        "runtime.dashboard=false",
        *args.set,
    ]
    try:
        default = run_mode(
            FabricConfig().with_overrides([*base, "runtime.name=load"]),
            counts,
            seconds,
            "default",
            args.profile,
            args.separate_release,
        )
        none = run_mode(
            FabricConfig().with_overrides(
                [*base, "runtime.name=load-none", "model.filler=constant"]
            ),
            free,
            seconds,
            "no compute",
            args.profile,
            args.separate_release,
        )
    finally:
        shutil.rmtree(l3, ignore_errors=True)
    last = default[-1]
    print(
        json.dumps(
            {
                "seconds_per_count": seconds,
                "release": "separate calls" if args.separate_release else "with the next submit",
                "coordinator_cpu_over_core": last["coordinator_cpu_over_core"],
                "requests_per_s": last["requests_per_s"],
                "no_compute_requests_per_s": max(r["requests_per_s"] for r in none),
                "default": default,
                "no_compute": none,
            }
        )
    )


def batch_curve(args: argparse.Namespace, sizes: list[int]) -> None:
    """The no-compute mode at ``--batch-drivers`` drivers, once per batch size."""
    from fabric.client import launch

    l3 = tempfile.mkdtemp(prefix="kvfabric-bench-load-")
    config = FabricConfig().with_overrides(
        [
            f"storage.path={l3}", "storage.backend=segment", f"runtime.ray_namespace={NS}",
            "runtime.dashboard=false", "runtime.name=load-batch", "model.filler=constant",
            *args.set,
        ]
    )  # fmt: skip
    seconds = 6.0 if args.quick else args.seconds
    rows = []
    # An engine's step fits its KV cache: prompts of up to two blocks, and an L1
    # (and L2) that holds all of them, or every driver's largest batch twice over
    # if that is more (so a size's row does not depend on the other sizes run).
    prompts = prompts_for(0, PROMPT_TOKENS, cut=True)
    held = max(len(prompts), 2 * args.batch_drivers * max(sizes))
    room = max(config.cache.device_tokens, held * PROMPT_TOKENS)
    config = config.with_overrides([f"cache.device_tokens={room}", f"cache.host_tokens={room}"])
    fabric = launch(config, address="local", announce=False)
    try:
        for start in range(0, len(prompts), 32):  # every size then finds the same L1
            for r in fabric.submit_many(prompts[start : start + 32], timeout=300):
                fabric.release(r.lease)
        fabric.settle(120)  # and its backups done
        for i, size in enumerate(sizes):
            where = f"{args.profile}-batch{size}.txt" if args.profile else None
            row = phase(
                fabric,
                args.batch_drivers,
                seconds,
                100 * i,
                where,
                False,
                size,
                PROMPT_TOKENS,
                True,
            )
            row["batch"] = size
            rows.append(row)
            print(
                f"batch {size:>4}: {row['requests_per_s']:>8} req/s, coordinator "
                f"{row['coordinator_cpu_ms_per_request']} ms CPU/request (core "
                f"{row['core_ms_per_request']} ms, x{row['coordinator_cpu_over_core']}), "
                f"{row['rounds_per_request']} rounds/request",
                file=sys.stderr,
                flush=True,
            )
            fabric.settle(60)
    finally:
        fabric.shutdown()
        shutil.rmtree(l3, ignore_errors=True)
    at = max((r for r in rows if r["batch"] <= 32), key=lambda r: r["batch"], default=rows[0])
    print(
        json.dumps(
            {
                "seconds_per_size": seconds,
                "drivers": args.batch_drivers,
                "at_batch": at["batch"],
                "no_compute_requests_per_s": at["requests_per_s"],
                "coordinator_cpu_over_core": at["coordinator_cpu_over_core"],
                "by_batch": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
