"""The one-line hint a command prints after its first run on a machine: what to
try next. Said once per user (a marker in ``$XDG_STATE_HOME/kvfabric``, by
default ``~/.local/state/kvfabric``); ``KVFABRIC_NO_HINT=1`` keeps it quiet."""

from __future__ import annotations

import os
from pathlib import Path

import click

HINTS = {
    "run": (
        "kvfabric: first run done. Next: run it again (its pages come back from L3: the "
        "storage line), `kvfabric run --keep` with `kvfabric top` in another shell, or "
        "`kvfabric simulate --workload chat`; docs/running.md has the rest."
    ),
}


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvfabric"


def first_run_hint(command: str) -> None:
    """Print ``command``'s hint to stderr if this user never saw it; never fails."""
    text = HINTS.get(command)
    if text is None or os.environ.get("KVFABRIC_NO_HINT"):
        return
    marker = state_dir() / f"hinted-{command}"
    try:
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        return  # a read-only home: no hint rather than an error
    click.echo(text, err=True)
