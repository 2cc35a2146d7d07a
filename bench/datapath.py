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

    python3 bench/datapath.py [--pages 256] [--page-kib 256] [--repeats 5] [--aes-gcm-only]

``--aes-gcm-only`` tags every authenticated page with AES-GCM, as kvfabric did
before pages of 64 KiB and more took AEGIS-128X4 tags: the same run's
``auth_overhead`` with the older tag.

Prints one JSON line: ``direct_warm_over_raw``, ``direct_cold_over_raw``
(throughput over the raw read's), ``auth_overhead`` (authenticated direct read
time over plain, less 1), ``l2_to_l1_over_memcpy``, with the GB/s behind them;
``auth_floor_one_thread``: a 256 KiB read and its tag (AEGIS-128X4, as a page of
that length carries) over the same read and its CRC, on one thread, less 1 (the
least the tag can add, whatever the read path).
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
from fabric.l3.auth import AEGIS_NONCE, GCM_NONCE, PageAuth
from fabric.l3.direct import DirectReads
from fabric.l3.format import Provenance
from fabric.l3.service import StorageService, page_geometry
from fabric.rank.node_l2 import NodeL2
from fabric.rank.pools import KVPool, copy_pages
from fabric.topology import Topology

SUFFIX = "0-0-0"
BACKUP_PAGES = 64  # pages per backup call, as a rank sends them


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-kib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-kib", type=int, default=64, help="a vLLM block of one layer")
    p.add_argument("--engine-layers", type=int, default=8)
    p.add_argument("--aes-gcm-only", action="store_true", help="AES-GCM tags on every page")
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
    return side_by_side({"x": fn}, repeats, before)["x"]


