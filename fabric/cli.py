"""The ``kvfabric`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from fabric import __version__
from fabric.config import FabricConfig, load_config
from fabric.errors import FabricError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfabric", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvfabric {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="replay a workload through the core with an in-process controller",
        description="Serve a workload through the cache core alone (no Ray) and print "
        "the prompt tokens served from each tier.",
    )
    demo.add_argument(
        "--trace", help="a Mooncake-format JSONL trace (default: a synthetic conversation workload)"
    )
    demo.add_argument(
        "--requests", type=int, default=2000, help="requests to replay (default 2000)"
    )
    demo.add_argument("--config", help="a config file (.json, .toml, .yaml)")
    demo.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value",
    )
    demo.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _demo(args)
    except (FabricError, OSError) as exc:
        print(f"kvfabric: error: {exc}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    from fabric.replay import CoreReplay
    from fabric.workload import read_trace, synthetic_trace

    if args.requests < 1:
        raise FabricError(f"--requests {args.requests} is refused: allowed is an int >= 1")
    config = load_config(args.config) if args.config else FabricConfig()
    config = config.with_overrides(args.set)
    if args.trace:
        requests, source = read_trace(args.trace, args.requests), args.trace
    else:
        requests, source = synthetic_trace(args.requests), "synthetic conversations"
    replay = CoreReplay(config)
    total = len(requests)
    step = max(1, total // 20)
    started = time.perf_counter()

    def progress(done: int) -> None:
        if done % step == 0 or done == total:
            bar = "#" * (30 * done // total)
            print(f"\r[{bar:<30}] {done}/{total} requests", end="", file=sys.stderr, flush=True)

    stats = replay.run(requests, progress)
    print(file=sys.stderr)
    elapsed = time.perf_counter() - started
    replay.cache.check_integrity()
    result = {
        "source": source,
        "requests": stats.requests,
        "refused_requests": stats.refused_requests,
        "prompt_tokens": stats.prompt_tokens,
        "tokens_by_tier": stats.tiers(),
        "requests_per_s": round(stats.requests / elapsed, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvfabric {__version__} core demo: {stats.requests} requests from {source}")
    served = max(1, stats.prompt_tokens)
    for tier, tokens in stats.tiers().items():
        print(f"  {tier:<9} {tokens:>12,} tokens  {100 * tokens / served:5.1f}%")
    print(f"  refused   {stats.refused_requests:>12,} requests (larger than L1 or no room)")
    print(f"  {result['requests_per_s']:,} requests/s through the core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
