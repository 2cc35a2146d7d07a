"""The coordinator's cost on engine steps (``bench/fabric_load.py --engine-steps``).

Engine processes call a local fabric as ``KvFabricConnector``'s scheduler side
does, through its own link (``fabric.engines.fabric_link.FabricLink``): each
step, one lookup of ``--batch`` requests' page chains (their leases, released
with the next step's lookup, as the connector releases them once loaded) and
one report of what the step stored — every rank's shard of each page not hit,
in L3 and in the engine's node L2. The chains are the Mooncake trace's
(``../shared/traces``: each hash id one page), every engine going through them
from its own point, pass after pass, each pass's pages new, so engines share
prefixes as the trace's conversations do and no more.
L3's cap (``storage.max_bytes``) is small enough that the tree evicts.

Per engine count: requests (chains looked up) per second, the coordinator
process's CPU per request (utime + stime, ``/proc``), its core's time per request
(``stats()["counters"]["core_time_s"]``: the tree's lookups and reports) and their
ratio — what the actor and Ray cost beyond the tree's own work."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import pathlib
import sys
import time
from typing import Any

TRACE = (
    pathlib.Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)
TAG = "00000000000000be"
WORLD = 2
PAGE_BYTES = 64 << 10  # one rank's page (a 32-token block of a small model)


def chains(limit: int) -> list[list[bytes]]:
    """The trace's first ``limit`` requests as page-hash chains (seeded as the
    connector seeds its tenant ``bench``)."""
    from fabric.cache.keys import namespace_seed

    out = []
    with open(TRACE) as f:
        for line, _ in zip(f, range(limit), strict=False):
            prev, chain = namespace_seed("bench"), []
            for hid in json.loads(line)["hash_ids"]:
                prev = hashlib.sha256(prev + int(hid).to_bytes(8, "little")).digest()
                chain.append(prev)
            out.append(chain)
    return out


def again(todo: list[list[bytes]], n: int) -> list[bytes]:
    """Request ``n`` of an endless trace: the trace's requests over and over, each
    pass's pages new (their hashes end in the pass number), so hits are only the
    reuse the trace has, never a page from an earlier pass."""
    chain = todo[n % len(todo)]
    tail = (n // len(todo)).to_bytes(8, "little")
    return [h[:24] + tail for h in chain]


def engine(
    address: str, name: str, ns: str, seed: int, seconds: float, batch: int, ready, go, out
) -> None:
    from fabric.cache.engine_input import L3, StoredRun
    from fabric.engines.fabric_link import FabricLink

    link = FabricLink(name, address, ns, timeout_s=60, retry_s=1)
    link.start()
    link.place = f"l2@bench-node-{seed % 2}"  # two engines a node
    todo = chains(1 << 30)
    ready.put(seed)
    go.wait()
    end, i, steps, asked, hit = time.monotonic() + seconds, 997 * seed, 0, 0, 0
    held: list[str] = []
    while time.monotonic() < end:
        group = [again(todo, i + k) for k in range(batch)]
        i += batch
        names = [f"e{seed}/{steps}/{k}" for k in range(batch)]
        hits = link.lookup(TAG, WORLD, group, names, 30.0, held, time.monotonic() + 60)
        assert hits is not None, "the fabric did not answer"
        held = names
        stored = []
        for chain, n in zip(group, hits, strict=True):
            asked, hit = asked + len(chain), hit + n
            if n == len(chain):
                continue
            for place in (L3, link.place):
                run = StoredRun(
                    "bench", chain[n - 1] if n else None, tuple(chain[n:]), place, PAGE_BYTES
                )
                stored += [(TAG, rank, run) for rank in range(WORLD)]
        link.report_stored(WORLD, stored)
        link.take_orders()
        steps += 1
    link.release(TAG, WORLD, held)
    link.close()
    out.put((seed, steps * batch, asked, hit))
    import ray

    from fabric.cli.exit import exit_process

    ray.shutdown()
    exit_process(0)


def phase(fabric: Any, engines: int, seconds: float, batch: int, cpu_s) -> dict[str, Any]:
    import ray

    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    args = (fabric.cluster_address, fabric.config.runtime.name, fabric.config.runtime.ray_namespace)
    procs = [
        ctx.Process(target=engine, args=(*args, k, seconds, batch, ready, go, out), daemon=True)
        for k in range(engines)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    pid = ray.get(fabric.coordinator.where.remote(), timeout=30)[0]
    before, cpu_before = fabric.stats(), cpu_s(pid)
    started = time.monotonic()
    go.set()
    results = [out.get(timeout=seconds + 300) for _ in procs]
    elapsed = time.monotonic() - started
    cpu, after = cpu_s(pid) - cpu_before, fabric.stats()
    for p in procs:
        p.join(timeout=60)
    requests = sum(r[1] for r in results)
    core = after["counters"]["core_time_s"] - before["counters"]["core_time_s"]
    pages = after["engine_pages"]
    return {
        "engines": engines,
        "batch": batch,
        "requests": requests,
        "requests_per_s": round(requests / elapsed, 1),
        "page_hit_rate": round(sum(r[3] for r in results) / max(1, sum(r[2] for r in results)), 3),
        "coordinator_cpu_ms_per_request": round(1e3 * cpu / max(1, requests), 3),
        "core_ms_per_request": round(1e3 * core / max(1, requests), 3),
        "coordinator_cpu_over_core": round(cpu / core, 2) if core else None,
        "evicted_pages": pages["evicted_by_place"],
        "tree_pages": pages["known"],
    }


def engine_curve(counts: list[int], seconds: float, batch: int, settings: list[str], cpu_s) -> None:
    """A local fabric (no model work: engine calls never reach the ranks), one
    phase per engine count; the last line one JSON object."""
    from fabric.client import launch
    from fabric.config import FabricConfig

    config = FabricConfig().with_overrides(
        [
            "runtime.dashboard=false",
            "runtime.name=load-engines",
            "runtime.ray_namespace=kvfabric-bench-engines",
            "model.filler=constant",
            # L3 holds about a third of the trace's pages' shards: the tree evicts.
            f"storage.max_bytes={3000 * WORLD * PAGE_BYTES}",
            *settings,
        ]
    )
    fabric = launch(config, address="local", announce=False)
    curve = []
    try:
        for engines in counts:
            row = phase(fabric, engines, seconds, batch, cpu_s)
            curve.append(row)
            print(
                f"{engines:>3} engines x {batch} requests a step: {row['requests_per_s']} req/s, "
                f"coordinator {row['coordinator_cpu_ms_per_request']} ms CPU/request (core "
                f"{row['core_ms_per_request']} ms, x{row['coordinator_cpu_over_core']}), "
                f"page hits {row['page_hit_rate']:.0%}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        fabric.shutdown()
    last = curve[-1]
    print(
        json.dumps(
            {
                "engine_steps": curve,
                "coordinator_cpu_over_core": last["coordinator_cpu_over_core"],
                "requests_per_s": last["requests_per_s"],
            }
        )
    )