def side_by_side(fns: dict, repeats: int, before=None) -> dict[str, float]:
    """The median seconds of each of ``fns``, taken in turn in every repeat (so a
    drift of the machine, the disk's cache above all, falls on all of them)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


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


def l3_store(args: argparse.Namespace, work: pathlib.Path, auth: bool):
    """A segment store of ``--pages`` pages (authenticated with ``auth``)."""
    key_file = work / "auth.key"
    if auth and not key_file.exists():
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
    root = work / ("l3-auth" if auth else "l3")
    cfg = config(root, args.page_kib, *([f"storage.auth_key_file={key_file}"] if auth else []))
    service = StorageService(cfg)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (args.pages, page_geometry(cfg)[1]), dtype=np.uint8)
    hashes = [i.to_bytes(32, "big") for i in range(1, args.pages + 1)]
    backup(service, hashes, data)
    return cfg, service, hashes, data, root


def backup(service: StorageService, hashes: list[bytes], data: np.ndarray) -> None:
    for start in range(0, len(hashes), BACKUP_PAGES):
        end = start + BACKUP_PAGES
        assert service.store(SUFFIX, hashes[start:end], data[start:end])


def l3_paths(args: argparse.Namespace, work: pathlib.Path) -> dict[str, float]:
    """Reads warm and cold, and backups, each side by side with its raw peer."""
    cfg, plain, hashes, data, root = l3_store(args, work, auth=False)
    auth_cfg, authed, _, _, _ = l3_store(args, work, auth=True)
    direct, direct_auth = DirectReads(plain, cfg), DirectReads(authed, auth_cfg)
    rows = np.zeros_like(data)  # a rank reads into rows it keeps, as the raw read does
    raw_path = work / "raw.bin"
    data.tofile(raw_path)
    nbytes = data.nbytes
    buf = bytearray(nbytes)

    def raw_read() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            assert f.readinto(buf) == nbytes

    def read(reads: DirectReads):
        def go() -> None:
            reads.plan(SUFFIX, hashes)
            assert len(reads.load(SUFFIX, hashes, out=rows)) == args.pages

        return go

    def through_actor(service: StorageService):
        return lambda: len(service.load(SUFFIX, hashes)) == args.pages or sys.exit("short")

    shard = Topology(cfg.topology).shard(0, cfg.model, cfg.cache.page_size)
    l2 = KVPool(args.pages, shard, cfg.model, torch.device("cpu"), layers=cfg.model.layers)
    l2.put_rows(range(args.pages), data)
    batch = cfg.storage.transfer_batch_pages
    staging = np.zeros((batch, data.shape[1]), np.uint8)
    slots = list(range(args.pages))
    random.Random(1).shuffle(slots)  # L2 slots are wherever the allocator had room

    def prefetch() -> None:  # as a rank's (fabric.rank.storage_io): batches into L2 slots
        direct.plan(SUFFIX, hashes)
        for start in range(0, args.pages, batch):
            got = direct.load(SUFFIX, hashes[start : start + batch], out=staging)
            assert len(got) == min(batch, args.pages - start)
            l2.put_rows(slots[start : start + len(got)], got)

    say("L3 reads, warm")
    warm = side_by_side(
        {
            "raw": raw_read,
            "direct": read(direct),
            "direct_auth": read(direct_auth),
            "prefetch": prefetch,
            "service": through_actor(plain),
            "service_auth": through_actor(authed),
        },
        args.repeats,
    )
    say("L3 reads, cold (posix_fadvise DONTNEED before each)")
    files = [raw_path, *root.glob("*.kvs")]
    cold = side_by_side(
        {"raw": raw_read, "direct": read(direct)}, args.repeats, lambda: drop_cache(files)
    )
    direct.close()
    direct_auth.close()
    say("L3 writes: backups and write-through against a raw write of the same bytes")

    def raw_write() -> None:
        with open(raw_path, "wb", buffering=0) as f:
            assert f.write(memoryview(data).cast("B")) == nbytes

    def write_through() -> None:  # a rank's: its L2 rows gathered, then stored
        for start in range(0, args.pages, BACKUP_PAGES):
            end = min(start + BACKUP_PAGES, args.pages)
            assert plain.store(SUFFIX, hashes[start:end], l2.rows(range(start, end)))

    def clear() -> None:
        raw_path.unlink(missing_ok=True)
        plain.backend.clear()
        authed.backend.clear()

    writes = side_by_side(
        {
            "raw": raw_write,
            "backup": lambda: backup(plain, hashes, data),
            "backup_auth": lambda: backup(authed, hashes, data),
            "write_through": write_through,
        },
        args.repeats,
        clear,
    )
    plain.detach()
    authed.detach()
    return {
        **{f"{k}_warm_s": v for k, v in warm.items()},
        **{f"{k}_cold_s": v for k, v in cold.items()},
        **{f"{k}_write_s": v for k, v in writes.items()},
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


def l2_to_blocks(args: argparse.Namespace, work: pathlib.Path) -> dict[str, float]:
    """A vLLM worker's load of pages its node's L2 holds (``PageMoves``: found and
    checked in place, then copied a layer at a time into the engine's blocks,
    scattered) against ``torch`` copying the same bytes in one piece; ``{}``
    where vLLM is not installed (``PageMoves`` runs inside it)."""
    try:
        from fabric.engines.vllm_moves import PageMoves
        from fabric.engines.vllm_pages import Placement
    except ImportError as exc:
        say(f"node L2 -> blocks skipped: {exc} (run with the vLLM tier's python)")
        return {}
    layers, block = args.engine_layers, args.block_kib * 1024
    pages, blocks = min(args.pages, 128), 1024
    moves = PageMoves(
        Provenance("bench", "vllm", "float16", (layers, block // 2), 16), Placement(1, 1), block
    )
    moves.layers = [torch.zeros(blocks, block // 2, dtype=torch.float16) for _ in range(layers)]
    moves.l2 = NodeL2(work / "node-l2", block * layers, 2 * pages, moves.provenance.tag, "0-0-0")
    hashes = tuple(i.to_bytes(32, "big") for i in range(1, pages + 1))
    stored = torch.randint(0, 256, (pages, block * layers), dtype=torch.uint8)
    assert moves.l2.put(moves.keys(hashes), stored) == pages
    into = tuple(random.Random(2).sample(range(blocks), pages))

    def load() -> None:
        f = moves.fetch(hashes, into)
        try:
            for layer in range(layers):
                moves.scatter_layer(f, layer)
            assert moves.settle(f) == pages
        finally:
            moves.release(f)

    src, dst = stored.view(-1), torch.empty_like(stored).view(-1)
    t = side_by_side({"load": load, "memcpy": lambda: dst.copy_(src)}, args.repeats)
    moves.l2.close()
    return {"l2_to_blocks_s": t["load"], "blocks_memcpy_s": t["memcpy"], "bytes": stored.numel()}


def checksums(args: argparse.Namespace, work: pathlib.Path) -> dict[str, float]:
    """Each checksum kvfabric could use, as a read uses it: a 256 KiB read from the
    page cache, then the sum over it while the CPU cache holds it. GB/s of the
    whole (read and sum) and of the read alone. zlib and zlib-ng always; xxhash
    and crc32c where installed (``pip install -e '.[bench]'``)."""
    import zlib

    from zlib_ng import zlib_ng

    sums = {"none": None, "crc32_zlib": zlib.crc32, "crc32_zlib_ng": zlib_ng.crc32}
    try:
        import xxhash

        sums.update(xxh3_64=xxhash.xxh3_64_intdigest, xxh64=xxhash.xxh64_intdigest)
    except ImportError:
        say("checksums: xxhash not installed")
    try:
        import crc32c

        sums["crc32c"] = crc32c.crc32c
    except ImportError:
        say("checksums: crc32c not installed")
    # The tags an authenticated page carries instead of the CRC (``PageAuth.tag_ok``:
    # AEGIS-128X4 on a page of 256 KiB, AES-GCM's on small ones): read and tag over
    # read and CRC, on one thread, is what the tag adds to a read at the least.
    auth, bound = PageAuth(os.urandom(32)), b"k" * 80 + b"\0model"
    for name, nonce in (
        ("aegis_tag", os.urandom(AEGIS_NONCE)),
        ("aes_gcm_tag", os.urandom(GCM_NONCE)),
    ):
        sums[name] = lambda row, nonce=nonce: auth.tag_ok(nonce, bytes(16), bound, row)
    call, nbytes = 256 << 10, args.pages * args.page_kib * 1024
    path = work / "sums.bin"
    path.write_bytes(os.urandom(nbytes))
    out = np.zeros((nbytes // call, call), np.uint8)
    fd = os.open(path, os.O_RDONLY)

    def read_and(fn):
        def go() -> None:
            for i, row in enumerate(out):
                os.preadv(fd, [row], i * call)
                if fn is not None:
                    fn(row)

        return go

    try:
        t = side_by_side({name: read_and(fn) for name, fn in sums.items()}, args.repeats)
    finally:
        os.close(fd)
    return {name: round(nbytes / 1e9 / v, 2) for name, v in t.items()}


def main() -> None:
    args = parse()
    if args.aes_gcm_only:  # every page signed with a 12-byte nonce: AES-GCM's tag
        PageAuth.nonce_bytes = staticmethod(lambda payload_len: GCM_NONCE)
    with tempfile.TemporaryDirectory(prefix="kvfabric-datapath-", dir=ROOT) as tmp:
        say(f"L3: {args.pages} pages of {args.page_kib} KiB")
        t = l3_paths(args, pathlib.Path(tmp))
        say("checksums after a read")
        sums = checksums(args, pathlib.Path(tmp))
        say("node L2 -> a vLLM worker's blocks against memcpy")
        blocks = l2_to_blocks(args, pathlib.Path(tmp))
    say("L2 -> L1 against memcpy")
    copy = l2_to_l1(args)
    gb = args.pages * args.page_kib * 1024 / 1e9

    def ratio(baseline: str, path: str) -> float:
        return round(t[baseline] / t[path], 3)

    print(
        json.dumps(
            {
                "direct_warm_over_raw": ratio("raw_warm_s", "direct_warm_s"),
                "direct_cold_over_raw": ratio("raw_cold_s", "direct_cold_s"),
                "auth_overhead": round(t["direct_auth_warm_s"] / t["direct_warm_s"] - 1, 3),
                # The least the tag adds to a read on one thread (checksums above).
                "auth_floor_one_thread": round(sums["crc32_zlib_ng"] / sums["aegis_tag"] - 1, 3),
                "l2_to_l1_over_memcpy": round(copy["memcpy_s"] / copy["l2_to_l1_s"], 3),
                **(
                    {
                        "l2_to_blocks_over_memcpy": round(
                            blocks["blocks_memcpy_s"] / blocks["l2_to_blocks_s"], 3
                        )
                    }
                    if blocks
                    else {}
                ),
                "prefetch_to_l2_over_raw": ratio("raw_warm_s", "prefetch_warm_s"),
                "service_warm_over_raw": ratio("raw_warm_s", "service_warm_s"),
                "service_auth_overhead": round(
                    t["service_auth_warm_s"] / t["service_warm_s"] - 1, 3
                ),
                "backup_over_raw_write": ratio("raw_write_s", "backup_write_s"),
                "backup_auth_over_raw_write": ratio("raw_write_s", "backup_auth_write_s"),
                "write_through_over_raw_write": ratio("raw_write_s", "write_through_write_s"),
                "gb_per_s": {
                    **{k[:-2]: round(gb / v, 2) for k, v in t.items()},
                    "l2_to_l1": round(copy["bytes"] / 1e9 / copy["l2_to_l1_s"], 2),
                    "memcpy": round(copy["bytes"] / 1e9 / copy["memcpy_s"], 2),
                },
                "read_and_checksum_gb_per_s": sums,
                "pages": args.pages,
                "page_kib": args.page_kib,
                "repeats": args.repeats,
                "tags": "aes-gcm" if args.aes_gcm_only else "by page length",
            }
        )
    )


if __name__ == "__main__":
    main()
