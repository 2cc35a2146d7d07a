"""Opening what is in an L3 directory without trusting it.

The store may be shared storage that others write: a name can be a link, a
FIFO, a device. ``open_regular`` reads only regular files, and no open can
block: the name is checked without following links (``lstat``), opened with
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in between opens at once instead of
waiting for a writer) and checked again on the descriptor (``fstat``).
"""

from __future__ import annotations

import errno
import os
import stat

READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(name: str, dir_fd: int) -> int | str:
    """A read descriptor of the regular file ``name`` in ``dir_fd``, or why not:
    ``miss``, ``symlink`` or ``not_regular`` (a FIFO, socket, device or
    directory)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "miss"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if not stat.S_ISREG(st.st_mode):
        return "not_regular"
    try:
        fd = os.open(name, READ, dir_fd=dir_fd)
    except OSError as exc:
        return "symlink" if exc.errno == errno.ELOOP else "miss"
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the two looks
        os.close(fd)
        return "not_regular"
    return fd
