"""Time to first token with the fabric vs without a cache, per model-parallel
shape, on multi-turn conversations through a real model (``model.filler=llama``),
in one run.

Each turn's prompt is the previous prompt, the model's answer and a new
message. For each shape (``tp1``, ``tp2``, ``pp2``, ``tp2pp2``, ``cp2``) a fabric runs in
one process (``fabric.driver.local``: one thread per rank, gloo groups between them).
**With the fabric**: serve the prompt; its ranks load the cached prefix back and
compute their share of the rest only, attending over the KV in their pools (the
last prompt token's hidden state, whose logits give the first token, comes out
of that pass). **Without a cache**: the same ranks — the same shards, groups and
threads — run the whole prompt from nothing: the prefill of the same engine with
no cache. ``hf_uncached_ms``: the single-process Hugging Face forward over the
whole prompt, for scale (the sharded prefill at ``tp1`` is that computation).
Outside the timing, every turn's first token from the fabric's KV is checked
against the uncached model's, and the answer is generated and decoded into the
fabric. Turn 1 of each conversation has nothing cached and is left out of the
ratios.

**By tier** (``tiers``, for each shape): time to first token of a follow-up
prompt whose prefix the fabric holds in one tier — L1, L2 (loaded back), L3
(prefetched) *cold*: a new fabric over the same L3 directory, its first reads of
those pages; and L3 *warm*: the same fabric again after its L1 and L2 were
emptied — each ``--repeats`` times on its own conversation, against the same
ranks' uncached prefill of the same prompt. Before any timing, one untimed
conversation warms every path up (kernels, groups, allocators). Figures are
medians with the 25th-75th percentile spread; the hit tokens each tier served
are reported beside them, so a row is what it says it is.

    python3 bench/ttft.py                 # hidden 512, 8 layers: ~20M parameters, 5 shapes
    python3 bench/ttft.py --shape tp1,tp2 --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from fabric.cache.keys import pack_tokens
from fabric.config import FabricConfig
from fabric.driver.local import LocalFabric
from fabric.rank.mesh import LocalBoard, Mesh
from fabric.rank.model import assemble, build_model
from fabric.tools.chat import generate, next_logits

SHAPES = {
    "tp1": (1, 1, 1),
    "tp2": (2, 1, 1),
    "pp2": (1, 2, 1),
    "tp2pp2": (2, 2, 1),
    "cp2": (1, 1, 2),
}


class Uncached:
    """The fabric's ranks' shards, run over a whole prompt from nothing: each on
    its own thread, with groups of their own (formed once, outside the timing).
    Under CP each runs its positions of every page, as the fabric's ranks do."""

    def __init__(self, f: LocalFabric) -> None:
        self.ranks = f.ranks
        self.pool = ThreadPoolExecutor(len(self.ranks))
        if len(self.ranks) == 1:
            self.meshes = [None]
        else:
            board, topology = LocalBoard(), f.config.topology
            self.meshes = list(
                self.pool.map(
                    lambda i: Mesh(board, "uncached", topology, i, torch.device("cpu"), 60),
                    range(len(self.ranks)),
                )
            )

    def prefill(self, prompt: list[int]) -> None:
        n = len(prompt)

        def run(i: int) -> None:
            rank = self.ranks[i]
            m = rank.filler.sharded
            empty = torch.empty(2, len(m.layers), m.kv_heads, 0, m.head_dim)
            mine = rank.filler.positions(0, n)
            ids = [prompt[p] for p in mine.tolist()]
            m.forward(self.meshes[i], ids, mine, empty, mine[:0], rank.filler.cp_positions(0, n))

        list(self.pool.map(run, range(len(self.ranks))))

    def close(self) -> None:
        for mesh in self.meshes:
            if mesh is not None:
                mesh.close()
        self.pool.shutdown()


def config_for(shape: str, hidden: int, layers: int, l3: str | None = None) -> FabricConfig:
    """A fabric of ``shape`` over a Llama model of ``hidden`` x ``layers``; with
    ``l3``, a file L3 in that directory that every page is backed up to."""
    tp, pp, cp = SHAPES[shape]
    heads = hidden // 64
    storage = ["storage.backend=none"]
    if l3 is not None:
        storage = [
            "storage.backend=file",
            f"storage.path={l3}",
            "cache.write_policy=write_through",
            "prefetch.threshold_tokens=16",
        ]
    return FabricConfig().with_overrides(
        [
            "model.filler=llama",
            "model.dtype=float32",
            f"model.layers={layers}",
            f"model.kv_heads={heads // 2}",
            "model.head_dim=64",
            f"model.attention_heads={heads}",
            f"topology.tp={tp}",
            f"topology.pp={pp}",
            f"topology.cp={cp}",
            "cache.page_size=16",
            "cache.device_tokens=16384",
            "cache.host_tokens=32768",
            *storage,
        ]
    )


