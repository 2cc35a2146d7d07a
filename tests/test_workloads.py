"""Generated workloads: seeded, of the shape each kind promises, and RAG's
documents recurring after other prefixes (what the prefix-keyed bounds are for)."""

from __future__ import annotations

import pytest

from fabric.cli import main
from fabric.errors import InvalidInput
from fabric.tools.simulate import infinite_hit_rate
from fabric.tools.workload import BLOCK_TOKENS
from fabric.tools.workloads import WORKLOADS, generated


@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_each_kind_is_seeded_and_well_formed(kind):
    trace = generated(kind, 400, seed=5)
    assert trace == generated(kind, 400, seed=5)
    assert trace != generated(kind, 400, seed=6)
    assert len(trace) == 400
    for r in trace:
        assert r.hash_ids and 0 < r.input_length <= len(r.hash_ids) * BLOCK_TOKENS
        assert r.input_length > (len(r.hash_ids) - 1) * BLOCK_TOKENS  # the last block is used
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)


def test_an_agent_loop_sends_its_whole_history_again_each_iteration():
    trace = generated("agent", 300)
    grown = sum(
        any(later.hash_ids[: len(r.hash_ids)] == r.hash_ids for later in trace[i + 1 : i + 40])
        for i, r in enumerate(trace)
    )
    assert grown > len(trace) // 2, "most requests are continued by a later one of their loop"


def test_rag_documents_recur_after_other_prefixes():
    trace = generated("rag", 2000)
    after: dict[int, set[tuple[int, ...]]] = {}
    for r in trace:
        for i, h in enumerate(r.hash_ids):
            after.setdefault(h, set()).add(r.hash_ids[:i])
    assert sum(len(prefixes) > 1 for prefixes in after.values()) > 100
    # Keyed by id alone, an infinite cache would count those as hits.
    seen: set[int] = set()
    raw = 0
    for r in trace:
        leading = next((i for i, h in enumerate(r.hash_ids) if h not in seen), len(r.hash_ids))
        raw += min(leading * BLOCK_TOKENS, r.input_length)
        seen.update(r.hash_ids)
    total = sum(r.input_length for r in trace)
    assert infinite_hit_rate(trace) < raw / total - 0.02, (infinite_hit_rate(trace), raw / total)


def test_a_mix_keeps_its_kinds_apart_and_an_unknown_kind_is_refused(capsys):
    trace = generated("mixed", 1000)
    assert len({r.hash_ids[0] // 10**9 for r in trace}) == 3, "chat, agent and RAG ids"
    with pytest.raises(InvalidInput, match="'nope'"):
        generated("nope", 10)
    assert main(["simulate", "--workload", "nope", "--requests", "10"]) == 2
    assert "--workload 'nope' is refused: allowed are chat, agent, rag, mixed" in (
        capsys.readouterr().err
    )
