"""``kvfabric config``: every config key, its value and what is allowed."""

from __future__ import annotations

import json

import click

from fabric.cli.options import config_options, emit, json_option, load
from fabric.observe.report import result


@click.command("config")
@config_options
@json_option
def config_keys(config_file, overrides, as_json) -> None:
    """List every config key: its value (default, or from --config/--set) and what is allowed."""
    from fabric.config import describe_keys

    keys = describe_keys(load(config_file, overrides))
    if not as_json:
        width = max(len(k["key"]) for k in keys)
        for k in keys:
            click.echo(f"{k['key']:<{width}}  {json.dumps(k['value']):<24} {k['allowed']}")
    emit(result("config", keys=keys))
