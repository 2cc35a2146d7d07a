"""The Redis backend against a real redis-server on loopback (started and stopped here)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from fabric.cache.keys import pack_tokens
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError
from fabric.l3 import make_backend
from tests.helpers import PAGE_BYTES, PROV, keys, pages, prompt, small_config

if shutil.which("redis-server") is None and not os.environ.get("CI"):
    pytest.skip("redis-server is not installed (CI installs it)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _redis_server(*args: str, port: int | None = None):
    port = port or _free_port()
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
            *args,
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


@pytest.fixture(scope="module")
def redis_port():
    with _redis_server() as port:
        yield port


def backend(port, prefix="t:"):
    return make_backend("redis", PROV, PAGE_BYTES, {"port": port, "prefix": prefix})


def test_round_trip_and_clear(redis_port):
    b = backend(redis_port, "rt:")
    assert b.set(keys(3), pages(3)) == [True] * 3
    assert b.exists(keys(4)) == 3
    out = np.zeros((3, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(3), out) == 3 and np.array_equal(out, pages(3))
    assert b.stats()["set_pages"] == 3
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
        f'storage.options={{"port": {redis_port}, "prefix": "fabric:"}}',
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


def _calls(b, command: str) -> int:
    return int(b.client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_batches_take_one_round_trip_and_stats_never_scan(redis_port):
    b = backend(redis_port, "batch:")
    before = {c: _calls(b, c) for c in ("get", "mget", "set", "scan")}
    assert b.set(keys(64), pages(64)) == [True] * 64
    out = np.zeros((64, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(64), out) == 64 and np.array_equal(out, pages(64))
    for _ in range(5):
        b.stats()
    assert _calls(b, "mget") == before["mget"] + 1 and _calls(b, "get") == before["get"]
    assert _calls(b, "scan") == before["scan"]


def test_a_page_stored_under_another_key_is_never_served(redis_port):
    b = backend(redis_port, "swap:")
    b.set(keys(3), pages(3))
    first, second = ("swap:" + k for k in keys(3)[1:])
    a, c = b.client.get(first), b.client.get(second)
    b.client.set(first, c)
    b.client.set(second, a)
    out = np.zeros((3, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(3), out) == 1
    assert b.stats()["refused_key"] == 1


@pytest.mark.parametrize("prefix", ["", "a?", "a*", "a[b]", "x" * 65, "a b", "a\n"])
def test_a_prefix_that_is_not_plain_is_refused(redis_port, prefix):
    with pytest.raises(ConfigError, match="prefix"):
        backend(redis_port, prefix)


def test_clear_removes_only_its_own_keys(redis_port):
    mine, longer = backend(redis_port, "a"), backend(redis_port, "ab")
    mine.set(keys(2), pages(2))
    longer.set(keys(2), pages(2))
    mine.client.set("a-unrelated", b"keep me")
    mine.clear()
    assert mine.exists(keys(2)) == 0
    assert longer.exists(keys(2)) == 2, "prefix 'ab' starts with 'a' and is not touched"
    assert mine.client.get("a-unrelated") == b"keep me"


def test_page_keys_lists_its_own_pages_for_audits(redis_port):
    mine, longer = backend(redis_port, "pk"), backend(redis_port, "pkx")
    mine.set(keys(3), pages(3))
    longer.set(keys(5), pages(5))
    mine.client.set("pk-not-a-page", b"x")
    assert sorted(mine.page_keys()) == sorted(keys(3))
    assert len(longer.page_keys()) == 5
    mine.clear()
    longer.clear()
    assert mine.page_keys() == []


def test_wrong_password_and_down_server_are_config_errors_naming_host_and_port():
    with _redis_server("--requirepass", "s3cret") as port:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: authentication failed"):
            make_backend("redis", PROV, PAGE_BYTES, {"port": port, "password": "wrong"})
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: authentication|refused"):
            make_backend("redis", PROV, PAGE_BYTES, {"port": port})
        ok = make_backend(
            "redis", PROV, PAGE_BYTES, {"port": port, "password": "s3cret", "username": "default"}
        )
        assert ok.set(keys(1), pages(1)) == [True]
    down = _free_port()
    with pytest.raises(ConfigError, match=f"127.0.0.1:{down} is unreachable"):
        make_backend("redis", PROV, PAGE_BYTES, {"port": down, "timeout_s": 1})


def test_an_outage_costs_one_attempt_then_fails_fast_until_redis_is_back(monkeypatch):
    """Redis stops: the next call tries once (no client retries), fails, and
    every call after it fails at once without touching the network — counted —
    until the retry interval passes; then one call tries again, and once Redis
    is back the store serves again."""
    from fabric.l3 import redis as redis_backend

    now = [100.0]
    with _redis_server() as port:
        b = make_backend("redis", PROV, PAGE_BYTES, {"port": port, "timeout_s": 2, "prefix": "cb:"})
        b.breaker.clock = lambda: now[0]
        b.set(keys(2), pages(2))
        attempts = []
        pool = b.client.connection_pool
        real = pool.get_connection
        monkeypatch.setattr(
            pool, "get_connection", lambda *a, **k: attempts.append(1) or real(*a, **k)
        )
        out = np.zeros((2, PAGE_BYTES), np.uint8)
        assert b.get(keys(2), out) == 2 and len(attempts) == 1
    # The server is gone (its port closed).
    pool.disconnect()
    attempts.clear()
    assert b.exists(keys(2)) == 0
    assert len(attempts) == 1, "one attempt: the client does not retry"
    assert b.get(keys(2), out) == 0 and b.set(keys(1), pages(1)) == [False]
    assert b.exists(keys(2)) == 0 and len(attempts) == 1, "the rest fail fast"
    st = b.stats()
    assert st["redis_errors"] == 1 and st["redis_fast_failed"] == 3
    assert st["refused_unavailable"] == 1
    now[0] += redis_backend.OUTAGE_RETRY_S + 1  # one call tries the server again
    assert b.exists(keys(2)) == 0 and len(attempts) == 2
    assert b.exists(keys(2)) == 0 and len(attempts) == 2, "still down: fast again"
    with _redis_server(port=port):  # back, on the same port
        now[0] += redis_backend.OUTAGE_RETRY_S + 1
        assert b.set(keys(1), pages(1)) == [True], "the trial call reaches it"
        assert b.exists(keys(1)) == 1, "served again once Redis is back"
    b.close()


def test_the_chaos_audit_reads_every_redis_page_and_names_a_damaged_one(redis_port, tmp_path):
    """``kvfabric chaos`` on the Redis backend: its L3 audit lists the pages (SCAN)
    and reads each as a prefetch would; a damaged value is named, not a crash."""
    from fabric.tools.chaos import ChaosOptions, chaos_config
    from fabric.tools.chaos.environment import scan_l3

    opts = ChaosOptions(
        overrides=(
            "storage.backend=redis",
            f'storage.options={{"port": {redis_port}, "prefix": "chaos:"}}',
        )
    )
    config = chaos_config(opts, str(tmp_path))
    f = LocalFabric(config)
    f.core.release(f.serve(pack_tokens(prompt(3, pages=4))).lease)
    f.settle()
    f.close()
    audit = scan_l3(config)
    assert audit["valid"] > 0 and set(audit) == {"valid"}, audit
    store = backend(redis_port, "chaos:")
    name = f"chaos:{store.page_keys()[0]}"
    value = bytearray(store.client.get(name))
    value[-1] ^= 1
    store.client.set(name, bytes(value))
    damaged = scan_l3(config)
    assert damaged["checksum"] == 1 and damaged["valid"] == audit["valid"] - 1
    store.clear()
