"""Authenticated L3 pages: a keyed tag over each page, so that whoever can write
the store (shared storage: other tenants' workers, other engines, operators)
cannot make a page the fabric serves without the secret.

The tag is AES-GCM's (``cryptography``'s AEAD, a library primitive) with a
random 96-bit nonce per page: the page's key and model tag as the (discarded)
plaintext, the payload as associated data — so the tag binds key, provenance
and every payload byte, at about 30 GB/s (GHASH), next to the CRC. The AES key
is SHA-256 of a domain string and the secret. A page without a valid tag is a
miss counted ``refused_auth``. Random nonces keep a key safe for about 2**32
pages (NIST SP 800-38D): rotate the secret (and clear L3) well before that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from fabric.errors import ConfigError
from fabric.l3.format import Provenance

_DOMAIN = b"kvfabric/l3-page-auth/v1\0"
MIN_SECRET_BYTES = 16


class PageAuth:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"an L3 authentication secret of {len(secret)} bytes is refused: allowed "
                f"is {MIN_SECRET_BYTES} bytes or more"
            )
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(hashlib.sha256(_DOMAIN + secret).digest())

    @classmethod
    def from_file(cls, path: str, setting: str = "storage.auth_key_file") -> PageAuth:
        """The secret in ``path`` (surrounding whitespace dropped): a file of its
        own, or Ray's token file (``~/.ray/auth_token``)."""
        where = Path(path).expanduser()
        try:
            secret = where.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"{setting}={path!r} cannot be read: {exc.strerror or exc}") from None
        try:
            return cls(secret)
        except ConfigError as exc:
            raise ConfigError(f"{setting}={path!r}: {exc}") from None

    @staticmethod
    def bound(key: str, provenance: Provenance) -> bytes:
        """What a tag binds besides the payload: the page's key and model tag."""
        return key.encode("ascii") + b"\0" + provenance.tag.encode("ascii")

    def sign(self, payload: Any, provenance: Provenance, key: str) -> dict[str, bytes]:
        """Header fields that authenticate ``payload`` stored under ``key``."""
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, self.bound(key, provenance), payload)
        return {"nonce": nonce, "mac": sealed[-16:]}

    def verify(self, header: dict, key: str, provenance: Provenance, payload: Any) -> bool:
        """Whether ``header`` carries a valid tag for ``payload`` under ``key``."""
        nonce, mac = header.get("nonce"), header.get("mac")
        if not isinstance(nonce, bytes) or len(nonce) != 12 or not isinstance(mac, bytes):
            return False
        return self.tag_ok(nonce, mac, self.bound(key, provenance), payload)

    def tag_ok(self, nonce: bytes, mac: bytes, bound: bytes, payload: Any) -> bool:
        """Whether ``mac`` (with ``nonce``, 12 bytes) is ``payload``'s tag for
        ``bound`` (``PageAuth.bound``: its key and model tag)."""
        sealed = self._aead.encrypt(nonce, bound, payload)
        return hmac.compare_digest(sealed[-16:], mac)
