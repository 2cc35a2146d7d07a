"""Cost of one consensus round against a bare gather of no-op calls to the same actors.

A round is what the coordinator does each step: encode the step's batch, send it
to every rank actor, await every report, decode and reduce them (MIN/MAX). The
baseline is the same fan-out of calls that do nothing. Same actors, same run:
``round_vs_bare_gather`` = round time / bare time (goal <= 1.5).

    python3 bench/consensus.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ray

from actors.factory import remote
from actors.rank_actor import RankActor
from fabric.config import FabricConfig
from fabric.coordinator.consensus import Consensus
from fabric.messages import Batch, decode, encode


def measure(world: int, rounds: int) -> dict:
    tp = 2 if world > 1 else 1
    config = FabricConfig().with_overrides(
        [
            f"topology.tp={tp}",
            f"topology.pp={world // tp}",
            "model.layers=8",
            "model.kv_heads=2",
            "model.head_dim=8",
            "cache.device_tokens=1024",
            "cache.host_tokens=2048",
        ]
    )
    cls = remote(RankActor, num_cpus=0, max_concurrency=4)
    ranks = [cls.remote(config.to_dict(), i) for i in range(world)]
    ray.get([r.ping.remote() for r in ranks])
    consensus = Consensus(world)

    def one_round() -> None:
        data = encode(Batch(1, ()))
        reports = [decode(x) for x in ray.get([r.step.remote(data) for r in ranks])]
        consensus.reduce(reports, 1)  # type: ignore[arg-type]

    def bare() -> None:
        ray.get([r.ping.remote() for r in ranks])

    for fn in (one_round, bare):
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {"round": [], "bare": []}
    for _ in range(rounds):  # interleave so drift hits both alike
        for name, fn in (("round", one_round), ("bare", bare)):
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    for r in ranks:
        ray.kill(r)
    round_us = statistics.median(samples["round"]) * 1e6
    bare_us = statistics.median(samples["bare"]) * 1e6
    return {
        "ranks": world,
        "round_us": round(round_us, 1),
        "bare_gather_us": round(bare_us, 1),
        "round_vs_bare_gather": round(round_us / bare_us, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for world in (2, 4, 8):
            row = measure(world, 100 if args.quick else 500)
            rows.append(row)
            print(
                f"{world} ranks: round {row['round_us']} us, bare gather {row['bare_gather_us']} us, "
                f"ratio {row['round_vs_bare_gather']}",
                file=sys.stderr,
            )
    finally:
        ray.shutdown()
    print(
        json.dumps(
            {"rows": rows, "round_vs_bare_gather": max(r["round_vs_bare_gather"] for r in rows)}
        )
    )


if __name__ == "__main__":
    main()
