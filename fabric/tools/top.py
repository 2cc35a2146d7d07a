"""``kvfabric top``: a live terminal view of a running fabric for operators
without Grafana — tokens moved per direction per second, where prompt tokens
came from (hit rate per tier), requests in flight, pool use, resets, and the
pages of engines attached through a connector per place and tenant.

Each frame is computed from two ``status`` snapshots (``Fabric.status``) and the
seconds between them; ``frame`` is pure (no Ray, no terminal), ``watch`` draws
frames with rich's ``Live`` until interrupted or ``count`` frames are shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

DIRECTIONS = {
    "device_to_host": "L1 > L2",
    "host_to_device": "L2 > L1",
    "host_to_storage": "L2 > L3",
    "storage_to_host": "L3 > L2",
}
SOURCES = {"device": "L1", "host": "L2", "storage": "L3", "computed": "computed"}


def rates(prev: Mapping[str, Any] | None, cur: Mapping[str, Any], seconds: float) -> dict:
    """Per second since ``prev`` (zeros for the first frame): tokens moved by
    direction, prompt tokens served by source, requests finished."""
    span = max(seconds, 1e-9)

    def per_s(key: str, name: str) -> float:
        if prev is None:
            return 0.0
        return max(0.0, cur[key].get(name, 0) - prev[key].get(name, 0)) / span

    return {
        "moved": {d: per_s("transfer_tokens", d) for d in DIRECTIONS},
        "served": {s: per_s("prompt_tokens", s) for s in SOURCES},
        "requests": (
            0.0
            if prev is None
            else max(0, cur["requests"]["finished"] - prev["requests"]["finished"]) / span
        ),
    }


def frame(prev: Mapping[str, Any] | None, cur: Mapping[str, Any], seconds: float) -> Group:
    """One screen: a header, transfers, hit rate per tier, pools."""
    r = rates(prev, cur, seconds)
    now = cur["requests_now"]
    header = Text.assemble(
        (f"kvfabric {cur['fabric']}", "bold"),
        f"  epoch {cur['epoch']}  resets {cur['resets']}  ",
        f"{r['requests']:.1f} req/s  in flight: waiting {now['waiting']}, ",
        f"prefetching {now['prefetching']}, running {now['running']}  leases {cur['leases']}",
    )
    moved = Table(title="transfers", expand=True)
    moved.add_column("direction")
    moved.add_column("tokens/s", justify="right")
    moved.add_column("tokens since start", justify="right")
    moved.add_column("in flight (ops)", justify="right")
    flight = cur.get("inflight_transfers", {})
    for d, label in DIRECTIONS.items():
        moved.add_row(
            label,
            f"{r['moved'][d]:,.0f}",
            f"{cur['transfer_tokens'].get(d, 0):,}",
            str(flight.get(d, "")),
        )
    served = Table(title="prompt tokens by source", expand=True)
    served.add_column("source")
    served.add_column("tokens/s", justify="right")
    served.add_column("share since start", justify="right")
    total = max(1, sum(cur["prompt_tokens"].get(s, 0) for s in SOURCES))
    for s, label in SOURCES.items():
        share = 100 * cur["prompt_tokens"].get(s, 0) / total
        served.add_row(label, f"{r['served'][s]:,.0f}", f"{share:5.1f}%")
    pools = Table(title="pools", expand=True)
    pools.add_column("tier")
    pools.add_column("used / capacity (tokens)", justify="right")
    for tier, sizes in cur["tiers"].items():
        cap = max(1, sizes["capacity"])
        used = cap - sizes["free"]
        pools.add_row(tier, f"{used:,} / {sizes['capacity']:,} ({100 * used / cap:.1f}%)")
    return Group(header, moved, served, pools, *_engines(cur.get("engines") or {}))


def _engines(engines: Mapping[str, Any]) -> list[Table]:
    """Pages of engines attached through a connector, per place of the tree (none
    while no engine stored any)."""
    places = engines.get("places") or {}
    if not any(p["pages"] for p in places.values()):
        return []
    hits = engines.get("hit_pages", {})
    table = Table(
        title=f"engine pages (hits: L2 {hits.get('l2', 0):,}, L3 {hits.get('l3', 0):,})",
        expand=True,
    )
    for column in ("place", "pages", "bytes", "by tenant"):
        table.add_column(column, justify="left" if column in ("place", "by tenant") else "right")
    for place, p in places.items():
        tenants = ", ".join(f"{t} {n:,}" for t, n in sorted(p["tenants"].items()))
        table.add_row(place, f"{p['pages']:,}", f"{p['bytes']:,}", tenants)
    return [table]


def watch(
    snapshot: Callable[[], Mapping[str, Any]],
    interval: float,
    count: int = 0,
    console: Console | None = None,
) -> int:
    """Draw a frame every ``interval`` seconds (``count`` frames; 0: until
    interrupted). Returns the frames drawn."""
    console = console or Console()
    prev, prev_at, shown = None, time.monotonic(), 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while True:
                cur, at = snapshot(), time.monotonic()
                live.update(frame(prev, cur, at - prev_at), refresh=True)
                prev, prev_at, shown = cur, at, shown + 1
                if count and shown >= count:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
    return shown
