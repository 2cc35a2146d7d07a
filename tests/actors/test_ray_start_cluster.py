"""kvfabric on a Ray cluster an operator started with ``ray start`` (a head and one
worker with its own resources, on this machine), driven as an operator drives
it: ``kvfabric`` commands and a driver under ``ray job submit``, each a separate
process. Every scenario ends in a working fabric or one clear line, never a
traceback, and Ray's own log lines stay off stderr below ``--log-level debug``.

The cluster is this module's own: its processes are started with ``--block``
and stopped by signal (never ``ray stop``, which would stop every Ray on the
machine), and the ``ray_current_cluster`` file it leaves is removed, so later
modules' ``ray.init()`` start their own Ray as before.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.helpers import wait_for

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
SMALL = ["--set", "model.layers=2", "--set", "runtime.step_interval_s=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bootstrap_file() -> Path:
    from ray._private.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.dashboard_port = free_port()
        self.client_port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.address = ""

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PYTHONPATH"] = str(ROOT)
        return {**env, **extra}

    def start(self) -> None:
        # Ray 2.60's `ray start --head` turns token authentication on; its CLI
        # (and so the worker's `ray start`) needs RAY_AUTH_MODE=token to join.
        token = self.env(RAY_AUTH_MODE="token")
        head = [
            RAY, "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", f"--port={self.port}", "--num-cpus=2",
            '--resources={"kvfabric_head": 1000}', "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={self.client_port}",
        ]  # fmt: skip
        self.procs.append(self._spawn(head, token, "head"))
        assert wait_for(self._bootstrapped, 90), self._logs()
        self.address = bootstrap_file().read_text().strip()
        worker = [
            RAY, "start", "--block", "--disable-usage-stats", f"--address={self.address}",
            "--node-ip-address=127.0.0.1", "--num-cpus=2", '--resources={"worker_node": 1}',
        ]  # fmt: skip
        self.procs.append(self._spawn(worker, token, "worker"))
        assert wait_for(lambda: self.nodes() == 2, 90), self._logs()

    def _spawn(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - the process keeps it
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _bootstrapped(self) -> bool:
        path = bootstrap_file()
        return path.exists() and path.read_text().strip().endswith(f":{self.port}")

    def _logs(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in self.tmp.glob("*.log"))

    def nodes(self) -> int:
        done = subprocess.run(
            [RAY, "list", "nodes", f"--address={self.address}", "--format=json"],
            env=self.env(RAY_AUTH_MODE="token"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        try:
            return sum(n["state"] == "ALIVE" for n in json.loads(done.stdout))
        except ValueError:
            return 0

    def stop(self) -> None:
        for p in reversed(self.procs):  # `ray start --block` stops what it started
            p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        path = bootstrap_file()
        if path.exists() and path.read_text().strip() == self.address:
            path.unlink()


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    if bootstrap_file().exists():
        pytest.fail(f"a `ray start` cluster already runs here ({bootstrap_file()}): stop it first")
    c = Cluster(tmp_path_factory.mktemp("ray-start"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def kvfabric(c: Cluster, *args: str, timeout: float = 180, **env: str):
    argv = [sys.executable, "-m", "fabric.cli", *args]
    return subprocess.run(
        argv, env=c.env(**env), capture_output=True, text=True, timeout=timeout, cwd=c.tmp
    )


def keep(c: Cluster, *args: str) -> subprocess.Popen:
    """``kvfabric run --keep``: returns once the fabric is up and serving is done."""
    log = c.tmp / f"keep-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", "run", "--requests", "4", "--keep", *args],
        env=c.env(),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),  # noqa: SIM115 - the process keeps it
        cwd=c.tmp,
        # Ctrl-C works as in a terminal even when the tests run in the background
        # of a shell without job control, which starts them with SIGINT ignored
        # (and an ignored signal stays ignored in every child).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    proc.log = log  # type: ignore[attr-defined]
    assert wait_for(lambda: "keeps running" in log.read_text() or proc.poll() is not None, 180)
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops ``kvfabric run --keep``; a minute before a kill."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        # Where it hangs, for the failure message (py-spy comes with Ray's extra).
        spy = Path(sys.executable).with_name("py-spy")
        try:
            dump = subprocess.run(
                [str(spy), "dump", "--pid", str(proc.pid)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            proc.stack = dump.stdout + dump.stderr  # type: ignore[attr-defined]
        except (OSError, subprocess.TimeoutExpired) as exc:
            proc.stack = f"no stack: {exc}"  # type: ignore[attr-defined]
        proc.kill()
        proc.wait()


def quiet(stderr: str) -> None:
    """Nothing but kvfabric's own lines: no traceback, no Ray INFO/WARNING line."""
    assert "Traceback" not in stderr, stderr[-3000:]
    for line in stderr.splitlines():
        assert line.startswith(("kvfabric", "serving", "  ")) or not line.strip(), (
            f"a line that is not kvfabric's: {line!r}\n{stderr[-3000:]}"
        )


