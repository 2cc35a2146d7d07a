"""L3 through the whole fabric in one process: backups, prefetch under each stop
policy, partial and shard-missing hits, damaged pages, abort, attach/detach."""

from __future__ import annotations

import pytest

from fabric.cache.events import BlockStored
from fabric.cache.keys import TokenKey, namespace_seed, pack_tokens
from fabric.cache.l3_transfers import PrefetchState
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError
from fabric.l3.format import page_key
from fabric.l3.service import storage_provenance
from tests.helpers import FakeClock, prompt, small_config, storage_options

P = 4


def config(tmp_path, *more):
    return small_config(
        *storage_options(tmp_path),
        "prefetch.threshold_tokens=4",
        "storage.transfer_batch_pages=2",
        *more,
    )


def fill_l3(cfg, tokens: bytes) -> None:
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    f.core.release(r.lease)
    f.settle()
    assert f.core.cache.l3.stats.backed_up_tokens == len(tokens) // 4 // P * P


def page_file(tmp_path, tokens: bytes, page: int, suffix: str, namespace: str = "default"):
    h = TokenKey(tokens, P, namespace).page_hashes()[page]
    key = page_key(h, storage_provenance(config(tmp_path)).tag, suffix)
    return tmp_path / "l3" / key[:2] / f"{key}.kv"


def test_a_fresh_fabric_serves_what_an_earlier_one_stored_verified(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 32 and r.computed_tokens == 0
    assert f.verify(r, tokens) == [True] * 4
    f.core.cache.check_integrity()


def test_the_coordinator_hashes_no_page_its_hit_queries_asked_about(tmp_path, monkeypatch):
    """The storage service hashes the pages a hit query asks about and answers with
    the hashes; the coordinator keeps them for its tree, backups and events."""
    import fabric.cache.keys as keys_module
    import fabric.cache.radix as radix_module
    import fabric.coordinator.commands as commands_module

    real, hashed = keys_module.chain_hashes, []

    def counting(prev: bytes, data: bytes, page_bytes: int) -> list[bytes]:
        hashed.append(len(data) // page_bytes)
        return real(prev, data, page_bytes)

    for module in (keys_module, radix_module, commands_module):
        monkeypatch.setattr(module, "chain_hashes", counting)
    cfg = config(tmp_path, "cache.kv_events=true")
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)  # the stored pages' keys are the storage service's hashes
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 32 and f.verify(r, tokens) == [True] * 4
    assert hashed == []
    stored = [e for e in f.core.events.take() if isinstance(e, BlockStored)]
    assert stored and all(
        e.page_hashes == tuple(real(e.parent_hash or namespace_seed("default"), e.tokens, 4 * P))
        for e in stored
    ), "events carry the chain hashes"
    monkeypatch.undo()
    f.core.cache.check_integrity()


def test_a_hit_answer_for_other_pages_is_refused_and_the_request_computes(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    real = f.storage.answer

    def for_other_pages(prev: bytes, tokens: bytes, batch_pages: int = 128):
        hits, hashes = real(prev, tokens, batch_pages)
        return hits, [*hashes[:-1], bytes(32)]  # the last page's hash is not its own

    f.storage.answer = for_other_pages
    r = f.serve(tokens)
    assert r.error is None and r.storage_hit_tokens == 0 and r.computed_tokens == 32
    assert f.verify(r, tokens) == [True] * 4
    assert figures(f.core).l3_transfers.bad_answers == 1
    f.storage.answer = real
    f.core.release(r.lease)
    f.settle()
    f.core.cache.check_integrity()


def test_partial_hit_takes_the_stored_prefix_and_computes_the_rest(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, pack_tokens(prompt(1, pages=4)))
    longer = pack_tokens(prompt(1, pages=8))
    f = LocalFabric(cfg)
    r = f.serve(longer)
    assert (r.storage_hit_tokens, r.computed_tokens) == (16, 16)
    assert f.verify(r, longer) == [True] * 4


def test_one_ranks_missing_shard_limits_the_hit_for_all(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    page_file(tmp_path, tokens, 3, "1-0-1").unlink()  # pp1, cp0, tp1: one rank's shard
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 12, "MIN over shards: pages 0-2"
    assert f.verify(r, tokens) == [True] * 4


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_pages_are_misses_and_never_served(tmp_path, damage):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    path = page_file(tmp_path, tokens, 2, "0-0-0")
    blob = path.read_bytes()
    path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]) if damage == "corrupt" else blob[:-9])
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 8 and r.computed_tokens == 24
    assert f.verify(r, tokens) == [True] * 4
    reason = "refused_checksum" if damage == "corrupt" else "refused_truncated"
    assert f.storage.stats()[reason] == 1


