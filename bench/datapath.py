"""What moving a hit's bytes costs on each path, against the raw operation it
stands on, side by side in one run (issue "datapath"):

- L3 reads of ``--pages`` pages of ``--page-kib`` each: a raw read of one file of
  the same bytes (``readinto`` one buffer: what the page cache and the disk do at
  best), a rank's own read of a segment store (``fabric.l3.direct``: where the
  pages lie, then ``preadv`` and the checks), and the storage actor's read
  (``StorageService.load``, in this process: the backend and its checks, no Ray),
  each warm (the page cache holds the files) and cold (``posix_fadvise
  DONTNEED`` first), and the direct read with authenticated pages
  (``storage.auth_key_file``) against plain ones;
- L2 -> L1: the rank's page copy (``fabric.rank.pools.copy_pages``, pages in a
  shuffled order) against ``torch`` copying the same bytes in one piece.

    python3 bench/datapath.py [--pages 256] [--page-kib 256] [--repeats 5]

Prints one JSON line: ``direct_warm_over_raw``, ``direct_cold_over_raw``
(throughput over the raw read's), ``auth_overhead`` (authenticated direct read
time over plain, less 1), ``l2_to_l1_over_memcpy``, with the GB/s behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from fabric.config import FabricConfig
from fabric.l3.direct import DirectReads
from fabric.l3.service import StorageService, page_geometry
from fabric.rank.pools import KVPool, copy_pages
from fabric.topology import Topology

SUFFIX = "0-0-0"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-kib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def say(text: str) -> None:
    print(f"datapath: {text}", file=sys.stderr, flush=True)


def drop_cache(paths: list[pathlib.Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, repeats: int, before=None) -> float:
    """The median seconds of ``fn`` (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def config(root: pathlib.Path, page_kib: int, *more: str) -> FabricConfig:
    """A model whose page is ``page_kib`` KiB on one rank (float16, 16 tokens)."""
    dim = page_kib * 1024 // (2 * 16 * 4 * 2 * 2)  # K and V, tokens, layers, heads, 2 bytes
    return FabricConfig().with_overrides(
        [
            "model.layers=4", "model.kv_heads=2", f"model.head_dim={dim}",
            "model.dtype=float16", "cache.page_size=16", "topology.tp=1",
            f"storage.path={root}", "storage.backend=segment", "storage.max_bytes=0",
            *more,
        ]
    )  # fmt: skip


def l3_reads(args: argparse.Namespace, work: pathlib.Path, auth: bool) -> dict[str, float]:
    key_file = work / "auth.key"
    if auth and not key_file.exists():
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
    root = work / ("l3-auth" if auth else "l3")
    more = [f"storage.auth_key_file={key_file}"] if auth else []
    cfg = config(root, args.page_kib, *more)
    service = StorageService(cfg)
    page = page_geometry(cfg)[1]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (args.pages, page), dtype=np.uint8)
    hashes = [i.to_bytes(32, "big") for i in range(1, args.pages + 1)]
    for start in range(0, args.pages, 64):
        assert service.store(SUFFIX, hashes[start : start + 64], data[start : start + 64])
    direct = DirectReads(service, cfg)
    segments = sorted(root.glob("*.kvs"))
    rows = np.zeros_like(data)  # a rank reads into rows it keeps, as the raw read does

    def read_direct() -> None:
        direct.plan(SUFFIX, hashes)
        assert len(direct.load(SUFFIX, hashes, out=rows)) == args.pages

    def read_service() -> None:
        assert len(service.load(SUFFIX, hashes)) == args.pages

    out = {
        "direct_warm_s": timed(read_direct, args.repeats),
        "direct_cold_s": timed(read_direct, args.repeats, lambda: drop_cache(segments)),
        "service_warm_s": timed(read_service, args.repeats),
    }
    direct.close()
    service.detach()
    return out


def raw_reads(args: argparse.Namespace, work: pathlib.Path, nbytes: int) -> dict[str, float]:
    path = work / "raw.bin"
    path.write_bytes(os.urandom(nbytes))
    buf = bytearray(nbytes)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            assert f.readinto(buf) == nbytes

    return {
        "raw_warm_s": timed(read, args.repeats),
        "raw_cold_s": timed(read, args.repeats, lambda: drop_cache([path])),
    }


def l2_to_l1(args: argparse.Namespace) -> dict[str, float]:
    cfg = config(pathlib.Path("/nonexistent"), args.page_kib)
    shard = Topology(cfg.topology).shard(0, cfg.model, cfg.cache.page_size)
    host = KVPool(args.pages, shard, cfg.model, torch.device("cpu"), layers=cfg.model.layers)
    device = KVPool(args.pages, shard, cfg.model, torch.device("cpu"), layers=cfg.model.layers)
    host.buffer.copy_(torch.randn_like(host.buffer, dtype=torch.float32).to(host.buffer.dtype))
    src = list(range(args.pages))
    dst = src[:]
    random.Random(0).shuffle(dst)  # L1 slots are wherever the allocator had room
    a, b = host.buffer.view(-1), device.buffer.view(-1)
    return {
        "l2_to_l1_s": timed(lambda: copy_pages(host, src, device, dst), args.repeats),
        "memcpy_s": timed(lambda: b.copy_(a), args.repeats),
        "bytes": host.buffer.numel() * host.buffer.element_size(),
    }


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="kvfabric-datapath-", dir=ROOT) as tmp:
        work = pathlib.Path(tmp)
        say(f"L3: {args.pages} pages of {args.page_kib} KiB, plain")
        plain = l3_reads(args, work, auth=False)
        say("L3: authenticated pages")
        authed = l3_reads(args, work, auth=True)
        nbytes = args.pages * args.page_kib * 1024
        say("raw one-file reads of the same bytes")
        raw = raw_reads(args, work, nbytes)
    say("L2 -> L1 against memcpy")
    copy = l2_to_l1(args)
    gb = nbytes / 1e9
    print(
        json.dumps(
            {
                "direct_warm_over_raw": round(raw["raw_warm_s"] / plain["direct_warm_s"], 3),
                "direct_cold_over_raw": round(raw["raw_cold_s"] / plain["direct_cold_s"], 3),
                "auth_overhead": round(authed["direct_warm_s"] / plain["direct_warm_s"] - 1, 3),
                "l2_to_l1_over_memcpy": round(copy["memcpy_s"] / copy["l2_to_l1_s"], 3),
                "service_warm_over_raw": round(raw["raw_warm_s"] / plain["service_warm_s"], 3),
                "gb_per_s": {
                    "raw_warm": round(gb / raw["raw_warm_s"], 2),
                    "raw_cold": round(gb / raw["raw_cold_s"], 2),
                    "direct_warm": round(gb / plain["direct_warm_s"], 2),
                    "direct_cold": round(gb / plain["direct_cold_s"], 2),
                    "direct_auth_warm": round(gb / authed["direct_warm_s"], 2),
                    "service_warm": round(gb / plain["service_warm_s"], 2),
                    "l2_to_l1": round(copy["bytes"] / 1e9 / copy["l2_to_l1_s"], 2),
                    "memcpy": round(copy["bytes"] / 1e9 / copy["memcpy_s"], 2),
                },
                "pages": args.pages,
                "page_kib": args.page_kib,
            }
        )
    )


if __name__ == "__main__":
    main()
