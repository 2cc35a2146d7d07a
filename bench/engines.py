"""Pages per second through kvfabric's engine adapters against each engine's own
built-in file backend, on the same pages, in one run.

- SGLang 0.5.20: its ``HiCacheController``'s own page functions, as its backup
  and prefetch threads call them (batches of 128 pages), over one host pool:
  kvfabric's backend (``interface_v1``: ``batch_set_v1`` / ``batch_get_v1``)
  against SGLang's ``HiCacheFile`` (its generic path: a flat page each).
- vLLM 0.33: the secondary tier's jobs (``submit_store`` / ``submit_load``,
  ``drain_jobs``) over one primary tensor: kvfabric's tier against vLLM's file
  system tier (``fs``, its default 16 + 16 threads). The fs tier reads and
  writes with O_DIRECT where the file system takes it, so its loads come from
  the device while kvfabric's come from the page cache when it holds them;
  ``vllm_*_vs_builtin_buffered`` is the same against the fs tier made to use
  buffered I/O, like for like.

kvfabric checks every page it reads (key binding, CRC-32, provenance): the
figures are with those checks on. Each side keeps one backend (one directory)
for the whole run, as an engine does; every round stores new pages, after a
``sync``, and loads those back. The sides alternate within each round; a first
round warms every side up and is not counted; each side's best round counts.

The stores go to ``/dev/shm`` (memory) by default, so the figures compare the
backends' own work — copies, checksums, system calls, files — and not the
disk under them: on this machine's virtual disk every writer, whichever way it
writes (one file or many, any call size), is throttled to the disk's ~430 MB/s
after its first few tens of MB, and which side meets the throttle first decides
the store ratio. ``--dir`` puts them on a disk instead (the last line names
the file system). On ``tmpfs`` vLLM's fs tier cannot use O_DIRECT and runs
buffered, as it does on any file system that refuses O_DIRECT; on a disk that
takes O_DIRECT its loads come from the device while kvfabric's come from the
page cache when it holds them (``vllm_*_vs_builtin_buffered`` compares against
the fs tier made to run buffered there).

The last line is one JSON object with ``sglang_store_vs_builtin``,
``sglang_load_vs_builtin``, ``vllm_store_vs_builtin`` and
``vllm_load_vs_builtin`` (kvfabric's pages/s over the built-in's; > 1:
kvfabric is faster).

Needs the interop tier's engines (``bash tests/interop/setup_engines.sh``).

    python3 bench/engines.py                  # ~30 s, stores in /dev/shm
    python3 bench/engines.py --dir /tmp/x     # stores on a disk
    python3 bench/engines.py --quick          # fewer, smaller pages
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.interop.engine_env import activate

try:
    activate()
except RuntimeError as exc:
    print(f"bench/engines.py: {exc}", file=sys.stderr)
    sys.exit(2)

import numpy as np
import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tests.interop.support import make_controller, offloading_spec, page_aligned

STORAGE_BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def sglang_backend(pool, backend: str, where: pathlib.Path) -> HiCacheController:
    """SGLang's controller over ``pool`` with ``backend`` storing into ``where``."""
    if backend == "kvfabric":
        extra = {
            "backend_name": "kvfabric",
            "module_path": "fabric.engines.sglang",
            "class_name": "KvFabricStorage",
            "interface_v1": 1,
            "path": str(where),
            "max_bytes": 0,
        }
        return make_controller(pool, "dynamic", extra, "bench")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(where)
    return make_controller(pool, "file", {}, "bench")


