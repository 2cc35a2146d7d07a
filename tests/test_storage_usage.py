"""``kvfabric storage usage --path DIR``: a store directory's pages per model and
writer, read without a fabric."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from fabric.engines.keys import PageNamer
from fabric.engines.store import StoreOptions, open_store
from fabric.l3.format import Provenance
from fabric.observe.report import SCHEMA

SGLANG = Provenance("llama", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4)
VLLM = Provenance("llama", "vllm/0123456789abcdef", "uint8", (128,), 16, "vllm")


def usage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fabric.cli", "storage", "usage", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_usage_of_a_directory_names_each_engine_and_model(tmp_path):
    for writer, prov, n in (("sglang", SGLANG, 3), ("vllm", VLLM, 2), ("hf", SGLANG, 1)):
        store = open_store(StoreOptions(path=str(tmp_path)), writer)
        hashes = [bytes([len(writer), i]) * 16 for i in range(n)]
        rows = np.zeros((n, 128), dtype=np.uint8)
        assert all(store.store(PageNamer(prov, "0-0-0").keys(hashes), rows, prov))
        store.close()
    done = usage("--path", str(tmp_path))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "hf,sglang" in text and "vllm/0123456789abcdef" in text
    out = json.loads(text.strip().splitlines()[-1])
    import jsonschema

    jsonschema.validate(out, SCHEMA)
    rows = {
        tuple(r["writers"]): (r["model_id"], r["pages"], r["component"])
        for r in out["storage"]["writers"]
    }
    assert rows == {("hf", "sglang"): ("llama", 4, "full"), ("vllm",): ("llama", 2, "vllm")}
    assert out["storage"]["pages"] == 6


def test_usage_of_a_path_that_is_not_a_store_says_so(tmp_path):
    (tmp_path / "file").write_text("x")
    done = usage("--path", str(tmp_path / "file" / "sub"))
    assert done.returncode != 0
    assert "cannot be used" in done.stderr and "Traceback" not in done.stderr
