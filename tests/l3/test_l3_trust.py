"""L3 never serves a page under a key it was not stored for, and its backends
keep tenants' pages private: pages swapped, linked or copied across pages,
shards, tenants and models are counted misses; files are owner-only; links,
stale temp files, bad paths and foreign modules are handled."""

from __future__ import annotations

import os
import stat
import sys
import time

import numpy as np
import pytest

from fabric.cache.keys import pack_tokens
from fabric.config import StorageConfig
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError
from fabric.l3 import make_backend
from fabric.l3.file import STALE_TMP_S, FileBackend
from fabric.l3.service import StorageService, backend_spec
from tests.helpers import PAGE_BYTES, PROV, keys, pages, prompt

from .test_storage_fabric import config, fill_l3, page_file

TOKENS = pack_tokens(prompt(1, pages=8))


def serve_checked(cfg, tokens=TOKENS, namespace="default"):
    """Serve ``tokens`` on a fresh fabric: every served page must verify."""
    f = LocalFabric(cfg)
    rid = f.core.submit(tokens, namespace)
    for _ in range(50):
        f.step()
        if rid in f.results:
            break
    r = f.results.pop(rid)
    assert r.error is None
    assert f.verify(r, tokens) == [True] * 4
    return r, f.storage.stats()


def swap(a, b):
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_two_pages_of_one_prompt_swapped_are_never_served(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    swap(page_file(tmp_path, TOKENS, 2, "0-0-0"), page_file(tmp_path, TOKENS, 5, "0-0-0"))
    r, stats = serve_checked(cfg)
    assert r.storage_hit_tokens == 8, "pages 0-1 only: page 2 holds page 5's KV"
    assert stats["refused_key"] >= 1


def test_two_tp_shards_swapped_are_never_served(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    swap(page_file(tmp_path, TOKENS, 3, "1-0-0"), page_file(tmp_path, TOKENS, 3, "1-0-1"))
    r, stats = serve_checked(cfg)
    assert r.storage_hit_tokens == 12
    assert stats["refused_key"] >= 1


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_page_linked_to_another_is_never_served(tmp_path, link):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    target, victim = (
        page_file(tmp_path, TOKENS, 6, "0-0-1"),
        page_file(tmp_path, TOKENS, 1, "0-0-1"),
    )
    victim.unlink()
    if link == "symlink":
        victim.symlink_to(target)
    else:
        os.link(target, victim)
    r, stats = serve_checked(cfg)
    assert r.storage_hit_tokens == 4
    assert stats["refused_symlink" if link == "symlink" else "refused_key"] >= 1


def test_another_tenants_page_copied_over_a_key_is_never_served(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    f = LocalFabric(cfg)
    r = f.serve(TOKENS, namespace="tenant-b")
    f.core.release(r.lease)
    f.settle()
    theirs = page_file(tmp_path, TOKENS, 0, "0-0-0", namespace="tenant-b")
    mine = page_file(tmp_path, TOKENS, 0, "0-0-0")
    mine.write_bytes(theirs.read_bytes())
    r, stats = serve_checked(cfg)
    assert r.storage_hit_tokens == 0 and r.computed_tokens == 32
    assert stats["refused_key"] >= 1


def test_two_models_share_one_l3_without_touching_each_others_pages(tmp_path):
    one, two = config(tmp_path, "model.model_id=model-one"), config(tmp_path, "model.model_id=m2")
    fill_l3(one, TOKENS)
    fill_l3(two, TOKENS)
    for cfg in (one, two):
        r, stats = serve_checked(cfg)
        assert r.storage_hit_tokens == 32 and stats.get("refused_provenance", 0) == 0
    assert len(list((tmp_path / "l3").rglob("*.kv"))) == 2 * 8 * 4


def test_files_and_directories_are_owner_only_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        b = FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "l3")})
        b.set(keys(2), pages(2))
        shared = FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "l3g"), "file_mode": "0640"})
        shared.set(keys(1), pages(1))
    finally:
        os.umask(old)
    for path in (tmp_path / "l3").rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    (page,) = (tmp_path / "l3g").rglob("*.kv")
    assert stat.S_IMODE(page.stat().st_mode) == 0o640


def test_a_subdirectory_replaced_by_a_link_is_not_followed(tmp_path):
    root = tmp_path / "l3"
    FileBackend(PROV, PAGE_BYTES, {"path": str(root)}).set(keys(1), pages(1))
    elsewhere = tmp_path / "elsewhere"
    (root / "00").rename(elsewhere)
    (root / "00").symlink_to(elsewhere)
    b = FileBackend(PROV, PAGE_BYTES, {"path": str(root)})
    out = np.zeros((1, PAGE_BYTES), dtype=np.uint8)
    assert b.exists(keys(1)) == 0 and b.get(keys(1), out) == 0
    assert b.set(keys(1), pages(1)) == [False]
    assert b.stats()["refused_symlink"] >= 1
    assert len(list(elsewhere.iterdir())) == 1, "nothing written through the link"


