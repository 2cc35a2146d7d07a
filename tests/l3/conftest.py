from __future__ import annotations

import pytest

from fabric.l3.file import FileBackend
from tests.helpers import PAGE_BYTES, PROV


@pytest.fixture
def file_backend(tmp_path):
    return FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path / "l3")})
