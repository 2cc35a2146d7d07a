"""Eviction policies side by side: the core's token hit rate with L1 alone (no
L2, no L3) at several sizes, on the Mooncake trace and on generated chat, agent,
RAG and mixed workloads — what ``kvfabric simulate --policies`` gives, for every
cell at once. Hit rates, not speed: the same numbers on any machine.

    python3 bench/eviction_policies.py                       # lru, 2q, a2q; 128K to 4M
    python3 bench/eviction_policies.py --workloads scan_hot,tenant_gaps,drift --trace ''
    python3 bench/eviction_policies.py --policies lru,a2q --sizes 2M --requests 2000

The last line is one JSON object: per source and size, each policy's hit rate
and Belady's block-level bound, and per policy its worst margin against LRU and
against the best policy of each cell, and where.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.config import FabricConfig
from fabric.observe.report import hit_rate
from fabric.tools.simulate import belady_hit_rate, core_replay
from fabric.tools.workload import BLOCK_TOKENS, read_trace
from fabric.tools.workloads import generated

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from unseen_workloads import UNSEEN

TRACE = (
    pathlib.Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)


def size(text: str) -> int:
    scale = {"K": 1024, "M": 1024**2}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", default="lru,2q,a2q")
    ap.add_argument("--sizes", default="128K,512K,1M,2M,4M", help="L1 tokens (K = 1024)")
    ap.add_argument("--requests", type=int, default=4000, help="of each generated workload")
    ap.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace ('' for none)")
    ap.add_argument(
        "--workloads",
        default="chat,agent,rag,mixed,scan_hot,tenant_gaps,drift,churn",
        help="generated workloads: fabric.tools.workloads' and bench/unseen_workloads.py's "
        "(shapes no policy was tuned on)",
    )
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    sizes = [size(s) for s in args.sizes.split(",") if s]
    sources = {
        kind: UNSEEN[kind](args.requests, 0) if kind in UNSEEN else generated(kind, args.requests)
        for kind in args.workloads.split(",")
        if kind
    }
    if args.trace:
        sources = {"mooncake": read_trace(args.trace), **sources}
    rates: dict[str, dict[int, dict[str, float]]] = {}
    for name, requests in sources.items():
        for tokens in sizes:
            row = rates.setdefault(name, {}).setdefault(tokens, {})
            for policy in policies:
                config = FabricConfig().with_overrides(
                    [
                        f"cache.device_tokens={tokens}",
                        "cache.host_tokens=16",
                        "storage.backend=none",
                        f"cache.eviction_policy={policy}",
                    ]
                )
                stats = core_replay(requests, config)
                row[policy] = round(hit_rate(stats.tokens.as_dict()), 4)
            # Belady's block-level bound on the requests the core served (as
            # ``kvfabric simulate`` counts it: a refused request is in neither).
            refused = set(stats.refused_at)
            served = [r for i, r in enumerate(requests) if i not in refused]
            row["belady"] = round(belady_hit_rate(served, tokens // BLOCK_TOKENS, page=16), 4)
            print(f"{name} {tokens}: {row}", file=sys.stderr)
    cells = [
        (f"{name} {tokens // 1024}K", row)
        for name, by in rates.items()
        for tokens, row in by.items()
    ]
    worst_vs_lru, worst_vs_best = {}, {}
    for p in policies:
        if "lru" in policies:
            worst_vs_lru[p] = min((round(row[p] - row["lru"], 4), cell) for cell, row in cells)
        worst_vs_best[p] = min(
            (round(row[p] - max(row[q] for q in policies), 4), cell) for cell, row in cells
        )
    print(
        json.dumps(
            {"hit_rate": rates, "worst_vs_lru": worst_vs_lru, "worst_vs_best": worst_vs_best}
        )
    )


if __name__ == "__main__":
    main()
