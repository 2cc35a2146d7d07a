"""What a chaos run holds while it runs: its options, its fabric and cluster, the
faults so far and the tally of requests. The harness (``harness.Chaos``) is
this plus what it does; the faults (``faults``) and the report (``verdict``)
read and fill it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from fabric.config import FabricConfig
from fabric.tools.chaos.options import ChaosOptions, Fault, Tally


class RunState:
    def __init__(self, opts: ChaosOptions, progress: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.progress = progress
        self.rng = random.Random(opts.seed)
        self.tally = Tally()
        self.faults: list[Fault] = []
        self.stop = threading.Event()
        self.cluster: Any = None
        self.fabric: Any = None
        self.config: FabricConfig | None = None
        self.t0 = 0.0
        self.stopped_pids: set[int] = set()
        self.placed: dict[str, dict] = {}
        # The last stats of each coordinator killed: its counters end with it, and
        # the report's are sums over every incarnation.
        self.incarnations: list[dict] = []
        self.l3_mount: str | None = None  # L3's own tmpfs (mount_l3)

    def now(self) -> float:
        return time.monotonic() - self.t0
