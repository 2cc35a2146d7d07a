"""Where an engine adapter's pages go: a kvfabric L3, opened one of two ways.

- ``path`` (direct): the adapter opens the store directory itself — the
  directory a fabric's ``storage.path`` names, on a local disk or a shared
  mount — with the same backend code the storage actor runs (``segment`` by
  default, or ``file``). Each process appends to segments of its own, so many
  engine processes and a fabric share one directory; a page another process
  wrote is seen after its next rescan (at most a second later).
- ``fabric`` (over Ray): pages go to and come from a running fabric's storage
  actor, found by the fabric's ``runtime.name`` on the Ray cluster at
  ``address``; bytes travel through Ray's object store.

Both check every page read as L3 does (its header binds its full key; checksum;
provenance): a page that fails is a miss, never bytes. Nothing here raises into
the engine on an I/O or Ray failure: a read that fails is a miss, a write that
fails is ``False``, and the reason is logged and counted in ``stats()``.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fabric.errors import ConfigError, FabricError
from fabric.l3 import make_backend
from fabric.l3.backend import L3Backend
from fabric.l3.format import Provenance
from fabric.l3.manifest import WRITERS

log = logging.getLogger(__name__)

# The backend's own default provenance is never used: every call names the
# provenance of the pages it moves.
_NO_PROVENANCE = Provenance("kvfabric-engines", "none", "uint8", (1,), 1)


class StoreOptions(BaseModel):
    """Where an adapter's pages go (one of ``path`` and ``fabric``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    path: str = Field("", description="a kvfabric L3 directory (a fabric's storage.path)")
    backend: Literal["segment", "file"] = Field(
        "segment", description="segment or file (the fabric's storage.backend)"
    )
    max_bytes: int = Field(1 << 30, ge=0, description="an integer >= 0 (0: no cap)")
    fsync: bool = Field(False, description="true or false")
    auth_key_file: str = Field(
        "",
        description="the fabric's storage.auth_key_file when it authenticates its L3 pages "
        "(pages are then written with its tag and read only with a valid one)",
    )
    fabric: str = Field("", description="a running fabric's runtime.name (pages over Ray)")
    address: str = Field("auto", min_length=1, description="the Ray cluster's address")
    ray_namespace: str = Field("kvfabric", min_length=1, description="the fabric's Ray namespace")
    timeout_s: float = Field(30.0, gt=0, description="a number > 0 (seconds per Ray call)")
    write_threads: int = Field(
        2, ge=1, le=16, description="an integer in 1..16 (threads a large store is split over)"
    )
    write_policy: Literal["write_through", "write_back", "write_through_selective"] = Field(
        "write_through",
        description="write_through, write_back or write_through_selective (the fabric's "
        "cache.write_policy: whether an engine with a node L2 stores a page in L3 at once)",
    )
    prefetch_stop_policy: Literal["best_effort", "wait_complete", "timeout"] = Field(
        "timeout",
        description="best_effort, wait_complete or timeout (the fabric's "
        "prefetch.stop_policy: how long a request waits for its pages' L3 reads)",
    )
    prefetch_timeout_s: tuple[float, float, float] = Field(
        (1.0, 0.25, 10.0),
        description="(base, per 1024 tokens, max) seconds, each >= 0 (the fabric's "
        "prefetch.timeout_*: under timeout, the longest a load reads L3)",
    )

    def limit_s(self, tokens: int) -> float:
        """How long a load of ``tokens`` may read L3 (0: as long as the connector's
        ``timeout_s`` lets it): the ``timeout`` prefetch stop policy's limit."""
        if self.prefetch_stop_policy != "timeout":
            return 0.0
        base, per_ki, most = self.prefetch_timeout_s
        return max(min(base + per_ki * tokens / 1024, most), 1e-3)

    @model_validator(mode="after")
    def _one_place(self) -> StoreOptions:
        if bool(self.path) == bool(self.fabric):
            raise ValueError(
                "give exactly one of path (a kvfabric L3 directory) and fabric "
                "(a running fabric's runtime.name)"
            )
        return self


