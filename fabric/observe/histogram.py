"""A fixed-bucket histogram: cheap to observe in the coordinator's hot path,
exported as a Prometheus histogram at scrape time (cumulative ``le`` buckets)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# Seconds: from a millisecond to a minute.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Tokens moved by one transfer: a page of 16 up to 4M, by 4x.
TOKENS = tuple(16 * 4**i for i in range(10))


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last (Prometheus' layout)."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", self.count))
        return out
