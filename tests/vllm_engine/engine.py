"""One vLLM engine, in a process of its own, over a list of prompts: the tier's
tests and ``bench/vllm_ttft.py`` run it as a script and read the line of
stdout that starts with ``RESULT``.

    python tests/vllm_engine/engine.py --model DIR --prompts FILE [--fabric NAME
        --address HOST:PORT] [--tp 2] [--runs 2] [--corrupt-after-run 1 DIR]
        [--kill-fabric-after-run 1] [--script FILE]

Each run serves every prompt in order, one ``generate`` call each (greedy), and
records its output tokens, ``num_cached_tokens`` and its time; vLLM's
own prefix cache is reset before every run after the first, so a later run's
cached tokens are the connector's. Without ``--fabric`` (or ``--example``,
vLLM's own ExampleConnector) the engine has no connector (the baseline).

With ``--script``, the engine runs the steps of a JSON list instead, so that one
engine process serves many checks (``run_script``): generate prompts (one call
each, or all in one call), a chat whose second turn carries the first's output,
resets of vLLM's prefix cache (and the connector's), faults (damage or delete
the store's files, kill the fabric), and barriers with other engine processes.
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
    p.add_argument("--prompts", default="", help="a JSON file: a list of token-id lists")
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
    p.add_argument(
        "--kv-events", default="", help="publish vLLM's KV events on this ZeroMQ endpoint"
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--block-size", type=int, default=BLOCK_SIZE, help="vLLM's block size (0: vLLM's choice)"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="vLLM's prefix cache off")
    p.add_argument("--corrupt-after-run", nargs=2, metavar=("RUN", "DIR"), default=None)
    p.add_argument("--kill-fabric-after-run", type=int, default=0)
    p.add_argument("--script", default="", help="a JSON file of steps (see run_script)")
    p.add_argument(
        "--prompt-embeds", action="store_true", help="accept prompt embeddings (the embeds step)"
    )
    p.add_argument(
        "--ngram", type=int, default=0,
        help="speculative decoding by n-gram lookup, proposing this many draft tokens",
    )  # fmt: skip
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


def fabric_places(args: argparse.Namespace, wait_for: str, min_pages: int = 1) -> dict:
    """The fabric's engine pages per place, once one named ``wait_for...`` has
    ``min_pages`` (reports land a moment after the events behind them)."""
    fabric = _fabric(args)
    deadline = time.monotonic() + 30
    while True:
        places = fabric.stats()["engine_pages"]["places"]
        ready = any(p.startswith(wait_for) and f["pages"] >= min_pages for p, f in places.items())
        if ready or not wait_for or time.monotonic() > deadline:
            return places
        time.sleep(0.2)


_FABRIC: list = []  # the front end's own connection to the fabric, made once


def _fabric(args: argparse.Namespace):
    from fabric.client import connect

    if not _FABRIC:
        _FABRIC.append(connect(args.fabric, args.address))
    return _FABRIC[0]


def settle(args: argparse.Namespace, pages: int) -> None:
    """Wait until the fabric's tree took ``pages`` more reported pages than at the
    last ``mark`` and no more came for a moment (this engine's stores and what
    they set off are in), at most 30 s."""
    fabric = _fabric(args)

    def reported() -> int:
        return fabric.stats()["engine_pages"]["reported_pages"]

    target = (_SETTLED[0] if _SETTLED else reported()) + pages
    deadline = time.monotonic() + 30
    last, since = reported(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = reported()
        if now != last:
            last, since = now, time.monotonic()
        elif now >= target and time.monotonic() - since > 0.3:
            break
    _SETTLED[:] = [last]


_SETTLED: list[int] = []


def kill_fabric(name: str, address: str) -> None:
    """Kill the fabric's coordinator for good (the engine must go on without it)."""
    import ray

    ray.init(address=address, namespace="kvfabric", log_to_driver=False)
    ray.kill(ray.get_actor(f"{name}-coordinator", namespace="kvfabric"), no_restart=True)
    ray.shutdown()


