"""L1 <-> L2 page copies through the pools against a raw torch index copy of the
same pages between the same tensors, in one process and one run.

Two patterns: contiguous pages (the pools copy slices) and scattered pages (one
gather/scatter). ``copy_vs_raw_torch`` = raw time / pool time over both
(goal >= 0.8: the pools add at most a fifth).

    python3 bench/transfer.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from fabric.config import FabricConfig
from fabric.rank.pools import KVPool, copy_pages, pick_device
from fabric.topology import Topology


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pages", type=int, default=256, help="pages per copy (default 256)")
    args = ap.parse_args()
    repeats = 20 if args.quick else 100
    rows = []
    for layout in ("layer_first", "page_first", "page_first_direct"):
        config = FabricConfig().with_overrides(
            [f"model.layout={layout}", "model.layers=8", "model.head_dim=64"]
        )
        shard = Topology(config.topology).shard(0, config.model, config.cache.page_size)
        device = pick_device("auto")
        l1 = KVPool(1024, shard, config.model, device)
        l2 = KVPool(
            2048, shard, config.model, torch.device("cpu"), pin_memory=device.type == "cuda"
        )
        rng = random.Random(0)
        for pattern in ("contiguous", "scattered"):
            if pattern == "contiguous":
                src, dst = list(range(100, 100 + args.pages)), list(range(500, 500 + args.pages))
            else:
                src, dst = rng.sample(range(1024), args.pages), rng.sample(range(2048), args.pages)
            s_idx = torch.tensor(src, device=device)
            d_idx = torch.tensor(dst)

            def raw(s_idx=s_idx, d_idx=d_idx, l1=l1, l2=l2):
                l2.pages[:, d_idx] = l1.pages[:, s_idx].to("cpu")

            def pool(src=src, dst=dst, l1=l1, l2=l2):
                copy_pages(l1, src, l2, dst)

            raw_s, pool_s = timed(raw, repeats), timed(pool, repeats)
            mb = args.pages * l1.nbytes / l1.num_pages / 1e6
            rows.append(
                {
                    "layout": layout,
                    "pattern": pattern,
                    "pool_ms": round(pool_s * 1e3, 3),
                    "raw_ms": round(raw_s * 1e3, 3),
                    "copy_vs_raw_torch": round(raw_s / pool_s, 3),
                    "pool_GBps": round(mb / 1e3 / pool_s, 2),
                }
            )
            print(
                f"{layout:<18} {pattern:<10} pool {pool_s * 1e3:7.3f} ms  raw {raw_s * 1e3:7.3f} ms  "
                f"ratio {raw_s / pool_s:.2f}  ({mb:.1f} MB)",
                file=sys.stderr,
            )
    print(
        json.dumps({"rows": rows, "copy_vs_raw_torch": min(r["copy_vs_raw_torch"] for r in rows)})
    )


if __name__ == "__main__":
    main()