def test_a_page_lost_mid_transfer_ends_the_prefetch_at_the_min_prefix(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    rid = f.core.submit(tokens)
    f.step()  # hit query answered: 8 pages on every shard
    (op,) = f.core.cache.l3.by_op.values()
    assert op.state is PrefetchState.LOADING and len(op.host_pages) == 8
    page_file(tmp_path, tokens, 5, "0-0-1").unlink()
    for _ in range(6):
        f.step()
    r = f.results[rid]
    assert r.storage_hit_tokens == 20, "one rank stopped after page 4: MIN wins"
    assert f.verify(r, tokens) == [True] * 4
    f.settle()
    assert not f.core.cache.l3.by_op and f.core.cache.l3.inflight_tokens == 0
    f.core.cache.check_integrity()


def test_abort_mid_prefetch_inserts_nothing_and_frees_host_pages(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    rid = f.core.submit(tokens)
    f.step()
    assert f.core.abort(rid).error == "aborted"
    f.settle()
    assert f.core.cache.tree.walk() == []
    assert f.core.cache.host_sizes().free == f.config.cache.host_tokens
    f.core.cache.check_integrity()


def test_wait_complete_waits_for_every_page(tmp_path):
    cfg = config(tmp_path, "prefetch.stop_policy=wait_complete")
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    rid = f.core.submit(tokens)
    f.step()
    for _ in range(3):
        f.step(run_ranks=False)  # ranks make no progress: the request waits
    assert rid not in f.results and rid in f.core.scheduler.prefetching
    for _ in range(5):
        f.step()
    assert f.results[rid].storage_hit_tokens == 32


def test_timeout_gives_up_waiting_and_computes(tmp_path):
    clock = FakeClock()
    cfg = config(
        tmp_path,
        "prefetch.stop_policy=timeout",
        "prefetch.timeout_base_s=1",
        "prefetch.timeout_per_ki_token_s=0",
        "prefetch.timeout_max_s=5",
    )
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg, clock=clock)
    rid = f.core.submit(tokens)
    f.step()
    f.step(run_ranks=False)
    assert rid in f.core.scheduler.prefetching
    clock.advance(1.5)
    for _ in range(4):
        f.step(run_ranks=False)
    assert rid not in f.core.scheduler.prefetching, "timed out"
    for _ in range(4):
        f.step()
    r = f.results[rid]
    assert r.storage_hit_tokens == 0 and r.computed_tokens == 32
    f.settle()
    f.core.cache.check_integrity()


def test_best_effort_takes_what_arrived_after_one_report(tmp_path):
    cfg = config(tmp_path, "prefetch.stop_policy=best_effort")
    tokens = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 32, "in one process every page arrives within the report"


def test_attach_detach_clear_at_runtime(tmp_path):
    cfg = config(tmp_path)
    tokens = pack_tokens(prompt(1, pages=4))
    fill_l3(cfg, tokens)
    f = LocalFabric(cfg)
    name, extra = f.storage.spec
    assert f.storage.attach(name, extra) == "already attached"
    with pytest.raises(ConfigError, match="detach it before attaching 'dynamic'"):
        f.storage.attach("dynamic", {"module": "tests.l3.memory_backend", "class": "MemoryBackend"})
    f.core.storage_begin_detach()
    f.settle()
    assert f.core.storage_drained() and f.storage.detach()
    r = f.serve(tokens)
    assert r.storage_hit_tokens == 0, "detached: no L3"
    f.core.release(r.lease)
    assert f.storage.attach(name, extra) == "attached"
    f.core.storage_attached()
    g = LocalFabric(cfg, storage=f.storage)
    assert g.serve(tokens).storage_hit_tokens == 16
    assert f.storage.clear()
    h = LocalFabric(cfg, storage=f.storage)
    assert h.serve(tokens).storage_hit_tokens == 0


def test_size_cap_evicts_old_pages_from_l3(tmp_path):
    cfg = config(tmp_path, "storage.max_bytes=20000")
    for seed in range(4):
        fill_l3(cfg, pack_tokens(prompt(seed, pages=6)))
    stats = LocalFabric(cfg).storage.stats()
    assert stats["bytes"] <= 20000
    assert 0 < stats["pages"] < 4 * 6 * 4
