"""The coordinator's metrics, fed from one loop: each second the core's figures
go to Ray's metrics (``actors.ray_metrics``) and, with ``runtime.metrics_port``
set, to a Prometheus endpoint of its own (``fabric.observe.metrics``); L3's
counters are asked of the storage actors every few seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from actors.ray_metrics import CoordinatorMetrics
from actors.storage_group import StorageGroup
from fabric.config import RuntimeConfig
from fabric.coordinator.figures import Figures
from fabric.observe.metrics import MetricsExporter

log = logging.getLogger(__name__)

EVERY_S = 1.0
L3_EVERY_S = 5.0


def prometheus_exporter(runtime: RuntimeConfig) -> MetricsExporter | None:
    """A Prometheus endpoint on ``runtime.metrics_port`` (localhost unless
    ``metrics_host`` says otherwise), serving; none without a port."""
    if not runtime.metrics_port:
        return None
    exporter = MetricsExporter()
    exporter.serve(runtime.metrics_port, runtime.metrics_host)
    return exporter


async def feed_metrics(
    figures: Callable[[], Figures],
    storage: StorageGroup,
    ray_metrics: CoordinatorMetrics,
    exporter: MetricsExporter | None,
    kv_events: Callable[[], dict[str, Any] | None],
) -> None:
    """For ever: the figures now (``figures()``: the core may be replaced between
    two calls) to both sinks. Where the storage actors cannot answer, Prometheus
    keeps showing L3's last counters and Ray's metrics leave L3 alone."""
    l3: dict[str, Any] = {}
    fresh, next_l3 = False, 0.0
    while True:
        if time.monotonic() >= next_l3:
            next_l3 = time.monotonic() + L3_EVERY_S
            got = await storage.stats(5)
            fresh = "error" not in got
            if fresh:
                l3 = got
        f = figures()
        if exporter is not None:
            try:
                exporter.update(f, l3, kv_events())
            except Exception:
                log.warning("Prometheus metrics not updated", exc_info=True)
        try:
            ray_metrics.update(f, l3 if fresh else {})
        except Exception:
            log.warning("Ray metrics not updated", exc_info=True)
        await asyncio.sleep(EVERY_S)
