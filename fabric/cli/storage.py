"""``kvfabric storage``: attach, detach, clear and read a fabric's L3."""

from __future__ import annotations

import click

from fabric.cli.options import cluster_options, connect, emit, json_option, say
from fabric.l3 import BACKENDS
from fabric.observe.report import result


@click.group()
def storage() -> None:
    """Manage a running fabric's L3: attach, detach, clear, usage."""


@storage.command()
@cluster_options
@click.argument("backend", type=click.Choice(list(BACKENDS)))
@click.option(
    "--options",
    "options",
    default="{}",
    show_default=True,
    help="The backend's options: JSON, or @file.json/.toml/.yaml (see fabric/l3/options.py).",
)
@json_option
def attach(address, name, ray_namespace, backend, options, as_json) -> None:
    """Attach an L3 backend at runtime."""
    from fabric.l3 import parse_options

    parsed = parse_options(options)  # here: an @file is this machine's
    fabric = connect(address, name, ray_namespace)
    outcome = fabric.attach_storage(backend, parsed)
    say(as_json, f"kvfabric {name}: L3 {backend} {outcome}")
    emit(
        result(
            "storage",
            fabric=name,
            storage={"action": "attach", "backend": backend, "outcome": outcome},
        )
    )


@storage.command()
@cluster_options
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to drain in-flight L3 traffic.",
)
@json_option
def detach(address, name, ray_namespace, timeout, as_json) -> None:
    """Detach L3 (in-flight prefetches and backups drain first)."""
    fabric = connect(address, name, ray_namespace)
    done = fabric.detach_storage(timeout)
    say(as_json, f"kvfabric {name}: L3 {'detached' if done else 'not detached (still draining)'}")
    emit(result("storage", fabric=name, storage={"action": "detach", "done": bool(done)}))


@storage.command()
@cluster_options
@click.option("--yes", is_flag=True, help="Do not ask; delete every page.")
@json_option
def clear(address, name, ray_namespace, yes, as_json) -> None:
    """Delete every page in L3."""
    if not yes:
        click.confirm(f"Delete every L3 page of fabric {name!r}?", abort=True, err=True)
    fabric = connect(address, name, ray_namespace)
    done = fabric.clear_storage()
    say(as_json, f"kvfabric {name}: L3 {'cleared' if done else 'not cleared (none attached)'}")
    emit(result("storage", fabric=name, storage={"action": "clear", "done": bool(done)}))


@storage.command()
@cluster_options
@click.option(
    "--path",
    "store_path",
    default=None,
    help="Read this L3 directory itself (no fabric, no Ray): its pages per model and engine.",
)
@click.option(
    "--backend",
    type=click.Choice(["segment", "file"]),
    default="segment",
    show_default=True,
    help="With --path: the directory's backend (storage.backend).",
)
@json_option
def usage(address, name, ray_namespace, store_path, backend, as_json) -> None:
    """Show L3 usage, traffic counters, and which engine wrote which model's pages."""
    if store_path is not None:
        from fabric.engines.store import StoreOptions, open_store

        store = open_store(StoreOptions(path=store_path, backend=backend, max_bytes=0), "kvfabric")
        try:
            l3 = {"attached": True, **store.backend.stats()}
            writers = store.backend.usage_by_writer()
        finally:
            store.close()
        where = store_path
    else:
        fabric = connect(address, name, ray_namespace)
        l3 = fabric.status()["l3"]
        writers = fabric.storage_usage() if l3.get("attached") else []
        where = f"kvfabric {name}"
    if not as_json:
        if not l3.get("attached"):
            click.echo(f"{where}: no L3 attached")
        else:
            click.echo(f"{where}: L3 {l3.get('backend')}")
            for key, value in sorted(l3.items()):
                if key not in ("attached", "backend"):
                    click.echo(f"  {key:<22} {value}")
            if writers:
                click.echo("  pages by model and writer:")
            for row in writers:
                shape = "x".join(map(str, row["shard_shape"] or [])) or "?"
                click.echo(
                    f"  {row['pages']:>10,}  {','.join(row['writers']):<22} {row['model_id'] or '?'}"
                    f"  {row['layout'] or '?'} {row['dtype'] or '?'} {shape} {row['component'] or '?'}"
                )
    emit(result("storage", fabric=name, storage={"action": "usage", **l3, "writers": writers}))
