"""``kvfabric pin``: keep a cached prefix from eviction for a while."""

from __future__ import annotations

import json

import click

from fabric.cli.options import cluster_options, connect, emit, json_option, say
from fabric.errors import FabricError
from fabric.observe.report import result


@click.command()
@cluster_options
@click.argument("tokens")
@click.option("--namespace", default="default", show_default=True, help="The tokens' namespace.")
@click.option("--ttl", type=float, default=300.0, show_default=True, help="Seconds the pin lasts.")
@click.option("--undo", is_flag=True, help="Unpin instead.")
@json_option
def pin(address, name, ray_namespace, tokens, namespace, ttl, undo, as_json) -> None:
    """Pin the cached prefix of TOKENS (comma-separated ids, or @file with one JSON list)."""
    ids = _token_ids(tokens)
    fabric = connect(address, name, ray_namespace)
    if undo:
        n = fabric.unpin(ids, namespace)
        say(as_json, f"kvfabric {name}: {n} tokens unpinned")
        emit(result("pin", fabric=name, pin={"action": "unpin", "tokens": n}))
        return
    got = fabric.pin(ids, ttl, namespace)
    say(
        as_json,
        f"kvfabric {name}: {got.pinned_tokens} tokens pinned for {ttl:g} s"
        + (f" ({got.reason})" if got.reason else ""),
    )
    emit(
        result(
            "pin",
            fabric=name,
            pin={"action": "pin", "tokens": got.pinned_tokens, "reason": got.reason},
        )
    )


def _token_ids(text: str) -> list[int]:
    try:
        if text.startswith("@"):
            with open(text[1:]) as f:
                ids = json.load(f)
        else:
            ids = [int(t) for t in text.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        raise FabricError(
            f"TOKENS {text[:40]!r} is refused: allowed is comma-separated ints or @file "
            f"holding a JSON list ({exc})"
        ) from None
    if not isinstance(ids, list) or not ids:
        raise FabricError(f"TOKENS {text[:40]!r} is refused: it names no token")
    return ids
