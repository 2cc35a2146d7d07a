"""Is ``bench/tree_ops.py``'s baseline as fast as the real thing it stands for?

Times ``bench/sglang_style_radix.py`` (SGLang's ``RadixCache`` algorithm and
paged allocator, re-written) against the real SGLang ``RadixCache`` in the same
process, request by request (match, lock, evict, allocate, insert, unlock), at
page sizes 16 and 64, events off and on, alternating the two in each round.
Prints each side's mean µs a request and ``real_over_rewritten`` (the real
one's time over the re-written one's): >= 1 means the baseline is at least as
fast as SGLang, so ratios against it do not flatter kvfabric. Hit tokens must be
equal (it exits 1 when they are not). The last line is one JSON object.

Needs SGLang importable (``pip install sglang``; for ``RadixCache`` alone on a
CPU machine, ``pip install --no-deps sglang`` and the modules its import chain
asks for are enough; where one has no build for the installed torch —
``torchvision``, ``tvm_ffi``, ``xgrammar`` here — an empty stand-in module
does, as ``RadixCache`` uses none of them).

    python3 bench/baseline_vs_sglang.py --trace ../shared/traces/mooncake_conversation_trace.jsonl
    python3 bench/baseline_vs_sglang.py --trace ... --events-requests 4000   # events on: slow
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from array import array

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tree_ops import best, config, run_peer

from fabric.cache.keys import unpack_tokens
from fabric.tools.workload import iter_packed, read_trace, synthetic_trace


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", help="Mooncake-format JSONL trace (default: synthetic)")
    ap.add_argument("--requests", type=int, help="events off (default: all of a trace, 3000)")
    ap.add_argument(
        "--events-requests",
        type=int,
        default=4000,
        help="events on: the first N requests (default 4000; both peers hash every page)",
    )
    ap.add_argument("--device-tokens", type=int, default=2_097_152, help="L1 (default 2M)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; each side's best is kept")
    args = ap.parse_args()
    try:
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    except ImportError as e:
        print(f"this bench needs SGLang's RadixCache, which did not import: {e}", file=sys.stderr)
        return 2
    n = args.requests if args.requests else (None if args.trace else 3000)
    requests = read_trace(args.trace, n) if args.trace else synthetic_trace(n or 3000)
    keys = [array("q", unpack_tokens(p)) for _, p in iter_packed(requests)]
    out: dict = {"source": args.trace or "synthetic", "requests": len(keys), "rows": {}}
    same = True
    for page in (16, 64):
        for events in (False, True):
            subset = keys[: args.events_requests] if events else keys
            cfg = config(page, args.device_tokens, page, events, True)
            rewritten, real = [], []
            for _ in range(args.repeat):
                rewritten.append(run_peer(subset, cfg, "faithful"))
                real.append(run_peer(subset, cfg, "sglang"))
            a, b = best(rewritten), best(real)
            same &= a["hit_tokens"] == b["hit_tokens"]
            name = f"page_{page}_events_{'on' if events else 'off'}"
            out["rows"][name] = {
                "requests": len(subset),
                "rewritten_us": a["us"],
                "sglang_us": b["us"],
                "real_over_rewritten": round(b["us"] / a["us"], 2),
                "hit_tokens": [a["hit_tokens"], b["hit_tokens"]],
            }
            print(
                f"{name}: re-written {a['us']} us, SGLang {b['us']} us a request "
                f"({out['rows'][name]['real_over_rewritten']}x); hit tokens "
                f"{a['hit_tokens']:,} vs {b['hit_tokens']:,}",
                file=sys.stderr,
            )
    out["real_over_rewritten_min"] = min(r["real_over_rewritten"] for r in out["rows"].values())
    out["equal_hits"] = same
    print(json.dumps(out))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
