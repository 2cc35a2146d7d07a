"""``bench/core_breakdown.py`` wraps the core's parts by name: when a part moves
(the cache split into placement, writes, ...) the bench must still time each
one, not fail or silently time nothing."""

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "core_breakdown.py"
PARTS = (
    "admission_us",
    "write_through_queueing_us",
    "apply_completions_us",
    "match_prefix_us",
    "in_process_stand_in_us",
)


@pytest.mark.parametrize("extra", [[], ["--free-hashes", "--set", "cache.eviction_policy=lru"]])
def test_the_breakdown_times_every_part_of_the_core(extra):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "60", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["requests"] == 60 and out["free_hashes"] == ("--free-hashes" in extra)
    assert all(out[part] > 0 for part in PARTS), out
    assert out["match_prefix_calls_per_request"] >= 1
    assert out["pages_hashed_per_request_stand_in"] > 0


def test_a_bad_override_is_refused_naming_it():
    run = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "5", "--set", "cache.eviction_policy=nope"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "nope" in run.stderr
