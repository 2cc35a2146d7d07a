"""Hybrid models served by the fabric with a real model behind the ranks: tiny
seeded-random Gemma 3 (sliding + full attention) and Bamba (Mamba2 + attention)
at TP=2 x PP=2 generate exactly the tokens they generate without a cache when
they continue from the state the fabric served — the full pages, the sliding
window before the prefix's end, the mamba state there — also through branch
points, after component evictions that leave tombstones, and from L2 and L3."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fabric.cache.keys import pack_tokens  # noqa: E402
from fabric.driver.local import LocalFabric  # noqa: E402
from fabric.rank.hybrid import (  # noqa: E402
    MambaState,
    build_hybrid,
    extract,
    layer_kinds,
    rebuild,
    served_states,
)
from tests.helpers import small_config, storage_options  # noqa: E402
from tests.rank.test_hybrid import greedy  # noqa: E402

MODELS = {
    "gemma3-swa": ["model.layer_kinds=[sliding, sliding, sliding, full]", "model.sliding_window=7"],
    "bamba-mamba2": [
        "model.layer_kinds=[mamba, full, mamba, full]",
        "model.mamba_state_bytes=11264",
    ],
    "qwen3next-gdn": [
        "model.layer_kinds=[mamba, full, mamba, full]",
        "model.recurrent_layer=gated_delta_net",
        "model.mamba_state_bytes=6144",
    ],
}


def fabric(name: str, *extra: str) -> LocalFabric:
    return LocalFabric(
        small_config(
            "model.layers=4",
            "model.kv_heads=2",
            "model.head_dim=16",
            "model.attention_heads=4",
            "model.vocab_size=200",
            "model.dtype=float32",
            "model.filler=hybrid",
            "cache.device_tokens=128",
            *MODELS[name],
            *extra,
        )
    )


def served_cache(f: LocalFabric, lease, hf_config, model):
    """The transformers cache the fabric's pages make for ``lease``'s prefix."""
    cfg = f.config.model
    full = [rank.read(lease.tokens, list(lease.device_pages)) for rank in f.ranks]
    parts = [rank.parts.read(list(lease.sliding), list(lease.mamba)) for rank in f.ranks]
    page = f.config.cache.page_size
    states = served_states(cfg, hf_config, page, lease.tokens // page, full, parts, lease.sliding)
    probe = model(torch.tensor([[1]]), use_cache=True, position_ids=torch.tensor([[0]]))
    for want, got in zip(
        extract(probe.past_key_values, layer_kinds(hf_config)), states, strict=True
    ):
        if isinstance(want, MambaState):  # each TP rank's share put back in place
            assert want.conv.shape == got.conv.shape
            assert want.recurrent.shape == got.recurrent.shape
    return rebuild(states, hf_config)


def check(f: LocalFabric, hf_config, model, prompt: list[int], more: list[int]) -> int:
    """Serve ``prompt`` (whole pages), continue greedily from what the fabric
    served and from no cache; returns the device hit."""
    r = f.serve(pack_tokens(prompt))
    assert r.error is None and r.lease.tokens == len(prompt)
    with torch.no_grad():
        cache = served_cache(f, r.lease, hf_config, model)
        got = greedy(model, torch.tensor([more]), cache, 6, len(prompt))
        want = greedy(model, torch.tensor([prompt + more]), None, 6, 0)
    assert got == want, f"continuing after {len(prompt)} served tokens"
    assert f.core.release(r.lease)
    f.core.cache.check_integrity()
    return r.device_hit_tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_a_hybrid_model_continues_from_served_state_as_from_no_cache(name):
    f = fabric(name)
    hf_config, model = build_hybrid(f.config.model)
    a = [(7 * t + 3) % 200 for t in range(24)]  # six pages
    b = a[:12] + [(5 * t + 1) % 200 for t in range(8)]  # branches after page 3
    assert check(f, hf_config, model, a, [11, 12]) == 0
    assert check(f, hf_config, model, a, [13]) == 24  # the whole prefix served
    # B's match stops at page 3 (no state was kept inside A's node); its fill
    # keeps one there, so C, which also branches there, is served up to it.
    assert check(f, hf_config, model, b, [14]) == 0
    c = a[:12] + [(3 * t + 2) % 200 for t in range(4)]
    assert check(f, hf_config, model, c, [15]) == 12
    # Evict every unlocked component: A's end is a tombstone, then removed;
    # served again, it is recomputed and its state is right.
    parts = f.core.cache.parts
    parts.evict_sliding(1 << 20)
    parts.evict_mamba(1 << 20)
    f.core.cache.check_integrity()
    assert parts.stats.tombstones_removed > 0
    assert check(f, hf_config, model, a, [16]) < 24
    assert check(f, hf_config, model, a, [17]) == 24


@pytest.mark.parametrize("name", list(MODELS))
def test_components_written_to_l2_and_loaded_back_continue_as_no_cache(name):
    f = fabric(name)
    hf_config, model = build_hybrid(f.config.model)
    a = [(11 * t + 5) % 200 for t in range(24)]
    assert check(f, hf_config, model, a, [21]) == 0
    for _ in range(3):
        f.step()  # the write-through to L2 completes on every rank
    f.core.cache.device_evictions.evict(1 << 20)  # L1 emptied: the pages and components stay in L2
    assert f.core.cache.device_sizes().evictable == 0
    for rank in f.ranks:  # as if other prompts had reused every L1 slot since
        for pool in (rank.l1, rank.parts.sliding, rank.parts.states):
            if pool is not None:
                pool.buffer.zero_()
    r = f.serve(pack_tokens(a))
    assert r.host_hit_tokens == 24, "served from L2, components loaded back with the pages"
    assert f.core.release(r.lease)
    assert check(f, hf_config, model, a, [22]) == 24


@pytest.mark.parametrize("name", list(MODELS))
def test_components_backed_up_to_l3_continue_as_no_cache_on_a_fresh_fabric(name, tmp_path):
    l3 = (*storage_options(tmp_path), "prefetch.threshold_tokens=4")
    f = fabric(name, *l3)
    hf_config, model = build_hybrid(f.config.model)
    a = [(13 * t + 7) % 200 for t in range(24)]
    assert check(f, hf_config, model, a, [31]) == 0
    f.settle()  # the write-through to L2, then the backup to L3, on every rank
    assert f.core.cache.l3.stats.backed_up_tokens == 24
    g = fabric(name, *l3)  # a new coordinator and ranks: L1 and L2 empty, the same L3
    r = g.serve(pack_tokens(a))
    assert r.storage_hit_tokens == 24, "the pages and every component come from L3"
    with torch.no_grad():
        got = greedy(model, torch.tensor([[32]]), served_cache(g, r.lease, hf_config, model), 6, 24)
        want = greedy(model, torch.tensor([[*a, 32]]), None, 6, 0)
    assert got == want
    assert g.core.release(r.lease)
    g.core.cache.check_integrity()


def test_a_checkpoint_state_inside_a_long_prompt_continues_as_no_cache():
    f = fabric("bamba-mamba2", "cache.mamba_checkpoint_tokens=8")
    hf_config, model = build_hybrid(f.config.model)
    a = [(17 * t + 9) % 200 for t in range(24)]  # six pages: checkpoints after 2 and 4
    assert check(f, hf_config, model, a, [41]) == 0
    assert f.core.cache.parts.stats.checkpoints_saved == 2
    # Prefixes ending at a checkpoint, and one ending between two (served up to
    # the first), continue from the state the ranks saved there.
    assert check(f, hf_config, model, a[:8], [42]) == 8
    assert check(f, hf_config, model, a[:16], [43]) == 16
    assert check(f, hf_config, model, [*a[:12], 7, 7, 7, 7], [44]) == 8


def test_requests_forking_one_cached_mamba_state_each_get_their_own_copy():
    """A rank holding the whole model computes from the cache: a request continuing
    a cached prefix forks the mamba state there and runs its new tokens only; the
    cached slot stays as it was, for the next request and for the prefix itself."""
    f = fabric("bamba-mamba2", "topology.tp=1", "topology.pp=1")
    hf_config, model = build_hybrid(f.config.model)
    (rank,) = f.ranks
    kv = rank.filler
    assert kv.forks is not None
    a = [(19 * t + 2) % 200 for t in range(12)]  # three pages
    assert check(f, hf_config, model, a, [51]) == 0
    r = f.serve(pack_tokens(a))
    ((end, slot),) = r.lease.mamba
    assert end == 3 and f.core.release(r.lease)
    cached = rank.parts.states.buffer[slot].clone()
    for more, token in (([5, 6, 7, 8, 9, 10, 11, 12], 52), ([90, 80, 70, 60, 50, 40, 30, 20], 53)):
        forked, ran, pieces = kv.forks.forked, kv.run_tokens, kv.forks.pieces
        assert check(f, hf_config, model, a + more, [token]) == 12
        assert kv.forks.forked == forked + 1, "started from the cached state slot"
        assert kv.run_tokens == ran + 8, "only the new tokens ran, the new state kept from them"
        assert kv.forks.pieces == pieces + 1, "in one piece: a state is stored at its end only"
        assert torch.equal(rank.parts.states.buffer[slot], cached), "the cached state is unchanged"
    assert check(f, hf_config, model, a, [54]) == 12  # the prefix itself is still served


def test_a_whole_model_rank_runs_to_each_checkpoint_and_keeps_its_state():
    """The commands name the page ends where the cache stores a state: the rank runs
    the prompt in pieces ending there and stores each state from its own run."""
    f = fabric("bamba-mamba2", "topology.tp=1", "topology.pp=1", "cache.mamba_checkpoint_tokens=8")
    hf_config, model = build_hybrid(f.config.model)
    kv = f.ranks[0].filler
    a = [(23 * t + 5) % 200 for t in range(24)]  # six pages: checkpoints after 2 and 4
    assert check(f, hf_config, model, a, [61]) == 0
    assert f.core.cache.parts.stats.checkpoints_saved == 2
    assert kv.forks.pieces == 3, "to page 2, to page 4, to the end"
    assert kv.run_tokens == 24, "each state kept from the one run"
    assert check(f, hf_config, model, a[:8], [62]) == 8
    assert check(f, hf_config, model, [*a[:16], 1, 2, 3, 4], [63]) == 16


def test_requests_forking_one_cached_sliding_window_each_run_their_new_tokens_only():
    """A whole-model rank of a sliding-window model starts a compute from the
    cached window's pages (the positions before it are never read): each request
    runs its new tokens only, stores its own window from that run, and the
    cached pages stay as they were."""
    f = fabric("gemma3-swa", "topology.tp=1", "topology.pp=1")
    hf_config, model = build_hybrid(f.config.model)
    (rank,) = f.ranks
    kv = rank.filler
    assert kv.forks is not None
    a = [(13 * t + 4) % 200 for t in range(16)]  # four pages; the window: the last two
    assert check(f, hf_config, model, a, [71]) == 0
    r = f.serve(pack_tokens(a))
    assert [key for key, _ in r.lease.sliding] == [2, 3] and f.core.release(r.lease)
    window = list(r.lease.sliding)
    cached = rank.parts.read(window, [])[1].clone()
    for more, token in (([5, 6, 7, 8, 9, 10, 11, 12], 72), ([90, 80, 70, 60, 50, 40, 30, 20], 73)):
        forked, ran = kv.forks.forked, kv.run_tokens
        assert check(f, hf_config, model, a + more, [token]) == 16
        assert kv.forks.forked == forked + 1, "started from the cached window"
        assert kv.run_tokens == ran + 8, "only the new tokens ran, the new window kept from them"
        assert torch.equal(rank.parts.read(window, [])[1], cached), "the window is unchanged"
    assert check(f, hf_config, model, a, [74]) == 16  # the prefix itself is still served


@pytest.mark.parametrize("name", ["bamba-mamba2", "gemma3-swa"])
def test_decode_steps_continue_the_run_the_step_before_left(name):
    """Each decode step of a whole-model rank runs its one new token on from the
    run the step before left (not its partial page again), and the KV and states
    it stores are those of a run from no cache."""
    f = fabric(name, "topology.tp=1", "topology.pp=1")
    hf_config, model = build_hybrid(f.config.model)
    kv = f.ranks[0].filler
    a = [(29 * t + 6) % 200 for t in range(12)]  # three pages
    r = f.serve(pack_tokens(a))
    lease, answer = r.lease, [3, 141, 59, 26, 53, 58]  # over the page end at 16
    for n, token in enumerate(answer, 1):
        ran = kv.run_tokens
        step = f.append(lease, pack_tokens([token]))
        assert step.error is None
        assert kv.run_tokens == ran + 1, f"step {n} ran its new token only"
        assert all(f.verify(step, pack_tokens(a + answer[:n]))), f"step {n}'s KV as from no cache"
        lease = step.lease
    assert f.core.release(lease)
    assert check(f, hf_config, model, a + answer[:4], [9]) == 16


@pytest.mark.parametrize("name", ["bamba-mamba2", "gemma3-swa"])
def test_verify_checks_a_real_models_components_against_a_fresh_run(name):
    """``verify`` checks a real model's sliding pages and mamba states as its full
    pages: a 1% change in one of them is caught."""
    f = fabric(name, "topology.tp=2", "topology.pp=1")
    a = [(31 * t + 8) % 200 for t in range(16)]
    r = f.serve(pack_tokens(a))
    assert r.lease.sliding or r.lease.mamba
    assert f.verify(r, pack_tokens(a)) == [True, True]
    rank = f.ranks[1]
    if r.lease.mamba:
        rank.parts.states.buffer[r.lease.mamba[-1][1]] *= 1.01
    else:
        pool_page = r.lease.sliding[-1][1]
        rank.parts.sliding.buffer[:, :, pool_page * 4 : pool_page * 4 + 4] *= 1.01
    assert f.verify(r, pack_tokens(a)) == [True, False]
    assert f.core.release(r.lease)


def test_verify_holds_a_bfloat16_hybrid_cache_to_its_precision():
    """A whole-model Bamba rank on a bfloat16 cache forks states computed over
    rounded full-attention KV: verify passes those leases (float32's bound refused
    some) and refuses a mamba state of another prefix."""
    f = fabric("bamba-mamba2", "model.dtype=bfloat16", "topology.tp=1", "topology.pp=1")
    assert f.ranks[0].filler.forks is not None
    stems = [[(s * 29 + 7 * t + 3) % 200 for t in range(16)] for s in range(3)]
    for i in range(9):
        ids = stems[i % 3] + [(i * 13 + t) % 200 for t in range(4 + 4 * (i % 4))]
        r = f.serve(pack_tokens(ids))
        assert f.verify(r, pack_tokens(ids)) == [True], f"request {i}"
        assert f.core.release(r.lease)
    assert f.ranks[0].filler.forks.forked > 0
    a, b = stems[0] + [1] * 8, stems[1] + [2] * 8
    ra, rb = f.serve(pack_tokens(a)), f.serve(pack_tokens(b))
    states = f.ranks[0].parts.states.buffer
    states[ra.lease.mamba[-1][1]] = states[rb.lease.mamba[-1][1]]
    assert f.verify(ra, pack_tokens(a)) == [False]


def test_interleaved_decodes_of_several_requests_each_continue_their_own_run():
    """Runs are kept within a byte budget, not one or two: requests decoding in
    turn (as a batch does) each continue their own run; past the budget the
    oldest is dropped and its next step runs its partial page again."""
    f = fabric("bamba-mamba2", "topology.tp=1", "topology.pp=1")
    kv = f.ranks[0].filler
    prompts = [[(p * 37 + 11 * t + 1) % 200 for t in range(12)] for p in range(4)]
    leases = [f.serve(pack_tokens(p)).lease for p in prompts]
    for n in range(3):
        for i, lease in enumerate(leases):
            ran = kv.run_tokens
            step = f.append(lease, pack_tokens([5 + n]))
            assert kv.run_tokens == ran + 1, f"request {i}, step {n + 1}: its own run went on"
            leases[i] = step.lease
    kv.forks.RUNNING_BYTES = 1  # the newest run only, from the next one kept on
    leases[1] = f.append(leases[1], pack_tokens([9])).lease
    ran = kv.run_tokens
    step = f.append(leases[0], pack_tokens([9]))
    assert kv.run_tokens == ran + 4, "its run was dropped: the partial page runs again"
    assert all(f.verify(step, pack_tokens(prompts[0] + [5, 6, 7, 9])))
    for lease in [step.lease, *leases[1:]]:
        assert f.core.release(lease)
