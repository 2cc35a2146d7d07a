"""L3 in a Redis server: a shared tier across nodes without a shared file system.

Each page shard is one Redis string under ``<prefix><key>``, in the same format
as the file backend (header with the page's own key, checksum, provenance).
Batches travel in one round trip each (``MGET``, pipelined ``EXISTS`` and
``SET``). The prefix is validated (letters, digits and ``_:.-``), and ``clear``
deletes only keys of this prefix's exact page-key form, so two prefixes never
touch each other's pages. Requires the ``redis`` package (``pip install
'kvfabric[redis]'``). A size cap is Redis's own business (``maxmemory`` with an
LRU policy); ``stats`` counts this process's traffic and never scans the server.

A Redis that is down or hangs costs one ``timeout_s`` (the client does not
retry), then nothing: the backend fails fast — reads are misses, writes fail,
``redis_fast_failed`` counts them — until ``OUTAGE_RETRY_S`` later one call tries
the server again (``redis_errors`` counts the calls that failed on it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
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
# After a failed call, the server is left alone this long (then one call tries it).
OUTAGE_RETRY_S = 5.0


class _Breaker:
    """Open after a call fails on the server; one trial call per ``retry_s``."""

    def __init__(self, retry_s: float, clock=time.monotonic) -> None:
        self.retry_s = retry_s
        self.clock = clock
        self._open_until = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self.clock()
            if now < self._open_until:
                return False
            if self._open_until:  # half-open: this call is the trial; the rest wait
                self._open_until = now + self.retry_s
            return True

    def failed(self) -> None:
        with self._lock:
            self._open_until = self.clock() + self.retry_s

    def succeeded(self) -> None:
        with self._lock:
            self._open_until = 0.0


class RedisBackend(L3Backend):
    name = "redis"

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
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
            # One attempt: a server that is down costs one timeout, not a retry loop.
            "retry": Retry(NoBackoff(), 0),
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
        self._down = (redis.ConnectionError, redis.TimeoutError)  # these open the breaker
        self.breaker = _Breaker(OUTAGE_RETRY_S)

    def _call(self, what: str, fn, down):
        """``fn()`` unless Redis is known to be down (then ``down`` at once); a
        failure on the server opens the breaker and returns ``down``."""
        if not self.breaker.allow():
            self.count("redis_fast_failed")
            return down
        try:
            out = fn()
        except self._errors as exc:
            self.count("redis_errors")
            if not isinstance(exc, self._down):  # the server answered: a refusal
                log.warning("L3 redis at %s: %s refused: %s", self.where, what, str(exc)[:120])
                return down
            self.breaker.failed()
            log.warning(
                "L3 redis at %s: %s failed (%s); failing fast for %.0f s",
                self.where, what, str(exc)[:120], OUTAGE_RETRY_S,
            )  # fmt: skip
            return down
        self.breaker.succeeded()
        return out

    # Batches: one round trip each.

    def exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.prefix + check_key(key))
        n = 0
        for found in self._call("exists", pipe.execute, []):
            if not found:
                break
            n += 1
        return n

    def _read_rows(
        self, keys: Sequence[str], out: np.ndarray, provenance: Provenance
    ) -> Iterator[str | None]:
        if not keys:
            return
        blobs = self._call("mget", lambda: self.client.mget([self.prefix + k for k in keys]), None)
        if blobs is None:
            yield "unavailable"
            return
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
            header = encode_header(payload, prov, key, self.auth)
            pipe.set(self.prefix + check_key(key), header + payload)
        done = self._call("set", lambda: pipe.execute(raise_on_error=False), None)
        ok = [False] * len(keys) if done is None else [r is True for r in done]
        self.count("set_pages", sum(ok))
        self.count("set_failed", len(ok) - sum(ok))
        return ok

    # One key at a time (the base class's fallbacks, and tests).

    def _read(self, key: str) -> bytes | None:
        return self._call("get", lambda: self.client.get(self.prefix + key), None)

    def delete(self, keys: Sequence[str]) -> int:
        names = [self.prefix + check_key(key) for key in keys]
        if not names:
            return 0
        gone = int(self._call("delete", lambda: self.client.delete(*names), 0))
        self.count("deleted_pages", gone)
        return gone

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        if not self._call(
            "set", lambda: self.client.set(self.prefix + key, b"".join(parts)), False
        ):
            raise OSError(f"redis at {self.where} did not store {key}")

    def _exists(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(self.prefix + key), 0))

    def _own_names(self) -> Iterator[bytes]:
        """The Redis names of this prefix's pages (SCAN: the server is never blocked)."""
        pattern = _GLOB.sub(r"\\\1", self.prefix) + "*"
        for name in self.client.scan_iter(match=pattern, count=1000):
            if self._own.fullmatch(name.decode("utf-8", "replace")):
                yield name

    def _clear(self) -> None:
        batch: list[bytes] = []
        for name in self._own_names():
            batch.append(name)
            if len(batch) >= 1000:
                self.client.delete(*batch)
                batch = []
        if batch:
            self.client.delete(*batch)

    def page_keys(self) -> list[str]:
        """Every page key under this prefix, for audits (a SCAN over the prefix)."""
        skip = len(self.prefix)
        return [name.decode("ascii")[skip:] for name in self._own_names()]

    def _usage(self) -> dict[str, Any]:
        return {"server": self.where, "prefix": self.prefix}

    def close(self) -> None:
        self.client.close()
