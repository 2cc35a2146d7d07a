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
    run = sub.add_parser(
        "run",
        help="launch a local fabric on Ray and serve a workload through it",
        description="Launch the fabric (coordinator and rank actors; local Ray unless "
        "runtime.address is set) and replay a workload through it from this driver, then "
        "print the prompt tokens served from each tier and the latency.",
    )
    _workload_args(run, default_requests=300)
    run.add_argument(
        "--inflight", type=int, default=8, help="requests in flight at once (default 8)"
    )
    chat = run.add_argument_group(
        "a real model (needs pip install 'kvfabric[model]')",
        "With --model the workload is multi-turn conversations: each turn's prompt is the "
        "previous prompt, the model's answer and a new message; the ranks compute a Llama "
        "model's KV, the driver generates from the KV the fabric serves.",
    )
    chat.add_argument(
        "--model", help="tiny-llama (seeded random weights) or a local Hugging Face model dir"
    )
    chat.add_argument(
        "--check",
        action="store_true",
        help="also generate every turn without a cache and count mismatching answers",
    )
    chat.add_argument("--conversations", type=int, default=4, help="default 4")
    chat.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    chat.add_argument("--new-tokens", type=int, default=8, help="answer length (default 8)")
    demo = sub.add_parser(
        "demo",
        help="replay a workload through the core with an in-process controller",
        description="Serve a workload through the cache core alone (no Ray) and print "
        "the prompt tokens served from each tier.",
    )
    _workload_args(demo, default_requests=2000)
    sim = sub.add_parser(
        "simulate",
        help="what-if on a trace: hit rate per tier, next to LRU and Belady bounds",
        description="Serve a trace through the core alone (no Ray, no KV bytes) at the "
        "configured sizes and policies and print the share of prompt tokens each tier "
        "served, next to block-level bounds at given capacities: LRU, Belady (the offline "
        "optimum) and an infinite cache.",
    )
    _workload_args(sim, default_requests=0)
    sim.add_argument(
        "--capacities",
        help="capacities in tokens for the bounds, comma-separated, K and M allowed "
        "(default: L1, and L1 + L2 of the config)",
    )
    sim.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw hit rate against capacity (needs pip install 'kvfabric[plot]')",
    )
    return p


