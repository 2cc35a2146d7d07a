"""The ``kvfabric`` command line (click).

Every command prints one JSON object last (``fabric.observe.report.SCHEMA``); with
``--json`` nothing else goes to stdout but ``kvfabric events``' own lines (one
JSON object per event; the last object counts them). Progress goes to stderr (a bar with
rate and ETA on a terminal, plain lines otherwise), logs to stderr at
``--log-level``. Errors are one line naming the value or setting to change,
exit status 2.
"""

from __future__ import annotations

import logging
import sys

import click

from fabric import __version__
from fabric.cli.chaos import chaos
from fabric.cli.config import config_keys
from fabric.cli.demo import demo
from fabric.cli.events import events
from fabric.cli.exit import finish
from fabric.cli.pin import pin
from fabric.cli.run import run
from fabric.cli.simulate import simulate
from fabric.cli.status import status, top
from fabric.cli.storage import storage
from fabric.errors import FabricError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvfabric")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="warning",
    show_default=True,
    help="How much kvfabric and Ray log to stderr.",
)
def cli(log_level: str) -> None:
    """kvfabric: a hierarchical KV-cache fabric for LLM serving, on Ray.

    Launch a fabric and serve a workload through it (run), look at a running one
    (status, events), manage its L3 (storage) and pins (pin), or ask what-if
    questions of a trace without Ray (simulate, demo).
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


for _command in (run, demo, simulate, chaos, status, top, events, storage, pin, config_keys):
    cli.add_command(_command)


# -- entry point -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; the exit status (2 on an error, printed as one line)."""
    try:
        cli.main(args=argv, prog_name="kvfabric", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("kvfabric: aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return 2
    except (FabricError, OSError) as exc:
        click.echo(f"kvfabric: error: {exc}", err=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


def entry() -> None:
    """The ``kvfabric`` command: :func:`main`, then the process ends through
    :func:`fabric.cli.exit.finish` (Ray's threads outlive ``ray.shutdown`` and can
    crash the native exit handlers after a command that succeeded)."""
    finish(main())