def corrupt_components(directory: Path) -> int:
    """Flip a byte of every page of hybrid engines' other KV cache groups (their
    sliding windows, their states) in the segment files under ``directory``: the
    pages whose tag is a group's of another tag there (``component_tag``)."""
    import re

    from fabric.engines.vllm_groups import component_tag

    key = re.compile(rb"[0-9a-f]{64}\.([0-9a-f]{16})\.\d+-\d+-\d+")
    files = {path: bytearray(path.read_bytes()) for path in directory.rglob("*.kvs")}
    tags = {m.group(1).decode() for data in files.values() for m in key.finditer(data)}
    groups = {component_tag(t, i) for t in tags for i in range(64)} & tags
    flipped = 0
    for path, data in files.items():
        for m in key.finditer(data):
            if m.group(1).decode() in groups and m.end() + 1024 < len(data):
                data[m.end() + 1024] ^= 0xFF
                flipped += 1
        path.write_bytes(bytes(data))
    return flipped


def delete_segments(directory: Path) -> int:
    """Delete every segment file under ``directory`` (pages gone behind the index)."""
    gone = 0
    for path in directory.rglob("*.kvs"):
        path.unlink()
        gone += 1
    return gone


def embedding_table(llm):
    """The model's input embeddings (a tensor of vocabulary rows), read from its
    checkpoint: prompts given as embeddings are those rows."""
    import torch
    from safetensors.torch import load_file

    path = Path(llm.llm_engine.model_config.model) / "model.safetensors"
    weights = load_file(str(path))
    return next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")).to(
        torch.float32
    )


