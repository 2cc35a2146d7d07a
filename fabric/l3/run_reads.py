"""How a rank's own L3 read moves one run of pages (``fabric.l3.direct``):
records that lie one after another in one file come in one ``preadv`` — a
header each into one array, each payload straight into its row — and are
checked as every L3 read is (``fabric.l3.format.check_read``; ``FastCheck``
first, which passes the common page without decoding its header)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from fabric.l3.backend import Location
from fabric.l3.format import PREAMBLE, FastCheck, Provenance, check_read, header_length

_MAX_GAP = 256  # between two records read in one call: a frame and a key
_SKIP = memoryview(bytearray(_MAX_GAP))  # where the bytes between records go (never read)
_PROBE = bytearray(1)  # where a probe of the page cache reads to (never read)
RUN_CHECK = 16  # pages from which a run's headers are checked as one array
_RUN_PAGES = 300  # pages per read call (three iovecs each, under IOV_MAX)
# Bytes per read call: a read's pages are checked while the CPU cache still
# holds them (a checksum over a larger read reads it back from memory), and a
# call carries enough small pages that its own cost is spread thin.
READ_CALL = 1 << 20
NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def read_run(
    run: list[Location],
    keys: list[str],
    rows: np.ndarray,
    prov: Provenance,
    fast: FastCheck,
    files: dict[str, int | str],
    auth: Any = None,
) -> tuple[int, str | None]:
    """Read ``run`` (records one after another in one file, or one page file)
    into ``rows`` in one call, then check its pages as the storage actor's
    reads do (``check_read``; ``fast`` first, which passes the common page
    without decoding its header): how many leading pages are served, and
    why the next is not (``None``: all are). ``files``: descriptors opened."""
    fd = files[run[0].file]
    if not isinstance(fd, int):
        return 0, fd
    try:
        heads, got = pread(fd, run, rows)
    except OSError:
        heads, got = [], 0
    if isinstance(heads, str):  # a page file whose preamble is not the format's
        return 0, heads
    last = run[-1]
    whole = (
        last.offset + last.head + last.payload - run[0].offset
        if last.head > 0
        else len(heads[0]) + rows.shape[1]  # a page file: nothing past its record
    )
    passed = 0
    if got == whole:  # every record read whole: the fast check first
        if isinstance(heads, np.ndarray):
            check = fast.run if len(run) >= RUN_CHECK else fast.one_by_one
            passed = check(heads, rows, keys)
        else:
            for head, key, row in zip(heads, keys, rows, strict=True):
                if not fast(head, row, key):
                    break
                passed += 1
        if passed == len(run):
            return passed, None
    at = 0
    for i, (loc, key, row) in enumerate(zip(run, keys, rows, strict=True)):
        if i < passed:  # served by the fast check
            at += len(heads[i]) + row.nbytes + gap(run, i)
            continue
        head = bytes(heads[i]) if i < len(heads) else bytes(loc.head)
        stored = loc.payload if loc.head > 0 else None
        mine = (
            max(got - at, 0) if i + 1 == len(run) else min(max(got - at, 0), len(head) + row.nbytes)
        )
        at += len(head) + row.nbytes + gap(run, i)
        refused = check_read(head, row, mine, prov, key, auth, stored)
        if refused is not None:
            return i, refused
    return len(run), None


def pread(
    fd: int, run: list[Location], rows: np.ndarray
) -> tuple[np.ndarray | list[bytearray] | str, int]:
    """Headers into a buffer and payloads straight into ``rows``, in one
    ``preadv``: a run's headers as one array, a header a row, when they are
    all one length (else a buffer each); a whole page file: its preamble
    read first for its length."""
    first = run[0]
    if first.head <= 0:  # a page file: the preamble says how long its header is
        n = header_length(os.pread(fd, PREAMBLE, first.offset))
        if isinstance(n, str):
            return n, 0
        head = bytearray(PREAMBLE + n)
        got = os.preadv(fd, [head, memoryview(rows[0]).cast("B"), bytearray(1)], first.offset)
        return [head], got  # a byte past the page: a file longer than its record
    uniform = all(loc.head == first.head for loc in run)
    heads = np.empty((len(run), first.head), np.uint8) if uniform else []
    iov: list = []
    end = first.offset
    for i, (loc, row) in enumerate(zip(run, rows, strict=True)):
        if loc.offset > end:
            iov.append(_SKIP[: loc.offset - end])  # the record's frame and key
        if uniform:
            iov.append(heads[i])
        else:
            heads.append(bytearray(loc.head))
            iov.append(heads[-1])
        iov.append(row)
        end = loc.offset + loc.head + loc.payload
    return heads, os.preadv(fd, iov, first.offset)


def cold(first: Location, files: dict[str, int | str]) -> bool:
    """Whether the page cache lacks the first byte of ``first``'s payload
    (a read that would wait: ``RWF_NOWAIT``); ``False`` where that cannot be
    asked."""
    fd = files.get(first.file)
    if not NOWAIT or not isinstance(fd, int):
        return False
    try:
        os.preadv(fd, [_PROBE], first.offset + max(first.head, 0), NOWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def rows_for(out: np.ndarray | None, n: int, row_bytes: int) -> np.ndarray:
    """``n`` rows of ``row_bytes`` to read into: the first of ``out`` or new ones."""
    if out is None:
        return np.empty((n, row_bytes), dtype=np.uint8)
    if (
        out.dtype != np.uint8
        or out.ndim != 2
        or out.shape[0] < n
        or out.shape[1] != row_bytes
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"a read of {n} pages of {row_bytes} bytes into rows {out.dtype}{list(out.shape)} "
            "(writable, contiguous uint8, one page a row, as many rows as pages)"
        )
    return out[:n]


def gap(run: list[Location], i: int) -> int:
    """Bytes between record ``i`` of ``run`` and the next one (0 after the last)."""
    if i + 1 == len(run):
        return 0
    loc = run[i]
    return run[i + 1].offset - (loc.offset + loc.head + loc.payload)


def runs(located: list[Location], row_bytes: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of each run of locations read in one call: records of one
    segment that follow one another closely (a backup's), of a page's length."""
    start = 0
    most = min(_RUN_PAGES, max(1, READ_CALL // max(row_bytes, 1)))
    prev = located[0] if located else None
    for i in range(1, len(located)):
        loc = located[i]
        if not (
            0 <= loc.offset - (prev.offset + prev.head + prev.payload) <= _MAX_GAP
            and loc.file == prev.file
            and prev.head > 0
            and loc.head > 0
            and loc.payload == row_bytes
            and i - start < most
        ):
            yield start, i
            start = i
        prev = loc
    if located:
        yield start, len(located)
