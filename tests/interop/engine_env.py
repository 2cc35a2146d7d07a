"""Where the interop tier's engines live (``.interop/``, made by
``tests/interop/setup_engines.sh``) and how a process reaches them: the
engines' directories go at the end of ``sys.path``, so nothing they bring
replaces a package of the project's own environment; transformers is asked
whether torchvision is available before the stand-in torchvision becomes
importable, so it caches the answer (no) and never reaches for the stand-in's
image transforms. The interop tests and ``bench/engines.py`` both start here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / ".interop"


def activate(interop: Path = INTEROP) -> None:
    """Make SGLang and vLLM's modules importable; ``RuntimeError`` naming the setup
    script when they are not installed."""
    if not (interop / "ready").is_file():
        raise RuntimeError(
            f"the engines are not installed in {interop}: run tests/interop/setup_engines.sh "
            "(the README's test command does)"
        )
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    for path in (interop / "site", interop / "vllm", interop / "stand-ins"):
        if str(path) not in sys.path:
            sys.path.append(str(path))
