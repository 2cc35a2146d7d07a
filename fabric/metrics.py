"""Prometheus metrics from a fabric's ``stats()`` snapshot.

Every number in the snapshot becomes a gauge named after its path
(``kvfabric_tokens_storage_hit``, ``kvfabric_l3_refused_checksum``, ...). The
HTTP endpoint binds to 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

_NAME = re.compile(r"[^a-zA-Z0-9_]")


def flatten(snapshot: Mapping[str, Any], prefix: str = "kvfabric") -> Iterator[tuple[str, float]]:
    """``(metric name, value)`` for every int, float or bool in a nested snapshot."""
    for key, value in snapshot.items():
        name = f"{prefix}_{_NAME.sub('_', str(key))}"
        if isinstance(value, Mapping):
            yield from flatten(value, name)
        elif isinstance(value, (int, float)):
            yield name, float(value)


class MetricsExporter:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}

    def update(self, snapshot: Mapping[str, Any]) -> None:
        for name, value in flatten(snapshot):
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = self.gauges[name] = Gauge(
                    name, name.replace("_", " "), registry=self.registry
                )
            gauge.set(value)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
