"""The whole suite, in two tiers at once: the README's test command.

    python3 tests/run.py            # every test
    python3 tests/run.py -x -k l3   # pytest's own options go to both tiers

The tests that start Ray (and the chaos and browser tests) leave the machine's cores
idle about half of their time: they wait for processes to start, actors to come
back, faults to be recovered from. The other tests are pure computation. So the
Ray tier runs in the foreground as it would alone, and the rest runs beside it at
a lower CPU priority (``nice``), taking only the cores the Ray tier leaves idle:
the Ray tier's timing is what it is alone, and the whole takes about as long as
the Ray tier. The second tier's output is printed once it ends; each tier's time
and exit status come last, and the exit status is the first failing tier's.

``python3 -m pytest tests`` still runs everything, one tier after the other.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY_TIER = "ray or chaos or browser"
NO_TESTS = 5  # pytest's exit status when a selection holds no test
# Below Ray's own workers, which Ray starts at nice 15: the other tier never
# takes a core from the Ray tier's actors.
NICE = 19


def pytest_argv(marker: str, extra: list[str]) -> list[str]:
    """Both tiers' command: ``tests`` unless ``extra`` names paths of its own."""
    named = any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in extra)
    return [sys.executable, "-m", "pytest", *([] if named else ["tests"]), "-m", marker, *extra]


def lower_priority() -> None:
    os.nice(NICE)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed to both tiers")
    argv = sys.argv[1:]
    # Every argument but --help is pytest's, options included (argparse would take
    # pytest's options for its own, so it sees only --help).
    ap.parse_args(["-h"] if {"-h", "--help"} & set(argv) else [])
    if any(a.startswith("-m") for a in argv):  # -m X, or -mX
        ap.error(
            "-m is refused: each tier chooses its own markers; for a marker of your "
            "own run python3 -m pytest tests -m ..."
        )
    extra = argv
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        other = subprocess.Popen(
            pytest_argv(f"not ({RAY_TIER})", extra),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lower_priority,
        )
        ended: dict[str, float] = {}
        watch = threading.Thread(
            target=lambda: (other.wait(), ended.setdefault("rest", time.monotonic())),
            daemon=True,
        )
        watch.start()
        print(f"+ the Ray tier (-m {RAY_TIER!r}); the rest beside it at nice {NICE}", flush=True)
        try:
            ray_status = subprocess.call(pytest_argv(RAY_TIER, extra), cwd=ROOT)
        except KeyboardInterrupt:
            other.terminate()
            raise
        ray_s = time.monotonic() - started
        if other.poll() is None:
            print("+ waiting for the rest", flush=True)
        watch.join()
        other_status = other.returncode
        other_s = ended["rest"] - started
        log.seek(0)
        print(f"+ the rest (-m 'not ({RAY_TIER})'):", flush=True)
        sys.stdout.write(log.read())
    statuses = {"ray": ray_status, "rest": other_status}
    print(
        f"tier times: Ray tier {ray_s:.0f} s (exit {ray_status}); "
        f"the rest {other_s:.0f} s (exit {other_status}), beside it",
        flush=True,
    )
    if all(s == NO_TESTS for s in statuses.values()):
        return NO_TESTS
    return next((s for s in statuses.values() if s not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main())
