"""Tree cost of the kvfabric core against an SGLang-style pure-Python radix cache.

Replays a workload (the synthetic conversations by default, or a Mooncake-format
trace) through the full core — match, load-back, prefetch, alloc/evict, insert,
write-through, with sized L1/L2 and an in-memory L3 — at page sizes 16 and 64,
and through the baseline (match + insert + LRU eviction, one tier) in the same
run. Prints requests/s, mean and p99 us per admission (match, load-back,
allocation with eviction, insert: the code that serves, ``fabric.cache.admission``),
tokens per tier, the tree's peak traced memory, and the ratio of per-request tree
cost — the baseline's match + evict + insert over kvfabric's admission (> 1 means
kvfabric is cheaper). It also
prints the whole per-request core cost: for kvfabric everything the core does
for a request (match, load-back, L3 prefetch bookkeeping, allocation and
eviction of L1 and L2, insert, the step's write-through, completions, SHA-256
page hashes for L3 and events); for the baseline match + eviction + insert of
its single tier. The last line is one JSON object.

    python3 bench/tree_ops.py --quick
    python3 bench/tree_ops.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from sglang_style_radix import SGLangStyleRadixCache

from fabric.cache.inprocess import CoreReplay
from fabric.cache.keys import unpack_tokens
from fabric.config import FabricConfig
from fabric.workload import iter_packed, read_trace, synthetic_trace


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(0.99 * (len(xs) - 1))] if xs else 0.0


def run_ours(packed: list[bytes], config: FabricConfig) -> dict:
    replay = CoreReplay(config)
    t0 = time.perf_counter()
    for p in packed:
        replay.serve(p)
    elapsed = time.perf_counter() - t0
    s = replay.stats
    replay.cache.check_integrity()
    return {
        "requests_per_s": round(len(packed) / elapsed, 1),
        "admit_us_mean": round(statistics.fmean(s.admit_us), 2),
        "admit_us_p99": round(p99(s.admit_us), 2),
        "tree_us_per_request": round(statistics.fmean(s.admit_us), 2),
        "core_us_per_request": round(elapsed * 1e6 / len(packed), 2),
        "tokens_by_tier": s.tokens.as_dict(),
        "refused_requests": s.refused_requests,
    }


def peak_memory(packed: list[bytes], config: FabricConfig) -> int:
    tracemalloc.start()
    replay = CoreReplay(config)
    for p in packed:
        replay.serve(p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def run_baseline(packed: list[bytes], page: int, capacity: int, hashes: bool) -> dict:
    cache = SGLangStyleRadixCache(page, capacity, page_hashes=hashes)
    match_us, insert_us, total_us = [], [], []
    for data in packed:
        # Lists are made per request, outside the timed region: holding every
        # request's token list at once would make the cyclic GC dominate both runs.
        key = unpack_tokens(data)
        if len(key) > capacity:
            continue
        t0 = time.perf_counter()
        hit = cache.match_prefix(key)
        t1 = time.perf_counter()
        new = len(key) // page * page - len(hit)
        cache.evict_to_fit(new)
        value = torch_cat(hit, cache.new_value(new))
        t2 = time.perf_counter()
        cache.insert(key, value)
        t3 = time.perf_counter()
        match_us.append((t1 - t0) * 1e6)
        insert_us.append((t3 - t2) * 1e6)
        total_us.append((t3 - t0) * 1e6)
    return {
        "match_us_mean": round(statistics.fmean(match_us), 2),
        "insert_us_mean": round(statistics.fmean(insert_us), 2),
        "tree_us_per_request": round((sum(match_us) + sum(insert_us)) / len(match_us), 2),
        "core_us_per_request": round(statistics.fmean(total_us), 2),
    }


def torch_cat(a, b):
    import torch

    return torch.cat([a, b])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", help="Mooncake-format JSONL trace (default: synthetic)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="600 requests, under a minute")
    args = ap.parse_args()
    n = 600 if args.quick else args.requests
    requests = read_trace(args.trace, n) if args.trace else synthetic_trace(n)
    packed = [p for _, p in iter_packed(requests)]
    source = args.trace or "synthetic"
    results: dict = {"source": source, "requests": len(packed), "pages": {}}
    for page in (16, 64):
        row = {}
        for events in (False, True):
            config = FabricConfig().with_overrides(
                [
                    f"cache.page_size={page}",
                    "cache.device_tokens=65536",
                    "cache.host_tokens=262144",
                    f"cache.kv_events={str(events).lower()}",
                ]
            )
            gc.collect()
            ours = run_ours(packed, config)
            gc.collect()
            base = run_baseline(packed, page, 65536, hashes=events)
            ratio = base["core_us_per_request"] / ours["tree_us_per_request"]
            tag = "events_on" if events else "events_off"
            row[tag] = {"kvfabric": ours, "baseline": base, "tree_cost_ratio": round(ratio, 2)}
            print(
                f"page {page:>3} {tag:<10} kvfabric {ours['requests_per_s']:>8} req/s  "
                f"admit {ours['admit_us_mean']:>7} us (p99 {ours['admit_us_p99']})  "
                f"| baseline match+evict+insert {base['core_us_per_request']} us  "
                f"| baseline/kvfabric tree cost {ratio:.2f}x  "
                f"| whole core {ours['core_us_per_request']} us/req vs baseline "
                f"{base['core_us_per_request']} us/req",
                file=sys.stderr,
            )
        row["tokens_by_tier"] = row["events_on"]["kvfabric"]["tokens_by_tier"]
        row["peak_tree_bytes"] = peak_memory(packed[: min(len(packed), 600)], config)
        print(
            f"page {page:>3} tiers {row['tokens_by_tier']} peak {row['peak_tree_bytes']:,} B",
            file=sys.stderr,
        )
        results["pages"][str(page)] = row
    results["requests_per_s"] = results["pages"]["16"]["events_on"]["kvfabric"]["requests_per_s"]
    results["tree_cost_ratio_min"] = min(
        results["pages"][p][e]["tree_cost_ratio"]
        for p in ("16", "64")
        for e in ("events_off", "events_on")
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
