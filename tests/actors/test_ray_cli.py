"""The ``kvfabric`` commands that talk to a running fabric, against one local Ray
and one fabric for the module, each command's last line parsed as JSON and checked
against the one schema. Most run in this process (``fabric.cli.main``, what the
``kvfabric`` command runs); ``run``, a missing fabric or cluster and ``top`` on a
terminal run as separate processes, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jsonschema
import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray
SHARES_RAY = True  # tests/ray_session.py

from fabric.cli import main  # noqa: E402
from fabric.client import connect, launch  # noqa: E402
from fabric.observe.report import SCHEMA  # noqa: E402
from tests.helpers import prompt, small_config, storage_options  # noqa: E402
from tests.ray_session import shared_ray  # noqa: E402

NAME = "kvfabric-cli"
NS = "kvfabric-cli-tests"


@pytest.fixture(scope="module")
def fabric(tmp_path_factory):
    shared_ray()
    l3 = tmp_path_factory.mktemp("l3")
    f = launch(
        small_config(f"runtime.name={NAME}", f"runtime.ray_namespace={NS}", *storage_options(l3))
    )
    try:
        yield f
    finally:
        f.shutdown()


@pytest.fixture
def kvfabric(capsys):
    """Run a ``kvfabric`` command here; its exit status, stdout and stderr."""

    def run(*args: str, cluster: bool = True, check: bool = True) -> SimpleNamespace:
        argv = list(args)
        if cluster:
            address = ray.get_runtime_context().gcs_address
            argv += ["--address", address, "--name", NAME, "--ray-namespace", NS]
        capsys.readouterr()  # what came before is not this command's
        code = main(argv)
        out, err = capsys.readouterr()
        if check:
            assert code == 0, err[-2000:]
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


def last_json(done) -> dict:
    out = json.loads(done.stdout.strip().splitlines()[-1])
    jsonschema.validate(out, SCHEMA)
    return out


def test_status_shows_actors_tiers_transfers_and_l3(fabric, kvfabric):
    r = fabric.submit(prompt(3, pages=4), timeout=60)
    assert r.error is None and fabric.release(r.lease)
    assert fabric.settle()
    done = kvfabric("status")
    out = last_json(done)
    st = out["status"]
    assert out["fabric"] == NAME and st["epoch"] >= 1
    roles = [a["role"] for a in st["actors"] if a["alive"]]
    assert roles.count("rank") == 4 and "coordinator" in roles and "storage" in roles
    assert st["tiers"]["device"]["capacity"] == 96
    assert st["l3"]["attached"] and st["l3"]["set_pages"] > 0
    assert st["transfer_tokens"]["device_to_host"] > 0
    assert "up   rank" in done.stdout and "L3 file" in done.stdout, "a table for people too"


def test_status_watch_refreshes_and_json_is_one_object_per_refresh(fabric, kvfabric):
    done = kvfabric("status", "--watch", "0.1", "--count", "2", "--json")
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        jsonschema.validate(json.loads(line), SCHEMA)


def test_events_prints_router_shaped_events(fabric, kvfabric):
    p = prompt(9, pages=3)
    r = fabric.submit(p, timeout=60)
    assert r.error is None and fabric.release(r.lease)
    done = kvfabric("events", "--json")
    out = last_json(done)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()[:-1]]
    assert out["events"] == len(lines) > 0, "one line per event, then their count"
    stored = [e for e in lines if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert any(e["token_ids"] == p for e in stored)
    assert all(isinstance(h, int) for e in stored for h in e["block_hashes"])


def test_storage_usage_detach_attach_clear(fabric, tmp_path, kvfabric):
    r = fabric.submit(prompt(31, pages=2), timeout=60)
    fabric.release(r.lease)
    assert fabric.settle(30)
    usage = last_json(kvfabric("storage", "usage", "--json"))["storage"]
    assert usage["attached"] and usage["backend"] == "file"
    assert usage["writers"] and all(row["writers"] == ["kvfabric"] for row in usage["writers"])
    assert sum(row["pages"] for row in usage["writers"]) == usage["pages"]
    assert last_json(kvfabric("storage", "detach", "--json"))["storage"]["done"] is True
    assert last_json(kvfabric("storage", "usage", "--json"))["storage"]["attached"] is False
    options = json.dumps({"path": str(tmp_path / "l3b")})
    out = last_json(kvfabric("storage", "attach", "file", "--options", options, "--json"))
    assert out["storage"]["backend"] == "file"
    assert last_json(kvfabric("storage", "clear", "--yes", "--json"))["storage"]["done"] is True
    refused = kvfabric("storage", "clear", check=False)  # asks; no answer on stdin
    assert refused.returncode != 0


def test_pin_and_unpin_a_cached_prefix(fabric, kvfabric):
    p = prompt(21, pages=4)
    r = fabric.submit(p, timeout=60)
    assert r.error is None and fabric.release(r.lease)
    tokens = ",".join(map(str, p))
    out = last_json(kvfabric("pin", tokens, "--ttl", "60", "--json"))
    assert out["pin"]["tokens"] == 16
    assert fabric.status()["pinned_tokens"] == 16
    out = last_json(kvfabric("pin", tokens, "--undo", "--json"))
    assert out["pin"]["tokens"] == 16 and fabric.status()["pinned_tokens"] == 0
    bad = kvfabric("pin", "1,x", check=False)
    assert bad.returncode == 2 and "TOKENS '1,x' is refused" in bad.stderr


def test_run_on_the_existing_cluster_prints_the_shared_schema(fabric, tmp_path):
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}  # a user who never ran it
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fabric.cli",
            "run",
            "--address",
            address,
            "--requests",
            "12",
            "--json",
            "--set",
            "runtime.name=kvfabric-cli-run",
            "--set",
            f"runtime.ray_namespace={NS}",
            "--set",
            "storage.backend=none",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.strip().splitlines()) == 1, "--json: only the result on stdout"
    assert done.stderr.count("kvfabric: first run done. Next:") == 1, "the first-run hint"
    out = last_json(done)
    assert out["command"] == "run" and out["requests"] == 12 and out["served"] == 12
    assert sum(out["tokens_by_tier"].values()) > 0 and out["latency_ms"]["p50"] > 0
    assert "serving: 12/12 requests (100%)" in done.stderr, "plain progress lines off a TTY"
    assert "\r" not in done.stderr
    assert "kvfabric: Ray dashboard: off" in done.stderr, (
        "where the dashboard is, or that none runs"
    )


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-bamba"])
def test_run_a_hybrid_model_with_check_ends_with_no_mismatch(fabric, model, tmp_path):
    """``kvfabric run --model tiny-gemma3|tiny-bamba --check --json`` under a tiny
    L1 and L2 with L3 on: every answer continued from what the fabric served (full
    pages, sliding window, mamba states) is the answer generated without a cache."""
    pytest.importorskip("transformers")
    address = ray.get_runtime_context().gcs_address
    options = {
        "runtime.name": f"kvfabric-cli-{model}",
        "runtime.ray_namespace": NS,
        "cache.device_tokens": 128,
        "cache.host_tokens": 128,
        "prefetch.threshold_tokens": 16,
        "storage.backend": "file",
        "storage.path": tmp_path / "l3",
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "fabric.cli", "run", "--address", address),
            *("--model", model, "--check", "--json", "--conversations", "3", "--turns", "3"),
            *(a for k, v in options.items() for a in ("--set", f"{k}={v}")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = last_json(done)
    m = out["model"]
    assert m["model_id"] == model and m["checked_requests"] == m["turns"] == 9
    assert m["mismatches"] == 0 and m["unserved_turns"] == 0
    assert out["tokens_by_tier"]["device"] + out["tokens_by_tier"]["host"] > 0


def test_connect_hands_back_the_running_fabric_s_own_config(fabric):
    other = connect(NAME, "auto", NS)
    assert other.config == fabric.config
    assert other.config.runtime.name == NAME and other.config.storage.backend == "file"


def test_a_missing_fabric_or_cluster_is_one_line(fabric):
    address = ray.get_runtime_context().gcs_address
    missing = subprocess.run(
        [sys.executable, "-m", "fabric.cli", "status", "--address", address, "--name", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert (
        missing.stderr.strip()
        .splitlines()[-1]
        .startswith("kvfabric: error: no fabric named 'nope'")
    )
    down = subprocess.run(
        [sys.executable, "-m", "fabric.cli", "status", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 2
    assert "no Ray cluster at --address='127.0.0.1:1'" in down.stderr.strip().splitlines()[-1]


def test_top_draws_live_frames_on_a_terminal(fabric):
    """``kvfabric top`` through a pseudo-terminal (as an operator's shell runs
    it): rich's live view, frames with transfers per direction, hit rate per
    tier and requests in flight, then the JSON result."""
    import os
    import pty
    import select

    for seed in range(40, 44):
        r = fabric.submit(prompt(seed, pages=6), timeout=60)
        assert r.error is None and fabric.release(r.lease)
    address = ray.get_runtime_context().gcs_address
    argv = [
        sys.executable, "-m", "fabric.cli", "top", "--address", address, "--name", NAME,
        "--ray-namespace", NS, "--interval", "0.5", "--count", "3",
    ]  # fmt: skip
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        proc.wait(60)
        os.close(leader)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "\x1b[" in text, "drawn as a live view (escape sequences), not plain lines"
    for needed in ("L1 > L2", "L2 > L1", "tokens/s", "prompt tokens by source", "computed"):
        assert needed in text, (needed, text[-3000:])
    assert f"kvfabric {NAME}" in text and "in flight" in text
    assert '"command": "top"' in text and '"frames": 3' in text