def run_script(llm, steps: list[dict], args: argparse.Namespace) -> dict:
    """Run ``steps`` on ``llm``; what each labelled step gave, by label. Steps:

    - ``{"op": "generate", "label", "prompts": [[ids]], "salt"?, "max_tokens"?,
      "prompt_logprobs"?, "together"?, "kv"?}``: greedy; per prompt its output tokens,
      ``num_cached_tokens`` and, with ``prompt_logprobs``, each prompt token's
      logprob; ``together``: one ``generate`` call for all (else one each);
      ``kv``: the requests' ``kv_transfer_params``;
    - ``{"op": "chat", "label", "first": [ids], "then": [ids], "salt"?, "max_tokens"?}``:
      the first turn, vLLM's prefix cache reset, then a turn of the first's
      prompt, its output and ``then``;
    - ``{"op": "reset", "label"?, "connector": bool, "retry_s"?}``: ``reset_prefix_cache``
      (tried again for ``retry_s`` while it fails: blocks not freed yet);
    - ``{"op": "signal", "path"}``, ``{"op": "wait", "path"}``: barriers between
      engine processes (a file made, a file waited for);
    - ``{"op": "corrupt" | "delete_segments", "dir"}``, ``{"op": "kill_fabric"}``;
    - ``{"op": "corrupt_components", "dir", "label"}``: a hybrid engine's other
      groups' pages damaged (how many, under ``label``);
    - ``{"op": "places", "label", "wait_for"?, "min_pages"?}``: the fabric's engine
      pages per place (waiting up to 30 s for a place whose name starts
      ``wait_for`` to have ``min_pages``);
    - ``{"op": "mark"}``, ``{"op": "settle", "pages"}``: wait for the fabric to take
      that many more reported pages than at the mark, and then a moment more.
    """
    from vllm import SamplingParams

    out: dict = {}
    for step in steps:
        op = step["op"]
        if op == "generate":
            kv = {"kv_transfer_params": step["kv"]} if step.get("kv") else None
            params = SamplingParams(
                max_tokens=step.get("max_tokens", args.max_tokens), temperature=0.0,
                prompt_logprobs=step.get("prompt_logprobs"), extra_args=kv,
            )  # fmt: skip
            items = [
                {
                    "prompt_token_ids": p,
                    **({"cache_salt": step["salt"]} if step.get("salt") else {}),
                }
                for p in step["prompts"]
            ]
            if step.get("together"):
                results = llm.generate(items, params, use_tqdm=False)
            else:
                results = [llm.generate([item], params, use_tqdm=False)[0] for item in items]
            record = {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [r.num_cached_tokens or 0 for r in results],
            }
            if step.get("prompt_logprobs") is not None:
                record["logprobs"] = [
                    [None if lp is None else lp[tok].logprob for tok, lp in
                     zip(r.prompt_token_ids, r.prompt_logprobs, strict=True)]
                    for r in results
                ]  # fmt: skip
            out[step["label"]] = record
        elif op == "chat":
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0)
            salt = {"cache_salt": step["salt"]} if step.get("salt") else {}
            (first,) = llm.generate([{"prompt_token_ids": step["first"], **salt}], params,
                                    use_tqdm=False)  # fmt: skip
            said = list(first.outputs[0].token_ids)
            llm.reset_prefix_cache()
            second_prompt = step["first"] + said + step["then"]
            (second,) = llm.generate([{"prompt_token_ids": second_prompt, **salt}], params,
                                     use_tqdm=False)  # fmt: skip
            out[step["label"]] = {
                "outputs": [said, list(second.outputs[0].token_ids)],
                "cached": [first.num_cached_tokens or 0, second.num_cached_tokens or 0],
                "prompts": [step["first"], second_prompt],
            }
        elif op == "embeds":
            # Prompts given as embeddings: those of token ids ``prompts`` (one call
            # each); their token ids, as vLLM sees them, are placeholders.
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0)
            table = embedding_table(llm)
            results = [
                llm.generate([{"prompt_embeds": table[p].clone()}], params, use_tqdm=False)[0]
                for p in step["prompts"]
            ]
            out[step["label"]] = {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [r.num_cached_tokens or 0 for r in results],
            }
        elif op == "reset":
            done = llm.reset_prefix_cache(reset_connector=step.get("connector", False))
            deadline = time.monotonic() + step.get("retry_s", 0.0)
            while not done and time.monotonic() < deadline:  # blocks not freed yet
                time.sleep(0.05)
                done = llm.reset_prefix_cache(reset_connector=step.get("connector", False))
            if step.get("label"):
                out[step["label"]] = done
        elif op == "signal":
            Path(step["path"]).touch()
        elif op == "wait":
            deadline = time.monotonic() + step.get("timeout", 300)
            while not Path(step["path"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited for {step['path']} in vain")
                time.sleep(0.01)
        elif op == "corrupt":
            corrupt(Path(step["dir"]))
        elif op == "corrupt_components":
            out[step.get("label", "corrupted")] = corrupt_components(Path(step["dir"]))
        elif op == "delete_segments":
            delete_segments(Path(step["dir"]))
        elif op == "kill_fabric":
            kill_fabric(args.fabric, args.address)
        elif op == "places":
            want = (step.get("wait_for", ""), step.get("min_pages", 1))
            out[step["label"]] = fabric_places(args, *want)
        elif op == "mark":
            _SETTLED[:] = [_fabric(args).stats()["engine_pages"]["reported_pages"]]
        elif op == "settle":
            settle(args, step.get("pages", 0))
        else:
            raise ValueError(f"unknown step {op!r}")
    return out


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
        block_size=args.block_size or None,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=8192,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
        kv_transfer_config=connector if args.fabric or args.example else None,
        seed=0,
        enable_prompt_embeds=args.prompt_embeds,
        kv_events_config=(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": args.kv_events}
            if args.kv_events
            else None
        ),
        speculative_config=(
            {"method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_max": 4}
            if args.ngram
            else None
        ),
    )
    startup_s = time.perf_counter() - started
    if args.script:
        steps = run_script(llm, json.loads(Path(args.script).read_text()), args)
        return {"startup_s": startup_s, "steps": steps}
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
