"""Where a warm L3 prefetch's time goes: each pass over the bytes on its own,
same bytes, same run (4,096 pages of 64 KB by default, from the page cache).

- ``read_one_file``: one sequential read of all pages into a touched buffer
  (the raw baseline's best);
- ``crc32``: the page checksum over every page (``fabric.l3.format.checksum``);
- ``segment_get``: the segment backend reading and verifying the pages in
  batches of 64, in-process (the kernel's copy and the CRC);
- ``ray_return``: an actor handing back batches it already holds (Ray's copy
  into the object store, no I/O: the transport alone).

A prefetch through the storage actor makes the last three passes in a row.

    python3 bench/storage_passes.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import ray

from fabric.cli.exit import finish
from fabric.config import FabricConfig
from fabric.l3.format import checksum, page_key
from fabric.l3.segment import SegmentBackend
from fabric.l3.service import page_geometry, storage_provenance


@ray.remote(num_cpus=0, max_concurrency=4)
class Holder:
    def __init__(self, batch: np.ndarray) -> None:
        self.batch = batch

    def get(self) -> np.ndarray:
        return self.batch


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    config = FabricConfig().with_overrides(["model.layers=8", "model.head_dim=64"])
    _, page_bytes = page_geometry(config)
    prov = storage_provenance(config)
    n, batch = args.pages, 64
    data = np.random.default_rng(0).integers(0, 256, size=(n, page_bytes), dtype=np.uint8)
    mb = data.nbytes / 1e6
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        path = pathlib.Path(root) / "all"
        path.write_bytes(data.tobytes())
        buffer = np.zeros_like(data)

        def read_one_file() -> None:
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(buffer).cast("B"))

        def crc() -> None:
            for row in data:
                checksum(row)

        backend = SegmentBackend(prov, page_bytes, {"path": str(pathlib.Path(root) / "seg")})
        keys = [page_key(os.urandom(32), prov.tag, "0-0-0") for _ in range(n)]
        for i in range(0, n, batch):
            backend.set(keys[i : i + batch], data[i : i + batch], prov)

        def segment_get() -> None:
            for i in range(0, n, batch):
                rows = np.empty((batch, page_bytes), dtype=np.uint8)
                assert backend.get(keys[i : i + batch], rows, prov) == batch

        out["read_one_file"] = mb / best(read_one_file, args.repeats)
        out["crc32"] = mb / best(crc, args.repeats)
        out["segment_get"] = mb / best(segment_get, args.repeats)
        backend.close()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        holder = Holder.remote(data[:batch].copy())
        ray.get(holder.get.remote())

        def ray_return() -> None:
            ray.get([holder.get.remote() for _ in range(n // batch)])

        out["ray_return"] = mb / best(ray_return, args.repeats)
    finally:
        ray.shutdown()
    # The segment read (which includes the CRC) and Ray's copy, one after the other.
    serial = 1 / (1 / out["segment_get"] + 1 / out["ray_return"])
    rows = {k: round(v, 1) for k, v in out.items()}
    for k, v in rows.items():
        print(f"{k:>14}: {v:8.1f} MB/s", file=sys.stderr)
    print(
        f"segment_get then ray_return in a row: {serial:.0f} MB/s "
        f"({serial / out['read_one_file']:.2f}x the one-file read)",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {"page_bytes": page_bytes, "pages": n, "MBps": rows, "serial_MBps": round(serial, 1)}
        )
    )


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
