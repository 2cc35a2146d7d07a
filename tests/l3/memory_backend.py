"""A user backend loaded with ``storage.backend=dynamic`` in tests."""

from __future__ import annotations

from fabric.l3.backend import L3Backend


class MemoryBackend(L3Backend):
    name = "memory"

    def __init__(self, provenance, page_bytes, extra):
        super().__init__(provenance, page_bytes, extra)
        self.blobs: dict[str, bytes] = {}
        self.label = extra.get("label")

    def _read(self, key):
        return self.blobs.get(key)

    def _write(self, key, parts):
        self.blobs[key] = b"".join(parts)

    def _exists(self, key):
        return key in self.blobs

    def _clear(self):
        self.blobs.clear()

    def _usage(self):
        return {"pages": len(self.blobs)}
