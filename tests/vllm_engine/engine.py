"""One vLLM engine, in a process of its own, over a list of prompts: the tier's
tests and ``bench/vllm_ttft.py`` run it as a script and read the line of
stdout that starts with ``RESULT``.

    python tests/vllm_engine/engine.py --model DIR --prompts FILE [--fabric NAME
        --address HOST:PORT] [--tp 2] [--runs 2] [--corrupt-after-run 1 DIR]
        [--kill-fabric-after-run 1]

Each run serves every prompt in order, one ``generate`` call each (greedy), and
records its output tokens, ``num_cached_tokens`` and its time; vLLM's
own prefix cache is reset before every run after the first, so a later run's
cached tokens are the connector's. Without ``--fabric`` (or ``--example``,
vLLM's own ExampleConnector) the engine has no connector (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

BLOCK_SIZE = 32
# The line of stdout that carries the result (vLLM logs there too).
RESULT = "kvfabric-engine-result: "


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="a JSON file: a list of token-id lists")
    p.add_argument("--fabric", default="", help="the fabric's runtime.name (empty: no connector)")
    p.add_argument("--address", default="auto")
    p.add_argument(
        "--example", default="", help="vLLM's ExampleConnector over this directory instead"
    )
    p.add_argument("--namespace", default="vllm")
    p.add_argument("--path", default="", help="the connector's path option")
    p.add_argument("--load-async", action="store_true", help="the connector's load_async")
    p.add_argument("--l2-dir", default="", help="the connector's l2_dir option")
    p.add_argument("--l2-bytes", type=int, default=None, help="the connector's l2_bytes option")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--corrupt-after-run", nargs=2, metavar=("RUN", "DIR"), default=None)
    p.add_argument("--kill-fabric-after-run", type=int, default=0)
    p.add_argument(
        "--warmup",
        action="store_true",
        help="first serve one prompt of other tokens as long as the first (not measured)",
    )
    return p.parse_args(argv)


def corrupt(directory: Path) -> int:
    """Flip one byte every 1 KiB of every segment file and node L2 region under
    ``directory``."""
    flipped = 0
    for path in [*directory.rglob("*.kvs"), *directory.rglob("*.l2")]:
        data = bytearray(path.read_bytes())
        for at in range(512, len(data), 1024):
            data[at] ^= 0xFF
            flipped += 1
        path.write_bytes(bytes(data))
    return flipped


def kill_fabric(name: str, address: str) -> None:
    """Kill the fabric's coordinator for good (the engine must go on without it)."""
    import ray

    ray.init(address=address, namespace="kvfabric", log_to_driver=False)
    ray.kill(ray.get_actor(f"{name}-coordinator", namespace="kvfabric"), no_restart=True)
    ray.shutdown()


def main(argv: list[str]) -> dict:
    args = parse(argv)
    # One core a TP worker (vLLM's automatic binding wants a NUMA node each).
    cores = os.cpu_count() or 1
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cores) for i in range(args.tp))
    )
    os.environ.setdefault("KVFABRIC_LOG_LEVEL", "INFO")  # the connector's own lines
    from vllm import LLM, SamplingParams

    extra = {"fabric": args.fabric, "address": args.address, "namespace": args.namespace}
    if args.path:
        extra["path"] = args.path
    if args.load_async:
        extra["load_async"] = True
    if args.l2_dir:
        extra["l2_dir"] = args.l2_dir
    if args.l2_bytes is not None:
        extra["l2_bytes"] = args.l2_bytes
    connector = {
        "kv_connector": "KvFabricConnector",
        "kv_connector_module_path": "fabric.engines.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if args.example:
        connector = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.example},
        }
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=8192,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
        kv_transfer_config=connector if args.fabric or args.example else None,
        seed=0,
    )
    startup_s = time.perf_counter() - started
    prompts = json.loads(Path(args.prompts).read_text())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if args.warmup and prompts:
        other = [3 + (t * 7919 + 11) % 29 for t in range(len(prompts[0]))]
        llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)
        llm.reset_prefix_cache()
    runs = []
    for run in range(1, args.runs + 1):
        if run > 1:
            llm.reset_prefix_cache()
        outputs, cached, seconds = [], [], []
        for tokens in prompts:
            t0 = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            outputs.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens or 0)
        runs.append({"outputs": outputs, "cached": cached, "seconds": seconds})
        if args.corrupt_after_run and run == int(args.corrupt_after_run[0]):
            corrupt(Path(args.corrupt_after_run[1]))
        if args.kill_fabric_after_run == run:
            kill_fabric(args.fabric, args.address)
    return {"startup_s": startup_s, "prompt_tokens": [len(p) for p in prompts], "runs": runs}


if __name__ == "__main__":
    result = main(sys.argv[1:])
    print(RESULT + json.dumps(result), flush=True)
