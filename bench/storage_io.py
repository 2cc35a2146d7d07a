"""Backup and prefetch throughput through the storage actor against raw
sequential file writes and reads of the same bytes in the same directory, same
run; and the L3 hit rate on a workload after a restart.

Backup: page batches go from a driver-side array, through Ray's object store,
into the storage actor, which writes them verified to its backend (``file``:
one file per page; ``segment``: appended to segment files). Prefetch: the
storage actor reads and verifies them and ships them back. Two baselines write
(then read) the same bytes with plain ``open/write``/``readinto``: as one file
per page (``raw_*``), and as one file read sequentially into one buffer
(``raw_*_one_file``, what the device and the page cache can do at best).
Direct reads (``storage.direct_reads``): the actor says where the pages lie
and this process reads and checks them, as a rank does (``prefetch_direct_*``).
``backup_vs_raw_write`` and ``prefetch_vs_raw_read`` are raw (one file per page)
time / actor time, ``prefetch_vs_raw_read_one_file`` against the one-file
read. ``files_per_GB`` counts the backend's files. By default reads come from
the page cache (just written), which measures memory copies more than storage;
``--cold`` drops the cache before each read (root) so both sides read from the
device. Each backend named in ``--backends`` is measured in the same run, with
plain pages and with authenticated ones (``storage.auth_key_file``: a tag per
page written and checked): ``prefetch_auth_vs_plain`` and
``backup_auth_vs_plain`` are the authenticated throughput over the plain one
(rounds of the two alternate, each ratio the median over pairs of rounds);
``store_prefetch_auth_vs_plain`` and ``store_backup_auth_vs_plain`` the same for
the backend alone, without Ray's round trips and their noise.

    python3 bench/storage_io.py --quick
    python3 bench/storage_io.py --backends file,segment [--cold]
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
from actors.rank_actor import StorageActorLink
from actors.storage_actor import StorageActor
from fabric.cli.exit import finish
from fabric.client import launch
from fabric.config import FabricConfig
from fabric.l3 import make_backend
from fabric.l3.auth import PageAuth
from fabric.l3.direct import DirectReads
from fabric.l3.format import Provenance
from fabric.l3.service import page_geometry
from fabric.tools.workload import drive, iter_packed, read_trace, synthetic_trace


def drop_page_cache() -> bool:
    """Empty the OS page cache (root on Linux), so reads come from the device."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def count_files(path: pathlib.Path) -> int:
    return sum(1 for p in path.rglob("*") if p.is_file())


