"""Ray Serve LLM with the connector: ``examples/serve_vllm.py --check`` deploys two
OpenAI deployments of vLLM on a Ray of its own, both attached to one fabric,
and sends one prompt over HTTP to each: the second loads the pages the first
computed, and both answer the same."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_engine import tiny_llama
from tests.vllm_engine.engine import BLOCK_SIZE

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 1200  # examples/serve_vllm.py's check prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_second_serve_deployment_loads_the_prompt_the_first_computed(tmp_path):
    model = tiny_llama.make(tmp_path / "model")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_vllm.py"), "--model", str(model),
         "--storage-path", str(tmp_path / "l3"), "--port", str(free_port()), "--check",
         "--block-size", str(BLOCK_SIZE), "--timeout-s", "400",
         "--l2-bytes", str(64 << 20), "--l2-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    logs = proc.stderr + proc.stdout
    assert proc.returncode == 0, logs[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"same_text"')]
    result = json.loads(line)
    assert result["same_text"]
    pages = result["engine_pages"]
    whole = (PROMPT_TOKENS - 1) // BLOCK_SIZE
    assert pages["whole_pages"] == whole  # the first deployment stored the prompt
    assert pages["hit_pages"] == whole  # the second loaded all of it