def test_stale_temp_files_are_swept_when_the_store_opens(tmp_path):
    root = tmp_path / "l3"
    FileBackend(PROV, PAGE_BYTES, {"path": str(root)}).set(keys(1), pages(1))
    stale, fresh = root / "00" / ".crashed.tmp", root / "00" / ".writing.tmp"
    stale.write_bytes(b"half a page")
    fresh.write_bytes(b"in progress")
    past = time.time() - STALE_TMP_S - 5
    os.utime(stale, (past, past))
    b = FileBackend(PROV, PAGE_BYTES, {"path": str(root)})
    assert not stale.exists() and fresh.exists()
    assert b.stats()["swept_temp_files"] == 1 and b.stats()["pages"] == 1


def test_an_unusable_path_is_a_config_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for path in (blocker, blocker / "l3"):
        with pytest.raises(ConfigError, match=f"storage path '{path}' cannot be used"):
            make_backend("file", PROV, PAGE_BYTES, {"path": str(path)})
    with pytest.raises(ConfigError, match="file_mode='rw'"):
        make_backend("file", PROV, PAGE_BYTES, {"path": str(tmp_path), "file_mode": "rw"})


def test_the_default_l3_has_a_size_cap():
    name, extra = backend_spec(StorageConfig())
    assert name == "segment" and extra["max_bytes"] == StorageConfig().max_bytes == 1 << 30


def test_the_dynamic_backend_imports_only_modules_the_launch_config_allows(tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "kvfabric_evil_backend.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = config(tmp_path, "storage.backend=none")
        service = StorageService(cfg)
        with pytest.raises(ConfigError, match="'kvfabric_evil_backend' is not allowed"):
            service.attach("dynamic", {"module": "kvfabric_evil_backend", "class": "B"})
        assert not marker.exists() and "kvfabric_evil_backend" not in sys.modules
        allowed = StorageService(
            config(
                tmp_path,
                "storage.backend=none",
                "storage.dynamic_modules=tests.l3.memory_backend",
            )
        )
        spec = {"module": "tests.l3.memory_backend", "class": "MemoryBackend"}
        assert allowed.attach("dynamic", spec) == "attached"
    finally:
        sys.path.remove(str(tmp_path))


def _finishes(fn, seconds: float = 20.0):
    """Run ``fn`` on a thread: its result, or a failure if it is still blocked
    after ``seconds`` (what a FIFO opened without O_NONBLOCK does: for ever)."""
    import threading

    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked on something in the store"
    return out.get("v")


def test_a_page_file_replaced_by_a_fifo_is_a_refused_miss_and_never_blocks(tmp_path):
    cfg = config(tmp_path)
    fill_l3(cfg, TOKENS)
    victim = page_file(tmp_path, TOKENS, 2, "0-0-1")
    victim.unlink()
    os.mkfifo(victim, 0o600)
    r, _ = _finishes(lambda: serve_checked(cfg))
    assert r.storage_hit_tokens == 8, "pages 0-1 only"
    # The hit query already skips it (not a regular file); a read that races the
    # swap is refused too:
    backend = FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "fifo-store")})
    backend.set(keys(1), pages(1))
    (key,) = keys(1)
    path = tmp_path / "fifo-store" / key[:2] / f"{key}.kv"
    path.unlink()
    os.mkfifo(path, 0o600)
    out = np.zeros((1, PAGE_BYTES), np.uint8)
    assert _finishes(lambda: backend.get(keys(1), out)) == 0
    assert _finishes(lambda: backend._read(key)) is None
    assert backend.stats()["refused_not_regular"] >= 1


@pytest.mark.parametrize("when", ["at open", "while open"])
def test_a_fifo_named_like_a_segment_never_stalls_the_segment_store(tmp_path, when):
    from fabric.l3.segment import SegmentBackend

    root = tmp_path / "seg"
    root.mkdir()
    if when == "at open":
        os.mkfifo(root / "seg-planted.kvs", 0o600)
    store = _finishes(lambda: SegmentBackend(PROV, PAGE_BYTES, {"path": str(root)}))
    store.set(keys(3), pages(3))
    if when == "while open":
        os.mkfifo(root / "seg-planted.kvs", 0o600)
        time.sleep(1.1)  # past the rescan interval: a miss rescans the directory
    other = keys(4)[3:]
    assert _finishes(lambda: store.exists(other)) == 0  # a miss: rescans, skips the FIFO
    assert _finishes(lambda: store.exists(keys(3))) == 3
    out = np.zeros((3, PAGE_BYTES), np.uint8)
    assert _finishes(lambda: store.get(keys(3), out)) == 3
    assert store.stats()["refused_not_regular"] == 1, "counted (and logged) once"
    store.close()


