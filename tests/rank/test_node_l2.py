"""The node's L2 for engine pages (``fabric.rank.node_l2``): pages shared by
every process of the node through one shared-memory file, each checked by its
checksum when read; a slot rewritten while read is never taken as the page; a
file others could write is repaired and emptied, one of another owner refused."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fabric.rank import node_l2, node_l2_mapping
from fabric.rank.node_l2 import WAYS, NodeL2, open_node_l2

PAGE = 4096


def page(key: str) -> torch.Tensor:
    """The bytes a page of ``key`` holds (derived from the key, so a reader can
    tell a right page from a wrong one)."""
    g = torch.Generator().manual_seed(int.from_bytes(node_l2_mapping.digest(key)[:7], "little"))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def region(tmp_path: Path, slots: int = 64, name: str = "r.l2") -> NodeL2:
    return NodeL2(tmp_path / name, PAGE, slots, "t" * 16, "0-0-0")


def read(l2: NodeL2, key: str) -> torch.Tensor | None:
    (found,) = l2.find([key])
    if found is None or not l2.check(found):
        return None
    out = l2.pool[found[0]].clone()
    return out if l2.unchanged(found) else None


def test_pages_one_process_stores_another_reads_bit_for_bit(tmp_path):
    keys = [f"k{i}" for i in range(20)]
    a = region(tmp_path)
    assert a.put(keys, torch.stack([page(k) for k in keys])) == [True] * 20
    b = region(tmp_path)  # another opener of the same region
    for key in keys:
        got = read(b, key)
        assert got is not None and torch.equal(got, page(key))
    assert b.find(["absent"]) == [None]
    assert stat.S_IMODE(os.stat(tmp_path / "r.l2").st_mode) == 0o600
    a.close()
    b.close()


def test_a_page_the_fabric_evicted_is_gone_for_every_reader_and_its_slot_reused(tmp_path):
    keys = [f"k{i}" for i in range(WAYS)]
    a, b = region(tmp_path, slots=WAYS), region(tmp_path, slots=WAYS)  # one set: full
    a.put(keys, torch.stack([page(k) for k in keys]))
    held = b.find(["k3"])[0]
    assert a.remove(["k3", "k4", "absent"]) == 2
    assert b.find(["k3", "k4", "k5"])[:2] == [None, None]
    assert not b.unchanged(held), "a reader copying it sees the slot move"
    assert read(b, "k5") is not None
    # Its slot takes the next page of its set before any other way is replaced.
    assert a.put(["k3"], page("k3")[None]) == [True]
    assert torch.equal(read(b, "k3"), page("k3"))
    assert a.counters["removed"] == 2 and a.counters["replaced"] == 0
    a.close()
    b.close()


def test_a_page_damaged_in_shared_memory_is_refused_not_served(tmp_path):
    l2 = region(tmp_path)
    l2.put(["k"], page("k")[None])
    (found,) = l2.find(["k"])
    l2.pool[found[0], 100] ^= 0xFF  # any writer on the node flips a byte
    assert not l2.check(found)
    assert read(l2, "k") is None and l2.counters["refused"] == 2
    l2.close()


def test_a_slot_rewritten_while_read_is_not_taken_as_the_page(tmp_path):
    l2 = region(tmp_path, slots=WAYS)  # one set: every key shares it
    keys = [f"k{i}" for i in range(WAYS)]
    l2.put(keys, torch.stack([page(k) for k in keys]))
    (found,) = l2.find(["k0"])
    assert l2.check(found)
    # Others are stored meanwhile: k0, least recently used, is replaced.
    for i in range(WAYS, WAYS + 2):
        l2.find(keys[1:])  # the others were used since
        l2.put([f"k{i}"], page(f"k{i}")[None])
    assert not l2.unchanged(found)
    assert l2.find(["k0"]) == [None]
    assert l2.counters["replaced"] >= 1
    l2.close()


def test_a_slot_a_reader_holds_is_never_replaced_until_it_lets_go(tmp_path):
    l2 = region(tmp_path, slots=WAYS)
    keys = [f"k{i}" for i in range(WAYS)]
    l2.put(keys, torch.stack([page(k) for k in keys]))
    held = l2.find(keys, pin_ms=60_000)  # a reader copying all eight
    assert l2.put(["new"], page("new")[None]) == [False]  # nowhere to go: not kept
    assert l2.counters["pinned_full"] == 1
    assert all(l2.unchanged(f) for f in held)
    l2.unpin(held[:1])  # done with the first one
    assert l2.put(["new"], page("new")[None]) == [True]
    assert not l2.unchanged(held[0]) and all(l2.unchanged(f) for f in held[1:])
    # A pin is a time: a reader that died holds nothing once it is up.
    l2.find(["new", *keys[1:]], pin_ms=1)  # every way pinned, for 1 ms
    time.sleep(0.01)
    assert l2.put(["later"], page("later")[None]) == [True]
    l2.close()


def test_a_page_held_for_l3_is_never_replaced_until_released_and_a_reader_keeps_its_hold(
    tmp_path,
):
    """Write-back: a page here only is held (``hold_ms``) against the region's own
    replacement until it is in L3 (``release``) or removed; a reader pinning and
    letting go of it leaves the hold as it was."""
    l2 = region(tmp_path, slots=WAYS)
    keys = [f"k{i}" for i in range(WAYS)]
    l2.put(keys, torch.stack([page(k) for k in keys]), hold_ms=60_000)
    found = l2.find(keys[:1], pin_ms=100)  # shorter than the hold: not the reader's
    l2.unpin(found)
    assert l2.put(["new"], page("new")[None]) == [False]  # every way held
    l2.release(keys[:1])  # copied to L3
    assert l2.put(["new"], page("new")[None]) == [True]
    assert l2.find(keys[:1]) == [None] and read(l2, "new") is not None
    assert all(read(l2, k) is not None for k in keys[1:])
    l2.remove(keys[1:2])  # the fabric evicted it: its slot is free again
    assert l2.put(["newer"], page("newer")[None]) == [True]
    l2.close()


def test_a_write_killed_midway_leaves_an_empty_slot_the_next_store_takes(tmp_path):
    l2 = region(tmp_path, slots=WAYS)
    l2.put(["k"], page("k")[None])
    (found,) = l2.find(["k"])
    at = node_l2.HEADER + found[0] * node_l2._RECORD.size
    node_l2._SEQ.pack_into(l2.view, at, found[1] + 1)  # odd: a writer died in it
    assert l2.find(["k"]) == [None]
    assert l2.put(["k"], page("k")[None]) == [True]
    assert torch.equal(read(l2, "k"), page("k"))
    l2.close()


def hold(path: Path) -> int:
    """Hold ``path`` as another process using the region does (a shared lock)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def test_a_region_others_could_write_is_repaired_and_emptied(tmp_path, caplog):
    l2 = region(tmp_path)
    l2.put(["k"], page("k")[None])
    (found,) = l2.find(["k"])
    other = hold(tmp_path / "r.l2")
    l2.close()  # the other user keeps it
    os.chmod(tmp_path / "r.l2", 0o666)
    with caplog.at_level(logging.WARNING, "fabric.rank.node_l2"):
        again = region(tmp_path)
    os.close(other)
    assert stat.S_IMODE(os.stat(tmp_path / "r.l2").st_mode) == 0o600
    assert again.find(["k"]) == [None]  # anyone may have written what was in it
    assert "repaired to 0600 and emptied" in caplog.text
    # A reader that held the slot before it was emptied never takes it again, even
    # once the slot is written twice more (seq only grows).
    assert not again.unchanged(found)
    for i in range(2 * WAYS * 8):
        again.put([f"x{i}"], page(f"x{i}")[None])
    assert not again.unchanged(found)
    again.close()


