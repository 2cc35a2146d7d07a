"""Rank actors of a TP=2 x PP=2 split computing a real model from the cache: each
runs its share of the new tokens only, the stages hand hidden states over, the
tensor-parallel pairs all-reduce (gloo); a rank killed while its peers wait in
a collective is a reset and a new group, never a hang."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from fabric.client import launch  # noqa: E402
from fabric.rank.model import assemble, build_model  # noqa: E402
from fabric.tools.chat import generate, model_overrides  # noqa: E402
from tests.helpers import small_config, wait_for, where_now  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py

NAME = "kvfabric-sharded"


def config():
    return small_config(
        *[o for o in model_overrides("tiny-llama") if "layers" not in o and "head_dim" not in o],
        "model.layers=4",
        "model.head_dim=16",
        "cache.device_tokens=256",
        "cache.host_tokens=512",
        f"runtime.name={NAME}",
        f"runtime.ray_namespace={NAME}",
        "runtime.rank_timeout_s=20",
        "runtime.collective_timeout_s=5",
    )


@pytest.fixture(scope="module")
def fabric():
    shared_ray()
    f = launch(config())
    try:
        yield f
    finally:
        f.shutdown()


def words(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def served_answer(fabric, hf, ids: list[int]) -> tuple[list[int], object]:
    """Greedy tokens continued from the KV the fabric serves for ``ids``."""
    result = fabric.submit(ids, timeout=120)
    assert result.error is None, result.error
    cfg = fabric.config
    kv = assemble(fabric.read_kv(result.lease), cfg.model, cfg.cache.page_size, len(ids))
    assert fabric.verify(result, ids) == [True] * 4
    return generate(hf, ids, 4, kv[:, :, :, :-1]), result


def test_ranks_compute_only_the_new_tokens_and_generation_matches(fabric):
    hf = build_model(fabric.config.model)
    before = fabric.computed_tokens_by_rank()
    prompt = words(1, 37)
    answer, first = served_answer(fabric, hf, prompt)
    assert answer == generate(hf, prompt, 4)
    lease = first.lease
    for token in answer:  # decode: one token each, computed by the ranks from the cache
        step = fabric.append(lease, [token], timeout=60)
        assert step.error is None and step.computed_tokens == 1
        lease = step.lease
    fabric.release(lease)
    turn = prompt + answer + words(2, 9)
    again, second = served_answer(fabric, hf, turn)
    assert again == generate(hf, turn, 4)
    assert second.device_hit_tokens >= 40  # the whole pages of the first turn and answer
    fabric.release(second.lease)
    after = fabric.computed_tokens_by_rank()
    ran = {rank: after[rank] - before.get(rank, 0) for rank in after}
    asked = first.computed_tokens + len(answer) + second.computed_tokens
    assert ran == dict.fromkeys(after, asked), (ran, asked)


def test_a_rank_killed_inside_a_collective_is_a_reset_and_a_new_group(fabric):
    hf = build_model(fabric.config.model)
    _, warm = served_answer(fabric, hf, words(3, 21))  # the group of this epoch formed
    fabric.release(warm.lease)
    epoch = fabric.stats()["epoch"]
    victim = fabric._deployment.ranks[3]  # pp1-cp0-tp1
    old_pid = ray.get(victim.where.remote())[0]
    # The victim stalls before its next command: its stage peer waits in the
    # all-reduce, the first stage in its send. Then it dies.
    ray.get(victim.set_faults.remote(delay_s=60))
    prompt = words(4, 30)
    ref = fabric.submit_async(prompt)
    time.sleep(1.5)
    ray.kill(victim, no_restart=False)
    # Answered (an error or KV), not hung on the dead rank's collective.
    result = fabric.result(ref, timeout=120)
    assert wait_for(lambda: (where_now(victim) or (old_pid,))[0] != old_pid, 60)
    stats = fabric.stats()
    assert stats["epoch"] > epoch and stats["counters"]["resets"] >= 1
    if result.error is None:
        fabric.release(result.lease)
    # The restarted rank and its peers formed the next group: computes are right.
    answer, again = served_answer(fabric, hf, prompt)
    assert answer == generate(hf, prompt, 4)
    fabric.release(again.lease)
