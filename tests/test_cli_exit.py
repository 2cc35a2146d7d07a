"""Ending a process that used Ray: Python's exit work still runs (atexit callbacks,
temporary directories, buffered output) and the exit status is the one asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def test_exit_process_runs_atexit_flushes_output_and_keeps_the_status():
    done = run(
        """
        import atexit, logging, sys
        from fabric.cli.exit import exit_process
        atexit.register(lambda: print("atexit ran"))
        logging.basicConfig(stream=sys.stderr)
        logging.getLogger("t").warning("logged")
        sys.stdout.write("buffered, no newline: ")
        exit_process(3)
        """
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline: atexit ran\n"
    assert "logged" in done.stderr


def test_exit_process_waits_for_threads_and_queued_executor_work():
    done = run(
        """
        import os, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from fabric.cli.exit import exit_process
        def late(what):
            time.sleep(0.3)
            os.write(1, (what + "\\n").encode())  # one write: lines cannot interleave
        threading.Thread(target=late, args=("thread",)).start()
        pool = ThreadPoolExecutor(1)
        pool.submit(late, "job 1")
        pool.submit(late, "job 2")
        exit_process(0)
        """
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["1", "2", "job", "job", "thread"]


def test_exit_process_removes_temporary_directories_left_to_the_exit():
    done = run(
        """
        import tempfile
        from fabric.cli.exit import exit_process
        d = tempfile.TemporaryDirectory(prefix="kvfabric-exit-")
        open(d.name + "/page", "w").write("x")
        print(d.name, flush=True)
        exit_process(0)
        """
    )
    assert done.returncode == 0, done.stderr
    left = Path(done.stdout.strip())
    assert left.name.startswith("kvfabric-exit-")
    assert not left.exists(), f"{left} was left behind"


def test_finish_exits_normally_without_ray_and_skips_the_interpreter_teardown_with_it():
    probe = """
        import atexit, sys, types
        from fabric.cli.exit import finish
        if {with_ray}:
            sys.modules["ray"] = types.ModuleType("ray")
        class Late:  # finalised by the interpreter's own teardown, not by atexit
            def __del__(self):
                print("interpreter teardown", flush=True)
        keep = Late()
        atexit.register(lambda: print("atexit", flush=True))
        finish(4)
        """
    plain = run(probe.format(with_ray=False))
    assert plain.returncode == 4, plain.stderr
    assert plain.stdout.split() == ["atexit", "interpreter", "teardown"]

    with_ray = run(probe.format(with_ray=True))
    assert with_ray.returncode == 4, with_ray.stderr
    assert with_ray.stdout.split() == ["atexit"]
