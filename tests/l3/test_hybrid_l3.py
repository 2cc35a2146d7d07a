"""A hybrid model's components in L3: backups store every component a prefix end
needs, a fresh fabric serves the prefix from L3 with them (every rank's pages,
sliding pages and mamba states verified), and a prefix end whose components L3
lacks — missing, damaged or stored for another component — is never served."""

from __future__ import annotations

import pytest

from fabric.cache.keys import TokenKey, pack_tokens
from fabric.driver.local import LocalFabric
from fabric.l3.format import page_key
from fabric.l3.service import StorageService
from tests.helpers import prompt, small_config, storage_options

P = 4
KINDS = {
    "sliding": ("[full, sliding]", 2),
    "mamba": ("[full, mamba]", 2),
    "both": ("[full, sliding, full, mamba]", 4),
}


def config(tmp_path, kinds: str, *more: str):
    layer_kinds, layers = KINDS[kinds]
    return small_config(
        f"model.layers={layers}",
        f"model.layer_kinds={layer_kinds}",
        "model.sliding_window=6",
        "model.mamba_state_bytes=64",
        "cache.sliding_tokens=32",
        "cache.mamba_states=8",
        "cache.host_sliding_tokens=64",
        "cache.host_mamba_states=16",
        *storage_options(tmp_path),
        "prefetch.threshold_tokens=4",
        "storage.transfer_batch_pages=2",
        *more,
    )


def fill_l3(cfg, tokens: bytes) -> LocalFabric:
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert f.verify(r, tokens) == [True] * 4
    f.core.release(r.lease)
    f.settle()
    l3 = f.core.cache.l3
    assert l3.stats.backed_up_tokens == len(tokens) // 4 // P * P and not l3.stats.failed_backups
    return f


def part_file(tmp_path, cfg, tokens: bytes, page: int, suffix: str, component: str):
    h = TokenKey(tokens, P, "default").page_hashes()[page]
    tag = StorageService(cfg.with_overrides(["storage.backend=none"])).shapes[component, suffix].tag
    key = page_key(h, tag, suffix)
    return tmp_path / "l3" / key[:2] / f"{key}.kv"


def serve_fresh(cfg, tokens: bytes):
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.error is None
    assert f.verify(r, tokens) == [True] * 4
    f.core.cache.check_integrity()
    return f, r


@pytest.mark.parametrize("kinds", list(KINDS))
def test_a_fresh_fabric_serves_a_hybrid_prefix_from_l3_with_every_component(tmp_path, kinds):
    cfg = config(tmp_path, kinds)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f, r = serve_fresh(cfg, tokens)
    assert r.storage_hit_tokens == 32 and r.computed_tokens == 0
    lease = r.lease
    if "sliding" in kinds or kinds == "both":
        assert [k for k, _ in lease.sliding] == [6, 7]  # the window before the end
    if kinds in ("mamba", "both"):
        assert [e for e, _ in lease.mamba] == [8]
    # What was served came through L2 with its components, and settles cleanly.
    f.core.release(r.lease)
    f.settle()
    f.core.cache.check_integrity()


@pytest.mark.parametrize(
    ("kinds", "component", "page"),
    [("mamba", "mamba", 7), ("sliding", "sliding", 6), ("both", "mamba", 7)],
)
def test_a_prefix_end_whose_component_l3_lacks_is_recomputed_not_served(
    tmp_path, kinds, component, page
):
    cfg = config(tmp_path, kinds)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    # One shard's component at the only stored end goes: the pages alone serve nothing.
    suffix = "1-0-1" if component == "mamba" else "0-0-0"
    part_file(tmp_path, cfg, tokens, page, suffix, component).unlink()
    _, r = serve_fresh(cfg, tokens)
    assert r.storage_hit_tokens == 0 and r.computed_tokens == 32


def test_a_component_page_stored_under_another_component_is_never_served(tmp_path):
    cfg = config(tmp_path, "both")
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    # Stage 0 holds the sliding layer: put its page 7 where page 6 should be.
    a = part_file(tmp_path, cfg, tokens, 6, "0-0-0", "sliding")
    b = part_file(tmp_path, cfg, tokens, 7, "0-0-0", "sliding")
    a.write_bytes(b.read_bytes())
    f, r = serve_fresh(cfg, tokens)
    assert r.storage_hit_tokens == 0 and r.computed_tokens == 32
    assert f.storage.stats()["refused_key"] >= 1


def test_a_hybrid_prefix_reaches_l3_from_every_node_end_it_was_cached_at(tmp_path):
    # Two prompts share four pages: the shared node's end gets its own
    # components (a branch point), so a third prompt sharing only those pages is
    # served them from L3 by a fresh fabric.
    cfg = config(tmp_path, "both")
    a = pack_tokens(prompt(1, pages=8, shared=4))
    b = pack_tokens(prompt(2, pages=8, shared=4))
    f = fill_l3(cfg, a)
    r = f.serve(b)
    f.core.release(r.lease)
    f.settle()
    c = pack_tokens(prompt(3, pages=8, shared=4))
    _, r = serve_fresh(cfg, c)
    assert r.storage_hit_tokens == 16 and r.computed_tokens == 16