def test_a_region_of_another_owner_is_refused_and_the_engine_runs_without(
    tmp_path, monkeypatch, caplog
):
    region(tmp_path, name=node_l2_mapping.region_name("f", "t" * 16, "0-0-0")).close()
    monkeypatch.setattr(node_l2.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with caplog.at_level(logging.ERROR, "fabric.rank.node_l2"):
        assert open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, 1 << 20) is None
    assert "not a regular file of this user" in caplog.text


def test_another_geometry_is_rebuilt_when_unused_and_left_alone_when_used(tmp_path, caplog):
    held = region(tmp_path)
    held.put(["k"], page("k")[None])
    with caplog.at_level(logging.ERROR, "fabric.rank.node_l2"), pytest.raises(OSError):
        NodeL2(tmp_path / "r.l2", PAGE * 2, 64, "t" * 16, "0-0-0")
    assert torch.equal(read(held, "k"), page("k"))  # the user's pages stay
    held.close()
    rebuilt = NodeL2(tmp_path / "r.l2", PAGE * 2, 64, "t" * 16, "0-0-0")
    assert rebuilt.page_bytes == PAGE * 2 and rebuilt.find(["k"]) == [None]
    rebuilt.close()


def test_open_refuses_sizes_that_hold_no_set_and_zero_means_off(tmp_path, caplog):
    assert open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, 0) is None
    with caplog.at_level(logging.WARNING, "fabric.rank.node_l2"):
        assert open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, PAGE * 3) is None
    assert "l2_bytes=12288" in caplog.text
    l2 = open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, PAGE * 20)
    assert l2 is not None and l2.slots == 16  # whole sets only
    other = open_node_l2(str(tmp_path), "g", "t" * 16, "0-0-0", PAGE, PAGE * 20)
    assert other is not None and other.path != l2.path  # another fabric, another region
    l2.close()
    other.close()


WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from tests.rank.test_node_l2 import page, PAGE
    from fabric.rank.node_l2 import NodeL2
    l2 = NodeL2(Path(sys.argv[1]), PAGE, 8, "t" * 16, "0-0-0")
    for i in range(int(sys.argv[2])):
        key = f"k{i % 11}"
        l2.put([key], page(key)[None])
        l2.find([f"k{(i + 5) % 11}"])
    print("done", l2.counters["replaced"], flush=True)
    """
)


def test_a_reader_racing_another_process_rewriting_slots_never_takes_wrong_bytes(tmp_path):
    """Eleven keys cycle through one set of eight slots in another process; every
    page this process takes as whole is the right page."""
    l2 = region(tmp_path, slots=WAYS)
    root = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "r.l2"), "3000"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    taken = refused = 0
    while writer.poll() is None or taken == 0:
        for i in range(11):
            key = f"k{i}"
            (found,) = l2.find([key])
            if found is None:
                continue
            copy = l2.pool[found[0]].clone() if l2.check(found) else None
            if copy is not None and l2.unchanged(found):
                assert torch.equal(copy, page(key)), f"wrong bytes taken for {key}"
                taken += 1
            else:
                refused += 1
    out, _ = writer.communicate()
    assert writer.returncode == 0 and out.startswith("done")
    assert int(out.split()[1]) > 0  # slots really were rewritten
    assert taken > 0
    l2.close()


def test_a_fabric_going_removes_its_regions_no_engine_uses(tmp_path):
    mine = node_l2_mapping.fabric_identity("fab", "kvfabric")
    used = open_node_l2(str(tmp_path), mine, "a" * 16, "0-0-0", PAGE, PAGE * 8)
    dead = tmp_path / node_l2_mapping.region_name(mine, "b" * 16, "0-0-0")
    other = tmp_path / node_l2_mapping.region_name("other|kvfabric", "a" * 16, "0-0-0")
    for path in (dead, other):
        path.write_bytes(b"left by an engine that died")
        os.chmod(path, 0o600)
    assert used is not None
    assert node_l2.remove_regions(tmp_path, mine) == 1
    assert used.path.exists() and not dead.exists() and other.exists()
    used.close()
    assert not used.path.exists()  # its last user removed it


def test_region_names_carry_their_owner_and_its_dead_engines_regions_go_at_start(tmp_path):
    name = node_l2_mapping.region_name("fab|ns", "a" * 16, "0-0-0")
    assert name.startswith(f"kvfabric-engine-{os.getuid()}-")
    assert node_l2_mapping.region_name("fab|ns", "b" * 16, "0-0-0") != name
    dead = tmp_path / node_l2_mapping.region_name("gone|ns", "c" * 16, "0-0-1")
    dead.write_bytes(b"x")
    held = tmp_path / node_l2_mapping.region_name("live|ns", "c" * 16, "0-0-1")
    held.write_bytes(b"x")
    fd = hold(held)
    foreign = tmp_path / f"{node_l2_mapping.PREFIX}{os.getuid() + 1}-x-y-0-0-0.l2"
    foreign.write_bytes(b"x")
    l2 = open_node_l2(str(tmp_path), "fab|ns", "a" * 16, "0-0-0", PAGE, PAGE * 8)
    assert l2 is not None and not dead.exists() and held.exists() and foreign.exists()
    os.close(fd)
    l2.close()


def test_a_region_grows_as_pages_come(tmp_path):
    l2 = open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, PAGE * 256)
    assert l2 is not None
    size = os.stat(l2.path).st_size
    empty = os.stat(l2.path).st_blocks * 512
    assert size >= 256 * PAGE and empty < 64 * PAGE
    keys = [f"k{i}" for i in range(64)]
    assert sum(l2.put(keys, torch.stack([page(k) for k in keys]))) == 64
    grown = os.stat(l2.path).st_blocks * 512
    assert grown >= empty + 60 * PAGE
    for key in keys:
        assert torch.equal(read(l2, key), page(key))
    l2.close()


def test_two_engines_in_one_process_share_one_mapping_and_its_locks(tmp_path):
    a, b = region(tmp_path), region(tmp_path)
    assert a._map is b._map and a._map.users == 2
    a.put(["k"], page("k")[None])
    a.close()  # b's byte-range locks and mapping are untouched by a's close
    assert torch.equal(read(b, "k"), page("k"))
    assert (tmp_path / "r.l2").exists()
    b.put(["j"], page("j")[None])
    b.close()
    assert not (tmp_path / "r.l2").exists()


def test_opening_a_region_this_process_maps_never_drops_its_locks(tmp_path, monkeypatch):
    """A second opener in the process, and the sweep at start, take the mapping it
    has without opening the file again: closing a second descriptor would drop
    every byte-range lock the process holds on it (a writer's mid-record too)."""
    a = open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, PAGE * 8)
    assert a is not None
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        node_l2.os, "open", lambda p, *x, **k: opened.append(p) or real_open(p, *x, **k)
    )
    b = open_node_l2(str(tmp_path), "f", "t" * 16, "0-0-0", PAGE, PAGE * 8)
    assert b is not None and b._map is a._map
    assert str(a.path) not in [str(p) for p in opened]
    a.close()
    b.close()
