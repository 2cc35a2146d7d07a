"""``kvfabric simulate``: block-level bounds on hand-made traces, and the command."""

import json
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.cli import main
from fabric.tools.simulate import belady_hit_rate, infinite_hit_rate, lru_hit_rate
from fabric.tools.workload import BLOCK_TOKENS, Request
from tests.helpers import example_count

B = BLOCK_TOKENS


def trace(*blocks: tuple[int, ...]) -> list[Request]:
    return [Request(i, len(b) * B, 0, b) for i, b in enumerate(blocks)]


def test_bounds_on_a_trace_where_lru_evicts_what_comes_back():
    # Capacity 2 blocks: A B, then C, then A B again. LRU lost the leaf B to C
    # (as a tree would: never A before B); Belady keeps both (C is never used
    # again); an infinite cache hits them too.
    t = trace((1, 2), (3,), (1, 2))
    total = 5 * B
    assert lru_hit_rate(t, 2) == B / total
    assert belady_hit_rate(t, 2) == 2 * B / total
    assert infinite_hit_rate(t) == 2 * B / total


def test_a_hit_is_the_leading_run_of_cached_blocks_and_stops_at_the_prompt():
    t = [Request(0, 2 * B, 0, (1, 2)), Request(1, B + 7, 0, (1, 9, 2))]
    assert infinite_hit_rate(t) == B / (3 * B + 7), "block 2 follows a miss: no hit"
    t = [Request(0, 2 * B, 0, (1, 2)), Request(1, B + 7, 0, (1, 2))]
    assert infinite_hit_rate(t) == (B + 7) / (3 * B + 7), "capped at the prompt's length"


def test_a_block_id_after_another_prefix_is_another_block():
    # A RAG document's block (7) recurs after different questions: a radix cache
    # shares it only where everything before it matches.
    t = trace((1, 7), (7,), (2, 7), (1, 7))
    assert infinite_hit_rate(t) == 2 * B / (7 * B), "only the last request's (1, 7) hits"
    assert lru_hit_rate(t, 100) == belady_hit_rate(t, 100) == infinite_hit_rate(t)


# Brute force, independent of ``prefix_keys``: a block is the tuple of ids up to
# and including it; evictions as the bounds define them (LRU: a request uses its
# blocks deepest first; Belady: furthest next use, ties to the block seen last).


def _hits(r: Request, held) -> int:
    leading = 0
    while leading < len(r.hash_ids) and held(r.hash_ids[: leading + 1]):
        leading += 1
    return min(leading * B, r.input_length)


def _blocks(r: Request) -> list[tuple[int, ...]]:
    return [r.hash_ids[: i + 1] for i in range(len(r.hash_ids))]


def _infinite(t: list[Request]) -> float:
    seen: set[tuple[int, ...]] = set()
    hit = 0
    for r in t:
        hit += _hits(r, seen.__contains__)
        seen.update(_blocks(r))
    return hit / max(1, sum(r.input_length for r in t))


def _lru(t: list[Request], capacity: int) -> float:
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hit = 0
    for r in t:
        hit += _hits(r, cache.__contains__)
        for b in reversed(_blocks(r)):
            cache.pop(b, None)
            cache[b] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hit / max(1, sum(r.input_length for r in t))


def _belady(t: list[Request], capacity: int) -> float:
    first_seen: dict[tuple[int, ...], int] = {}
    for r in t:
        for b in _blocks(r):
            first_seen.setdefault(b, len(first_seen))

    def next_use(b: tuple[int, ...], after: int) -> int:
        return next((j for j in range(after + 1, len(t)) if b in _blocks(t[j])), len(t) + 1)

    cache: set[tuple[int, ...]] = set()
    hit = 0
    for i, r in enumerate(t):
        hit += _hits(r, cache.__contains__)
        cache.update(_blocks(r))
        while len(cache) > capacity:
            cache.remove(max(cache, key=lambda b: (next_use(b, i), first_seen[b])))
        # Whole prefixes only, as in a tree: a block's prefix is held with it.
        assert all(b[:-1] in cache for b in cache if len(b) > 1)
    return hit / max(1, sum(r.input_length for r in t))


