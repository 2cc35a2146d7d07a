"""What computing from the cache saves a hybrid model's rank (full attention with
Mamba2, gated-delta-net or sliding-window layers).

A rank that holds the whole model (TP = PP = 1) forks the cached state where a
request's prefix ends — the Mamba state, the sliding window's pages — and runs
only the new tokens (``fabric/rank/hybrid_fork.py``); the baseline is the same
rank with that off, which runs the whole prefix through the model for every
value it stores — what every hybrid rank did before, and what ranks holding a
TP or PP share still do. Both serve the same requests through the same
in-process fabric (``LocalFabric``), so the hits are the same; only the ranks'
compute differs. The two alternate, one repeat each at a time.

- **forks**: one shared prefix of ``--prefix`` tokens, then ``--forks`` requests
  that each add ``--new`` tokens to it (agents or samples branching off one
  context): each forks the one cached state.
- **chat**: ``kvfabric run --model``'s conversations (``--conversations`` x
  ``--turns``, answers appended token by token), without the check.

Printed per scenario and model: the serving time of each (median of
``--repeats``), the tokens each ran through the model, and the ratios
(from the cache over recomputing). The last line is one JSON object.

    python3 bench/hybrid_compute.py --quick
    python3 bench/hybrid_compute.py --models tiny-bamba,tiny-qwen3next,tiny-gemma3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fabric.cache.keys import pack_tokens
from fabric.config import FabricConfig
from fabric.driver.local import LocalClient, LocalFabric
from fabric.tools.chat import converse, model_overrides


def make(model: str, page: int, from_cache: bool) -> LocalFabric:
    config = FabricConfig().with_overrides(
        [
            *model_overrides(model),
            "topology.tp=1",
            "topology.pp=1",
            f"cache.page_size={page}",
            "cache.device_tokens=8192",
            "cache.host_tokens=8192",
            "cache.load_back_threshold=0",
            "runtime.step_interval_s=0",
            "storage.backend=none",
        ]
    )
    f = LocalFabric(config)
    if not from_cache:
        f.ranks[0].filler.forks = None
    return f


def forks(model: str, page: int, prefix: int, n: int, new: int, from_cache: bool):
    """Seconds to serve ``n`` requests branching off one cached prefix, and the
    tokens the rank ran through the model for them."""
    f = make(model, page, from_cache)
    base = [(7 * t + 3) % 200 for t in range(prefix)]
    r = f.serve(pack_tokens(base))
    f.core.release(r.lease)
    kv = f.ranks[0].filler
    ran = kv.run_tokens
    started = time.perf_counter()
    for i in range(n):
        r = f.serve(pack_tokens(base + [(11 * i + 5 * t + 1) % 200 for t in range(new)]))
        assert r.error is None and r.device_hit_tokens == prefix
        f.core.release(r.lease)
    return time.perf_counter() - started, kv.run_tokens - ran


def chat(model: str, page: int, conversations: int, turns: int, from_cache: bool):
    """Seconds for the conversations (serving, generating from what was served,
    appending the answers) and the tokens the rank ran through the model."""
    f = make(model, page, from_cache)
    started = time.perf_counter()
    converse(LocalClient(f), f.config, conversations, turns, 8, check=False)
    return time.perf_counter() - started, f.ranks[0].filler.run_tokens


def measure(run, repeats: int) -> dict:
    out, runs = {}, {"from_cache": True, "recompute": False}
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens = dict.fromkeys(runs, 0)
    for _ in range(repeats):
        for name, from_cache in runs.items():
            seconds, tokens[name] = run(from_cache)
            times[name].append(seconds)
    for name in runs:
        out[name] = {
            "seconds": round(statistics.median(times[name]), 4),
            "model_tokens": tokens[name],
        }
    out["time_ratio"] = round(out["from_cache"]["seconds"] / out["recompute"]["seconds"], 3)
    out["token_ratio"] = round(
        out["from_cache"]["model_tokens"] / max(1, out["recompute"]["model_tokens"]), 3
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-bamba,tiny-qwen3next,tiny-gemma3")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--forks", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small run (CI-sized)")
    a = p.parse_args()
    if a.quick:
        a.prefix, a.forks, a.turns, a.repeats = 128, 4, 2, 1
    results: dict = {}
    for model in a.models.split(","):
        rows = {
            "forks": measure(
                lambda c, m=model: forks(m, a.page, a.prefix, a.forks, a.new, c), a.repeats
            ),
            "chat": measure(
                lambda c, m=model: chat(m, a.page, a.conversations, a.turns, c), a.repeats
            ),
        }
        results[model] = rows
        for scenario, r in rows.items():
            print(
                f"{model:<15} {scenario:<6} from the cache {r['from_cache']['seconds']:7.3f} s "
                f"({r['from_cache']['model_tokens']:,} tokens through the model), recomputing "
                f"{r['recompute']['seconds']:7.3f} s ({r['recompute']['model_tokens']:,}): "
                f"time x{r['time_ratio']}, tokens x{r['token_ratio']}"
            )
    print(
        json.dumps(
            {
                "bench": "hybrid_compute",
                "page": a.page,
                "prefix": a.prefix,
                "forks": a.forks,
                "new": a.new,
                "conversations": a.conversations,
                "turns": a.turns,
                "repeats": a.repeats,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
