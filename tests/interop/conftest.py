"""The interop tier: kvfabric driven by the engines' own code (SGLang 0.5.20, vLLM
0.33.0, Hugging Face transformers), installed by ``tests/interop/setup_engines.sh``
into ``.interop/`` — the README's test command runs it first.

The engines' directories go at the end of ``sys.path``, so nothing they bring
replaces a package of the project's own environment. transformers is asked
whether torchvision is available before the stand-in torchvision becomes
importable: it caches the answer (no), so transformers never reaches for the
stand-in's image transforms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / ".interop"
PATHS = [INTEROP / "site", INTEROP / "vllm", INTEROP / "stand-ins"]


def _activate() -> None:
    if not (INTEROP / "ready").is_file():
        raise pytest.UsageError(
            "the interop tests need the engines: run tests/interop/setup_engines.sh first "
            "(the README's test command does)"
        )
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    for path in map(str, PATHS):
        if path not in sys.path:
            sys.path.append(path)


_activate()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.interop)
