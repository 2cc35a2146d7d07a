"""What one Ray actor call costs the actor that receives it: the floor under any
coordinator request (``bench/fabric_load.py``).

A no-op method on a sync, a threaded (``max_concurrency=4``) and an async actor,
called one at a time and pipelined (all calls in flight at once); the actor
process's CPU per call (utime + stime from ``/proc``) and the wall time. Then
the floor under a consensus round (``RayRankGroup.round``): an async actor
sends a 2 KB batch to 1, 2 and 4 actors that echo 64 bytes and awaits the
replies, as the coordinator does each round; that actor's CPU per round, over
Ray calls and over the ranks' sockets (``fabric.round_sockets``, the project's
own code on both ends: ``runtime.round_transport``).

    python3 bench/ray_call_floor.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import asyncio
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


class Echo:
    def __init__(self) -> None:
        from fabric.round_sockets import RoundServer

        self.server = RoundServer(lambda batch: batch[:64], "127.0.0.1", 1 << 20)

    async def step(self, batch: bytes) -> bytes:
        return batch[:64]

    async def endpoint(self) -> tuple[str, bytes]:
        return self.server.endpoint, self.server.secret


class Rounds:
    """An async actor that fans a batch out to ``ranks`` and awaits their replies."""

    def __init__(self, ranks: list) -> None:
        self.ranks = ranks

    def pid(self) -> int:
        return os.getpid()

    async def rounds(self, n: int, width: int) -> int:
        batch = b"x" * 2048
        for _ in range(n):
            await asyncio.gather(*(r.step.remote(batch) for r in self.ranks[:width]))
        return n

    async def socket_rounds(self, n: int, width: int) -> int:
        from fabric.round_sockets import RoundSockets

        sockets = RoundSockets(width, 1 << 20)
        for i, rank in enumerate(self.ranks[:width]):
            sockets.connect(i, *await rank.endpoint.remote())
        batch = b"x" * 2048
        try:
            for _ in range(n):
                replies, _ = await sockets.round(batch, 30.0)
                assert all(isinstance(r, bytes) for r in replies), replies
        finally:
            sockets.close()
        return n


WIDTHS = (1, 2, 4)


def round_floor(calls: int) -> dict[str, float]:
    """The fanning actor's CPU per round to 1, 2 and 4 echoing actors, over Ray
    calls and over sockets."""
    echo = ray.remote(num_cpus=0, max_concurrency=1000)(Echo)
    fan = ray.remote(num_cpus=0, max_concurrency=1000)(Rounds)
    actor = fan.remote([echo.remote() for _ in range(max(WIDTHS))])
    pid = ray.get(actor.pid.remote())
    out = {}
    for kind, method in (("round", actor.rounds), ("socket_round", actor.socket_rounds)):
        for width in WIDTHS:
            ray.get(method.remote(100, width))  # warm
            c0 = cpu_s(pid)
            ray.get(method.remote(calls, width))
            out[f"{kind}_to_{width}_cpu_ms"] = round(1e3 * (cpu_s(pid) - c0) / calls, 3)
    return out


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
        rounds = round_floor(args.calls)
    finally:
        ray.shutdown()
    for name, r in result.items():
        print(
            f"{name:>9}: {r['one_at_a_time_actor_cpu_ms']} ms actor CPU a call one at a time, "
            f"{r['pipelined_actor_cpu_ms']} ms pipelined",
            file=sys.stderr,
        )
    for kind, label in (("round", "Ray calls"), ("socket_round", "sockets")):
        per = ", ".join(f"{rounds[f'{kind}_to_{w}_cpu_ms']} to {w}" for w in WIDTHS)
        print(f"    round over {label}: ms of the sender's CPU {per}", file=sys.stderr)
    print(json.dumps({**result, "round": rounds}))


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
