"""Hit rate gained by caching each turn's answer, on a conversation workload.

Every request is served through the request lifecycle (``CoreReplay``: L1, L2
and an in-memory L3), twice in one run: once caching only the prompt, once
also decoding the answer into the cache as an engine does when a turn finishes
(the whole prompt, then the answer appended). The answers are reconstructed
from the trace (``fabric.tools.workload.iter_turns``): a turn's answer is what the
next turn of its conversation has after its prompt; a turn with no next one
gets fresh tokens. Hit rates count the prompts' whole pages.

    python3 bench/output_caching.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
    python3 bench/output_caching.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.cache.inprocess import CoreReplay
from fabric.config import FabricConfig
from fabric.tools.workload import iter_turns, read_trace, synthetic_trace


def replay(turns, config: FabricConfig, answers: bool) -> dict:
    r = CoreReplay(config, storage=True)
    started = time.perf_counter()
    for _, prompt, answer, _ in turns:
        r.serve(prompt, answer if answers else b"")
    r.cache.check_integrity()
    t = r.stats.tokens
    hits = t.device + t.host + t.storage
    return {
        "hit_rate": round(hits / max(1, r.stats.prompt_tokens), 4),
        "tokens_by_tier": t.as_dict(),
        "refused_requests": r.stats.refused_requests,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", help="Mooncake-format JSONL trace (default: synthetic)")
    ap.add_argument(
        "--requests", type=int, help="how many (default: all of a trace, 3000 synthetic)"
    )
    ap.add_argument("--quick", action="store_true", help="600 synthetic requests, small pools")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=2_097_152, help="L1 (default 2M)")
    ap.add_argument("--host-tokens", type=int, default=20_971_520, help="L2 (default 20M)")
    args = ap.parse_args()
    device, host = args.device_tokens, args.host_tokens
    if args.quick:
        requests, device, host = synthetic_trace(args.requests or 600), 65_536, 262_144
    elif args.trace:
        requests = read_trace(args.trace, args.requests)
    else:
        requests = synthetic_trace(args.requests or 3000)
    config = FabricConfig().with_overrides(
        [
            f"cache.page_size={args.page}",
            f"cache.device_tokens={device}",
            f"cache.host_tokens={host}",
            "cache.kv_events=false",
        ]
    )
    turns = list(iter_turns(requests))
    followed = sum(1 for *_, has_next in turns if has_next)
    print(f"{len(turns)} turns, L1 {device:,} tokens, L2 {host:,}", file=sys.stderr)
    prompts_only = replay(turns, config, answers=False)
    with_answers = replay(turns, config, answers=True)
    out = {
        "source": args.trace or "synthetic",
        "requests": len(turns),
        "turns_followed_by_another": followed,
        "device_tokens": device,
        "host_tokens": host,
        "prompts_only": prompts_only,
        "with_answers": with_answers,
        "hit_rate_gain": round(with_answers["hit_rate"] - prompts_only["hit_rate"], 4),
        "hit_rate_ratio": round(with_answers["hit_rate"] / max(prompts_only["hit_rate"], 1e-9), 2),
    }
    print(
        f"hit rate: prompts only {prompts_only['hit_rate']:.2%}, with answers "
        f"{with_answers['hit_rate']:.2%} (+{out['hit_rate_gain']:.2%}, x{out['hit_rate_ratio']})",
        file=sys.stderr,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
