"""L3 in a Redis server: a shared tier across nodes without a shared file system.

Each page shard is one Redis string under ``<prefix><key>``, in the same format
as the file backend (header, checksum, provenance). Requires the ``redis``
package (``pip install 'kvfabric[redis]'``). A size cap is Redis's own business
(``maxmemory`` with an LRU policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fabric.l3.backend import L3Backend
from fabric.l3.codec import Provenance


class RedisBackend(L3Backend):
    name = "redis"

    def __init__(self, provenance: Provenance, page_bytes: int, extra: Mapping[str, Any]) -> None:
        super().__init__(provenance, page_bytes, extra)
        try:
            import redis
        except ImportError:  # pragma: no cover - depends on the install
            raise ValueError(
                "the redis backend needs the 'redis' package: pip install redis"
            ) from None
        self.prefix = str(extra.get("prefix", "kvfabric:"))
        self.client = redis.Redis(
            host=str(extra.get("host", "127.0.0.1")),
            port=int(extra.get("port", 6379)),
            db=int(extra.get("db", 0)),
            password=extra.get("password"),
            socket_timeout=float(extra.get("timeout_s", 5.0)),
        )
        self.client.ping()

    def _read(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def _write(self, key: str, parts: tuple[bytes, memoryview]) -> None:
        import redis

        try:
            self.client.set(self.prefix + key, b"".join(parts))
        except redis.RedisError as exc:
            raise OSError(str(exc)) from None

    def _exists(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))

    def _clear(self) -> None:
        for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
            self.client.delete(key)

    def _usage(self) -> dict[str, Any]:
        pages = sum(1 for _ in self.client.scan_iter(match=self.prefix + "*", count=1000))
        return {"pages": pages}

    def close(self) -> None:
        self.client.close()
