"""Where the whole core's time goes per request: ``CoreReplay`` (three tiers,
in-memory L3, events off by default) with timers wrapped around its parts.

Prints, per request: the whole core, SHA-256 page hashing — the core's own and
the stand-in's (the storage actor's in a fabric, which hashes the pages a hit
query asks about) — with pages hashed by each and µs per page, the in-process
stand-in (in-memory L3, hit answers and completions; it includes the stand-in's
hashing), the admission, write-through queueing, applying completions, and how
often ``match_prefix`` runs (its time is part of the admission's and the
prefetch's). The wrappers add ~1 µs per wrapped call, so the parts are upper
bounds. ``--free-hashes`` replaces SHA-256 with a slice of the page
(no hashing at all): what the core would cost if page hashes came for free —
the floor of any change to where pages are hashed. The last line is one JSON
object. ``--count-repeats`` also reports the fraction of page hashes that were
computed before (a page hashed twice).

    python3 bench/core_breakdown.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
    python3 bench/core_breakdown.py --trace ... --free-hashes --requests 0   # the whole trace
    python3 bench/core_breakdown.py --trace ... --set cache.eviction_policy=lru
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fabric.cache.inprocess as inprocess
import fabric.cache.keys as keys
import fabric.cache.l3_transfers as l3_transfers
import fabric.cache.radix as radix
from fabric.cache.admission import Admission
from fabric.cache.hicache import HiCache
from fabric.cache.inprocess import CoreReplay, InProcessController
from fabric.cache.placement import Placement
from fabric.cache.writes import Writes
from fabric.config import FabricConfig
from fabric.tools.workload import iter_packed, read_trace, synthetic_trace

spent: Counter[str] = Counter()
calls: Counter[str] = Counter()


def timed(owner: object, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
            calls[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", help="Mooncake-format JSONL trace (default: synthetic)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--events", action="store_true", help="KV events on")
    ap.add_argument("--free-hashes", action="store_true", help="no SHA-256: slices stand in")
    ap.add_argument(
        "--count-repeats",
        action="store_true",
        help="also count page hashes computed more than once (keeps every hash: "
        "memory, and slower timings)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override, e.g. cache.eviction_policy=lru (repeatable)",
    )
    args = ap.parse_args()
    limit = args.requests or None  # 0: all of a trace
    requests = read_trace(args.trace, limit) if args.trace else synthetic_trace(limit or 3000)
    packed = [p for _, p in iter_packed(requests)]
    config = FabricConfig().with_overrides(
        [
            f"cache.page_size={args.page}",
            "cache.device_tokens=2097152",
            "cache.host_tokens=20971520",
            f"cache.kv_events={str(args.events).lower()}",
            *args.set,
        ]
    )
    hashed = Counter()
    real_chain = keys.chain_hashes

    def free(prev: bytes, data: bytes, page_bytes: int) -> list[bytes]:
        return [data[i : i + 32] for i in range(0, len(data), page_bytes)]

    hash_pages = free if args.free_hashes else real_chain
    if args.free_hashes:  # a hit answer's slices pass for its hashes
        l3_transfers.answers_chain = lambda prev, data, pb, hashes: len(hashes) == len(data) // pb

    seen: set[bytes] = set()
    repeats = [0]

    def counting(where: str):
        def chain(prev: bytes, data: bytes, page_bytes: int) -> list[bytes]:
            hashed[where] += len(data) // page_bytes
            out = hash_pages(prev, data, page_bytes)
            if args.count_repeats:
                before = len(seen)
                seen.update(out)
                repeats[0] += len(out) - (len(seen) - before)
            return out

        return chain

    # The core's own hashing, and the stand-in's (the storage actor's in a fabric:
    # it hashes the pages a hit query asks about and answers with the hashes).
    keys.chain_hashes = counting("core")
    timed(keys, "chain_hashes", "sha256_page_hashes_core")
    radix.chain_hashes = keys.chain_hashes  # the tree imported it by name
    inprocess.chain_hashes = counting("stand_in")
    timed(inprocess, "chain_hashes", "sha256_page_hashes_stand_in")
    timed(InProcessController, "take_completions", "in_process_stand_in")
    timed(Admission, "prefill", "admission")
    timed(Writes, "write_through", "write_through_queueing")
    timed(HiCache, "apply", "apply_completions")
    timed(Placement, "match_prefix", "match_prefix")
    replay = CoreReplay(config, storage=True)
    for data in packed:
        replay.serve(data)
    n = len(packed)
    out = {
        "requests": n,
        "page": args.page,
        "events": args.events,
        "free_hashes": args.free_hashes,
        "whole_core_us": round(statistics.fmean(replay.stats.request_us), 1),
        "core_without_stand_in_us": round(
            statistics.fmean(replay.stats.request_us) - statistics.fmean(replay.stats.stand_in_us),
            1,
        ),
        **{f"{k}_us": round(v * 1e6 / n, 1) for k, v in spent.items()},
        "pages_hashed_per_request_core": round(hashed["core"] / n, 1),
        "pages_hashed_per_request_stand_in": round(hashed["stand_in"] / n, 1),
        "us_per_page_hash": round(
            (spent["sha256_page_hashes_core"] + spent["sha256_page_hashes_stand_in"])
            * 1e6
            / max(hashed.total(), 1),
            3,
        ),
        "match_prefix_calls_per_request": round(calls["match_prefix"] / n, 2),
    }
    if args.count_repeats:
        out["page_hashes_repeated_fraction"] = round(repeats[0] / max(hashed.total(), 1), 5)
    for k, v in out.items():
        print(f"{k:>32}: {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
