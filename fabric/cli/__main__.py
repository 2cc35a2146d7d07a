"""``python -m fabric.cli``: the ``kvfabric`` command."""

from fabric.cli import entry

entry()
