"""``kvfabric demo``: a workload through the cache core alone."""

from __future__ import annotations

import time

import click

from fabric import __version__
from fabric.cli.options import (
    config_options,
    emit,
    json_option,
    load,
    read_requests,
    workload_options,
)
from fabric.cli.render import tiers_text
from fabric.observe.progress import Progress
from fabric.observe.report import result, workload


@click.command()
@workload_options(2000)
@config_options
@json_option
def demo(trace, workload_kind, requests, config_file, overrides, as_json) -> None:
    """Serve a workload through the cache core alone (no Ray, an in-memory L3)."""
    from fabric.cache.inprocess import CoreReplay
    from fabric.tools.workload import iter_packed

    config = load(config_file, overrides)
    reqs, source = read_requests(trace, requests, workload_kind)
    replay = CoreReplay(config)
    started = time.perf_counter()
    with Progress(len(reqs), "requests", "core") as progress:
        stats = replay.run((p for _, p in iter_packed(reqs)), progress.update)
    elapsed = time.perf_counter() - started
    replay.cache.check_integrity()
    refused = (
        {"larger than L1 or no room": stats.refused_requests} if stats.refused_requests else {}
    )
    out = result(
        "demo", **workload(source, stats.requests, stats.tokens.as_dict(), refused, elapsed)
    )
    if not as_json:
        click.echo(f"kvfabric {__version__} core demo: {stats.requests} requests from {source}")
        click.echo(tiers_text(out["tokens_by_tier"]))
        click.echo(
            f"  refused   {stats.refused_requests:>12,} requests (larger than L1 or no room)"
        )
        click.echo(f"  {out['requests_per_s']:,} requests/s through the core")
    emit(out)
