"""Workloads: conversation turns rebuilt from a trace, and answers cached."""

from fabric.cache.inprocess import CoreReplay
from fabric.config import FabricConfig
from fabric.tools.workload import BLOCK_TOKENS, Request, iter_turns, synthetic_trace


def test_a_next_turn_starts_with_the_prompt_and_answer_of_the_one_before():
    turns = list(iter_turns(synthetic_trace(300)))
    prompts = [prompt for _, prompt, _, _ in turns]
    followed = 0
    for i, (request, prompt, answer, has_next) in enumerate(turns):
        assert len(prompt) == 4 * request.input_length
        assert len(answer) <= 4 * request.output_length
        later = [p for p in prompts[i + 1 :] if p.startswith(prompt + answer)]
        if has_next:
            followed += 1
            assert later, f"turn {i}: no later prompt holds its prompt and answer"
    assert followed > 100


def test_turns_are_linked_by_whole_blocks_and_a_last_turn_gets_fresh_answers():
    b = BLOCK_TOKENS
    first = Request(0, b + 10, 20, (1, 2))
    second = Request(1, 2 * b + 50, 5, (1, 9, 3))  # block 2 was partial: 9 holds it and the answer
    other = Request(2, b + 10, 20, (4, 2))
    (_, p1, a1, n1), (_, p2, a2, n2), (_, p3, _, n3) = iter_turns([first, second, other])
    assert n1 and not n2 and not n3
    assert p2.startswith(p1 + a1) and len(a1) == 4 * 20
    assert len(a2) == 4 * 5 and a2 not in p1 + p2 + p3
    assert p3[: 4 * b] != p1[: 4 * b], "a different first block"


def test_caching_answers_raises_the_hit_rate_of_the_next_turns():
    config = FabricConfig().with_overrides(
        ["cache.device_tokens=65536", "cache.host_tokens=131072", "cache.page_size=16"]
    )
    rates = []
    for answers in (False, True):
        replay = CoreReplay(config)
        for _, prompt, answer, _ in iter_turns(synthetic_trace(200)):
            replay.serve(prompt, answer if answers else b"")
        replay.cache.check_integrity()
        t = replay.stats.tokens
        assert not replay.cache.placement.leased and replay.cache.tree.protected_size == 0
        rates.append((t.device + t.host + t.storage) / replay.stats.prompt_tokens)
    assert rates[1] > rates[0]
