"""Live requests while KV event subscribers flood the replay socket: the latency of
a request served by a fabric whose publisher replays its whole buffer to many
clients at once, against the same requests unloaded, side by side in one run —
with the replay's CPU budget (``fabric.coordinator.publisher.REPLAY_SHARE``) and
without it (the share set to a whole core).

    python3 bench/replay_flood.py [--clients 16] [--requests 200] [--buffer 3000]

The fabric runs in this process (``LocalFabric``: coordinator, ranks and the
publisher's thread, as in the coordinator actor); the flooding clients run in
another process, each asking again for the whole buffer as soon as its replay
ends. Prints one JSON line: ``flooded_over_unloaded`` (with the budget; target
<= 1.5), ``unbudgeted_over_unloaded``, and the latencies and replay rates.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric.cache.keys import pack_tokens
from fabric.config import FabricConfig
from fabric.coordinator import publisher
from fabric.driver.local import LocalFabric

FLOOD = """
import sys, time, zmq
endpoint, clients, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
socks = []
for _ in range(clients):
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send((0).to_bytes(8, "big"))
    socks.append(s)
poller = zmq.Poller()
for s in socks:
    poller.register(s, zmq.POLLIN)
frames = replays = 0
end = time.monotonic() + seconds
print("ready", flush=True)
while time.monotonic() < end:
    for s, _ in poller.poll(100):
        while True:
            try:
                msg = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            frames += 1
            if msg[-2] == b"\\xff" * 8:
                replays += 1
                s.send((0).to_bytes(8, "big"))
print(frames, replays, flush=True)
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--buffer", type=int, default=3000, help="event batches to fill first")
    return p.parse_args()


def say(text: str) -> None:
    print(f"replay_flood: {text}", file=sys.stderr, flush=True)


def latencies(f: LocalFabric, rng: random.Random, n: int) -> list[float]:
    out = []
    for _ in range(n):
        tokens = pack_tokens([rng.randrange(1, 30000) for _ in range(64)])
        started = time.perf_counter()
        r = f.serve(tokens)
        f.core.release(r.lease)
        out.append(time.perf_counter() - started)
    return out


def flooded(f: LocalFabric, rng: random.Random, args: argparse.Namespace) -> tuple[float, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, f.publisher.replay_endpoint, str(args.clients), "600"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # the flood is under way
    before = (f.publisher.replays, f.publisher.replay_cpu_s)
    started = time.perf_counter()
    lat = latencies(f, rng, args.requests)
    wall = time.perf_counter() - started
    replays = f.publisher.replays - before[0]
    cpu = f.publisher.replay_cpu_s - before[1]
    proc.kill()
    proc.wait()
    return statistics.median(lat), {"replays_per_s": round(replays / wall, 1),
                                    "replay_cpu_share": round(cpu / wall, 3)}  # fmt: skip


def main() -> None:
    args = parse()
    config = FabricConfig().with_overrides(
        [
            "events.endpoint=tcp://127.0.0.1:*",
            "events.replay_endpoint=tcp://127.0.0.1:*",
            f"events.buffer_batches={args.buffer}",
        ]
    )
    rng = random.Random(0)
    f = LocalFabric(config)
    try:
        say(f"filling the replay buffer with {args.buffer} event batches")
        while f.publisher.published_batches < args.buffer:
            latencies(f, rng, 50)
            f.settle()
        f.publisher.flush()
        say("unloaded")
        latencies(f, rng, 20)  # warm
        unloaded = statistics.median(latencies(f, rng, args.requests))
        say(f"flooded by {args.clients} replaying clients, with the replay's budget")
        budgeted, with_budget = flooded(f, rng, args)
        say("flooded, the budget lifted (a whole core)")
        share = publisher.REPLAY_SHARE
        publisher.REPLAY_SHARE = 1.0
        try:
            unbudgeted, without = flooded(f, rng, args)
        finally:
            publisher.REPLAY_SHARE = share
    finally:
        f.close()
    print(
        json.dumps(
            {
                "flooded_over_unloaded": round(budgeted / unloaded, 3),
                "unbudgeted_over_unloaded": round(unbudgeted / unloaded, 3),
                "unloaded_ms": round(unloaded * 1e3, 3),
                "flooded_ms": round(budgeted * 1e3, 3),
                "unbudgeted_ms": round(unbudgeted * 1e3, 3),
                "budget_share": share,
                "with_budget": with_budget,
                "without_budget": without,
                "clients": args.clients,
                "buffer_batches": args.buffer,
            }
        )
    )


if __name__ == "__main__":
    main()