def _forge_key(path, new_key: str) -> None:
    """Rewrite a page file's header to claim ``new_key``, CRC recomputed: what
    anyone who can write the store can do without a secret."""
    import msgpack

    from fabric.l3.format import MAGIC, PREAMBLE, header_length

    blob = path.read_bytes()
    n = header_length(blob[:PREAMBLE])
    header = msgpack.unpackb(blob[PREAMBLE : PREAMBLE + n], raw=False)
    header["key"] = new_key
    packed = msgpack.packb(header, use_bin_type=True)
    path.write_bytes(MAGIC + len(packed).to_bytes(4, "little") + packed + blob[PREAMBLE + n :])


@pytest.mark.parametrize("backend_name", ["file", "segment"])
def test_with_a_secret_a_forged_or_untagged_page_is_refused(tmp_path, backend_name):
    """Without a secret, a header rewritten to claim another key (CRC recomputed)
    is served: the store's writers are trusted. With ``storage.auth_key_file``,
    pages carry a keyed tag: a forged page, an untagged one and one tagged with
    another secret are all ``refused_auth`` misses; the genuine ones are served."""
    from fabric.l3.auth import PageAuth

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    auth = PageAuth.from_file(str(secret))
    root = tmp_path / backend_name
    plain = make_backend(backend_name, PROV, PAGE_BYTES, {"path": str(root / "plain")})
    signed = make_backend(backend_name, PROV, PAGE_BYTES, {"path": str(root / "signed")})
    signed.auth = auth
    data = pages(3)
    out = np.zeros((3, PAGE_BYTES), np.uint8)
    assert signed.set(keys(3), data) == [True] * 3
    assert signed.get(keys(3), out) == 3 and np.array_equal(out, data)
    # A flipped payload byte is corruption, counted as such (the tag is checked
    # first; the checksum names why it failed).
    last = (
        next((root / "signed").glob("seg-*.kvs"))
        if backend_name == "segment"
        else root / "signed" / keys(3)[2][:2] / f"{keys(3)[2]}.kv"
    )
    blob = bytearray(last.read_bytes())
    blob[-1] ^= 1
    last.write_bytes(bytes(blob))
    damaged = make_backend(backend_name, PROV, PAGE_BYTES, {"path": str(root / "signed")})
    damaged.auth = auth
    assert damaged.get(keys(3), out) == 2 and damaged.stats()["refused_checksum"] == 1
    assert "refused_auth" not in damaged.stats()
    blob[-1] ^= 1
    last.write_bytes(bytes(blob))
    # Untagged pages (written without the secret) are refused by a reader with it.
    plain.set(keys(3), data)
    plain.auth = auth
    assert plain.get(keys(3), out) == 0 and plain.stats()["refused_auth"] == 1
    # Another secret's tags are refused too.
    other = PageAuth(os.urandom(32))
    stranger = make_backend(backend_name, PROV, PAGE_BYTES, {"path": str(root / "signed")})
    stranger.auth = other
    assert stranger.get(keys(3), out) == 0 and stranger.stats()["refused_auth"] == 1
    if backend_name == "file":  # the forgery: page 0's bytes claiming page 1's key
        victim = root / "signed" / keys(2)[1][:2] / f"{keys(2)[1]}.kv"
        source = root / "signed" / keys(1)[0][:2] / f"{keys(1)[0]}.kv"
        victim.write_bytes(source.read_bytes())
        _forge_key(victim, keys(2)[1])
        reader = make_backend("file", PROV, PAGE_BYTES, {"path": str(root / "signed")})
        assert reader.get(keys(2)[1:], out[:1]) == 1, "without a secret the forgery is served"
        reader.auth = auth
        assert reader.get(keys(2)[1:], out[:1]) == 0 and reader.stats()["refused_auth"] == 1


def test_a_secret_that_cannot_be_used_is_one_line_naming_the_setting(tmp_path):
    from fabric.l3.auth import PageAuth

    with pytest.raises(ConfigError, match=r"storage.auth_key_file='.*nope' cannot be read"):
        PageAuth.from_file(str(tmp_path / "nope"))
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="3 bytes is refused: allowed is 16 bytes or more"):
        PageAuth.from_file(str(short))
    cfg = config(tmp_path, f"storage.auth_key_file={short}")
    with pytest.raises(ConfigError, match="storage.auth_key_file"):
        StorageService(cfg)


def test_an_authenticated_fabric_serves_its_own_l3_pages_verified(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    cfg = config(tmp_path, f"storage.auth_key_file={secret}")
    fill_l3(cfg, TOKENS)
    r, stats = serve_checked(cfg)
    assert r.storage_hit_tokens == 32 and "refused_auth" not in stats
    other = tmp_path / "other"
    other.write_bytes(os.urandom(32))
    r, stats = serve_checked(config(tmp_path, f"storage.auth_key_file={other}"))
    assert r.storage_hit_tokens == 0 and stats["refused_auth"] >= 1
