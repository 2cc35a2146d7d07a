"""L3 through real actors: persistence across fabrics, runtime attach/detach/clear,
bad backend configs, and a storage actor killed mid-prefetch and mid-backup."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from fabric.errors import ConfigError  # noqa: E402
from tests.helpers import (  # noqa: E402
    prompt,
    small_config,
    wait_for,
)
from tests.ray_session import shared_ray  # noqa: E402

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py

NS = "kvfabric-storage-tests"


@pytest.fixture(scope="module")
def ray_session():
    shared_ray()
    yield


RANKS = 2  # TP=2 without PP: L3 is per shard either way, and each launch starts fewer ranks


def make(tmp_path, name, *more):
    return launch(
        small_config(
            "topology.pp=1",
            f"runtime.name={name}",
            f"runtime.ray_namespace={NS}",
            "storage.backend=file",
            f"storage.path={tmp_path / 'l3'}",
            "prefetch.threshold_tokens=4",
            "storage.transfer_batch_pages=2",
            *more,
        )
    )


HYBRID = (
    "model.layers=4",
    "model.layer_kinds=[full, sliding, full, mamba]",
    "model.sliding_window=6",
    "model.mamba_state_bytes=64",
)


@pytest.mark.parametrize("model", [(), HYBRID], ids=["full", "hybrid"])
def test_a_fresh_fabric_on_the_same_l3_serves_verified_pages(ray_session, tmp_path, model):
    # A hybrid model's sliding pages and mamba states travel through the
    # storage actor too, and every rank verifies them after the prefetch.
    tokens = prompt(1, pages=8)
    first = make(tmp_path, "persist-a", *model)
    try:
        r = first.submit(tokens, timeout=60)
        first.release(r.lease)
        assert first.settle(30)
        assert first.stats()["l3_transfers"]["backed_up_tokens"] == 32
    finally:
        first.shutdown()
    second = make(tmp_path, "persist-b", *model)
    try:
        r = second.submit(tokens, timeout=60)
        assert r.storage_hit_tokens == 32 and r.computed_tokens == 0
        assert second.verify(r, tokens) == [True] * RANKS
        second.release(r.lease)
        second.check_integrity()
        # The ranks read the pages from the L3 directory themselves (storage.direct_reads):
        # the storage actor said where they lie and counted them (sent without waiting).
        assert wait_for(lambda: second.stats()["l3"].get("direct_pages", 0) >= 8 * RANKS, 10), (
            second.stats()["l3"]
        )
    finally:
        second.shutdown()


def test_attach_detach_clear_and_bad_configs_at_runtime(ray_session, tmp_path):
    f = make(tmp_path, "attach", "storage.backend=none")
    try:
        tokens = prompt(2, pages=4)
        assert f.stats()["l3"]["attached"] is False
        with pytest.raises(ConfigError, match="are not JSON"):
            f.attach_storage("file", "{not json")
        with pytest.raises(ConfigError, match=r"key 'bogus' is unknown for backend 'file'"):
            f.attach_storage("file", '{"bogus": 1}')
        with pytest.raises(ConfigError, match="storage.backend='tape'"):
            f.attach_storage("tape")
        extra = f'{{"path": "{tmp_path / "l3"}"}}'
        assert f.attach_storage("file", extra) == "attached"
        assert f.attach_storage("file", extra) == "already attached"
        with pytest.raises(ConfigError, match="detach it before"):
            f.attach_storage(
                "dynamic", '{"module": "tests.l3.memory_backend", "class": "MemoryBackend"}'
            )
        f.release(f.submit(tokens, timeout=60).lease)
        assert f.settle(30)
        assert f.stats()["l3"]["pages"] == 4 * RANKS
        assert f.clear_storage()
        assert f.stats()["l3"]["pages"] == 0
        assert f.detach_storage(30)
        assert f.stats()["l3"]["attached"] is False
        r = f.submit(prompt(3, pages=4), timeout=60)
        assert r.error is None and f.verify(r, prompt(3, pages=4)) == [True] * RANKS
        f.release(r.lease)
        f.check_integrity()
    finally:
        f.shutdown()


def test_storage_actor_killed_mid_backup_and_mid_prefetch(ray_session, tmp_path):
    f = make(tmp_path, "chaos")
    try:
        storage = f._deployment.storage
        # Mid-backup: every batch is held until the actor dies under it.
        ray.get(storage.set_faults.remote(hold=True))
        r = f.submit(prompt(4, pages=6), timeout=60)
        f.release(r.lease)
        # Kill only once a rank's backup is really inside the storage actor.
        assert wait_for(lambda: ray.get(storage.holding.remote()) > 0, 30)
        ray.kill(storage, no_restart=False)
        assert f.settle(60), "failed backups are acked; nothing stays pending"
        s = f.stats()
        assert s["now"]["inflight"]["host_to_storage"] == 0, s
        assert s["l3_transfers"]["failed_backups"] >= 1, s
        f.check_integrity()

        # Store a prompt for real, then kill the actor while a fresh request prefetches it.
        assert wait_for(lambda: "error" not in f.stats()["l3"], 60)
        tokens = prompt(5, pages=8)
        f.release(f.submit(tokens, timeout=60).lease)
        assert f.settle(60)
        g = make(tmp_path, "chaos-2")
        try:
            ray.get(g._deployment.storage.set_faults.remote(hold=True))
            ref = g.submit_async(tokens)
            assert wait_for(lambda: ray.get(g._deployment.storage.holding.remote()) > 0, 30)
            ray.kill(g._deployment.storage, no_restart=False)
            r = g.result(ref, timeout=120)
            assert r.error is None and r.storage_hit_tokens < 32
            assert g.verify(r, tokens) == [True] * RANKS
            g.release(r.lease)
            assert g.settle(60)
            assert g.stats()["now"]["inflight"]["storage_to_host"] == 0
            g.check_integrity()
        finally:
            g.shutdown()
        assert len(list((tmp_path / "l3").rglob("*.kv"))) >= 8 * RANKS, "L3 files are intact"
    finally:
        f.shutdown()


def test_a_restarted_storage_actor_keeps_a_backend_attached_at_runtime(ray_session, tmp_path):
    f = make(tmp_path, "restore", "storage.backend=none")
    try:
        l3 = tmp_path / "runtime-l3"
        assert f.attach_storage("file", f'{{"path": "{l3}"}}') == "attached"
        ray.kill(f._deployment.storage, no_restart=False)
        assert wait_for(lambda: f.stats()["l3"].get("attached") is True, 60)
        assert f.stats()["now"]["l3_attached"] is True
        tokens = prompt(6, pages=4)
        f.release(f.submit(tokens, timeout=60).lease)
        assert f.settle(60)
        s = f.stats()
        assert (
            s["l3_transfers"]["failed_backups"] == 0 and s["l3_transfers"]["backed_up_tokens"] == 16
        )
        assert len(list(l3.rglob("*.kv"))) == 4 * RANKS, (
            "the runtime backend, not the launch config's"
        )
    finally:
        f.shutdown()


@pytest.mark.parametrize("backend", ["segment", "file"])
def test_fifos_and_device_links_in_a_live_fabric_s_l3_stall_nothing(ray_session, tmp_path, backend):
    """Things planted in a running fabric's L3 directory — a FIFO named like a
    segment, a page file replaced by a FIFO, a link to a device — are refused
    misses: every request finishes, and what L3 still holds is served from it."""
    import os

    from fabric.cache.keys import TokenKey
    from fabric.l3.format import page_key
    from fabric.l3.service import storage_provenance

    name = f"fifo-{backend}"
    tokens = prompt(3, pages=8)
    first = make(tmp_path, name + "-a", f"storage.backend={backend}")
    try:
        r = first.submit(tokens, timeout=60)
        first.release(r.lease)
        assert first.settle(30)
    finally:
        first.shutdown()
    l3 = tmp_path / "l3"
    os.mkfifo(l3 / "seg-planted-fifo.kvs", 0o600)
    os.symlink("/dev/zero", l3 / "seg-planted-link.kvs")
    if backend == "file":  # the third page's shard on rank 0-0-0 becomes a FIFO
        cfg = small_config("topology.pp=1", "storage.backend=file")
        h = TokenKey(tokens, cfg.cache.page_size).page_hashes()[2]
        key = page_key(h, storage_provenance(cfg).tag, "0-0-0")
        page = l3 / key[:2] / f"{key}.kv"
        page.unlink()
        os.mkfifo(page, 0o600)
    second = make(tmp_path, name + "-b", f"storage.backend={backend}")
    try:
        r = second.submit(tokens, timeout=60)  # would wait for ever on a FIFO
        assert r.error is None
        assert r.storage_hit_tokens == (8 if backend == "file" else 32), r
        assert second.verify(r, tokens) == [True] * RANKS
        second.release(r.lease)
        other = second.submit(prompt(4, pages=4), timeout=60)
        assert other.error is None
        second.release(other.lease)
    finally:
        second.shutdown()
