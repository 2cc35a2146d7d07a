"""What the commands share: their common options, loading the config and the
workload, finding a running fabric, and printing a command's result."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from fabric.config import FabricConfig, load_config
from fabric.errors import FabricError


def config_options(f: Callable) -> Callable:
    f = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help="Override a config value (repeatable; values parsed as YAML). "
        "`kvfabric config` lists every key with its default and what is allowed.",
    )(f)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        help="A config file (.json, .toml or .yaml).",
    )(f)


def workload_options(default_requests: int) -> Callable:
    def wrap(f: Callable) -> Callable:
        f = click.option(
            "--requests",
            type=int,
            default=default_requests,
            show_default=True,
            help="Requests to replay" + (" (0: all of a trace)." if not default_requests else "."),
        )(f)
        f = click.option(
            "--workload",
            "workload_kind",
            metavar="KIND",
            help="Without --trace: a generated workload, chat (the default), agent, rag "
            "or mixed (fabric/tools/workloads.py).",
        )(f)
        return click.option(
            "--trace",
            type=click.Path(dir_okay=False),
            help="A Mooncake-format JSONL trace (default: generated chat conversations).",
        )(f)

    return wrap


def json_option(f: Callable) -> Callable:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print only the result, as one JSON object."
    )(f)


def cluster_options(f: Callable) -> Callable:
    f = click.option(
        "--ray-namespace",
        default="kvfabric",
        show_default=True,
        help="The fabric's Ray namespace (runtime.ray_namespace).",
    )(f)
    f = click.option(
        "--name",
        default="kvfabric",
        show_default=True,
        help="The fabric's name (runtime.name).",
    )(f)
    return click.option(
        "--address",
        default="auto",
        show_default=True,
        help="The Ray cluster the fabric runs on: HOST:PORT, ray://..., or auto (RAY_ADDRESS, "
        "else the local cluster where --name was launched, else the `ray start` cluster, else "
        "the only one).",
    )(f)


def load(config_file: str | None, overrides: tuple[str, ...]) -> FabricConfig:
    config = load_config(config_file) if config_file else FabricConfig()
    return config.with_overrides(list(overrides))


def read_requests(
    trace: str | None, n: int, workload: str | None = None, whole_trace_ok: bool = False
):
    """The requests to replay and where they came from: the first ``n`` of
    ``trace`` (0: all, where allowed), or ``n`` of a generated ``workload``."""
    from fabric.tools.workload import read_trace
    from fabric.tools.workloads import generated

    if n < (0 if whole_trace_ok else 1):
        raise FabricError(
            f"--requests {n} is refused: allowed is an int >= {0 if whole_trace_ok else 1}"
        )
    if trace and workload:
        raise FabricError(f"--workload {workload} refused with --trace: the trace is the workload")
    if trace:
        return read_trace(trace, n or None), trace
    kind = workload or "chat"
    source = "synthetic conversations" if kind == "chat" else f"generated {kind} workload"
    return generated(kind, n or 3000), source


def emit(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj))


def say(as_json: bool, text: str) -> None:
    if not as_json:
        click.echo(text)


def connect(address: str, name: str, ray_namespace: str):
    """The running fabric ``name``; says on stderr which cluster it was found on."""
    from fabric.client import connect

    fabric = connect(name, address, ray_namespace)
    click.echo(
        f"kvfabric: fabric {name!r} on the Ray cluster at {fabric.cluster_address}", err=True
    )
    return fabric
