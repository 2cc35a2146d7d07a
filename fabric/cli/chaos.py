"""``kvfabric chaos``: seeded faults under load, and a verdict."""

from __future__ import annotations

import os
import sys

import click

from fabric.cli.options import emit, json_option
from fabric.errors import FabricError
from fabric.tools.chaos import FAULTS


@click.command()
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the faults and the workload."
)
@click.option(
    "--duration", type=float, default=60.0, show_default=True, help="Seconds of workload."
)
@click.option(
    "--nodes",
    type=int,
    default=2,
    show_default=True,
    help="Nodes of the local Ray cluster made for the run (the head and workers).",
)
@click.option(
    "--address",
    default=None,
    help="Run on this existing Ray cluster instead (node loss needs a local one).",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    help="Comma-separated fault kinds, or all: " + ", ".join(FAULTS) + ".",
)
@click.option(
    "--fault-every", type=float, default=4.0, show_default=True, help="Mean seconds between faults."
)
@click.option(
    "--hold", type=float, default=3.0, show_default=True, help="Seconds a lasting fault lasts."
)
@click.option(
    "--max-faults",
    type=int,
    default=None,
    help="End the run once this many faults were injected and recovered from "
    "(default: run the whole duration).",
)
@click.option("--clients", type=int, default=2, show_default=True, help="Concurrent clients.")
@click.option("--set", "overrides", multiple=True, help="A config override for the fabric.")
@json_option
def chaos(
    seed,
    duration,
    nodes,
    address,
    faults,
    fault_every,
    hold,
    max_faults,
    clients,
    overrides,
    as_json,
) -> None:
    """Inject seeded faults into a fabric under load and prove nothing was lost.

    Exits 1 on any loss (a wrong page served, a leaked slot or lease, a stuck
    request, an integrity error, a fault not injected or not recovered from, an
    L3 page the audit refused, too many unverifiable leases or failed requests)
    or when it never served again, and 3 when the harness itself broke (no
    verdict); the last line is the report as one JSON object."""
    from fabric.tools.chaos import ChaosOptions, summary

    kinds = FAULTS if faults == "all" else tuple(k.strip() for k in faults.split(",") if k.strip())
    opts = ChaosOptions(
        seed=seed,
        duration_s=duration,
        nodes=nodes,
        address=address,
        faults=kinds,
        fault_every_s=fault_every,
        fault_hold_s=hold,
        max_faults=max_faults,
        clients=clients,
        overrides=tuple(overrides),
    )
    report = _run(opts)
    if not as_json:
        click.echo(summary(report))
    emit(report)
    if not report["ok"]:
        raise SystemExit(1)


def _run(opts) -> dict:
    """Run the chaos test: its report. Progress goes to stderr, and so does
    whatever the Ray nodes the run starts and stops print (a removed node's
    raylet dumps its state): stdout keeps only the summary and the report."""
    from fabric.tools.chaos import run_chaos

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        return run_chaos(opts, progress=lambda line: click.echo(line, err=True))
    except (FabricError, OSError):
        raise  # a setting or the machine: one line, exit 2
    except Exception as exc:  # the harness broke: no verdict either way
        click.echo(
            f"kvfabric chaos: the harness failed, no verdict: {type(exc).__name__}: "
            f"{str(exc)[:300]}",
            err=True,
        )
        raise SystemExit(3) from None
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
