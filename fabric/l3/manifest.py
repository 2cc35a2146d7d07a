"""Who wrote what into a shared store: one small record per (model tag, writer).

Page keys name a model tag (a digest of the pages' provenance), not the
provenance itself, and nothing in a key says which engine wrote the page. A
store that several engines share (kvfabric's own fabric, SGLang workers, vLLM
workers, Hugging Face drivers) keeps, beside its pages, a record per tag and
writer in ``<store>/provenance/<tag>.<writer>.json``: the provenance the tag is
the digest of, and the writer's name. ``kvfabric storage usage`` joins it with
the keys to say how many pages each engine and model holds.

The records are labels, never used to serve anything: a record whose provenance
does not hash to its tag is ignored, and a missing one is an ``unknown`` writer.
Files are written owner-only, atomically (temporary file, rename), without
following links, and read only when they are regular files of a bounded size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fabric.l3.format import Provenance
from fabric.l3.safe_open import open_regular

log = logging.getLogger(__name__)

WRITERS = ("kvfabric", "sglang", "vllm", "hf")
_DIR = "provenance"
_NAME = re.compile(r"([0-9a-f]{16})\.([a-z0-9_-]{1,32})\.json")
_MAX_RECORD = 4096


def provenance_of(wire: Any) -> Provenance | None:
    """A ``Provenance`` from its header form, or ``None`` when it is not one."""
    if not isinstance(wire, dict):
        return None
    try:
        shape = tuple(int(n) for n in wire["shard_shape"])
        return Provenance(
            str(wire["model_id"]),
            str(wire["layout"]),
            str(wire["dtype"]),
            shape,
            int(wire["page_size"]),
            str(wire.get("component", "full")),
        )
    except (KeyError, TypeError, ValueError):
        return None


class Manifest:
    """The records of one store directory (``root``)."""

    def __init__(self, root: Path, file_mode: int, dir_mode: int) -> None:
        self.dir = root / _DIR
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self._written: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, provenance: Provenance, writer: str) -> None:
        """Note that ``writer`` stores pages of ``provenance`` (once per process;
        a failure is logged, never raised: the record is a label)."""
        if writer not in WRITERS:
            raise ValueError(f"writer {writer!r} is refused: allowed is one of {WRITERS}")
        mark = (provenance.tag, writer)
        with self._lock:
            if mark in self._written:
                return
            self._written.add(mark)
        name = f"{provenance.tag}.{writer}.json"
        body = json.dumps({"writer": writer, "provenance": provenance.as_wire()}).encode()
        try:
            self.dir.mkdir(mode=self.dir_mode, exist_ok=True)
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            log.warning("L3 manifest %s: %s", self.dir, exc)
            return
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(tmp, flags, self.file_mode, dir_fd=dir_fd)
            with open(fd, "wb", closefd=True) as f:
                os.fchmod(f.fileno(), self.file_mode)
                f.write(body)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            log.warning("L3 manifest %s/%s: %s", self.dir, name, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def entries(self) -> dict[str, dict[str, Any]]:
        """Per model tag: its provenance (header form) and the writers recorded."""
        out: dict[str, dict[str, Any]] = {}
        try:
            dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return out
        try:
            for entry in os.scandir(dir_fd):
                match = _NAME.fullmatch(entry.name)
                record = self._read(dir_fd, entry.name) if match else None
                if record is None or record.get("writer") != match.group(2):  # type: ignore[union-attr]
                    continue
                prov = provenance_of(record.get("provenance"))
                tag = match.group(1)  # type: ignore[union-attr]
                if prov is None or prov.tag != tag:
                    continue
                slot = out.setdefault(tag, {"provenance": prov.as_wire(), "writers": []})
                slot["writers"] = sorted({*slot["writers"], record["writer"]})
        finally:
            os.close(dir_fd)
        return out

    @staticmethod
    def _read(dir_fd: int, name: str) -> dict | None:
        fd = open_regular(name, dir_fd)  # never blocks (a FIFO), never a link
        if not isinstance(fd, int):
            return None
        with open(fd, "rb", closefd=True) as f:
            data = f.read(_MAX_RECORD + 1)
        if len(data) > _MAX_RECORD:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                if _NAME.fullmatch(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        with self._lock:
            self._written.clear()


def usage_by_tag(keys: Iterable[str], entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Pages per model tag, with what the manifest says of each tag (``unknown``
    writers where it says nothing), most pages first."""
    pages = Counter(key.split(".")[1] for key in keys)
    rows = []
    for tag, n in pages.most_common():
        entry = entries.get(tag, {})
        prov = entry.get("provenance", {})
        rows.append(
            {
                "tag": tag,
                "pages": n,
                "writers": entry.get("writers", ["unknown"]),
                "model_id": prov.get("model_id"),
                "layout": prov.get("layout"),
                "dtype": prov.get("dtype"),
                "shard_shape": prov.get("shard_shape"),
                "component": prov.get("component", "full") if prov else None,
            }
        )
    return rows