def run_shape(shape: str, args, hidden: int, layers: int) -> tuple[dict, int]:
    config = config_for(shape, hidden, layers)
    f = LocalFabric(config)
    uncached = Uncached(f)
    hf = build_model(config.model)
    rng = random.Random(0)
    vocab = config.model.vocab_size

    def message(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    # Warm-up, untimed: the fabric's paths, the uncached ranks and the model once.
    warm = message(args.system)
    f.core.release(f.serve(pack_tokens(warm), max_steps=1000).lease)
    uncached.prefill(warm)
    with torch.no_grad():
        hf(input_ids=torch.tensor([warm]))
    prompts = [message(args.system) for _ in range(args.conversations)]
    rows = []
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = prompts[c]
            t0 = time.perf_counter()
            result = f.serve(pack_tokens(prompt), max_steps=1000)
            t1 = time.perf_counter()
            uncached.prefill(prompt)
            t2 = time.perf_counter()
            with torch.no_grad():
                hf(input_ids=torch.tensor([prompt]))
            t3 = time.perf_counter()
            if result.error is not None:
                raise SystemExit(f"{shape}: turn {turn}, conversation {c}: {result.error}")
            kv = assemble(f.read_kv(result.lease), config.model, 16, len(prompt))
            kv = kv[:, :, :, :-1]
            served = int(next_logits(hf, prompt, kv).argmax())
            if served != int(next_logits(hf, prompt).argmax()):
                raise SystemExit(f"{shape}: turn {turn}, conversation {c}: first tokens differ")
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": len(prompt),
                    "hit_tokens": len(prompt) - result.computed_tokens,
                    "fabric_ms": (t1 - t0) * 1e3,
                    "uncached_ms": (t2 - t1) * 1e3,
                    "hf_uncached_ms": (t3 - t2) * 1e3,
                }
            )
            answer = generate(hf, prompt, args.answer, kv)
            step = f.append(result.lease, pack_tokens(answer), max_steps=1000)
            f.core.release(step.lease, session=f"c{c}")
            prompts[c] = prompt + answer + message(args.message)
        print(f"{shape}: turn {turn + 1}/{args.turns} done", file=sys.stderr)
    computed = f.computed_tokens_by_rank()
    collectives = collective_costs(f)
    uncached.close()
    f.close()
    later = [r for r in rows if r["turn"] > 1]
    out = {
        "first_turns": summary([r for r in rows if r["turn"] == 1]),
        "later_turns": summary(later) if later else None,
        "computed_tokens_by_rank": computed,
        "collectives": collectives,
    }
    if later:
        out["fabric_over_uncached"] = out["later_turns"]["fabric_over_uncached"]
        out["hit_share"] = out["later_turns"]["hit_share"]
    return out, sum(p.numel() for p in hf.parameters())


def collective_costs(f: LocalFabric) -> dict:
    """What the fabric's ranks spent in collectives over the run (waiting for their
    peers included), per layer of a compute pass, averaged over the ranks."""
    meshes = [(r.mesh, r.filler) for r in f.ranks if r.mesh is not None]
    if not meshes:
        return {}
    out: dict = {}
    layer_passes = sum(filler.passes * len(filler.sharded.layers) for _, filler in meshes)
    total = 0.0
    for kind in ("all-reduce", "all-gather", "send", "receive"):
        calls = sum(m.calls[kind] for m, _ in meshes)
        seconds = sum(m.seconds[kind] for m, _ in meshes)
        total += seconds
        if calls:
            out[kind] = {
                "calls_per_layer": round(calls / layer_passes, 2),
                "us_per_call": round(seconds / calls * 1e6, 1),
            }
    out["ms_per_layer"] = round(total / layer_passes * 1e3, 3)
    return out


def spread(xs: list[float], digits: int = 1) -> dict:
    """The median of ``xs`` and its 25th-75th percentile range."""
    if len(xs) == 1:
        return {
            "median": round(xs[0], digits),
            "p25": round(xs[0], digits),
            "p75": round(xs[0], digits),
        }
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": round(q2, digits), "p25": round(q1, digits), "p75": round(q3, digits)}


def summary(part: list[dict]) -> dict:
    """Turns of the conversation run: medians with spread, the ratio per turn."""
    hit = sum(r["hit_tokens"] for r in part) / sum(r["prompt_tokens"] for r in part)
    return {
        "turns": len(part),
        "prompt_tokens": round(statistics.median(r["prompt_tokens"] for r in part), 1),
        "hit_share": round(hit, 3),
        "fabric_ms": spread([r["fabric_ms"] for r in part]),
        "uncached_ms": spread([r["uncached_ms"] for r in part]),
        "hf_uncached_ms": spread([r["hf_uncached_ms"] for r in part]),
        "fabric_over_uncached": spread([r["fabric_ms"] / r["uncached_ms"] for r in part], 3),
    }


TIERS = ("L1", "L2", "L3 cold", "L3 warm")


