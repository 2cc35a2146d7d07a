"""Backup and prefetch throughput through the storage actor against raw
sequential file writes and reads of the same bytes in the same directory, same
run; and the L3 hit rate on a workload after a restart.

Backup: page batches go from a driver-side array, through Ray's object store,
into the storage actor, which writes one verified file per page. Prefetch: the
storage actor reads and verifies them and ships them back. The baseline writes
(then reads) the same bytes as one file per page with plain ``open/write``:
``backup_vs_raw_write`` and ``prefetch_vs_raw_read`` are raw time / actor time
(goal >= 0.7 each). By default reads come from the page cache (just written),
which measures memory copies more than storage; ``--cold`` drops the cache
before each read so both sides read from the device.

    python3 bench/storage_io.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import ray

from actors.factory import remote
from actors.storage_actor import StorageActor
from fabric.client import launch
from fabric.config import FabricConfig
from fabric.l3.service import page_geometry
from fabric.workload import drive, iter_packed, read_trace, synthetic_trace


def drop_page_cache() -> bool:
    """Empty the OS page cache (root on Linux), so reads come from the device."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def io_throughput(root: pathlib.Path, pages: int, batch: int, repeats: int, cold: bool) -> dict:
    config = FabricConfig().with_overrides(
        [f"storage.path={root / 'actor'}", "model.layers=8", "model.head_dim=64"]
    )
    _, page_bytes = page_geometry(config)
    data = np.random.default_rng(0).integers(0, 256, size=(pages, page_bytes), dtype=np.uint8)
    actor = remote(StorageActor, num_cpus=0, max_concurrency=4).remote(config.to_dict())
    ray.get(actor.ping.remote())
    raw_dir = root / "raw"
    raw_dir.mkdir()

    # Every round stores new pages under new names, as a backup does (a page's key
    # is new until it is stored), and reads back what it just wrote.
    def one_round(r: int) -> dict[str, float]:
        hashes = [os.urandom(32) for _ in range(pages)]
        took = {}
        t0 = time.perf_counter()
        calls = [
            actor.store.remote("0-0-0", hashes[i : i + batch], data[i : i + batch])
            for i in range(0, pages, batch)
        ]
        assert all(ray.get(calls))
        took["backup"] = time.perf_counter() - t0
        if cold:
            drop_page_cache()
        t0 = time.perf_counter()
        calls = [actor.load.remote("0-0-0", hashes[i : i + batch]) for i in range(0, pages, batch)]
        assert sum(len(g) for g in ray.get(calls)) == pages
        took["prefetch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(pages):
            with open(raw_dir / f"{r}-{i}.bin", "wb") as f:
                f.write(data[i].tobytes())
        took["write"] = time.perf_counter() - t0
        if cold:
            drop_page_cache()
        t0 = time.perf_counter()
        for i in range(pages):
            with open(raw_dir / f"{r}-{i}.bin", "rb") as f:
                f.read()
        took["read"] = time.perf_counter() - t0
        return took

    one_round(-1)  # warm-up
    rounds = [one_round(r) for r in range(repeats)]
    backup_s, write_s, prefetch_s, read_s = (
        statistics.median(t[k] for t in rounds) for k in ("backup", "write", "prefetch", "read")
    )
    ray.kill(actor)
    mb = pages * page_bytes / 1e6
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "backup_MBps": round(mb / backup_s, 1),
        "prefetch_MBps": round(mb / prefetch_s, 1),
        "raw_write_MBps": round(mb / write_s, 1),
        "raw_read_MBps": round(mb / read_s, 1),
        "backup_vs_raw_write": round(write_s / backup_s, 3),
        "prefetch_vs_raw_read": round(read_s / prefetch_s, 3),
        "reads_from": "device (page cache dropped)" if cold else "page cache",
    }


def hit_rate_after_restart(root: pathlib.Path, requests, inflight: int) -> dict:
    config = FabricConfig().with_overrides(
        [f"storage.path={root / 'fabric'}", "runtime.name=bench-l3", "cache.device_tokens=32768"]
    )
    packed = [p for _, p in iter_packed(requests)]
    out = {}
    for run in ("first", "after_restart"):
        fabric = launch(config)
        try:
            stats = drive(fabric, packed, inflight)
            fabric.settle(120)
        finally:
            fabric.shutdown()
        tiers = stats.tokens.as_dict()
        total = max(1, sum(tiers.values()))
        out[run] = {"tokens_by_tier": tiers, "l3_hit_rate": round(tiers["storage"] / total, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer pages and requests, under a minute")
    ap.add_argument(
        "--trace", help="a Mooncake-format trace for the hit-rate part (default synthetic)"
    )
    ap.add_argument("--dir", help="directory to measure in (default: a temporary one)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the OS page cache before each read (needs root), so both the prefetch and "
        "the raw read come from the device, not from memory",
    )
    args = ap.parse_args()
    root = pathlib.Path(tempfile.mkdtemp(dir=args.dir))
    pages = 512 if args.quick else 4096
    n = 30 if args.quick else 200
    requests = read_trace(args.trace, n) if args.trace else synthetic_trace(n)
    try:
        ray.init(include_dashboard=False, log_to_driver=False)
        cold = args.cold and drop_page_cache()
        if args.cold and not cold:
            print("cannot drop the page cache here (not root?): reads are warm", file=sys.stderr)
        io = io_throughput(
            root, pages, FabricConfig().storage.transfer_batch_pages, 3 if args.quick else 7, cold
        )
        print(
            f"backup {io['backup_MBps']} MB/s vs raw write {io['raw_write_MBps']} MB/s "
            f"({io['backup_vs_raw_write']}); prefetch {io['prefetch_MBps']} MB/s vs raw read "
            f"{io['raw_read_MBps']} MB/s ({io['prefetch_vs_raw_read']}); reads from {io['reads_from']}",
            file=sys.stderr,
        )
        hits = hit_rate_after_restart(root, requests, inflight=8)
        print(
            f"L3 hit rate: first run {hits['first']['l3_hit_rate']}, after restart "
            f"{hits['after_restart']['l3_hit_rate']}",
            file=sys.stderr,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({**io, "hit_rate": hits}))


if __name__ == "__main__":
    main()
