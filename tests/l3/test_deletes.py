"""Deleting pages the fabric's tree evicted (``L3Backend.delete``): gone for the
deleting process at once and for every other process once it scans again; a copy
stored after the deletion stays; a segment whose every record is dead is removed
once no writer appends to it, and its disk freed."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from fabric.engines.store import DirectStore, StoreOptions
from fabric.l3 import segment
from fabric.l3.format import Provenance, page_key

PROV = Provenance("m", "layer_first", "uint8", (64,), 1)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 64), dtype=np.uint8)


def keys(n: int, first: int = 0) -> list[str]:
    return [
        page_key(i.to_bytes(32, "big"), "0123456789abcdef", "0-0-0")
        for i in range(first, first + n)
    ]


def store(tmp_path, backend: str) -> DirectStore:
    return DirectStore(
        StoreOptions(path=str(tmp_path), backend=backend, max_bytes=0, write_threads=1), "vllm"
    )


def loaded(s: DirectStore, ks: list[str]) -> list[bool]:
    out = np.empty((1, 64), dtype=np.uint8)
    return [s.backend.get_fresh([k], out, PROV) == 1 for k in ks]


@pytest.mark.parametrize("backend", ["segment", "file"])
def test_a_deleted_page_is_gone_here_at_once_and_elsewhere_after_a_rescan(tmp_path, backend):
    a, b = store(tmp_path, backend), store(tmp_path, backend)
    ks = keys(6)
    assert a.store(ks, rows(6), PROV) == [True] * 6
    assert loaded(b, ks) == [True] * 6  # b has indexed them
    assert a.delete(ks[:2] + keys(1, first=99)) == 2
    assert loaded(a, ks) == [False, False, True, True, True, True]
    b.backend.refresh()
    assert loaded(b, ks) == [False, False, True, True, True, True]
    assert a.stats()["deleted_pages"] == 2
    # Stored again after the deletion: the new copy stays, for both.
    a.store(ks[:1], rows(1, seed=1), PROV)
    b.backend.refresh()
    assert loaded(a, ks[:1]) == [True] and loaded(b, ks[:1]) == [True]
    a.close()
    b.close()


def test_a_deletion_scanned_before_the_record_it_names_still_holds(tmp_path):
    a, b = store(tmp_path, "segment"), store(tmp_path, "segment")
    ks = keys(3)
    a.store(ks, rows(3), PROV)
    b.delete(ks[:1])  # b has not seen the page: it deletes nothing
    assert loaded(a, ks[:1]) == [True]
    b.backend.refresh()  # now it has
    assert b.delete(ks[:1]) == 1
    c = store(tmp_path, "segment")  # scans b's tombstone and a's record, in name order
    assert loaded(c, ks) == [False, True, True]
    for s in (a, b, c):
        s.close()


def test_a_segment_whose_records_all_died_is_removed_once_nobody_appends(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "SEAL_S", 0.05)
    monkeypatch.setattr(segment, "REAP_S", 0.0)
    a, b = store(tmp_path, "segment"), store(tmp_path, "segment")
    ks = keys(4)
    a.store(ks, rows(4), PROV)
    first = {n for n in os.listdir(tmp_path) if n.endswith(".kvs")}
    b.backend.refresh()
    b.delete(ks)
    a.backend.refresh()
    a.backend._reap()
    assert first <= set(os.listdir(tmp_path)), "not while its writer may append to it"
    # Sealed: a's last append longer ago than SEAL_S, the file untouched for twice
    # as long (its mtime set back rather than waited for).
    time.sleep(0.1)
    _sealed(tmp_path)
    a.backend.refresh()
    a.backend._reap()
    left = {n for n in os.listdir(tmp_path) if n.endswith(".kvs")}
    assert not first & left, "the dead segment went"
    assert a.backend.stats()["deleted_segments"] >= 1
    # A writer never appends to a segment left alone past SEAL_S: a new one is made.
    a.store(keys(1, first=50), rows(1), PROV)
    assert loaded(a, keys(1, first=50)) == [True]
    a.close()
    b.close()


def test_a_store_that_cannot_delete_deletes_nothing_and_says_so(tmp_path, caplog):
    s = store(tmp_path, "segment")
    s.backend.delete = lambda ks: (_ for _ in ()).throw(NotImplementedError("no deletes"))
    assert s.delete(keys(2)) == 0
    assert s.stats()["errors"] == 1 and "no deletes" in caplog.text
    s.close()


def _sealed(tmp_path) -> None:
    """Every segment untouched for longer than twice SEAL_S (its mtime set back)."""
    for name in os.listdir(tmp_path):
        if name.endswith(".kvs"):
            os.utime(tmp_path / name, (1, 1))


def test_two_copies_of_a_key_keep_both_segments_whichever_each_process_takes(tmp_path, monkeypatch):
    """Which copy of a key is newer is only a process's scan order: a copy another
    process took over is not dead, so neither segment goes."""
    monkeypatch.setattr(segment, "SEAL_S", 0.05)
    monkeypatch.setattr(segment, "REAP_S", 0.0)
    a, b = store(tmp_path, "segment"), store(tmp_path, "segment")
    k = keys(1)
    a.store(k, rows(1), PROV)
    b.store(k, rows(1), PROV)
    a.backend.refresh()
    b.backend.refresh()
    time.sleep(0.1)
    _sealed(tmp_path)
    a.backend._reap()
    b.backend._reap()
    fresh = store(tmp_path, "segment")
    assert loaded(a, k) == loaded(b, k) == loaded(fresh, k) == [True]
    for s in (a, b, fresh):
        s.close()


def test_a_segment_another_process_wrote_to_since_it_was_read_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "SEAL_S", 0.05)
    monkeypatch.setattr(segment, "REAP_S", 0.0)
    a, b = store(tmp_path, "segment"), store(tmp_path, "segment")
    k1, k2 = keys(1), keys(1, first=1)
    a.store(k1, rows(1), PROV)
    b.backend.refresh()
    a.delete(k1)
    b.backend.refresh()  # b: the segment's one record is dead
    monkeypatch.setattr(segment, "SEAL_S", 60.0)  # a appends to the same segment again
    a.store(k2, rows(1), PROV)
    monkeypatch.setattr(segment, "SEAL_S", 0.05)
    _sealed(tmp_path)
    b.backend._reap()  # b has not read k2's record: it keeps the segment
    assert loaded(a, k2) == [True] and loaded(store(tmp_path, "segment"), k2) == [True]
    a.close()
    b.close()


def test_a_delete_of_a_page_another_process_stored_since_the_last_scan_finds_it(tmp_path):
    a, b = store(tmp_path, "segment"), store(tmp_path, "segment")
    k = keys(2)
    a.store(k, rows(2), PROV)
    time.sleep(segment.RESCAN_S)
    assert b.delete(k) == 2  # b looked again before calling them absent
    a.backend.refresh()
    assert loaded(a, k) == [False, False]
    a.close()
    b.close()
