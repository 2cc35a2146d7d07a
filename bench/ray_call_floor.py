"""What one Ray actor call costs the actor that receives it: the floor under any
coordinator request (``bench/fabric_load.py``).

A no-op method on a sync, a threaded (``max_concurrency=4``) and an async actor,
called one at a time and pipelined (all calls in flight at once); the actor
process's CPU per call (utime + stime from ``/proc``) and the wall time.

    python3 bench/ray_call_floor.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ray
from fabric_load import cpu_s  # this directory is on the path of a script run from it

from fabric.cli.exit import finish


class Plain:
    def pid(self) -> int:
        return os.getpid()

    def noop(self) -> None:
        return None


class Async:
    async def pid(self) -> int:
        return os.getpid()

    async def noop(self) -> None:
        return None


def measure(actor, calls: int) -> dict[str, float]:
    pid = ray.get(actor.pid.remote())
    ray.get([actor.noop.remote() for _ in range(200)])  # warm
    out = {}
    c0, t0 = cpu_s(pid), time.perf_counter()
    for _ in range(calls):
        ray.get(actor.noop.remote())
    out["one_at_a_time_wall_ms"] = 1e3 * (time.perf_counter() - t0) / calls
    out["one_at_a_time_actor_cpu_ms"] = 1e3 * (cpu_s(pid) - c0) / calls
    c0, t0 = cpu_s(pid), time.perf_counter()
    ray.get([actor.noop.remote() for _ in range(calls)])
    out["pipelined_wall_ms"] = 1e3 * (time.perf_counter() - t0) / calls
    out["pipelined_actor_cpu_ms"] = 1e3 * (cpu_s(pid) - c0) / calls
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        kinds = {
            "sync": ray.remote(num_cpus=0)(Plain),
            "threaded": ray.remote(num_cpus=0, max_concurrency=4)(Plain),
            "async": ray.remote(num_cpus=0, max_concurrency=1000)(Async),
        }
        result = {name: measure(cls.remote(), args.calls) for name, cls in kinds.items()}
    finally:
        ray.shutdown()
    for name, r in result.items():
        print(
            f"{name:>9}: {r['one_at_a_time_actor_cpu_ms']} ms actor CPU a call one at a time, "
            f"{r['pipelined_actor_cpu_ms']} ms pipelined",
            file=sys.stderr,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
