"""L1 memory an interleaved sliding-window model saves in kvfabric's tree, against
caching every layer as full attention, on a trace.

The model is Gemma-3-like: 12 layers, five sliding-window layers (window
``--window`` tokens) to each full-attention layer, 8 KV heads of 128, bf16. Each
configuration replays the trace through the core (``fabric.tools.simulate.core_replay``:
the real tree, L1 alone, no L2 or L3, so only L1 serves):

- **all full**: every layer cached as full attention, L1 = ``--device-tokens``
  tokens (what a full-attention-only cache must do for this model);
- **hybrid**: the full-attention layers' L1 at the same token count, plus a
  sliding-window pool of a fraction of it (``--sliding-fractions``): the tree
  keeps only the window before each node's end and serves a prefix only where
  that window is whole;
- **all full, same memory**: every layer full again, with L1 shrunk to the
  hybrid configuration's bytes — the fair comparison of what the memory buys.

Printed per hybrid configuration: its token hit rate, its L1 bytes, the memory
saved against all full (1 - hybrid / all full) and the hit rate all full reaches
in the same bytes. The last line is one JSON object.

    python3 bench/hybrid_memory.py --quick
    python3 bench/hybrid_memory.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.config import FabricConfig
from fabric.tools.simulate import core_replay
from fabric.tools.workload import read_trace, synthetic_trace

LAYERS = ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)


def config(page: int, device: int, window: int, sliding: int | None) -> FabricConfig:
    overrides = [
        f"cache.page_size={page}",
        f"cache.device_tokens={device}",
        f"cache.host_tokens={page}",  # one page of L2: L1 alone serves
        "cache.kv_events=false",
        "storage.backend=none",
        "model.layers=12",
        "model.kv_heads=8",
        "model.head_dim=128",
        "topology.tp=1",
    ]
    if sliding is not None:
        overrides += [
            f"model.layer_kinds=[{', '.join(LAYERS)}]",
            f"model.sliding_window={window}",
            f"cache.sliding_tokens={sliding}",
        ]
    return FabricConfig().with_overrides(overrides)


def replay(requests, cfg: FabricConfig) -> dict:
    t0 = time.perf_counter()
    stats = core_replay(requests, cfg)
    tokens = stats.tokens.as_dict()
    total = max(1, sum(tokens.values()))
    per = cfg.model.component_bytes()
    if stats.components:
        memory = stats.components["bytes"]
    else:
        memory = cfg.cache.device_tokens * per["full"]
    return {
        "device_tokens": cfg.cache.device_tokens,
        "sliding_tokens": cfg.cache.sliding_tokens if stats.components else 0,
        "hit_rate": round(tokens["device"] / total, 4),
        "bytes": memory,
        "refused_requests": stats.refused_requests,
        "counters": stats.components.get("counters", {}),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", help="Mooncake-format JSONL trace (default: synthetic)")
    ap.add_argument("--requests", type=int, help="how many (default: all of a trace, 3000)")
    ap.add_argument("--quick", action="store_true", help="600 synthetic requests, small L1")
    ap.add_argument("--device-tokens", type=int, default=2_097_152, help="L1 (default 2M)")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--window", type=int, default=1024, help="sliding window in tokens")
    ap.add_argument(
        "--sliding-fractions",
        default="0.03125,0.125,0.25",
        help="sliding pool sizes as fractions of L1 (comma-separated)",
    )
    args = ap.parse_args()
    device, page = args.device_tokens, args.page
    if args.quick:
        device = 65_536
        n = args.requests or 600
    else:
        n = args.requests if args.requests else (None if args.trace else 3000)
    requests = read_trace(args.trace, n) if args.trace else synthetic_trace(n or 3000)
    fractions = [float(f) for f in args.sliding_fractions.split(",")]
    print(f"{len(requests)} requests, L1 {device:,} tokens, page {page}", file=sys.stderr)

    full = replay(requests, config(page, device, args.window, None))
    full_per_token = full["bytes"] // device
    print(
        f"all full:   hit {full['hit_rate']:6.1%}  L1 {full['bytes'] / 2**30:7.2f} GiB",
        file=sys.stderr,
    )
    rows = []
    for fraction in fractions:
        sliding = max(page, int(device * fraction) // page * page)
        hybrid = replay(requests, config(page, device, args.window, sliding))
        same_tokens = max(page, hybrid["bytes"] // full_per_token // page * page)
        same = replay(requests, config(page, same_tokens, args.window, None))
        row = {
            "sliding_fraction": fraction,
            "hybrid": hybrid,
            "all_full_same_memory": same,
            "memory_saved": round(1 - hybrid["bytes"] / full["bytes"], 4),
            "hit_rate_vs_all_full": round(hybrid["hit_rate"] / max(full["hit_rate"], 1e-9), 3),
            "hit_rate_vs_all_full_same_memory": round(
                hybrid["hit_rate"] / max(same["hit_rate"], 1e-9), 3
            ),
        }
        rows.append(row)
        print(
            f"hybrid, sliding pool {fraction:.3g} of L1: hit {hybrid['hit_rate']:6.1%}  "
            f"L1 {hybrid['bytes'] / 2**30:7.2f} GiB ({row['memory_saved']:.0%} saved); "
            f"all full in the same memory ({same_tokens:,} tokens): hit {same['hit_rate']:6.1%}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "source": args.trace or "synthetic",
                "requests": len(requests),
                "page_size": page,
                "window": args.window,
                "layers": list(LAYERS),
                "all_full": full,
                "hybrid": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
