"""``kvfabric status`` and ``kvfabric top``: a running fabric at a glance, once or live."""

from __future__ import annotations

import sys
import time

import click

from fabric.cli.options import cluster_options, connect, emit, json_option
from fabric.cli.render import status_text
from fabric.errors import FabricError
from fabric.observe.report import result


@click.command()
@cluster_options
@click.option(
    "--watch",
    type=float,
    default=0.0,
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (0: once).",
)
@click.option("--count", type=int, default=0, help="With --watch: stop after this many (0: never).")
@json_option
def status(address, name, ray_namespace, watch, count, as_json) -> None:
    """Show a running fabric: actors, epoch, per-tier usage, transfers in flight, L3 usage."""
    if watch < 0 or count < 0:
        raise FabricError(
            f"--watch {watch} / --count {count} are refused: allowed are numbers >= 0"
        )
    fabric = connect(address, name, ray_namespace)
    shown = 0
    while True:
        st = {**fabric.status(), "cluster": fabric.cluster_address}
        if not as_json:
            if watch and sys.stdout.isatty():
                click.clear()
            click.echo(status_text(st, fabric.dashboard_hint()))
        emit(result("status", fabric=st["fabric"], status=st))
        shown += 1
        if not watch or (count and shown >= count):
            return
        time.sleep(watch)


@click.command()
@cluster_options
@click.option(
    "--interval", type=float, default=1.0, show_default=True, help="Seconds between frames."
)
@click.option("--count", type=int, default=0, help="Stop after this many frames (0: never).")
def top(address, name, ray_namespace, interval, count) -> None:
    """A live view of a running fabric: tokens moved per direction per second,
    hit rate per tier, requests in flight, pool use (Ctrl-C stops)."""
    from fabric.tools.top import watch

    if interval <= 0 or count < 0:
        raise FabricError(
            f"--interval {interval} / --count {count} are refused: allowed are "
            "--interval > 0 and --count >= 0"
        )
    fabric = connect(address, name, ray_namespace)
    shown = watch(fabric.status, interval, count)
    emit(result("top", fabric=name, frames=shown))
