"""L3 in a Redis server: a shared tier across nodes without a shared file system.

Each page shard is one Redis string under ``<prefix><key>``, in the same format
as the file backend (header with the page's own key, checksum, provenance).
Batches travel in one round trip each (``MGET``, pipelined ``EXISTS`` and
``SET``). The prefix is validated (letters, digits and ``_:.-``), and ``clear``
deletes only keys of this prefix's exact page-key form, so two prefixes never
touch each other's pages. Requires the ``redis`` package (``pip install
'kvfabric[redis]'``). A size cap is Redis's own business (``maxmemory`` with an
LRU policy); ``stats`` counts this process's traffic and never scans the server.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fabric.errors import ConfigError
from fabric.l3.backend import L3Backend
from fabric.l3.format import Provenance, check_key
from fabric.l3.options import RedisOptions

log = logging.getLogger(__name__)

_GLOB = re.compile(r"([*?\[\]\\^])")
_PAGE_KEY = r"[0-9a-f]{64}\.[0-9a-f]{16}\.[0-9]{1,4}-[0-9]{1,4}-[0-9]{1,4}"


class RedisBackend(L3Backend):
    name = "redis"

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        try:
            import redis
        except ImportError:  # pragma: no cover - depends on the install
            raise ValueError(
                "the redis backend needs the 'redis' package: pip install 'kvfabric[redis]'"
            ) from None
        opts = RedisOptions.parse(extra, "redis")
        self.prefix = opts.prefix
        self._own = re.compile(re.escape(opts.prefix) + _PAGE_KEY)
        self.where = f"{opts.host}:{opts.port}"
        options: dict[str, Any] = {
            "host": opts.host,
            "port": opts.port,
            "db": opts.db,
            "username": opts.username,
            "password": opts.password,
            "socket_timeout": opts.timeout_s,
            "socket_connect_timeout": opts.timeout_s,
        }
        if opts.ssl:
            options.update(
                ssl=True,
                ssl_ca_certs=opts.ssl_ca_certs,
                ssl_certfile=opts.ssl_certfile,
                ssl_keyfile=opts.ssl_keyfile,
                ssl_cert_reqs=opts.ssl_cert_reqs,
            )
        self.client = redis.Redis(**options)
        try:
            self.client.ping()
        except redis.AuthenticationError as exc:
            raise ConfigError(
                f"storage redis at {self.where}: authentication failed: {exc}"
            ) from None
        except redis.ResponseError as exc:
            raise ConfigError(f"storage redis at {self.where}: refused: {exc}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConfigError(
                f"storage redis at {self.where} is unreachable: {exc}; start Redis there or "
                "set storage.options host and port"
            ) from None
        except redis.RedisError as exc:
            raise ConfigError(f"storage redis at {self.where}: {exc}") from None
        self._errors = redis.RedisError

    # Batches: one round trip each.

    def exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.prefix + check_key(key))
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def _read_rows(
        self, keys: Sequence[str], out: np.ndarray, provenance: Provenance
    ) -> Iterator[str | None]:
        if not keys:
            return
        blobs = self.client.mget([self.prefix + key for key in keys])
        for i, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
            yield self.verify_into(key, blob, out[i], provenance)

    def set(
        self, keys: Sequence[str], pages: np.ndarray, provenance: Provenance | None = None
    ) -> list[bool]:
        from fabric.l3.format import encode_header

        prov = provenance or self.provenance
        pipe = self.client.pipeline(transaction=False)
        for i, key in enumerate(keys):
            payload = memoryview(pages[i]).cast("B")
            pipe.set(self.prefix + check_key(key), encode_header(payload, prov, key) + payload)
        try:
            ok = [bool(r) for r in pipe.execute(raise_on_error=False)]
        except self._errors as exc:
            log.warning("L3 redis at %s: storing %d pages failed: %s", self.where, len(keys), exc)
            ok = [False] * len(keys)
        self.count("set_pages", sum(ok))
        self.count("set_failed", len(ok) - sum(ok))
        return ok

    # One key at a time (the base class's fallbacks, and tests).

    def _read(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        try:
            self.client.set(self.prefix + key, b"".join(parts))
        except self._errors as exc:
            raise OSError(str(exc)) from None

    def _exists(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def _clear(self) -> None:
        pattern = _GLOB.sub(r"\\\1", self.prefix) + "*"
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=pattern, count=1000):
            if self._own.fullmatch(name.decode("utf-8", "replace")):
                batch.append(name)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        if batch:
            self.client.delete(*batch)

    def _usage(self) -> dict[str, Any]:
        return {"server": self.where, "prefix": self.prefix}

    def close(self) -> None:
        self.client.close()
