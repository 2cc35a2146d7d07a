"""The README's driver script runs as written and prints what its comments say:
taken from the README itself, run in a process of its own on a private local
Ray (``RAY_ADDRESS=local``), with its L3 in a directory of the test's."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def driver_script() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From a Python driver") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_driver_script_runs_and_prints_what_it_says(tmp_path):
    script = driver_script()
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    first, again, other, tokens = done.stdout.strip().splitlines()[-4:]
    # The comments of the script's prints, on a first run (an empty L3).
    assert "# 599 on a first run" in script and first == "599"
    assert "# 592 hit, 10 computed" in script and again == "592 10"
    assert "# 599: tenants never share pages" in script and other == "599"
    by_tier = ast.literal_eval(tokens)
    assert by_tier["device"] == 592 and by_tier["computed"] == 599 + 10 + 599 + 1