@settings(max_examples=example_count(300, 5000), deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 3), min_size=0, max_size=5).map(tuple), min_size=1, max_size=10
    ),
    st.integers(1, 8),
)
def test_the_bounds_equal_a_brute_force_keyed_by_whole_prefixes(blocks, capacity):
    t = trace(*blocks)
    assert infinite_hit_rate(t) == _infinite(t)
    assert lru_hit_rate(t, capacity) == _lru(t, capacity)
    assert belady_hit_rate(t, capacity) == _belady(t, capacity)
    assert max(lru_hit_rate(t, capacity), belady_hit_rate(t, capacity)) <= infinite_hit_rate(t)


def test_simulate_prints_the_core_by_tier_and_the_bounds(capsys):
    code = main(
        [
            "simulate",
            "--requests",
            "200",
            "--set",
            "cache.device_tokens=65536",
            "--set",
            "cache.host_tokens=131072",
            "--capacities",
            "64K,1M",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    core, bounds = out["core"], out["bounds"]
    assert abs(sum(core["by_tier"].values()) - 1) < 1e-3
    assert out["refused_requests"] == 0
    assert [b["capacity_tokens"] for b in bounds] == [65536, 1 << 20]
    for b in bounds:
        assert b["lru"] <= b["belady"] <= b["infinite"]
    assert bounds[0]["belady"] <= bounds[1]["belady"]


def test_bad_capacities_are_refused_naming_the_item(capsys):
    assert main(["simulate", "--requests", "10", "--capacities", "2M,lots"]) == 2
    assert "--capacities item 'lots' is refused" in capsys.readouterr().err


def test_plot_draws_a_png_of_hit_rate_against_capacity(tmp_path, capsys):
    chart = tmp_path / "hits.png"
    args = ["simulate", "--requests", "50", "--capacities", "16K,64K,256K", "--plot", str(chart)]
    assert main(args) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_capacities_include_the_config_tiers_and_2m_20m(capsys):
    assert main(["simulate", "--requests", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    caps = [b["capacity_tokens"] for b in out["bounds"]]
    assert caps == sorted(caps) and {32768, 163840, 2 << 20, 20 << 20} <= set(caps)


def test_simulate_reports_each_component_of_a_hybrid_model(capsys):
    args = ["simulate", "--requests", "200", "--capacities", "64K", "--set"]
    args += [
        "cache.device_tokens=65536",
        "--set",
        "model.layer_kinds=[full, sliding, sliding, mamba]",
    ]
    args += ["--set", "model.sliding_window=256", "--set", "cache.sliding_tokens=4096"]
    assert main([*args, "--set", "cache.mamba_states=8", "--set", "storage.backend=none"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text.strip().splitlines()[-1])
    comp = out["core"]["components"]
    pools = comp["pools"]
    assert set(pools) == {"full", "sliding", "mamba"}
    assert pools["sliding"]["capacity"] == 4096 and pools["mamba"]["capacity"] == 8
    # Bytes from the model's shape: 1 full and 2 sliding layers of 4 heads x 32 x bf16 K+V.
    assert pools["full"]["bytes"] == 65536 * 1 * 2 * 4 * 32 * 2
    assert pools["sliding"]["bytes"] == 4096 * 2 * 2 * 4 * 32 * 2
    assert pools["mamba"]["bytes"] == 8 * 65536
    assert comp["bytes"] == sum(p["bytes"] for p in pools.values())
    assert comp["all_full_attention_bytes"] == 65536 * 3 * 2 * 4 * 32 * 2
    assert comp["counters"]["mamba_evicted_states"] > 0, "8 states: evicted apart"
    # Each component alone serves at least what they all serve together, and
    # full attention (present wherever the others are) the most; here the 8
    # mamba states are what limits the hybrid hit rate.
    rates = comp["hit_rates"]
    assert set(rates) == {"full", "sliding", "mamba", "all"}
    assert rates["full"] >= max(rates["sliding"], rates["mamba"]) >= rates["all"] > 0
    assert rates["mamba"] < rates["sliding"]
    assert "could serve alone" in text
    assert "L1 sliding" in text and "every attention layer as full attention" in text


@pytest.mark.parametrize("interval", [0, 64])
def test_simulate_reports_a_mamba_model_with_checkpoints_on_and_off(interval, capsys):
    # RAG prompts share documents after different questions: a prefix often ends
    # inside a cached node, where only a checkpoint has a state.
    args = ["simulate", "--requests", "150", "--workload", "rag", "--capacities", "64K"]
    for option in (
        "cache.device_tokens=65536",
        "model.layer_kinds=[full, mamba, mamba, mamba]",
        "storage.backend=none",
        f"cache.mamba_checkpoint_tokens={interval}",
    ):
        args += ["--set", option]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    comp = out["core"]["components"]
    cp = comp["checkpoints"]
    assert cp["interval_tokens"] == (interval or 128)  # 8 pages when the config has none
    on, off = cp["on"], cp["off"]
    # The core's own replay is the one its config asks for.
    assert (on if interval else off)["hit_rate"] == out["hit_rate"]
    assert on["saved"] > 0 and off["saved"] == off["skipped"] == 0
    assert on["hit_rates"]["mamba"] > off["hit_rates"]["mamba"]
    assert on["hit_rate"] > off["hit_rate"]
    # A state every few pages: mamba serves (nearly) whatever full attention does.
    assert on["hit_rates"]["full"] - on["hit_rates"]["mamba"] < (
        off["hit_rates"]["full"] - off["hit_rates"]["mamba"]
    )
    assert main(args) == 0
    assert "mamba checkpoints every" in capsys.readouterr().out


def test_simulate_compares_eviction_policies_and_2q_resists_a_scan(tmp_path, capsys):
    # A prompt used again after every three single-use prompts: its reuse distance
    # (8 blocks) is twice L1 (4 blocks). LRU loses it each time; 2Q keeps it
    # protected and evicts the single-use prompts instead; a2q learns to.
    lines, single = [], 100
    reused = [1, 2]
    for _ in range(12):
        lines.append(reused)
        for _ in range(3):
            lines.append([single, single + 1])
            single += 2
    path = tmp_path / "scan.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 2 * B, "output_length": 1, "hash_ids": h})
            + "\n"
            for i, h in enumerate(lines)
        )
    )
    args = ["simulate", "--trace", str(path), "--capacities", "2K", "--json"]
    sizes = ["--set", "cache.device_tokens=2048", "--set", "cache.host_tokens=16"]
    code = main([*args, *sizes, "--set", "storage.backend=none", "--policies", "lru,2q"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rates = out["policies"]
    assert rates["lru"] == 0
    # 2Q: from the third use on (the second protects it) every use of the prompt hits.
    assert rates["2q"] == round(10 * 2 * B / (len(lines) * 2 * B), 4)
    # The default, a2q, starts as LRU and learns from the prompt coming back.
    assert 0 < rates["a2q"] == out["hit_rate"] <= rates["2q"]


def test_simulate_refuses_an_unknown_policy_naming_it(capsys):
    assert main(["simulate", "--requests", "10", "--policies", "lru,bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "2q" in err


def test_the_core_and_the_bounds_count_the_same_requests_and_the_refused_beside(tmp_path, capsys):
    # L1 holds 4 blocks: the 8-block prompt is refused by the core, so it is in
    # neither the hit rate nor the bounds (it would have put blocks 3-8 in them).
    rows = [(1, 2), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3), (1, 2, 3, 4), (1, 2, 3)]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": len(ids) * B, "hash_ids": list(ids)}) + "\n"
            for i, ids in enumerate(rows)
        )
    )
    args = ["simulate", "--trace", str(path), "--set", f"cache.device_tokens={4 * B}"]
    assert main([*args, "--capacities", "2K,1M", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["refused_requests"] == 1
    served = [r for i, r in enumerate(trace(*rows)) if i != 1]
    assert out["bounds"][-1]["infinite"] == round(infinite_hit_rate(served), 4)
    assert out["hit_rate"] <= out["bounds"][-1]["infinite"]
    assert main([*args, "--capacities", "1M"]) == 0
    assert "the 4 requests the core served, not the 1 refused" in capsys.readouterr().out
