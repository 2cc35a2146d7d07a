"""The Redis backend against a real redis-server on loopback (started and stopped here)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from fabric.keys import pack_tokens
from fabric.l3 import make_backend
from fabric.local import LocalFabric
from tests.fabric.conftest import prompt, small_config

from .conftest import PAGE_BYTES, PROV, keys, pages

if shutil.which("redis-server") is None and not os.environ.get("CI"):
    pytest.skip("redis-server is not installed (CI installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def redis_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def backend(port, prefix="t:"):
    return make_backend("redis", PROV, PAGE_BYTES, {"port": port, "prefix": prefix})


def test_round_trip_and_clear(redis_port):
    b = backend(redis_port, "rt:")
    assert b.set(keys(3), pages(3)) == [True] * 3
    assert b.exists(keys(4)) == 3
    out = np.zeros((3, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(3), out) == 3 and np.array_equal(out, pages(3))
    assert b.stats()["pages"] == 3
    b.clear()
    assert b.exists(keys(1)) == 0


def test_damaged_values_are_misses(redis_port):
    b = backend(redis_port, "dmg:")
    b.set(keys(2), pages(2))
    raw = b.client.get("dmg:" + keys(2)[1])
    b.client.set("dmg:" + keys(2)[1], raw[:-3])
    out = np.zeros((2, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(2), out) == 1
    assert b.stats()["refused_truncated"] == 1


def test_a_fresh_fabric_serves_pages_from_redis(redis_port):
    cfg = small_config(
        "storage.backend=redis",
        f'storage.extra_config={{"port": {redis_port}, "prefix": "fabric:"}}',
        "prefetch.threshold_tokens=4",
    )
    tokens = pack_tokens(prompt(1, pages=6))
    first = LocalFabric(cfg)
    first.core.release(first.serve(tokens).lease)
    first.settle()
    second = LocalFabric(cfg)
    r = second.serve(tokens)
    assert r.storage_hit_tokens == 24
    assert second.verify(r, tokens) == [True] * 4
