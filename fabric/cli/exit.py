"""Ending a driver process that has used Ray, without a crash at the very end.

Ray (2.60 at least) starts an OpenTelemetry metrics reader thread in the driver on
every ``ray.init`` and leaves it running after ``ray.shutdown``; from then on each of
its exports fails, and logs. When the interpreter exits, the C++ exit handlers of the
native libraries run (libtorch's alone take a while) with those threads still alive,
and a failed export that logs after Ray's logger registry is destroyed ends the
process with SIGSEGV: after all the work succeeded, the exit status is 139. A
process that started and stopped Ray several times (a test session) has one such
thread per start and crashes on most exits.

:func:`exit_process` ends the process the way Python would, minus the native exit
handlers: it waits for the non-daemon threads (and lets ``concurrent.futures``
finish its queued work), runs the ``atexit`` callbacks (``weakref.finalize`` among
them, so temporary directories are removed), flushes logging and the standard
streams, then calls ``os._exit``. Nothing here imports Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def ray_was_loaded() -> bool:
    """Whether this process imported Ray (and so may hold its threads)."""
    return "ray" in sys.modules


def exit_process(code: int) -> NoReturn:
    """Wait for the non-daemon threads, run the ``atexit`` callbacks, flush logging and
    the standard streams, and end the process with ``code``, skipping the native
    libraries' exit handlers."""
    # What the interpreter's own shutdown does first (private, so looked up).
    wait_for_threads = getattr(threading, "_shutdown", None)
    if wait_for_threads is not None and threading.current_thread() is threading.main_thread():
        wait_for_threads()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def finish(code: int) -> NoReturn:
    """End a driver script with ``code``: through :func:`exit_process` when Ray was
    loaded, else an ordinary ``sys.exit``."""
    if ray_was_loaded():
        exit_process(code)
    sys.exit(code)
