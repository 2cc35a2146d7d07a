"""A rank's own L3 read (``fabric.l3.direct``) is as strict as the storage actor's
(``L3Backend.get``): both paths are fed the same damaged stores — every kind of
damage, on both file backends, plain and authenticated pages (both MACs) — and
must serve the same pages, refuse the same page for the same reason, and count
it the same way."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fabric.l3 import direct as direct_module
from fabric.l3 import run_reads, segment
from fabric.l3.direct import DirectReads
from fabric.l3.format import PREAMBLE, header_length
from fabric.l3.service import StorageService, page_geometry

from .test_storage_fabric import config

SUFFIX = "0-0-0"
PAGES = 6
HASHES = [bytes([i + 1]) * 32 for i in range(PAGES)]


# Plain pages; authenticated ones of 128 bytes (an AES-GCM tag) and of 64 KiB
# (AEGIS-128X4, ``fabric.l3.auth.AEGIS_FROM``).
TAGS = {
    "plain": [],
    "gcm": ["storage.auth_key_file={secret}"],
    "aegis": ["storage.auth_key_file={secret}", "model.head_dim=4096"],
}


def store(tmp_path, backend: str, tags: str = "plain"):
    secret = tmp_path / "secret"
    secret.write_bytes(b"a secret of the store's writers")
    more = [o.format(secret=secret) for o in TAGS[tags]]
    cfg = config(tmp_path, f"storage.backend={backend}", *more)
    service = StorageService(cfg)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (PAGES, page_geometry(cfg)[1]), dtype=np.uint8)
    assert service.store(SUFFIX, HASHES, data)
    return cfg, service, data


def record(service, page: int):
    """(file, offset of the record's header, header bytes, payload bytes) of ``page``."""
    (loc,) = service.locate(SUFFIX, [HASHES[page]])[1]
    path = service.backend.root / loc.file
    if loc.head > 0:  # a segment's record
        return path, loc.offset, loc.head, loc.payload
    data = path.read_bytes()  # a page file: its preamble says how long its header is
    head = PREAMBLE + header_length(data[:PREAMBLE])
    return path, 0, head, len(data) - head


def flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


# Each damages page 2 (or the store around it) in its own way.
def payload_bit(service):
    path, offset, head, _ = record(service, 2)
    flip(path, offset + head + 5)


def header_bit(service):
    path, offset, head, _ = record(service, 2)
    flip(path, offset + head - 3)


def trailing_bytes(service):
    path, offset, head, payload = record(service, 2)
    if service.backend.name == "file":
        with open(path, "ab") as f:
            f.write(b"\0" * 16)  # a page file longer than its record
    else:
        os.truncate(path, offset + head + payload // 2)  # a segment cut inside it


def cut_inside(service):
    path, offset, head, payload = record(service, 2)
    os.truncate(path, offset + head + payload - 1)


def vanished(service):
    path, *_ = record(service, 2)
    os.unlink(path)


def other_length(service):
    """A record under page 2's key whose payload is not a page long."""
    backend = service.backend
    key = service.key(HASHES[2], SUFFIX, "full")
    prov = service.shapes["full", SUFFIX]
    short = type(prov)(prov.model_id, prov.layout, prov.dtype, prov.shard_shape, prov.page_size)
    rows = np.zeros((1, 64), dtype=np.uint8)
    backend.set([key], rows, short)


DAMAGES = [payload_bit, header_bit, trailing_bytes, cut_inside, vanished, other_length]


def outcome(service, read) -> tuple[int, dict[str, int]]:
    """Pages ``read`` served, and how the store's counters moved."""
    before = dict(service.backend.stats())
    rows = read()
    after = service.backend.stats()
    moved = {
        k: after[k] - before.get(k, 0)
        for k in after
        if (k.startswith("refused_") or k == "get_miss") and after[k] != before.get(k, 0)
    }
    return len(rows), moved


@pytest.mark.parametrize("tags", list(TAGS))
@pytest.mark.parametrize("reads", ["one_call", "a_call_a_page", "a_call_a_page_cold"])
@pytest.mark.parametrize("backend", ["file", "segment"])
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_both_read_paths_serve_refuse_and_count_alike(
    tmp_path, monkeypatch, backend, damage, reads, tags
):
    """``a_call_a_page``: every page is a read of its own, so the direct read's
    threads take them side by side and the refusal lies in another's run;
    ``_cold``: the store's files out of the page cache first (more reads in flight)."""
    cfg, service, data = store(tmp_path, backend, tags)
    assert (service.backend.auth is not None) == (tags != "plain")
    if reads.startswith("a_call_a_page"):
        monkeypatch.setattr(run_reads, "READ_CALL", data.shape[1])
    colds = []
    if reads.endswith("_cold"):
        monkeypatch.setattr(direct_module, "cold", lambda *a: colds.append(run_reads.cold(*a)))
    direct = DirectReads(service, cfg)
    if damage is vanished:  # gone between the rank's asking where and its read
        direct.plan(SUFFIX, HASHES)
        damage(service)
    else:
        damage(service)
        direct.plan(SUFFIX, HASHES)
    mine = np.full_like(data, 0xAA)  # rows the rank keeps: what is served is read into them
    if reads.endswith("_cold"):
        drop_cache(tmp_path)
    by_direct = outcome(service, lambda: direct.load(SUFFIX, HASHES, out=mine))
    if reads.endswith("_cold") and damage is not vanished:
        assert len(colds) == 1, "a load asks once whether the page cache holds it"
    by_actor = outcome(service, lambda: service.load(SUFFIX, HASHES))
    assert by_direct == by_actor, f"direct read {by_direct}, storage actor {by_actor}"
    n = by_direct[0]
    assert n <= 2, "nothing at or after the damaged page is served"
    rows = service.load(SUFFIX, HASHES)
    assert np.array_equal(rows, data[: len(rows)])
    assert np.array_equal(mine[:n], data[:n])
    direct.close()
    service.detach()


def drop_cache(under) -> None:
    """Every file under ``under`` out of the page cache."""
    for root, _, names in os.walk(under):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_a_load_the_page_cache_does_not_hold_is_known_cold(tmp_path):
    from fabric.l3.backend import Location

    path = tmp_path / "pages.bin"
    path.write_bytes(os.urandom(1 << 20))
    drop_cache(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        files = {"pages.bin": fd}
        cold = run_reads.cold(Location("pages.bin", 4096, 0, 4096), files)
        if not cold and not run_reads.NOWAIT:
            pytest.skip("this platform cannot ask the page cache (no RWF_NOWAIT)")
        if not cold:
            pytest.skip(f"{tmp_path} keeps its pages in memory (tmpfs): nothing is cold")
        os.pread(fd, 8192, 4096)
        assert not run_reads.cold(Location("pages.bin", 4096, 0, 4096), files)
        assert not run_reads.cold(Location("pages.bin", 4096, 0, 4096), {"pages.bin": "miss"})
    finally:
        os.close(fd)


def test_a_direct_read_into_rows_that_do_not_fit_is_refused_by_name(tmp_path):
    cfg, service, data = store(tmp_path, "segment")
    direct = DirectReads(service, cfg)
    for rows in (
        np.zeros((PAGES - 1, data.shape[1]), np.uint8),  # too few
        np.zeros((PAGES, data.shape[1] + 1), np.uint8),  # not a page a row
        np.zeros((PAGES, data.shape[1] // 2), np.uint16),  # not bytes
        np.zeros((data.shape[1], PAGES), np.uint8).T,  # not contiguous
    ):
        with pytest.raises(ValueError, match=f"{PAGES} pages of {data.shape[1]} bytes"):
            direct.load(SUFFIX, HASHES, out=rows)
    assert np.array_equal(direct.load(SUFFIX, HASHES), data)
    direct.close()
    service.detach()


def deleted_fds(under) -> list[str]:
    """This process's descriptors of files under ``under`` that were removed (disk
    not freed)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and target.startswith(str(under)):
            out.append(target)
    return out


def test_segments_removed_by_another_node_or_a_clear_are_not_held_open(tmp_path):
    """Another storage actor over the same directory (another node) clears it: this
    one's reads and a rank's own reads then miss, and neither holds a removed
    segment open (its disk is freed)."""
    cfg, service, _ = store(tmp_path, "segment")
    direct = DirectReads(service, cfg)
    assert len(direct.load(SUFFIX, HASHES)) == PAGES
    assert deleted_fds(tmp_path) == []
    other = StorageService(cfg)  # another node's storage actor
    other.backend.clear()
    assert len(direct.load(SUFFIX, HASHES)) == 0
    assert len(service.load(SUFFIX, HASHES)) == 0
    assert deleted_fds(tmp_path) == [], "a removed segment is closed once a read finds it gone"
    direct.close()
    other.detach()
    service.detach()
    assert deleted_fds(tmp_path) == []


def test_eviction_frees_the_disk_it_says_it_freed(tmp_path, monkeypatch):
    """A cap of about four pages: storing more evicts whole segments, another
    store's too (as another node's would); once that store next reads, writes or
    reports its usage, no process here holds an evicted one open, and the
    directory holds about what the cap says."""
    monkeypatch.setattr(segment, "REAP_S", 0.0)  # (at most a second in service)
    _, service, data = store(tmp_path, "segment")
    page = data.shape[1]
    cap = 4 * page
    capped = config(tmp_path, "storage.backend=segment", f"storage.max_bytes={cap}")
    small = StorageService(capped)
    direct = DirectReads(small, capped)
    for round_ in range(6):
        hashes = [bytes([100 + round_, i]) * 16 for i in range(2)]
        assert small.store(SUFFIX, hashes, data[:2])
        direct.load(SUFFIX, hashes)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "l3").glob("*.kvs"))
    service.stats()  # the other store's next call
    assert deleted_fds(tmp_path) == []
    assert on_disk <= cap + 2 * (page + 4096), (on_disk, cap)
    direct.close()
    small.detach()
    service.detach()
