"""An L3 whose file system turns read-only: the pages it holds are still served,
writes fail (counted once a page, logged once) and go through again when it is
writable; a store opened read-only starts and serves. The directory backends
hold no file open for writing between appends, so the file system under a
running fabric can be remounted read-only at all (an open writer makes that
EBUSY) — the fault ``kvfabric chaos`` injects as ``l3_read_only``."""

from __future__ import annotations

import os
import subprocess
import threading

import numpy as np
import pytest

from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.l3.file import FileBackend
from fabric.l3.segment import SegmentBackend
from fabric.observe.metrics import MetricsExporter
from tests.helpers import PAGE_BYTES, PROV, keys, pages, prompt

from ..test_metrics import scrape, value
from .test_storage_fabric import config, fill_l3

BACKENDS = {"file": FileBackend, "segment": SegmentBackend}


def writers_under(root) -> list[str]:
    """Files under ``root`` this process holds open for writing."""
    root = os.path.realpath(root)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as info:
                fields = dict(line.split(":", 1) for line in info if ":" in line)
            flags = int(fields["flags"].strip(), 8)
        except OSError:
            continue
        if target.startswith(root + "/") and flags & os.O_ACCMODE != os.O_RDONLY:
            out.append(target)
    return out


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_between_appends_no_file_of_the_store_is_open_for_writing(tmp_path, name):
    b = BACKENDS[name](PROV, PAGE_BYTES, {"path": str(tmp_path / "l3")})
    data = pages(40)
    threads = [
        threading.Thread(target=b.set, args=(keys(10, start=10 * i), data[10 * i : 10 * i + 10]))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.exists(keys(40)) == 40
    assert writers_under(tmp_path / "l3") == []
    with open(tmp_path / "l3" / "probe", "wb"):  # the check sees a writer where there is one
        assert writers_under(tmp_path / "l3") == [os.path.realpath(tmp_path / "l3" / "probe")]
    os.unlink(tmp_path / "l3" / "probe")
    # Appending to a segment again reopens it; what was written is read back.
    assert b.set(keys(1, start=40), pages(1, seed=3)) == [True]
    out = np.zeros((41, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(41), out) == 41 and np.array_equal(out[:40], data)
    assert writers_under(tmp_path / "l3") == []


def test_a_segment_replaced_under_its_writer_is_not_appended_to(tmp_path):
    root = tmp_path / "l3"
    b = SegmentBackend(PROV, PAGE_BYTES, {"path": str(root)})
    b.set(keys(2), pages(2))
    (seg,) = root.glob("seg-*.kvs")
    os.replace(seg, root / "elsewhere")
    seg.write_bytes(b"someone else's file")
    assert b.set(keys(1, start=2), pages(1, seed=1)) == [True]
    assert seg.read_bytes() == b"someone else's file"
    assert len(list(root.glob("seg-*.kvs"))) == 2


@pytest.fixture
def mount(tmp_path):
    """A tmpfs of the test's own that it can remount read-only and back."""
    where = tmp_path / "l3"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a file system (CI runs as root)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "kvfabric-test-l3", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def remount(mode: str) -> None:
        cmd = ["mount", "-o", f"remount,bind,{mode}", str(where)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr  # EBUSY: a file left open for writing

    yield remount
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_store_turned_read_only_serves_what_it_holds_and_takes_writes_again(
    tmp_path, mount, name
):
    path = str(tmp_path / "l3")
    b = BACKENDS[name](PROV, PAGE_BYTES, {"path": path})
    data = pages(8)
    assert b.set(keys(4), data[:4]) == [True] * 4
    mount("ro")  # under the open backend
    assert b.set(keys(4, start=4), data[4:]) == [False] * 4
    assert b.set(keys(4, start=4), data[4:]) == [False] * 4
    st = b.stats()
    assert st["write_error"] == "erofs" and st["set_failed_erofs"] == 8 and st["set_failed"] == 8
    out = np.zeros((8, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(8), out) == 4 and np.array_equal(out[:4], data[:4])
    # A store opened while read-only starts, serves, and says it takes no writes.
    other = BACKENDS[name](PROV, PAGE_BYTES, {"path": path})
    assert other.stats()["write_error"] == "erofs"
    assert other.get(keys(8), out) == 4 and np.array_equal(out[:4], data[:4])
    mount("rw")
    assert b.set(keys(4, start=4), data[4:]) == [True] * 4
    assert b.stats()["write_error"] is None
    assert other.set(keys(1, start=8), pages(1, seed=5)) == [True]
    assert other.stats()["write_error"] is None
    fresh = BACKENDS[name](PROV, PAGE_BYTES, {"path": path})
    assert fresh.get(keys(8), out) == 8 and np.array_equal(out, data)


def test_a_fabric_on_a_read_only_store_serves_its_pages_and_says_writes_fail(tmp_path, mount):
    cfg = config(tmp_path)
    stored = pack_tokens(prompt(1, pages=8))
    fill_l3(cfg, stored)
    mount("ro")
    f = LocalFabric(cfg)
    r = f.serve(stored)
    assert r.storage_hit_tokens == 32 and r.computed_tokens == 0
    assert f.verify(r, stored) == [True] * 4
    f.core.release(r.lease)
    fresh = pack_tokens(prompt(2, pages=8))
    r = f.serve(fresh)  # computed; its backup fails and nothing is lost or held
    f.core.release(r.lease)
    f.settle()
    l3 = f.storage.stats()
    assert l3["write_error"] == "erofs" and l3["set_failed"] > 0
    exporter = MetricsExporter()
    exporter.update(figures(f.core), l3)
    m = scrape(exporter)
    assert value(m, "kvfabric_l3_writable") == 0
    assert value(m, "kvfabric_l3_write_failed_pages_total") == l3["set_failed"]
    f.core.cache.check_integrity()
    mount("rw")
    r = f.serve(stored + fresh)  # the next backup goes through
    f.core.release(r.lease)
    f.settle()
    assert f.storage.stats()["write_error"] is None