class Side:
    """One storage actor over one backend, plain or authenticated, and the raw
    baselines in the same directory."""

    def __init__(
        self, root: pathlib.Path, pages: int, batch: int, cold: bool, backend: str, auth: bool
    ) -> None:
        self.where = f"{backend}-auth" if auth else backend
        self.root, self.pages, self.batch, self.cold = root, pages, batch, cold
        self.backend, self.auth = backend, auth
        extra = []
        if auth:  # authenticated pages: every page tagged on write, checked on read
            secret = root / "secret"
            secret.write_bytes(os.urandom(32))
            extra = [f"storage.auth_key_file={secret}"]
        config = FabricConfig().with_overrides(
            [
                f"storage.path={root / self.where}",
                f"storage.backend={backend}",
                "storage.max_bytes=0",
                "model.layers=8",
                "model.head_dim=64",
                *extra,
            ]
        )
        _, self.page_bytes = page_geometry(config)
        self.data = np.random.default_rng(0).integers(
            0, 256, size=(pages, self.page_bytes), dtype=np.uint8
        )
        self.actor = remote(StorageActor, num_cpus=0, max_concurrency=4).remote(config.to_dict())
        ray.get(self.actor.ping.remote())
        # A rank's direct reads (storage.direct_reads): where from the actor, bytes read here.
        self.direct = DirectReads(StorageActorLink("", "", 60.0, handle=self.actor), config)
        self.raw_dir = root / f"raw-{self.where}"
        self.raw_dir.mkdir()
        self.buffer = np.zeros_like(self.data)  # touched before any timing: reads only fill it
        self.rounds: list[dict[str, float]] = []
        self.stored = 0

    def one_round(self, r: int, raw: bool) -> dict[str, float]:
        """Store new pages under new names, as a backup does (a page's key is new
        until it is stored), and read back what was just written; with ``raw``, the
        same bytes through plain files too."""
        pages, batch, data, actor = self.pages, self.batch, self.data, self.actor
        hashes = [os.urandom(32) for _ in range(pages)]
        took = {}
        t0 = time.perf_counter()
        calls = [
            actor.store.remote("0-0-0", hashes[i : i + batch], data[i : i + batch])
            for i in range(0, pages, batch)
        ]
        assert all(ray.get(calls))
        took["backup"] = time.perf_counter() - t0
        self.stored += pages * self.page_bytes
        if self.cold:
            drop_page_cache()
        t0 = time.perf_counter()
        calls = [actor.load.remote("0-0-0", hashes[i : i + batch]) for i in range(0, pages, batch)]
        assert sum(len(g) for g in ray.get(calls)) == pages
        took["prefetch"] = time.perf_counter() - t0
        if self.cold:
            drop_page_cache()
        t0 = time.perf_counter()
        self.direct.plan("0-0-0", hashes)  # as a rank does: one locate a prefetch
        got = sum(
            len(self.direct.load("0-0-0", hashes[i : i + batch])) for i in range(0, pages, batch)
        )
        took["prefetch_direct"] = time.perf_counter() - t0
        assert got == pages and self.direct.relayed_pages == 0
        if raw:
            took.update(self.raw_round(r))
        return took

    def raw_round(self, r: int) -> dict[str, float]:
        took = {}
        raw_dir, data, pages = self.raw_dir, self.data, self.pages
        t0 = time.perf_counter()
        for i in range(pages):
            with open(raw_dir / f"{r}-{i}.bin", "wb") as f:
                f.write(data[i].tobytes())
        took["write"] = time.perf_counter() - t0
        if self.cold:
            drop_page_cache()
        t0 = time.perf_counter()
        for i in range(pages):
            with open(raw_dir / f"{r}-{i}.bin", "rb") as f:
                f.read()
        took["read"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(raw_dir / f"{r}.all", "wb") as f:
            f.write(memoryview(data).cast("B"))
        took["write_one_file"] = time.perf_counter() - t0
        if self.cold:
            drop_page_cache()
        t0 = time.perf_counter()
        with open(raw_dir / f"{r}.all", "rb", buffering=0) as f:
            f.readinto(memoryview(self.buffer).cast("B"))
        took["read_one_file"] = time.perf_counter() - t0
        return took

    def report(self) -> dict:
        ray.kill(self.actor)
        rounds = self.rounds
        backup_s, prefetch_s, direct_s = (
            statistics.median(t[k] for t in rounds)
            for k in ("backup", "prefetch", "prefetch_direct")
        )
        mb = self.pages * self.page_bytes / 1e6
        out = {
            "backend": self.backend,
            "authenticated": self.auth,
            "files_per_GB": round(count_files(self.root / self.where) / (self.stored / 1e9), 1),
            "pages": self.pages,
            "page_bytes": self.page_bytes,
            "backup_MBps": round(mb / backup_s, 1),
            "prefetch_MBps": round(mb / prefetch_s, 1),
            "prefetch_direct_MBps": round(mb / direct_s, 1),
            "prefetch_direct_vs_through_actor": round(prefetch_s / direct_s, 3),
            "reads_from": "device (page cache dropped)" if self.cold else "page cache",
        }
        raw = [t for t in rounds if "read" in t]
        if raw:
            write_s, read_s, read1_s = (
                statistics.median(t[k] for t in raw) for k in ("write", "read", "read_one_file")
            )
            out |= {
                "raw_read_one_file_MBps": round(mb / read1_s, 1),
                "prefetch_vs_raw_read_one_file": round(read1_s / prefetch_s, 3),
                "prefetch_direct_vs_raw_read_one_file": round(read1_s / direct_s, 3),
                "raw_write_MBps": round(mb / write_s, 1),
                "raw_read_MBps": round(mb / read_s, 1),
                "backup_vs_raw_write": round(write_s / backup_s, 3),
                "prefetch_vs_raw_read": round(read_s / prefetch_s, 3),
            }
        return out


def io_throughput(
    root: pathlib.Path, pages: int, batch: int, repeats: int, cold: bool, backend: str
) -> tuple[dict, dict]:
    """The backend with plain pages (and the raw baselines) and with authenticated
    ones, their rounds alternating so that both see the same machine; the auth
    ratios are the median of each pair's ratio."""
    plain = Side(root, pages, batch, cold, backend, auth=False)
    signed = Side(root, pages, batch, cold, backend, auth=True)
    plain.one_round(-1, raw=True)  # warm-up
    signed.one_round(-1, raw=False)
    # Twice the rounds for the pairs: two identical plain actors differ by up to
    # ±30% a round here; the raw baselines run in the first ``repeats`` only.
    for r in range(2 * repeats + 1):
        first, second = (plain, signed) if r % 2 == 0 else (signed, plain)
        for side in (first, second):
            side.rounds.append(side.one_round(r, raw=side is plain and r < repeats))
    ratios = {
        f"{kind}_auth_vs_plain": round(
            statistics.median(
                p[kind] / s[kind] for p, s in zip(plain.rounds, signed.rounds, strict=True)
            ),
            3,
        )
        for kind in ("prefetch", "backup")
    }
    return plain.report() | ratios, signed.report()


def store_auth_cost(
    root: pathlib.Path, backend: str, pages: int, page_bytes: int, repeats: int
) -> dict[str, float]:
    """What authentication costs the store itself: the backend (as the storage
    actor builds it) writing and reading the same pages plain and authenticated,
    rounds alternating, no Ray in between — on 2 cores the actor round trips
    vary by ±30% between two identical plain actors, which hides a cost this size.
    Ratios are authenticated throughput over plain, the median over pairs."""
    provenance = Provenance("bench", "layer_first", "float16", (1,), 16)
    data = np.random.default_rng(1).integers(0, 256, size=(pages, page_bytes), dtype=np.uint8)
    out = np.zeros_like(data)
    stores = {}
    for auth in (False, True):
        where = root / f"store-{backend}-{'auth' if auth else 'plain'}"
        stores[auth] = make_backend(backend, provenance, page_bytes, {"path": str(where)})
        if auth:
            stores[auth].auth = PageAuth(os.urandom(32))
    took: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(repeats + 1):
        for auth in (False, True) if r % 2 == 0 else (True, False):
            b = stores[auth]
            keys = [f"{os.urandom(32).hex()}.{provenance.tag}.0-0-0" for _ in range(pages)]
            t0 = time.perf_counter()
            for i in range(0, pages, 64):
                assert all(b.set(keys[i : i + 64], data[i : i + 64]))
            t1 = time.perf_counter()
            for i in range(0, pages, 64):
                assert b.get(keys[i : i + 64], out[i : i + 64]) == len(keys[i : i + 64])
            if r:  # the first round warms up
                took[auth].append((t1 - t0, time.perf_counter() - t1))
    for b in stores.values():
        b.close()
    pairs = list(zip(took[False], took[True], strict=True))
    return {
        "store_backup_auth_vs_plain": round(statistics.median(p[0] / a[0] for p, a in pairs), 3),
        "store_prefetch_auth_vs_plain": round(statistics.median(p[1] / a[1] for p, a in pairs), 3),
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
        "--backends", default="file,segment", help="L3 backends to measure, comma-separated"
    )
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
        batch = FabricConfig().storage.transfer_batch_pages
        io = {}
        repeats = 3 if args.quick else 7
        for name in args.backends.split(","):
            # Authenticated pages (storage.auth_key_file) against plain ones, same run.
            one, signed = io_throughput(root, pages, batch, repeats, cold, name)
            io[name], io[f"{name}+auth"] = one, signed
            one |= store_auth_cost(root, name, min(pages, 1024), one["page_bytes"], 2 * repeats + 1)
            print(
                f"{name} with authenticated pages: prefetch {signed['prefetch_MBps']} MB/s "
                f"({one['prefetch_auth_vs_plain']} of plain), backup {signed['backup_MBps']} "
                f"MB/s ({one['backup_auth_vs_plain']} of plain)",
                file=sys.stderr,
            )
            print(
                f"{name}: backup {one['backup_MBps']} MB/s vs raw write {one['raw_write_MBps']} "
                f"MB/s ({one['backup_vs_raw_write']}); prefetch {one['prefetch_MBps']} MB/s vs "
                f"raw read {one['raw_read_MBps']} MB/s ({one['prefetch_vs_raw_read']}), one file "
                f"{one['raw_read_one_file_MBps']} MB/s ({one['prefetch_vs_raw_read_one_file']}); "
                f"direct reads {one['prefetch_direct_MBps']} MB/s "
                f"({one['prefetch_direct_vs_raw_read_one_file']} of the one-file read); "
                f"{one['files_per_GB']} files per GB; reads from {one['reads_from']}",
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
    print(json.dumps({"backends": io, "hit_rate": hits}))


if __name__ == "__main__":
    main()
    finish(0)  # Ray's threads outlive ray.shutdown: see fabric/cli/exit.py