def _workload_args(p: argparse.ArgumentParser, default_requests: int) -> None:
    p.add_argument(
        "--trace", help="a Mooncake-format JSONL trace (default: a synthetic conversation workload)"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=default_requests,
        help=f"requests to replay (default {default_requests})",
    )
    p.add_argument("--config", help="a config file (.json, .toml, .yaml)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        commands = {"run": _run, "demo": _demo, "simulate": _simulate}
        return commands[args.command](args)
    except (FabricError, OSError) as exc:
        print(f"kvfabric: error: {exc}", file=sys.stderr)
        return 2


def _setup(args: argparse.Namespace, whole_trace_ok: bool = False):
    from fabric.workload import read_trace, synthetic_trace

    if args.requests < (0 if whole_trace_ok else 1):
        raise FabricError(f"--requests {args.requests} is refused: allowed is an int >= 1")
    if not args.requests:
        args.requests = None if args.trace else 3000
    config = load_config(args.config) if args.config else FabricConfig()
    config = config.with_overrides(args.set)
    if args.trace:
        requests, source = read_trace(args.trace, args.requests), args.trace
    else:
        requests, source = synthetic_trace(args.requests), "synthetic conversations"
    return config, requests, source


def _progress(total: int, unit: str = "requests"):
    step = max(1, total // 50)

    def show(done: int) -> None:
        if done % step == 0 or done == total:
            bar = "#" * (30 * done // total)
            print(f"\r[{bar:<30}] {done}/{total} {unit}", end="", file=sys.stderr, flush=True)

    return show


def _run(args: argparse.Namespace) -> int:
    from fabric.client import launch
    from fabric.workload import drive, iter_packed

    if args.model is not None:
        return _chat(args)
    config, requests, source = _setup(args)
    if args.inflight < 1:
        raise FabricError(f"--inflight {args.inflight} is refused: allowed is an int >= 1")
    topo = config.topology
    print(
        f"kvfabric {__version__}: launching TP={topo.tp} CP={topo.cp} PP={topo.pp} ...",
        file=sys.stderr,
    )
    fabric = launch(config)
    try:
        prompts = (packed for _, packed in iter_packed(requests))
        run = drive(fabric, prompts, args.inflight, _progress(len(requests)))
        print(file=sys.stderr)
        fabric.settle()  # let the last backups reach L3 before the actors go
        fabric.check_integrity()
        stats = fabric.stats()
    finally:
        fabric.shutdown()
    served = len(run.latencies_s)
    result = {
        "source": source,
        "requests": len(requests),
        "served": served,
        "refused": run.refused,
        "tokens_by_tier": run.tokens.as_dict(),
        "requests_per_s": round(served / run.elapsed_s, 1) if run.elapsed_s else 0.0,
        "latency_ms_p50": run.percentile_ms(0.5),
        "latency_ms_p99": run.percentile_ms(0.99),
        "resets": stats["resets"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"kvfabric {__version__}: {served} of {len(requests)} requests from {source} served "
        f"by {topo.world_size} rank actors"
    )
    _print_tiers(run.tokens.as_dict())
    for reason, n in sorted(run.refused.items()):
        print(f"  refused   {n:>12,} requests: {reason}")
    print(
        f"  latency   p50 {result['latency_ms_p50']} ms, p99 {result['latency_ms_p99']} ms; "
        f"{result['requests_per_s']:,} requests/s"
    )
    return 0


def _chat(args: argparse.Namespace) -> int:
    from fabric.chat import converse, model_overrides
    from fabric.client import launch

    for name in ("conversations", "turns", "new_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise FabricError(f"{flag} {getattr(args, name)} is refused: allowed is an int >= 1")
    config = load_config(args.config) if args.config else FabricConfig()
    config = config.with_overrides([*model_overrides(args.model), *args.set])
    total = args.conversations * args.turns
    print(
        f"kvfabric {__version__}: launching with model {config.model.model_id} ...", file=sys.stderr
    )
    fabric = launch(config)
    try:
        started = time.perf_counter()
        stats = converse(
            fabric,
            config,
            args.conversations,
            args.turns,
            args.new_tokens,
            args.check,
            progress=_progress(total, "turns"),
        )
        elapsed = time.perf_counter() - started
        print(file=sys.stderr)
        fabric.check_integrity()
    finally:
        fabric.shutdown()
    result = {
        "model": config.model.model_id,
        "conversations": args.conversations,
        "turns": stats.turns,
        "checked_requests": stats.checked,
        "mismatches": stats.mismatches,
        "tokens_by_tier": stats.tokens.as_dict(),
        "generated_tokens": stats.generated_tokens,
        "turns_per_s": round(stats.turns / elapsed, 2) if elapsed else 0.0,
    }
    if not args.json:
        print(
            f"kvfabric {__version__}: {stats.turns} turns of {args.conversations} conversations "
            f"with {result['model']}"
        )
        _print_tiers(stats.tokens.as_dict())
        if args.check:
            print(
                f"  checked   {stats.checked} answers against generation without a cache: "
                f"{stats.mismatches} mismatched"
            )
    print(json.dumps(result))
    return 1 if stats.mismatches else 0


def _capacities(text: str | None, config: FabricConfig) -> list[int]:
    if not text:
        cache = config.cache
        return [cache.device_tokens, cache.device_tokens + cache.host_tokens]
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = {"K": 1024, "M": 1024**2}.get(item[-1:].upper(), 1)
        number = item[:-1] if scale > 1 else item
        if not number.isdigit() or int(number) < 1:
            raise FabricError(
                f"--capacities item {item!r} is refused: allowed is a count of tokens >= 1, "
                "with an optional K or M"
            )
        out.append(int(number) * scale)
    return out


def _simulate(args: argparse.Namespace) -> int:
    from fabric.simulate import bounds, core_hit_rates, plot

    config, requests, source = _setup(args, whole_trace_ok=True)
    capacities = _capacities(args.capacities, config)
    tiers, refused = core_hit_rates(requests, config, _progress(len(requests)))
    print(file=sys.stderr)
    limits = bounds(requests, capacities)
    result = {
        "source": source,
        "requests": len(requests),
        "core": {
            "device_tokens": config.cache.device_tokens,
            "host_tokens": config.cache.host_tokens,
            "eviction_policy": config.cache.eviction_policy,
            "page_size": config.cache.page_size,
            "hit_rate": round(1 - tiers["computed"], 4),
            "by_tier": {tier: round(share, 4) for tier, share in tiers.items()},
            "refused_requests": refused,
        },
        "bounds": [
            {
                "capacity_tokens": b.capacity_tokens,
                "lru": round(b.lru, 4),
                "belady": round(b.belady, 4),
                "infinite": round(b.infinite, 4),
            }
            for b in limits
        ],
    }
    if not args.json:
        c = result["core"]
        print(
            f"kvfabric {__version__} simulate: {len(requests)} requests from {source}; core at "
            f"L1 {c['device_tokens']:,} + L2 {c['host_tokens']:,} tokens, page {c['page_size']}, "
            f"{c['eviction_policy']}: hit rate {c['hit_rate']:.1%}"
        )
        for tier, share in c["by_tier"].items():
            print(f"  {tier:<9} {share:6.1%}")
        if refused:
            print(f"  refused   {refused} requests larger than L1 (raise cache.device_tokens)")
        print(
            f"  {'capacity':>14}  {'LRU':>6}  {'Belady':>6}  {'infinite':>8}   (512-token blocks)"
        )
        for b in result["bounds"]:
            print(
                f"  {b['capacity_tokens']:>14,}  {b['lru']:6.1%}  {b['belady']:6.1%}  "
                f"{b['infinite']:8.1%}"
            )
    if args.plot:
        core = (config.cache.device_tokens + config.cache.host_tokens, result["core"]["hit_rate"])
        plot(args.plot, limits, core)
        print(f"  chart: {args.plot}", file=sys.stderr)
    print(json.dumps(result))
    return 0


def _print_tiers(tiers: dict[str, int]) -> None:
    served = max(1, sum(tiers.values()))
    for tier, tokens in tiers.items():
        print(f"  {tier:<9} {tokens:>12,} tokens  {100 * tokens / served:5.1f}%")


def _demo(args: argparse.Namespace) -> int:
    from fabric.cache.inprocess import CoreReplay
    from fabric.workload import iter_packed

    config, requests, source = _setup(args)
    replay = CoreReplay(config)
    started = time.perf_counter()
    stats = replay.run((p for _, p in iter_packed(requests)), _progress(len(requests)))
    print(file=sys.stderr)
    elapsed = time.perf_counter() - started
    replay.cache.check_integrity()
    result = {
        "source": source,
        "requests": stats.requests,
        "refused_requests": stats.refused_requests,
        "prompt_tokens": stats.prompt_tokens,
        "tokens_by_tier": stats.tokens.as_dict(),
        "requests_per_s": round(stats.requests / elapsed, 1),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"kvfabric {__version__} core demo: {stats.requests} requests from {source}")
    _print_tiers(stats.tokens.as_dict())
    print(f"  refused   {stats.refused_requests:>12,} requests (larger than L1 or no room)")
    print(f"  {result['requests_per_s']:,} requests/s through the core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
