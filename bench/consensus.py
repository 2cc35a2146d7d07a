"""Cost of one consensus round against a bare gather of no-op calls to the same actors.

A round is what the coordinator does each step: encode the step's batch, send it
to every rank actor, await every report, decode and reduce them (MIN/MAX). The
baseline is the same fan-out of calls that do nothing. Same actors, same run:
``round_vs_bare_gather`` = round time / bare time (goal <= 1.5). The same
round on a Ray Compiled Graph (``runtime.compiled_rounds``: the batch and the
reports through shared-memory channels) is ``compiled_round_us``, and
``compiled_vs_bare_gather`` its time over the bare gather's (goal <= 0.3 at 8
ranks). ``--no-compiled`` leaves it out.

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
from fabric.cli.exit import finish
from fabric.config import FabricConfig
from fabric.coordinator.consensus import Consensus
from fabric.messages import Batch, decode, encode


def interleaved(fns: list, rounds: int) -> dict[str, list[float]]:
    """Each function's time per call, ``rounds`` times, interleaved so that drift
    hits all alike (after 20 warm-up calls each)."""
    for _, fn in fns:
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {name: [] for name, _ in fns}
    for _ in range(rounds):
        for name, fn in fns:
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def measure(world: int, rounds: int, compiled: bool = True) -> dict:
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

    fns = [("round", one_round), ("bare", bare)]
    samples = interleaved(fns, rounds)
    if compiled:
        # Measured after the plain calls, with no graph compiled while they ran:
        # a graph's actors poll their channels on a core each, which would slow
        # the baseline down and flatter the ratio.
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as batch:
            dag = MultiOutputNode([r.step.bind(batch) for r in ranks])
        graph = dag.experimental_compile()

        def compiled_round() -> None:
            data = encode(Batch(1, ()))
            reports = [decode(x) for x in ray.get(graph.execute(data))]
            consensus.reduce(reports, 1)  # type: ignore[arg-type]

        samples.update(interleaved([("compiled", compiled_round)], rounds))
        graph.teardown()
    for r in ranks:
        ray.kill(r)
    round_us = statistics.median(samples["round"]) * 1e6
    bare_us = statistics.median(samples["bare"]) * 1e6
    row = {
        "ranks": world,
        "round_us": round(round_us, 1),
        "bare_gather_us": round(bare_us, 1),
        "round_vs_bare_gather": round(round_us / bare_us, 3),
    }
    if compiled:
        compiled_us = statistics.median(samples["compiled"]) * 1e6
        row["compiled_round_us"] = round(compiled_us, 1)
        row["compiled_vs_bare_gather"] = round(compiled_us / bare_us, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    ap.add_argument("--no-compiled", action="store_true", help="leave out the compiled-graph round")
    args = ap.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for world in (2, 4, 8):
            row = measure(world, 100 if args.quick else 500, not args.no_compiled)
            rows.append(row)
            compiled = (
                f"; compiled round {row['compiled_round_us']} us, "
                f"{row['compiled_vs_bare_gather']}x the bare gather"
                if "compiled_round_us" in row
                else ""
            )
            print(
                f"{world} ranks: round {row['round_us']} us, bare gather {row['bare_gather_us']} us, "
                f"ratio {row['round_vs_bare_gather']}{compiled}",
                file=sys.stderr,
            )
    finally:
        ray.shutdown()
    out = {"rows": rows, "round_vs_bare_gather": max(r["round_vs_bare_gather"] for r in rows)}
    if not args.no_compiled:
        out["compiled_vs_bare_gather_8"] = rows[-1]["compiled_vs_bare_gather"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
