from __future__ import annotations

import numpy as np
import pytest

from fabric.l3.file import FileBackend
from fabric.l3.format import Provenance

PROV = Provenance("m", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4)
PAGE_BYTES = 2 * 4 * 1 * 1 * 8 * 2


def keys(n: int, suffix: str = "0-0-0", start: int = 0, prov: Provenance = PROV) -> list[str]:
    return [f"{i:064x}.{prov.tag}.{suffix}" for i in range(start, start + n)]


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE_BYTES), dtype=np.uint8)


@pytest.fixture
def file_backend(tmp_path):
    return FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "l3")})


def storage_options(tmp_path, *more: str) -> list[str]:
    return [f"storage.path={tmp_path / 'l3'}", "storage.backend=file", *more]