def parse_options(model: type[BaseModel], options: Mapping[str, Any], where: str) -> Any:
    """``options`` validated by ``model``, or a ``ConfigError`` naming ``where``, the
    key, the value and what is allowed."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ConfigError(
                f"{where}: option {key!r} is unknown; known: {sorted(model.model_fields)}"
            ) from None
        field = model.model_fields.get(str(err["loc"][0])) if err["loc"] else None
        allowed = (field.description if field else None) or err["msg"]
        if not key:
            raise ConfigError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
        raise ConfigError(
            f"{where}: {key}={err.get('input')!r} is refused: allowed is {allowed}"
        ) from None


# How long a delete of a page stored anew after a failed read is not carried out.
ANEW_HOLD_S = 60.0
# Keys a read found missing or refused, remembered per process (at most this many).
MAX_FAILED_KEYS = 65536


class PageStore(ABC):
    """Pages by full L3 key, for one writer (an engine's name).

    A page a read found missing or refused (corrupt, foreign) is remembered: it
    is absent to ``present`` from then on — so an engine does not ask for it
    again and again — and the next ``store`` of it writes it anew (the store
    then serves the new copy), which ends the memory of it. A delete of a page
    stored anew that way is not carried out for ``ANEW_HOLD_S``: the fabric
    orders one each time it forgets a page a load failed, and those orders can
    come after the new copy (deleting it then would leave the fabric counting a
    page that is gone; not deleting it costs room until the store's bound)."""

    def __init__(self, writer: str) -> None:
        if writer not in WRITERS:
            raise ValueError(f"writer {writer!r} is refused: allowed is one of {WRITERS}")
        self.writer = writer
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._failed: OrderedDict[str, None] = OrderedDict()
        self._anew: OrderedDict[str, float] = OrderedDict()  # stored again after a failure

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds."""
        present = self.present(keys)
        return present.index(False) if False in present else len(present)

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the store holds it (unverified: a read still checks)
        and no read of it here failed since it was last stored."""
        if not keys:
            return []
        found = self._present(keys)
        with self._lock:
            failed = self._failed
            return [ok and key not in failed for key, ok in zip(keys, found, strict=True)]

    def load(self, keys: Sequence[str], out: np.ndarray, provenance: Provenance) -> int:
        """Read and verify the leading pages into ``out`` (one uint8 row a key);
        how many were read (the first missing or refused page ends it)."""
        n = self._load(keys, out, provenance) if len(keys) else 0
        if n is None:  # the store could not be asked: nothing is learnt of its pages
            return 0
        self.count("loaded_pages", n)
        if n < len(keys):
            self.mark_failed(keys[n : n + 1])
        return n

    def mark_failed(self, keys: Sequence[str]) -> None:
        """Remember ``keys`` as absent (a reader elsewhere failed them) until
        they are stored again."""
        with self._lock:
            for key in keys:
                self._failed[key] = None
            while len(self._failed) > MAX_FAILED_KEYS:
                self._failed.popitem(last=False)

    def store(
        self, keys: Sequence[str], pages: np.ndarray | Sequence[np.ndarray], provenance: Provenance
    ) -> list[bool]:
        """Store ``pages`` (one uint8 row a key: an array, or a list of rows, which
        a direct store writes without gathering them first) of ``provenance``; per
        page, whether it was stored."""
        ok = self._store(keys, pages, provenance) if len(keys) else []
        self.count("stored_pages", sum(ok))
        with self._lock:
            for key, good in zip(keys, ok, strict=True):
                if good and key in self._failed:
                    del self._failed[key]
                    self._anew[key] = time.monotonic()
                    self._anew.move_to_end(key)
            while len(self._anew) > MAX_FAILED_KEYS:
                self._anew.popitem(last=False)
        return ok

    def delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` (the fabric's tree evicted them); how many the store held.
        A store that cannot delete, or fails, deletes nothing (logged, counted):
        its own bound frees the room then."""
        now = time.monotonic()
        with self._lock:
            keep = {k for k in keys if now - self._anew.get(k, -ANEW_HOLD_S) < ANEW_HOLD_S}
        keys = [k for k in keys if k not in keep]
        n = self._delete(keys) if len(keys) else 0
        self.count("deleted_pages", n)
        return n

    @abstractmethod
    def _delete(self, keys: Sequence[str]) -> int: ...

    @abstractmethod
    def _present(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def _load(self, keys: Sequence[str], out: np.ndarray, provenance: Provenance) -> int | None:
        """Pages read and verified into ``out``; ``None`` when the store could not
        be asked (an I/O error, a storage actor away)."""

    @abstractmethod
    def _store(
        self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance
    ) -> list[bool]: ...

    @abstractmethod
    def clear(self) -> bool:
        """Delete every page of the store (every engine's and the fabric's)."""

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files or connections."""


# A store of at least this many bytes is split over ``write_threads`` threads.
SPLIT_BYTES = 4 << 20


class DirectStore(PageStore):
    """A kvfabric L3 directory opened in this process. A large store is split over
    ``write_threads`` threads, each appending to segments of its own: copying
    pages into the page cache is most of a store's time, and it runs in parallel."""

    def __init__(self, options: StoreOptions, writer: str) -> None:
        super().__init__(writer)
        self.backend: L3Backend = make_backend(
            options.backend,
            _NO_PROVENANCE,
            1,
            {"path": options.path, "max_bytes": options.max_bytes, "fsync": options.fsync},
        )
        if options.auth_key_file:
            from fabric.l3.auth import PageAuth

            self.backend.auth = PageAuth.from_file(options.auth_key_file, "auth_key_file")
        self.write_threads = options.write_threads
        self._writers = (
            ThreadPoolExecutor(self.write_threads, thread_name_prefix="kvfabric-l3-write")
            if self.write_threads > 1
            else None
        )

    def _present(self, keys: Sequence[str]) -> list[bool]:
        try:
            return self.backend.present(keys)
        except OSError as exc:
            log.warning("L3 %s: lookup failed: %s", self.backend.name, exc)
            self.count("errors")
            return [False] * len(keys)

    def _load(self, keys: Sequence[str], out: np.ndarray, provenance: Provenance) -> int | None:
        """A page another process stored may not be indexed here yet (segments are
        rescanned at most once a second): a missing one is looked for again after
        a rescan before it counts as missing."""
        try:
            return self.backend.get_fresh(keys, out, provenance)
        except OSError as exc:
            log.warning("L3 %s: reading %d pages failed: %s", self.backend.name, len(keys), exc)
            self.count("errors")
            return None

    def _store(self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance) -> list[bool]:
        self.backend.record_writer(provenance, self.writer)
        n = len(keys)
        parts = min(self.write_threads, n)
        try:
            if self._writers is None or parts < 2 or n * len(memoryview(pages[0])) < SPLIT_BYTES:
                return self.backend.set(keys, pages, provenance)
            cuts = [n * i // parts for i in range(parts + 1)]
            futures = [
                self._writers.submit(self.backend.set, keys[a:b], pages[a:b], provenance)
                for a, b in pairwise(cuts)
            ]
            return [ok for f in futures for ok in f.result()]
        except OSError as exc:
            log.warning("L3 %s: storing %d pages failed: %s", self.backend.name, len(keys), exc)
            self.count("errors")
            return [False] * len(keys)

    def _delete(self, keys: Sequence[str]) -> int:
        try:
            return self.backend.delete(keys)
        except (OSError, NotImplementedError) as exc:
            log.warning("L3 %s: deleting %d pages failed: %s", self.backend.name, len(keys), exc)
            self.count("errors")
            return 0

    def clear(self) -> bool:
        self.backend.clear()
        return True

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "l3": self.backend.stats()}

    def close(self) -> None:
        if self._writers is not None:
            self._writers.shutdown(wait=True)
        self.backend.close()


class RayStore(PageStore):
    """A running fabric's L3, through its storage actor."""

    def __init__(self, options: StoreOptions, writer: str) -> None:
        super().__init__(writer)
        import ray

        if not ray.is_initialized():
            from fabric.driver import cluster

            try:  # the cluster decided as kvfabric's commands decide it (fabric.driver.cluster)
                target = cluster.resolve(
                    options.address, options.fabric, options.ray_namespace, "address"
                )
                if target.address is None:
                    raise FabricError(f"address={options.address!r} names no running cluster")
                cluster.init_ray(
                    target.address, options.ray_namespace, False, f"address={target.address!r}"
                )
            except FabricError as exc:
                raise ConfigError(f"fabric={options.fabric!r}: {exc}") from None
        try:
            self.actor = ray.get_actor(f"{options.fabric}-storage", namespace=options.ray_namespace)
        except ValueError:
            raise ConfigError(
                f"fabric={options.fabric!r}: no such fabric's storage actor in Ray namespace "
                f"{options.ray_namespace!r}; check fabric (its runtime.name) and ray_namespace"
            ) from None
        self.timeout_s = options.timeout_s
        self._ray = ray

    def _call(self, method: Any, *args: Any, default: Any) -> Any:
        try:
            return self._ray.get(method.remote(*args), timeout=self.timeout_s)
        except Exception as exc:  # a dead, restarting or slow storage actor: a miss
            log.warning("kvfabric storage actor: %s failed: %s", method, exc)
            self.count("errors")
            return default

    def _present(self, keys: Sequence[str]) -> list[bool]:
        return self._call(self.actor.engine_exists, list(keys), default=[False] * len(keys))

    def _load(self, keys: Sequence[str], out: np.ndarray, provenance: Provenance) -> int | None:
        rows = self._call(self.actor.engine_load, list(keys), provenance, default=None)
        if rows is None:
            return None
        n = min(len(rows), len(keys))
        out[:n] = rows[:n]
        return n

    def _store(self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance) -> list[bool]:
        return self._call(
            self.actor.engine_store,
            list(keys),
            np.ascontiguousarray(pages),
            provenance,
            self.writer,
            default=[False] * len(keys),
        )

    def _delete(self, keys: Sequence[str]) -> int:
        return int(self._call(self.actor.engine_delete, list(keys), default=0))

    def clear(self) -> bool:
        return bool(self._call(self.actor.clear, default=False))


def open_store(options: StoreOptions, writer: str) -> PageStore:
    """The store ``options`` name, for ``writer``'s pages."""
    return DirectStore(options, writer) if options.path else RayStore(options, writer)


def store_options(config: Any) -> StoreOptions | None:
    """Where workers read and write a fabric's L3 themselves (its directory, with
    the fabric's own backend, cap and authentication); ``None`` for an L3 they
    cannot open (none, Redis, a dynamic backend)."""
    storage, prefetch = config.storage, config.prefetch
    if storage.backend not in ("segment", "file"):
        return None
    return StoreOptions(
        path=storage.path,
        backend=storage.backend,
        max_bytes=storage.max_bytes,
        fsync=storage.fsync,
        auth_key_file=storage.auth_key_file,
        write_policy=config.cache.write_policy,
        prefetch_stop_policy=prefetch.stop_policy,
        prefetch_timeout_s=(
            prefetch.timeout_base_s,
            prefetch.timeout_per_ki_token_s,
            prefetch.timeout_max_s,
        ),
    )