def run_tiers(shape: str, args, hidden: int, layers: int) -> dict:
    """Time to first token of a follow-up prompt whose prefix one tier holds (see
    the module docstring), ``args.repeats`` times per tier."""
    import tempfile

    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="kvfabric-ttft-l3-") as l3:
        config = config_for(shape, hidden, layers, l3)
        vocab = config.model.vocab_size

        def message(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        def stored(f: LocalFabric, prompt: list[int]) -> None:
            # The prefix computed, its lease released, backed up to L2 and L3.
            f.core.release(f.serve(pack_tokens(prompt), max_steps=1000).lease)
            f.settle(1000)

        def emptied(f: LocalFabric, tiers: str) -> None:
            cache = f.core.cache
            cache.device_evictions.evict(config.cache.device_tokens)  # demoted to L2
            if tiers == "L1 and L2":
                cache.host_evictions.evict(config.cache.host_tokens)
            f.settle(1000)

        f = LocalFabric(config)
        uncached = Uncached(f)
        warm = message(args.system)  # warm-up, untimed: every path once
        stored(f, warm)
        uncached.prefill(warm + message(args.message))
        rows: dict[str, list[dict]] = {tier: [] for tier in TIERS}
        prefixes = [message(args.system) for _ in range(args.repeats)]
        for tier in ("L1", "L2"):
            for prefix in prefixes:
                stored(f, prefix)
                if tier == "L2":
                    emptied(f, "L1")
                rows[tier].append(timed(f, uncached, prefix + message(args.message)))
        # L3 cold: a new fabric over the same directory, nothing in its L1 or L2.
        uncached.close()
        f.close()
        f = LocalFabric(config)
        uncached = Uncached(f)
        stored(f, warm)
        for prefix in prefixes:
            rows["L3 cold"].append(timed(f, uncached, prefix + message(args.message)))
        # L3 warm: the same prefixes again, once this fabric's L1 and L2 are empty.
        for prefix in prefixes:
            emptied(f, "L1 and L2")
            rows["L3 warm"].append(timed(f, uncached, prefix + message(args.message)))
        uncached.close()
        f.close()
    return {tier: tier_summary(part) for tier, part in rows.items()}


def timed(f: LocalFabric, uncached: Uncached, prompt: list[int]) -> dict:
    """One follow-up prompt: the fabric's time to serve it, the same ranks' uncached
    prefill of it, and the tokens each tier served."""
    t0 = time.perf_counter()
    result = f.serve(pack_tokens(prompt), max_steps=1000)
    t1 = time.perf_counter()
    uncached.prefill(prompt)
    t2 = time.perf_counter()
    if result.error is not None:
        raise SystemExit(f"a follow-up prompt failed: {result.error}")
    f.core.release(result.lease)
    f.settle(1000)
    return {
        "prompt_tokens": len(prompt),
        "L1_hit": result.device_hit_tokens,
        "L2_hit": result.host_hit_tokens,
        "L3_hit": result.storage_hit_tokens,
        "fabric_ms": (t1 - t0) * 1e3,
        "uncached_ms": (t2 - t1) * 1e3,
    }


def tier_summary(part: list[dict]) -> dict:
    return {
        "repeats": len(part),
        "prompt_tokens": round(statistics.median(r["prompt_tokens"] for r in part)),
        "hit_tokens": {
            k: round(statistics.median(r[k] for r in part)) for k in ("L1_hit", "L2_hit", "L3_hit")
        },
        "fabric_ms": spread([r["fabric_ms"] for r in part]),
        "uncached_ms": spread([r["uncached_ms"] for r in part]),
        "fabric_over_uncached": spread([r["fabric_ms"] / r["uncached_ms"] for r in part], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small model, 2 conversations")
    ap.add_argument(
        "--shape",
        default=",".join(SHAPES),
        help=f"comma-separated shapes among {', '.join(SHAPES)} (default: all)",
    )
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512, help="first prompt tokens (default 512)")
    ap.add_argument("--message", type=int, default=64, help="new tokens per turn (default 64)")
    ap.add_argument("--answer", type=int, default=32, help="answer tokens (default 32)")
    ap.add_argument(
        "--repeats", type=int, default=5, help="follow-up prompts timed per tier (default 5)"
    )
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shape {args.shape!r} is refused: allowed is a list of {', '.join(SHAPES)}")
    hidden, layers = 512, 8
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} is refused: allowed is an int >= 1")
    if args.quick:
        hidden, layers, args.conversations, args.turns, args.system = 256, 2, 2, 3, 128
        args.repeats = min(args.repeats, 3)
    by_shape, params = {}, 0
    for shape in shapes:
        by_shape[shape], params = run_shape(shape, args, hidden, layers)
        by_shape[shape]["tiers"] = run_tiers(shape, args, hidden, layers)
        for tier, figures in by_shape[shape]["tiers"].items():
            ratio = figures["fabric_over_uncached"]
            print(
                f"{shape} {tier:<8}: {figures['fabric_ms']['median']} ms with the fabric vs "
                f"{figures['uncached_ms']['median']} ms uncached -> {ratio['median']} "
                f"({ratio['p25']}-{ratio['p75']}); hits {figures['hit_tokens']}",
                file=sys.stderr,
            )
    out = {
        "model_parameters": params,
        "hidden": hidden,
        "layers": layers,
        "threads": torch.get_num_threads(),
        "by_shape": by_shape,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
