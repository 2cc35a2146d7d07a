"""Progress of long work on stderr: a bar with rate and ETA on a terminal
(tqdm), plain lines now and then when stderr is a file or a pipe, so logs hold
no carriage returns."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

PLAIN_EVERY_S = 5.0
tqdm.monitor_interval = 0  # no monitor thread: bars are updated from the work's own thread


class Progress:
    """``update(done)`` with the count done so far; ``close()`` at the end."""

    def __init__(
        self, total: int, unit: str = "requests", desc: str = "", stream: TextIO | None = None
    ) -> None:
        self.total, self.unit, self.desc = total, unit, desc or "kvfabric"
        self.stream = stream or sys.stderr
        self.done = 0
        self.started = self.last_line = time.monotonic()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = (
            tqdm(
                total=total,
                unit=f" {unit}",
                desc=self.desc,
                file=self.stream,
                leave=True,
                mininterval=0.2,
            )
            if tty
            else None
        )

    def update(self, done: int) -> None:
        grown, self.done = done - self.done, done
        if self.bar is not None:
            self.bar.update(grown)
            return
        now = time.monotonic()
        if done >= self.total or now - self.last_line >= PLAIN_EVERY_S:
            self.last_line = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        pct = 100 * self.done / self.total if self.total else 100.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "done" if self.done >= self.total else f"ETA {_duration(left)}"
        return (
            f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct:.0f}%), "
            f"{rate:,.1f} {self.unit}/s, {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown"
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m:02d} min"