def sglang_round(cc: HiCacheController, pool, src, dst) -> tuple[float, float]:
    """New pages stored, then loaded, through SGLang's own controller, the way its
    backup and prefetch threads call the backend; seconds for each. Checked."""
    t = pool.page_size
    hashes = [os.urandom(32).hex() for _ in range(len(src) // t)]
    os.sync()  # no earlier round's dirty pages to write back while this one is timed
    start = time.perf_counter()
    for i in range(0, len(hashes), STORAGE_BATCH):
        batch = hashes[i : i + STORAGE_BATCH]
        assert cc.page_set_func(batch, src[i * t : (i + len(batch)) * t])
    stored = time.perf_counter() - start
    op = PrefetchOperation("bench", [], None)
    start = time.perf_counter()
    for i in range(0, len(hashes), STORAGE_BATCH):
        batch = hashes[i : i + STORAGE_BATCH]
        assert cc.page_get_func(op, batch, dst[i * t : (i + len(batch)) * t]) == len(batch)
    loaded = time.perf_counter() - start
    assert torch.equal(pool.kv_buffer[:, :, dst], pool.kv_buffer[:, :, src])
    pool.kv_buffer[:, :, dst] = 0
    return stored, loaded


def vllm_tier(tensor, backend: str, where: pathlib.Path):
    """A secondary tier over ``tensor`` (the primary), made by vLLM's factory:
    kvfabric's, or vLLM's fs tier (with O_DIRECT where it works, or buffered)."""
    if backend == "kvfabric":
        config = {
            "type": "KvFabricTier",
            "module_path": "fabric.engines.vllm",
            "path": str(where),
            "max_bytes": 0,
        }
    else:
        config = {"type": "fs", "root_dir": str(where)}
    import vllm.v1.kv_offload.tiering.fs.manager as fs_manager

    probe = fs_manager.probe_o_direct
    if backend == "fs-buffered":
        fs_manager.probe_o_direct = lambda _dir: False
    try:
        return SecondaryTierFactory.create_secondary_tier(
            config, memoryview(tensor.numpy()), offloading_spec()
        )
    finally:
        fs_manager.probe_o_direct = probe


def vllm_round(tier, tensor, n: int, job_keys: int) -> tuple[float, float]:
    """``n`` new chunks stored, then loaded into the other half of the primary
    tensor, in jobs of ``job_keys`` chunks; seconds for each. Checked."""
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(n)]
    os.sync()
    start = time.perf_counter()
    for j, i in enumerate(range(0, n, job_keys)):
        chunk = np.arange(i, min(i + job_keys, n))
        tier.submit_store(TransferJob(j, keys[i : i + job_keys], chunk, False, None))
    tier.drain_jobs()
    stored = time.perf_counter() - start
    assert all(r.success for r in tier.get_finished_jobs())
    start = time.perf_counter()
    for j, i in enumerate(range(0, n, job_keys)):
        chunk = np.arange(n + i, n + min(i + job_keys, n))
        tier.submit_load(TransferJob(1000 + j, keys[i : i + job_keys], chunk, True, None))
    tier.drain_jobs()
    loaded = time.perf_counter() - start
    assert all(r.success for r in tier.get_finished_jobs())
    assert torch.equal(tensor[n:], tensor[:n])
    tensor[n:] = 0
    return stored, loaded


def file_system(path: pathlib.Path) -> str:
    """The type of the file system ``path`` is on (from /proc/mounts), or ``?``."""
    best, kind = "", "?"
    try:
        mounts = pathlib.Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    where = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if (
            len(fields) > 2
            and where.startswith(fields[1].rstrip("/") + "/")
            and len(fields[1]) > len(best)
        ):
            best, kind = fields[1], fields[2]
    return kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller pages and rounds")
    ap.add_argument(
        "--pages", type=int, default=128, help="pages (SGLang) and chunks (vLLM) a round"
    )
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--dir", default="", help="where the stores go (default: a temporary directory)"
    )
    args = ap.parse_args()
    pages, rounds = (64, 2) if args.quick else (args.pages, args.rounds)
    if pages < 1 or rounds < 1:
        ap.error("--pages and --rounds must be >= 1")
    # SGLang: pages of 32 tokens x 8 layers x 4 KV heads x 128 dims, bf16: 512 KiB.
    layers, heads, dim, t = (4, 4, 64, 16) if args.quick else (8, 4, 128, 32)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    base = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="kvfabric-bench-engines-", dir=shm))
    base.mkdir(parents=True, exist_ok=True)
    pg = base / "pg"
    pg.mkdir(exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{pg}/init", rank=0, world_size=1)
    device = MHATokenToKVPool(
        size=2 * pages * t,
        page_size=t,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    pool = MHATokenToKVPoolHost(device, 1.0, 0, t, "layer_first", pin_memory=False, device="cpu")
    src, dst = pool.alloc(pages * t), pool.alloc(pages * t)
    pool.kv_buffer[:, :, src] = torch.randn(2, layers, pages * t, heads, dim).to(torch.bfloat16)
    page_bytes = 2 * layers * t * heads * dim * 2
    # vLLM: chunks of the same size, float32, page aligned as its primary tier's.
    floats = page_bytes // 4
    tensor = page_aligned(2 * pages, floats)
    tensor[:pages] = torch.rand(pages, floats)

    # One backend a side for the whole run, as an engine keeps one: every round
    # stores new pages (fresh hashes and keys) and loads those back.
    sglang = {
        name: sglang_backend(pool, name, base / f"sglang-{name}") for name in ("kvfabric", "file")
    }
    vllm = {
        name: vllm_tier(tensor, name, base / f"vllm-{name}")
        for name in ("kvfabric", "fs", "fs-buffered")
    }
    times: dict[str, list[float]] = {}
    try:
        for r in range(-1, rounds):  # round -1 warms every side up and is not counted
            order = 1 if r % 2 else -1  # who goes first alternates
            measured: dict[str, float] = {}
            for name in list(sglang)[::order]:
                stored, loaded = sglang_round(sglang[name], pool, src, dst)
                measured |= {f"sglang_{name}_store": stored, f"sglang_{name}_load": loaded}
            for name in list(vllm)[::order]:
                stored, loaded = vllm_round(vllm[name], tensor, pages, job_keys=16)
                measured |= {f"vllm_{name}_store": stored, f"vllm_{name}_load": loaded}
            if r >= 0:
                for k, v in measured.items():
                    times.setdefault(k, []).append(v)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for cc in sglang.values():
            cc.detach_storage_backend()
        for tier in vllm.values():
            tier.shutdown()
        dist.destroy_process_group()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    rate = {k: pages / min(v) for k, v in times.items()}  # pages/s, best round
    mb = page_bytes / 1e6
    print(
        f"{pages} pages of {page_bytes >> 10} KiB on {file_system(base)}, "
        f"best of {rounds} rounds (pages/s, MB/s)"
    )
    for k in sorted(rate):
        print(f"  {k:<28} {rate[k]:>9.0f} pages/s {rate[k] * mb:>8.0f} MB/s")
    out = {
        "file_system": file_system(base),
        "pages": pages,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "pages_per_s": {k: round(v, 1) for k, v in sorted(rate.items())},
        "sglang_store_vs_builtin": round(
            rate["sglang_kvfabric_store"] / rate["sglang_file_store"], 2
        ),
        "sglang_load_vs_builtin": round(rate["sglang_kvfabric_load"] / rate["sglang_file_load"], 2),
        "vllm_store_vs_builtin": round(rate["vllm_kvfabric_store"] / rate["vllm_fs_store"], 2),
        "vllm_load_vs_builtin": round(rate["vllm_kvfabric_load"] / rate["vllm_fs_load"], 2),
        "vllm_store_vs_builtin_buffered": round(
            rate["vllm_kvfabric_store"] / rate["vllm_fs-buffered_store"], 2
        ),
        "vllm_load_vs_builtin_buffered": round(
            rate["vllm_kvfabric_load"] / rate["vllm_fs-buffered_load"], 2
        ),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
