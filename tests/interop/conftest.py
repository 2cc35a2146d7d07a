"""The interop tier: kvfabric driven by the engines' own code (SGLang 0.5.20, vLLM
0.33.0, Hugging Face transformers), installed by ``tests/interop/setup_engines.sh``
into ``.interop/`` — the README's test command runs it first. Every test module
here is marked ``interop`` (``python3 -m pytest -m interop`` runs them)."""

from __future__ import annotations

import pytest

from tests.interop.engine_env import activate

try:
    activate()
except RuntimeError as exc:
    raise pytest.UsageError(str(exc)) from None
