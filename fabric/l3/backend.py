"""The L3 backend interface: batches of page shards by key.

Backends store opaque blobs (``fabric.l3.format`` format); this base class does
the batching, the verification and the counting, so a backend implements only
``_read``, ``_write``, ``_exists``, ``_clear`` and ``_usage``. Keys are checked
page keys (hex digest + shard suffix), never user text.
"""

from __future__ import annotations

import errno
import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from fabric.l3.format import Provenance, check_key, decode_page, encode_header
from fabric.l3.manifest import Manifest, usage_by_tag

log = logging.getLogger(__name__)


class Location(NamedTuple):
    """Where one page lies: the file (relative to the store's root: ``name`` or
    ``dir/name``), the offset of its preamble, and the bytes of preamble and
    header (``head``) and of payload; ``head == 0``: the whole file is the page,
    its lengths read from its preamble."""

    file: str
    offset: int
    head: int
    payload: int


class L3Backend(ABC):
    """Batch ``exists``/``get``/``set``, ``clear`` and ``stats``. Thread-safe
    counters; subclasses make their own I/O safe to call from several threads."""

    name = ""
    # Backends that keep a directory record who wrote which model's pages there
    # (``fabric.l3.manifest``); the others cannot say.
    manifest: Manifest | None = None
    # Whether it counts other processes' pages in the same store against its
    # ``max_bytes`` (several storage actors share one store): one that counts only
    # its own writes is given its share of the cap (``StorageService.attach``).
    sees_others = False

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        self.provenance = provenance
        self.page_bytes = page_bytes
        self.extra = dict(extra)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        # Keys this backend dropped on its own (evictions, files gone), for the KV
        # events of a router; kept only once ``track_removals`` is set.
        self.track_removals = False
        self._removed: dict[str, None] = {}
        # Authenticated pages (``fabric.l3.auth.PageAuth``): written with a tag, and
        # read only with a valid one; None: CRC and key binding only.
        self.auth: Any = None
        # Why the last write failed (``None``: it did not): a read-only or full
        # store keeps serving what it holds, and says so once, not once a page.
        self.write_error: str | None = None

    def record_writer(self, provenance: Provenance, writer: str) -> None:
        """Note that ``writer`` (an engine: ``kvfabric``, ``sglang``, ``vllm``, ``hf``)
        stores pages of ``provenance`` here, for ``usage_by_writer``."""
        if self.manifest is not None:
            self.manifest.record(provenance, writer)

    def usage_by_writer(self) -> list[dict[str, Any]]:
        """Pages per model tag, with the tag's model, layout, dtype, shape and the
        engines that wrote it (``unknown`` where no record says); ``[]`` for a
        backend that cannot list its keys."""
        try:
            keys = self.page_keys()
        except NotImplementedError:
            return []
        return usage_by_tag(keys, self.manifest.entries() if self.manifest else {})

    def note_removed(self, keys: Iterable[str]) -> None:
        """Keys that left the store other than by ``clear`` (an eviction, a file
        another process deleted)."""
        if self.track_removals:
            with self._lock:
                self._removed.update(dict.fromkeys(keys))

    def note_stored(self, key: str) -> None:
        """``key`` is in the store again: a removal not yet taken no longer holds."""
        if self._removed:
            with self._lock:
                self._removed.pop(key, None)

    def take_removed(self) -> list[str]:
        """Drain the keys noted by ``note_removed``, oldest first."""
        with self._lock:
            out, self._removed = list(self._removed), {}
        return out

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, exist (unverified)."""
        n = 0
        for key in keys:
            if not self._exists(check_key(key)):
                break
            n += 1
        return n

    def locate(self, keys: Sequence[str]) -> list[Location] | None:
        """Where the leading ``keys`` found lie, for a reader that opens the files
        itself (``fabric.l3.direct``): per key, a ``Location`` under ``root``;
        it stops at the first key not found. ``None``: this backend's pages are
        not files a reader can open (the default)."""
        return None

    def refresh(self) -> bool:
        """Pick up other writers' pages now (a reader about to call a page another
        process says it stored missing); whether anything was looked at anew. The
        default: a backend that sees every writer's pages at once."""
        return False

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it exists (unverified)."""
        return [self._exists(check_key(key)) for key in keys]

    def get(
        self, keys: Sequence[str], out: np.ndarray, provenance: Provenance | None = None
    ) -> int:
        """Read and verify pages into ``out`` (one uint8 row per key: ``page_bytes``,
        or the row length of pages of ``provenance``, another shape this backend
        also holds — a hybrid model's other components) from the first key on;
        stop at the first miss. Returns pages read. A corrupt, truncated or
        foreign page — one stored under another page's, shard's, component's,
        tenant's or model's key included — is a miss, counted under its reason."""
        n = 0
        prov = provenance or self.provenance
        for refused in self._read_rows([check_key(key) for key in keys], out, prov):
            if refused is not None:
                self.refuse(refused)
                break
            n += 1
        self.count("get_pages", n)
        return n

    def get_fresh(self, keys: Sequence[str], out: np.ndarray, provenance: Provenance) -> int:
        """``get``, looking for a page not found again once other writers' pages are
        picked up (``refresh``): a page another process stored may not be indexed
        here yet, and only a page still missing after that is missing."""
        n = self.get(keys, out, provenance)
        missing = n < len(keys) and not self.present(keys[n : n + 1])[0]
        if missing and self.refresh():
            n += self.get(keys[n:], out[n:], provenance)
        return n

    def _read_rows(
        self, keys: Sequence[str], out: np.ndarray, provenance: Provenance
    ) -> Iterator[str | None]:
        """Per key in order, read and verify its page (of ``provenance``, one row of
        ``out`` long) into ``out[i]``: ``None`` when served, else why not. The
        caller stops at the first refusal; a backend that fetches batches in one
        round trip overrides this."""
        for i, key in enumerate(keys):
            yield self._read_into(key, out[i], provenance)

    def refuse(self, reason: str) -> None:
        """Count a page not served: ``get_miss``, or ``refused_<reason>``."""
        self.count("get_miss" if reason == "miss" else f"refused_{reason}")

    def _read_into(self, key: str, row: np.ndarray, provenance: Provenance) -> str | None:
        """Verify one page into ``row``: ``None`` when served, else why not (``miss``,
        or a ``decode_page`` reason). Backends may read straight into ``row``."""
        return self.verify_into(key, self._read(key), row, provenance)

    def verify_into(
        self, key: str, blob: bytes | None, row: np.ndarray, provenance: Provenance | None = None
    ) -> str | None:
        """Check ``blob`` read under ``key`` (a page of ``provenance``, by default the
        backend's) and copy its payload into ``row``; ``None`` when served, else why not."""
        if blob is None:
            return "miss"
        payload = decode_page(blob, provenance or self.provenance, row.nbytes, key, self.auth)
        if isinstance(payload, str):
            return payload
        row[:] = np.frombuffer(payload, dtype=np.uint8)
        return None

    def set(
        self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance | None = None
    ) -> list[bool]:
        """Store ``pages`` (one uint8 row per key, pages of ``provenance``, by default
        the backend's); per page, whether it was stored."""
        ok = []
        prov = provenance or self.provenance
        for i, key in enumerate(keys):
            try:
                payload = memoryview(pages[i]).cast("B")
                check_key(key)
                self._write(key, (encode_header(payload, prov, key, self.auth), payload))
                ok.append(True)
            except OSError as exc:
                self.write_failed(exc, 1)
                ok.append(False)
            else:
                self.wrote()
        self.count("set_pages", sum(ok))
        return ok

    def write_failed(self, exc: OSError, pages: int) -> None:
        """Count ``pages`` not stored because of ``exc``; log when writes start to
        fail or fail for another reason (a read-only store is not a page's fault)."""
        reason = errno.errorcode.get(exc.errno or 0, "error").lower()
        self.count("set_failed", pages)
        self.count(f"set_failed_{reason}", pages)
        with self._lock:
            said, self.write_error = self.write_error, reason
        if said != reason:
            log.warning("L3 %s: writes fail (%s); pages are still served", self.name, exc)

    def wrote(self) -> None:
        """A write went through: a store that had refused writes takes them again."""
        if self.write_error is not None:
            with self._lock:
                said, self.write_error = self.write_error, None
            if said is not None:
                log.warning("L3 %s: writes go through again (they failed: %s)", self.name, said)

    def clear(self) -> None:
        self._clear()
        self.take_removed()  # the caller knows: everything went
        if self.manifest is not None:
            self.manifest.clear()
        self.count("clears")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out.update(self._usage())
        out["backend"] = self.name
        out["write_error"] = self.write_error
        out["sees_others"] = self.sees_others
        return out

    def keep_only(self, owns: Callable[[str], bool]) -> None:  # noqa: B027 - optional hook
        """Count and evict only the pages whose keys ``owns`` (several storage
        actors on one store, each with its share of the cap); a backend that
        sees the whole store, or keeps no index, ignores it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles (default: nothing)."""

    def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` (the fabric's tree evicted them); how many were here.
        Backends that cannot raise ``NotImplementedError``."""
        raise NotImplementedError(f"the {self.name} backend cannot delete pages")

    def page_keys(self) -> list[str]:
        """Every page key this backend holds, for audits (``kvfabric chaos``);
        backends that cannot list cheaply raise ``NotImplementedError``."""
        raise NotImplementedError(f"the {self.name} backend cannot list its keys")

    @abstractmethod
    def _read(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        """Store the page ``parts[0] + parts[1]`` (header, payload) under ``key``."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _usage(self) -> dict[str, Any]: ...
