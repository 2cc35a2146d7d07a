"""What the shared L2's page checksums cost (``fabric.rank.shared_l2``), side by
side in one run, against the copy they guard: a rank's L1 -> L2 write (the copy
into the pool, then naming the slot, which now takes the page's CRC-32) and its
L2 -> L1 load (the copy out, after ``check`` of every 8th page, or of every
page), on a pool of real KV layout in shared memory.

    python3 bench/shared_l2_checks.py [--pages 512] [--page-kib 256] [--repeats 5]

Prints one JSON line: ``write_overhead`` (naming with the checksum over the copy
alone), ``load_check_overhead_sampled`` (every 8th page, as ranks run) and
``load_check_overhead_all``, with the times behind them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from fabric.rank.shared_l2 import L2_CHECK_EVERY, SharedL2, shm_dir


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--page-kib", type=int, default=256, help="bytes of one page (K and V)")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    args = parse()
    pages, layers, tokens, heads = args.pages, 4, 16, 2
    dim = args.page_kib * 1024 // (2 * layers * tokens * heads * 2)  # float16
    shape = (2, pages, layers, tokens, heads, dim)  # page_first_direct
    nbytes = 2 * pages * layers * tokens * heads * dim * 2
    geometry = {"shape": list(shape), "dtype": "torch.float16", "pool_bytes": nbytes,
                "page_size": tokens, "layout": "page_first_direct"}  # fmt: skip
    with tempfile.TemporaryDirectory(dir=shm_dir()) as tmp:
        store = SharedL2(pathlib.Path(tmp) / "bench.l2", geometry, pages, tokens * 4)
        pool = torch.frombuffer(store.pool, dtype=torch.float16, count=nbytes // 2).view(shape)
        l1 = torch.randn(shape, dtype=torch.float16)
        slots = list(range(pages))
        index = torch.arange(pages)
        tokens_bytes, parent = bytes(tokens * 4), b"\1" * 32

        def copy_in() -> None:
            pool.index_copy_(1, index, l1)

        def write() -> None:
            copy_in()
            for slot in slots:
                store.put(slot, "bench", parent, tokens_bytes)

        def copy_out() -> None:
            l1.index_copy_(1, index, pool)

        def load(every: int) -> None:
            assert store.check(slots, every) == []
            copy_out()

        write()
        copy_in_s = best(copy_in, args.repeats)
        write_s = best(write, args.repeats)
        copy_out_s = best(copy_out, args.repeats)
        sampled_s = best(lambda: load(L2_CHECK_EVERY), args.repeats)
        all_s = best(lambda: load(1), args.repeats)
        store.close(unlink=True)
    mb = nbytes / 1e6
    print(
        json.dumps(
            {
                "write_overhead": round(write_s / copy_in_s - 1, 3),
                "load_check_overhead_sampled": round(sampled_s / copy_out_s - 1, 3),
                "load_check_overhead_all": round(all_s / copy_out_s - 1, 3),
                "check_every": L2_CHECK_EVERY,
                "pool_mb": round(mb, 1),
                "copy_in_gb_s": round(mb / 1e3 / copy_in_s, 2),
                "write_with_checksums_gb_s": round(mb / 1e3 / write_s, 2),
                "copy_out_gb_s": round(mb / 1e3 / copy_out_s, 2),
                "load_sampled_gb_s": round(mb / 1e3 / sampled_s, 2),
                "load_all_checked_gb_s": round(mb / 1e3 / all_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
