"""Helpers shared by test modules."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from hypothesis import HealthCheck, settings

# ``ci`` (the default) keeps the suite quick; ``deep`` runs thousands of examples per
# state machine with fresh random seeds: KVFABRIC_HYPOTHESIS=deep python3 -m pytest tests -k Machine
HYPOTHESIS_PROFILE = os.environ.get("KVFABRIC_HYPOTHESIS", "ci")
_DEEP_EXAMPLES = {"ci": None, "deep": 2000}


def machine_settings(examples: int, steps: int) -> settings:
    """Settings of a Hypothesis state machine: ``examples`` under the ci profile, at
    least 2,000 (and 10x as many) under ``deep``."""
    if HYPOTHESIS_PROFILE not in _DEEP_EXAMPLES:
        raise ValueError(
            f"KVFABRIC_HYPOTHESIS={HYPOTHESIS_PROFILE!r} is refused: allowed is ci or deep"
        )
    deep = _DEEP_EXAMPLES[HYPOTHESIS_PROFILE]
    return settings(
        max_examples=examples if deep is None else max(deep, 10 * examples),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=False,
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` until it holds (``True``) or ``timeout`` seconds pass (``False``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