def one_line_refusal(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvfabric: error:")]
    assert len(lines) == 1, done.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_run_with_no_address_uses_the_ray_start_cluster_quietly(ray_cluster):
    done = kvfabric(ray_cluster, "run", "--requests", "6", *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    quiet(done.stderr)
    assert f"on the Ray cluster at {ray_cluster.address}" in done.stderr
    assert "ray start" in done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["served"] == 6 and out["resets"] == 0


def test_fabrics_side_by_side_a_taken_name_refused_and_status_names_its_cluster(ray_cluster):
    first = keep(ray_cluster, "--name", "first", *SMALL)
    try:
        # A second fabric under another name, through `auto`, on the same cluster.
        done = kvfabric(ray_cluster, "run", "--address", "auto", "--requests", "4", *SMALL)
        assert done.returncode == 0, done.stderr[-3000:]
        quiet(done.stderr)
        # The same name: one line that says what to change; the running one is untouched.
        taken = kvfabric(ray_cluster, "run", "--address", "auto", "--name", "first", *SMALL)
        one_line_refusal(taken, "'first' already runs", "--name")
        # Ray Client, then the same status three times over: always this cluster.
        # (Ray Client starts a server process per connection; on a loaded 2-core
        # machine that start can outlast Ray's own wait, so a second try is allowed.)
        client = f"ray://127.0.0.1:{ray_cluster.client_port}"
        for _ in range(2):
            done = kvfabric(ray_cluster, "status", "--address", client, "--name", "first", "--json")
            if "ConnectionAbortedError" not in done.stderr:
                break
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["status"]["requests"]["finished"] == 4
        for _ in range(3):
            done = kvfabric(ray_cluster, "status", "--name", "first", "--json")
            assert done.returncode == 0, done.stderr[-3000:]
            quiet(done.stderr)
            assert json.loads(done.stdout)["status"]["cluster"] == ray_cluster.address
        missing = kvfabric(ray_cluster, "status", "--name", "nobody")
        one_line_refusal(missing, "no fabric named 'nobody'", ray_cluster.address)
    finally:
        stop(first)
    assert first.returncode == 0, (
        first.log.read_text()[-3000:] + getattr(first, "stack", "")[-6000:]  # type: ignore[attr-defined]
    )


def test_a_private_fabric_beside_the_cluster_and_auto_tells_them_apart(ray_cluster):
    # The private Ray's dashboard asks for the port the cluster's dashboard holds.
    private = keep(
        ray_cluster,
        "--address",
        "local",
        "--name",
        "private",
        "--set",
        f"runtime.dashboard_port={ray_cluster.dashboard_port}",
        *SMALL,
    )
    try:
        log = private.log.read_text()  # type: ignore[attr-defined]
        quiet(log)
        assert "a new local Ray" in log
        assert f"127.0.0.1:{ray_cluster.dashboard_port}" not in log
        on_cluster = keep(ray_cluster, "--name", "shared", *SMALL)
        try:
            seen = set()
            for name in ("private", "shared", "private", "shared"):
                done = kvfabric(
                    ray_cluster, "status", "--address", "auto", "--name", name, "--json"
                )
                assert done.returncode == 0, done.stderr[-3000:]
                seen.add((name, json.loads(done.stdout)["status"]["cluster"]))
            assert len(seen) == 2, seen  # each name always on its own cluster
            assert ("shared", ray_cluster.address) in seen
        finally:
            stop(on_cluster)
    finally:
        stop(private)


def test_a_driver_under_ray_job_submit_launches_its_fabric(ray_cluster):
    driver = ray_cluster.tmp / "driver.py"
    driver.write_text(
        "from fabric.client import launch\n"
        "from fabric.config import FabricConfig\n"
        "f = launch(FabricConfig().with_overrides(['runtime.name=job', 'model.layers=2',\n"
        f"    'storage.path={ray_cluster.tmp / 'l3-job'}']))\n"
        "r = f.submit(list(range(256)), timeout=60)\n"
        "again = f.submit(list(range(256)), timeout=60)\n"
        "print('JOB', r.error, again.device_hit_tokens, f.cluster_address, flush=True)\n"
        "f.release(r.lease); f.release(again.lease); f.shutdown()\n"
    )
    submit = [
        RAY, "job", "submit", f"--address=http://127.0.0.1:{ray_cluster.dashboard_port}",
        "--runtime-env-json", json.dumps({"env_vars": {"PYTHONPATH": str(ROOT)}}),
        "--", sys.executable, str(driver),
    ]  # fmt: skip
    done = subprocess.run(
        submit,
        env=ray_cluster.env(RAY_AUTH_MODE="token"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("JOB "))
    _, error, device, address = line.split()
    assert error == "None" and int(device) > 0 and address == ray_cluster.address


def test_no_cluster_at_an_address_is_one_line(ray_cluster):
    done = kvfabric(ray_cluster, "status", "--address", f"127.0.0.1:{free_port()}")
    one_line_refusal(done, "no Ray cluster at --address=")
