"""``kvfabric events``: a running fabric's KV events, one JSON line each."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from fabric.cli.options import cluster_options, connect, emit
from fabric.errors import FabricError
from fabric.observe.report import result


@click.command()
@cluster_options
@click.option(
    "--limit", type=int, default=1000, show_default=True, help="Events per poll (take_events)."
)
@click.option("--namespace", help="Only this namespace's events.")
@click.option("--follow", is_flag=True, help="Keep printing events as they come (Ctrl-C stops).")
@click.option(
    "--interval",
    type=float,
    default=1.0,
    show_default=True,
    help="With --follow: seconds between polls.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Accepted for uniformity: the output is JSON already (a line per event, then the count).",
)
def events(address, name, ray_namespace, limit, namespace, follow, interval, as_json) -> None:
    """Print a running fabric's KV events, one JSON line each (the routers' maps).

    A fabric without events.endpoint keeps its events for take_events: they are
    drained here (a router taking them too would miss these). A fabric that
    publishes on ZMQ is read there instead, as a router reads it: the replay
    socket's buffer first, then (--follow) the live feed.
    """
    fabric = connect(address, name, ray_namespace)
    published = fabric.stats().get("kv_events")
    shown = 0

    def show(batch: list[dict[str, Any]]) -> None:
        nonlocal shown
        for e in batch:
            # A clear of every namespace (namespace "") concerns each of them.
            if namespace is None or e.get("namespace") in (namespace, ""):
                click.echo(json.dumps(e))  # one JSON line per event, with --json too
                shown += 1

    try:
        if published:
            _zmq_events(published, fabric.config.events.topic, follow, show)
        else:
            from fabric.coordinator.publisher import to_wire

            page = fabric.config.cache.page_size
            while True:
                show([_event_dict(e) for e in to_wire(fabric.take_events(limit, namespace), page)])
                if not follow:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    emit(result("events", fabric=name, events=shown))


def _zmq_events(
    published: dict[str, Any], topic: str, follow: bool, show: Callable[[list], None]
) -> None:
    """Read a publishing fabric's events: replay from batch 0, then the live feed."""
    import msgspec
    import zmq

    replay, endpoint = published.get("replay_endpoint"), published["endpoint"]
    if not replay and not follow:
        raise FabricError(
            f"the fabric publishes KV events at {endpoint} with no events.replay_endpoint: "
            "pass --follow to read the live feed"
        )
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if follow:  # subscribe first: nothing published after the replay is missed
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        seen = -1
        if replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send((0).to_bytes(8, "big"))
            while dealer.poll(5000):
                # [topic, seq, payload] (vllm dialect) or [seq, payload] (sglang)
                *_, seq, payload = dealer.recv_multipart()
                if not payload:
                    break  # the end-of-replay marker
                seen = int.from_bytes(seq, "big")
                show(msgspec.msgpack.decode(payload)[1])
            else:
                raise FabricError(f"no answer from the KV event replay socket at {replay}")
        while follow:
            if sub.poll(1000):
                _, seq, payload = sub.recv_multipart()
                if int.from_bytes(seq, "big") > seen:  # not one the replay gave
                    show(msgspec.msgpack.decode(payload)[1])
    finally:
        ctx.destroy(linger=0)


def _event_dict(event: Any) -> dict[str, Any]:
    """An event as the routers' map (``type`` first), for a JSON line."""
    import msgspec

    return msgspec.to_builtins(event)
