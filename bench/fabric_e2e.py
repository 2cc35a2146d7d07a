"""End-to-end requests/s through real actors, and the coordinator's own cost.

Launches a local fabric (TP=2, CPU pools by default) and replays a workload
(synthetic conversations, or a Mooncake-format trace) from this driver with a
window of requests in flight. Reports requests/s, latency percentiles, tokens
per tier, and the coordinator overhead per request: time spent in the
coordinator's core (admission, tree, commit) per finished request, beside the
mean latency measured in the same run (``coordinator_share`` = overhead /
latency).

    python3 bench/fabric_e2e.py --quick
    python3 bench/fabric_e2e.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.cli.exit import finish
from fabric.client import launch
from fabric.config import FabricConfig
from fabric.tools.workload import drive, iter_packed, read_trace, synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="120 requests, under a minute")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    n = 120 if args.quick else args.requests
    l3 = tempfile.mkdtemp(prefix="kvfabric-bench-l3-")  # unless --set storage.path=...
    config = FabricConfig().with_overrides([f"storage.path={l3}", *args.set])
    requests = read_trace(args.trace, n) if args.trace else synthetic_trace(n)
    packed = [p for _, p in iter_packed(requests) if len(p) // 4 <= config.cache.device_tokens]
    fabric = launch(config)
    try:
        run = drive(fabric, packed, args.inflight)
        stats = fabric.stats()
    finally:
        fabric.shutdown()
        shutil.rmtree(l3, ignore_errors=True)
    latencies = sorted(run.latencies_s)
    tiers = run.tokens.as_dict()
    elapsed = run.elapsed_s
    finished = max(1, stats["counters"]["finished"])
    overhead_ms = 1e3 * stats["counters"]["core_time_s"] / finished
    mean_ms = 1e3 * sum(latencies) / max(1, len(latencies))
    result = {
        "source": args.trace or "synthetic",
        "requests": len(packed),
        "served": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "latency_ms_p50": round(1e3 * latencies[len(latencies) // 2], 2),
        "latency_ms_p99": round(1e3 * latencies[int(0.99 * (len(latencies) - 1))], 2),
        "latency_ms_mean": round(mean_ms, 2),
        "coordinator_overhead_ms_per_request": round(overhead_ms, 3),
        "coordinator_share": round(overhead_ms / mean_ms, 3) if mean_ms else None,
        "tokens_by_tier": tiers,
        "rounds": stats["counters"]["rounds"],
    }
    print(
        f"{result['served']} requests: {result['requests_per_s']} req/s, p50 {result['latency_ms_p50']} ms, "
        f"p99 {result['latency_ms_p99']} ms, coordinator {result['coordinator_overhead_ms_per_request']} ms/request "
        f"({100 * (result['coordinator_share'] or 0):.1f}% of latency), tiers {tiers}",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
