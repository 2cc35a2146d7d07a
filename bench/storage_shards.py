"""What several storage actors (``storage.actors``) buy: hit queries, prefetch
loads and backup stores through 1, 2, 4... storage actors on one segment store,
same run, each count against one actor.

For each count N, N ``StorageActor`` processes open the same store (a fresh
directory per count). This process plays the ranks and the coordinator:
- **backup**: ``--clients`` threads each store a prompt's pages for one rank
  shard through a ``ShardedLink`` (one actor: the plain link), split by owner;
- **prefetch**: the same threads load them back through the actors (the
  relayed path; direct reads skip the actors' data path altogether);
- **query**: batches of ``--batch`` hit queries (packed prompts, hashed in the
  storage actors), ``--clients`` batches in flight, as the coordinator sends
  them: one actor answers ``query``; with several, each leads its turn of the
  batch (hashes the chains once, asks the owners of the pages, merges:
  ``StorageActor.lead``).
Each figure is also given over the one-actor figure of the same run
(``*_vs_one``). On a machine with C cores, N actors can use at most C of them.

    python3 bench/storage_shards.py --quick
    python3 bench/storage_shards.py --actors 1,2,4 --prompts 64 --pages 64

The last line is one JSON object: per count, ``queries_per_s``,
``prefetch_MB_per_s``, ``backup_MB_per_s`` and their ratios to one actor.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import ray
from fabric_load import cpu_s  # this directory is on the path of a script run from it

from actors.factory import remote
from actors.rank_actor import StorageActorLink
from actors.storage_actor import StorageActor
from actors.storage_group import storage_names
from fabric.cache.keys import chain_hashes, pack_tokens
from fabric.cli.exit import finish
from fabric.config import FabricConfig
from fabric.l3.service import StorageService, provenance_bytes
from fabric.l3.shards import ShardedLink

NS = "kvfabric-bench-shards"


def fabric_config(path: str, actors: int, page_size: int) -> FabricConfig:
    return FabricConfig().with_overrides(
        [
            "runtime.name=bench-shards",
            f"runtime.ray_namespace={NS}",
            "storage.backend=segment",
            f"storage.path={path}",
            "storage.max_bytes=0",
            f"storage.actors={actors}",
            f"cache.page_size={page_size}",
        ]
    )


def measure(args: argparse.Namespace, actors: int) -> dict:
    path = tempfile.mkdtemp(prefix="kvfabric-shards-", dir=args.dir)
    config = fabric_config(path, actors, args.page_size)
    handles = [
        remote(StorageActor, name=name, namespace=NS, num_cpus=0, max_concurrency=16).remote(
            config.to_dict(), None, shard
        )
        for shard, name in enumerate(storage_names(config))
    ]
    ray.get([h.ping.remote() for h in handles])
    links = [
        StorageActorLink(n, NS, 60.0, handle=h)
        for n, h in zip(storage_names(config), handles, strict=True)
    ]
    # One link per client thread, as each rank has its own (and its one storage thread).
    local = threading.local()

    def client_link():
        if not hasattr(local, "link"):
            local.link = links[0] if actors == 1 else ShardedLink(links)
        return local.link

    # What the actors hold, seen from here (no backend of its own).
    service = StorageService(
        config.replace(storage={**config.storage.model_dump(), "backend": "none"})
    )
    suffix = service.suffixes[0]
    page_bytes = provenance_bytes(service.shapes["full", suffix])
    rng = random.Random(1)
    prompts = [
        [rng.randrange(32000) for _ in range(args.pages * args.page_size)]
        for _ in range(args.prompts)
    ]
    chains = [chain_hashes(b"", pack_tokens(p), service.key_page_bytes) for p in prompts]
    data = np.random.default_rng(0).integers(0, 256, (args.pages, page_bytes), dtype=np.uint8)
    batch = 64

    pids = [ray.get(h.where.remote())[0] for h in handles]

    def cpu() -> list[float]:
        return [cpu_s(pid) for pid in pids]

    busiest: dict[str, float] = {}  # per phase: CPU seconds of the busiest actor

    def run(fn, phase: str, n: int) -> float:
        before = cpu()
        started = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(fn, range(n)))
        took = time.perf_counter() - started
        used = [b - a for a, b in zip(before, cpu(), strict=True)]
        busiest[phase] = min(busiest.get(phase, float("inf")), max(used))
        return took

    def store(i: int) -> None:
        for at in range(0, args.pages, batch):
            assert client_link().store(suffix, chains[i][at : at + batch], data[at : at + batch])

    def load(i: int) -> None:
        for at in range(0, args.pages, batch):
            got = client_link().load(suffix, chains[i][at : at + batch])
            assert len(got) == len(chains[i][at : at + batch]), "every page stored is found"

    moved = args.prompts * args.pages * page_bytes / 1e6
    backup_s = run(store, "backup", args.prompts)
    prefetch_s = min(run(load, "prefetch", args.prompts) for _ in range(args.repeat))

    # Hit queries: a page is a hit only when every rank's shard of it is there;
    # store the other ranks' shards too.
    for other in service.suffixes[1:]:
        for i in range(args.prompts):
            for at in range(0, args.pages, batch):
                assert client_link().store(other, chains[i][at : at + batch], data[at : at + batch])
    queries = [(i, b"", pack_tokens(p)) for i, p in enumerate(prompts)]
    lock = threading.Lock()
    answered = []

    def ask(k: int) -> None:
        group = [queries[(k * args.batch + j) % len(queries)] for j in range(args.batch)]
        if actors == 1:
            got = ray.get(handles[0].query.remote(group))
            pages = [got[op][0] for op, *_ in group]
        else:
            got = {}  # each actor leads its turn of the batch, as the coordinator deals them
            for part in ray.get([h.lead.remote(group[i::actors]) for i, h in enumerate(handles)]):
                got.update(part)
            pages = [got[op][0] for op, *_ in group]
        with lock:
            answered.extend(pages)

    rounds = max(args.clients, args.query_rounds)
    query_s = run(ask, "query", rounds)
    assert all(p == args.pages for p in answered), "every query hits every page"
    for h in handles:
        ray.kill(h, no_restart=True)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "actors": actors,
        "queries_per_s": round(rounds * args.batch / query_s, 1),
        "query_pages_per_s": round(rounds * args.batch * args.pages / query_s),
        "prefetch_MB_per_s": round(moved / prefetch_s, 1),
        "backup_MB_per_s": round(moved / backup_s, 1),
        # The busiest actor's CPU per unit of work: what bounds the rate where
        # every actor has a core of its own.
        "busiest_actor_cpu_ms_per_query": round(1e3 * busiest["query"] / (rounds * args.batch), 3),
        "busiest_actor_cpu_ms_per_MB_prefetch": round(1e3 * busiest["prefetch"] / moved, 2),
        "busiest_actor_cpu_ms_per_MB_backup": round(1e3 * busiest["backup"] / moved, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actors", default="1,2,4", help="storage actor counts")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64, help="pages per prompt")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4, help="calls in flight")
    ap.add_argument("--batch", type=int, default=8, help="hit queries per call")
    ap.add_argument("--query-rounds", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="prefetch passes (the best is kept)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    ap.add_argument("--quick", action="store_true", help="1 and 2 actors, fewer pages")
    args = ap.parse_args()
    if args.quick:
        args.actors, args.prompts, args.pages, args.query_rounds, args.repeat = "1,2", 8, 32, 40, 1
    counts = [int(n) for n in args.actors.split(",")]
    ray.init(include_dashboard=False, namespace=NS, log_to_driver=False)
    try:
        rows = []
        for n in counts:
            row = measure(args, n)
            rows.append(row)
            print(
                f"{n} storage actor(s): {row['queries_per_s']:>8} queries/s  "
                f"prefetch {row['prefetch_MB_per_s']:>7} MB/s  backup {row['backup_MB_per_s']:>7} MB/s",
                file=sys.stderr,
            )
        one = rows[0]
        for row in rows:
            for key in ("queries_per_s", "prefetch_MB_per_s", "backup_MB_per_s"):
                row[key.replace("_per_s", "").removesuffix("_MB") + "_vs_one"] = round(
                    row[key] / one[key], 2
                )
        print(json.dumps({"cpus": os.cpu_count(), "config": vars(args), "by_actors": rows}))
    finally:
        ray.shutdown()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py


if __name__ == "__main__":
    main()
