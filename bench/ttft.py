"""Time to first token with the fabric vs without a cache, on multi-turn
conversations through a real model (``model.filler=llama``), in one run.

Each turn's prompt is the previous prompt, the model's answer and a new
message. **With the fabric** (in one process, ``fabric.local``; one rank that
holds the whole KV, so it continues from the cached prefix): serve the prompt
(hits, the rest computed by the rank from the KV it holds), read the KV back,
and run the last prompt token over it for the first token. **Without a cache**:
one forward over the whole prompt. Both give the same first token (checked).
The answer is then generated and decoded into the fabric (not timed). The
ratio is uncached time over fabric time (> 1: the fabric is faster); turn 1 of
each conversation has nothing cached and is reported apart.

    python3 bench/ttft.py            # hidden 512, 8 layers: ~56M parameters
    python3 bench/ttft.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

from fabric.cache.keys import pack_tokens
from fabric.chat import generate
from fabric.config import FabricConfig
from fabric.local import LocalFabric
from fabric.rank.model import assemble, build_model, to_cache


def first_token_cached(f: LocalFabric, hf, config: FabricConfig, prompt: list[int]):
    result = f.serve(pack_tokens(prompt), max_steps=1000)
    kv = assemble(f.read_kv(result.lease), config.model, config.cache.page_size, len(prompt))
    cache = to_cache(kv[:, :, :, :-1], hf)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt[-1:]]), cache=cache).logits[0, -1]
    return int(logits.argmax()), result


def first_token_uncached(hf, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(hf(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a small model, 2 conversations")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=512, help="first prompt tokens (default 512)")
    ap.add_argument("--message", type=int, default=64, help="new tokens per turn (default 64)")
    ap.add_argument("--answer", type=int, default=32, help="answer tokens (default 32)")
    args = ap.parse_args()
    hidden, layers = 512, 8
    if args.quick:
        hidden, layers, args.conversations, args.turns, args.system = 128, 2, 2, 3, 128
    heads = hidden // 64
    config = FabricConfig().with_overrides(
        [
            "model.filler=llama",
            "model.dtype=float32",
            f"model.layers={layers}",
            f"model.kv_heads={heads // 2}",
            "model.head_dim=64",
            f"model.attention_heads={heads}",
            "topology.tp=1",
            "cache.page_size=16",
            "cache.device_tokens=16384",
            "cache.host_tokens=32768",
            "storage.backend=none",
        ]
    )
    f = LocalFabric(config)
    hf = build_model(config.model)
    params = sum(p.numel() for p in hf.parameters())
    rng = random.Random(0)
    vocab = config.model.vocab_size

    def message(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prompts = [message(args.system) for _ in range(args.conversations)]
    rows = []
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = prompts[c]
            t0 = time.perf_counter()
            token, result = first_token_cached(f, hf, config, prompt)
            t1 = time.perf_counter()
            fresh = first_token_uncached(hf, prompt)
            t2 = time.perf_counter()
            if token != fresh:
                raise SystemExit(f"turn {turn}, conversation {c}: first tokens differ")
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": len(prompt),
                    "hit_tokens": result.device_hit_tokens + result.host_hit_tokens,
                    "fabric_ms": (t1 - t0) * 1e3,
                    "uncached_ms": (t2 - t1) * 1e3,
                }
            )
            kv = assemble(f.read_kv(result.lease), config.model, 16, len(prompt))
            answer = generate(hf, prompt, args.answer, kv[:, :, :, :-1])
            step = f.append(result.lease, pack_tokens(answer), max_steps=1000)
            f.core.release(step.lease, session=f"c{c}")
            prompts[c] = prompt + answer + message(args.message)
        print(f"turn {turn + 1}/{args.turns} done", file=sys.stderr)

    def summary(part: list[dict]) -> dict:
        fabric = statistics.fmean(r["fabric_ms"] for r in part)
        uncached = statistics.fmean(r["uncached_ms"] for r in part)
        return {
            "turns": len(part),
            "prompt_tokens": round(statistics.fmean(r["prompt_tokens"] for r in part), 1),
            "hit_tokens": round(statistics.fmean(r["hit_tokens"] for r in part), 1),
            "fabric_ms": round(fabric, 1),
            "uncached_ms": round(uncached, 1),
            "ttft_ratio": round(uncached / fabric, 2),
        }

    later = [r for r in rows if r["turn"] > 1]
    out = {
        "model_parameters": params,
        "hidden": hidden,
        "layers": layers,
        "threads": torch.get_num_threads(),
        "first_turns": summary([r for r in rows if r["turn"] == 1]),
        "later_turns": summary(later) if later else None,
    }
    if later:
        print(
            f"later turns: {out['later_turns']['uncached_ms']} ms uncached vs "
            f"{out['later_turns']['fabric_ms']} ms with the fabric -> "
            f"{out['later_turns']['ttft_ratio']}x",
            file=sys.stderr,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
