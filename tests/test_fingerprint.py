"""A checkpoint's fingerprint (``fabric.engines.fingerprint``): it changes with any
byte of any file, a file rewritten in place included, is the same for a copy at
another path, and is read from its cache while the files are unchanged."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from fabric.engines import fingerprint as fp


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFABRIC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def checkpoint(path, weights: bytes = b"\x01" * 4096):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_copy_elsewhere_has_the_fingerprint_of_the_original(tmp_path):
    a = checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert fp.fingerprint(a) == fp.fingerprint(b)
    assert len(fp.fingerprint(a)) == 64


def test_any_byte_of_any_file_changes_it(tmp_path):
    base = fp.fingerprint(checkpoint(tmp_path / "a"))
    weights = bytearray(b"\x01" * 4096)
    weights[2049] ^= 1
    assert fp.fingerprint(checkpoint(tmp_path / "b", bytes(weights))) != base
    c = checkpoint(tmp_path / "c")
    (c / "config.json").write_text(json.dumps({"hidden_size": 9}))
    assert fp.fingerprint(c) != base
    d = checkpoint(tmp_path / "d")
    (d / "extra.safetensors").write_bytes(b"")
    assert fp.fingerprint(d) != base


def test_weights_rewritten_in_place_with_the_same_size_and_time_are_a_new_fingerprint(tmp_path):
    a = checkpoint(tmp_path / "a")
    before = fp.fingerprint(a)
    st = os.stat(a / "model.safetensors")
    with open(a / "model.safetensors", "r+b") as f:  # same size, same mtime set back
        f.write(b"\x02")
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fp.fingerprint(a) != before


def test_an_unchanged_file_is_read_from_the_cache_not_hashed_again(tmp_path, monkeypatch):
    a = checkpoint(tmp_path / "a")
    first = fp.fingerprint(a)
    hashed = []
    monkeypatch.setattr(fp, "_sha256", lambda path: hashed.append(path) or "0" * 64)
    assert fp.fingerprint(a) == first and hashed == []


def test_processes_fingerprinting_one_file_at_once_hash_it_once(tmp_path, monkeypatch):
    a = checkpoint(tmp_path / "a")
    real, calls = fp._sha256, []

    def slow(path):
        calls.append(path)
        threading.Event().wait(0.2)
        return real(path)

    monkeypatch.setattr(fp, "_sha256", slow)
    out: list[str] = []
    threads = [threading.Thread(target=lambda: out.append(fp.fingerprint(a))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1
    assert len(calls) == 2  # each of the two files once (a lock per file)


def test_an_unwritable_cache_still_gives_the_fingerprint(tmp_path, monkeypatch):
    a = checkpoint(tmp_path / "a")
    expected = fp.fingerprint(a)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("KVFABRIC_CACHE_DIR", str(blocked))
    assert fp.fingerprint(a) == expected


def test_a_single_file_checkpoint_and_a_missing_one(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    assert len(fp.fingerprint(gguf)) == 64
    with pytest.raises(FileNotFoundError, match="neither a directory nor a file"):
        fp.fingerprint(tmp_path / "nowhere")
