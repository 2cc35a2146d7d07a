"""Authenticated L3 pages: a keyed tag over each page, so that whoever can write
the store (shared storage: other tenants' workers, other engines, operators)
cannot make a page the fabric serves without the secret.

A tag binds the page's key and model tag and every payload byte, with a random
nonce per page whose length names the MAC:

- **AEGIS-128X4's MAC** (AEGIS-MAC: ``pyaegis``, libaegis), a 16-byte nonce,
  for payloads of ``AEGIS_FROM`` bytes and more: over the nonce, the key and
  model tag (their length first) and the payload. A keyed PRF that needs no
  unique nonce; 30-34 GB/s at 256 KiB on one core of the project's machine
  against AES-GCM's 19-20 (``bench/auth_tags.py``), so a read and its tag cost
  little more than a read and its CRC.
- **AES-GCM** (``cryptography``), a 12-byte nonce, for smaller payloads, where
  its cheaper call wins: the key and model tag as the (discarded) plaintext,
  the payload as associated data. Random 96-bit nonces keep a key safe for
  about 2**32 such pages (NIST SP 800-38D): rotate the secret (and clear L3)
  well before.

A reader accepts either, whatever the page's length (a store written before
AEGIS tags is still served). Each has its own key: SHA-256 of its domain string
and the secret. A page without a valid tag is a miss counted ``refused_auth``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from pathlib import Path
from typing import Any

from fabric.errors import ConfigError
from fabric.l3.format import Provenance

_GCM_DOMAIN = b"kvfabric/l3-page-auth/v1\0"
_AEGIS_DOMAIN = b"kvfabric/l3-page-auth/aegis-128x4/v1\0"
MIN_SECRET_BYTES = 16
# Payloads from this length on are tagged with AEGIS-128X4: below it AES-GCM's
# call costs less (one thread, ``bench/auth_tags.py --page-kib N``: at 32 KiB
# GCM 10.9 GB/s, AEGIS-MAC 9.2; at 64 KiB 11.8 and 13.7; at 128 KiB 14.3 and 21.9).
AEGIS_FROM = 64 << 10
GCM_NONCE, AEGIS_NONCE = 12, 16


class PageAuth:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"an L3 authentication secret of {len(secret)} bytes is refused: allowed "
                f"is {MIN_SECRET_BYTES} bytes or more"
            )
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            import cffi
            from pyaegis import AegisMac128X4
        except ImportError as exc:
            raise ConfigError(
                f"authenticated L3 pages need pyaegis ({exc}): pip install 'kvfabric[auth]'"
            ) from None
        self._gcm = AESGCM(hashlib.sha256(_GCM_DOMAIN + secret).digest())
        self._mac_type = AegisMac128X4
        self._aegis_key = hashlib.sha256(_AEGIS_DOMAIN + secret).digest()[:16]
        self._macs = threading.local()  # a MAC state a thread, reset for each tag
        self._buffer = cffi.FFI().from_buffer  # a payload handed to libaegis uncopied

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

    @staticmethod
    def nonce_bytes(payload_len: int) -> int:
        """The nonce's length ``sign`` gives a payload of ``payload_len`` bytes
        (it names the MAC: 16 bytes AEGIS-128X4's, 12 AES-GCM's)."""
        return AEGIS_NONCE if payload_len >= AEGIS_FROM else GCM_NONCE

    def sign(self, payload: Any, provenance: Provenance, key: str) -> dict[str, bytes]:
        """Header fields that authenticate ``payload`` stored under ``key``."""
        nonce = os.urandom(self.nonce_bytes(memoryview(payload).nbytes))
        return {"nonce": nonce, "mac": self._tag(nonce, self.bound(key, provenance), payload)}

    def verify(self, header: dict, key: str, provenance: Provenance, payload: Any) -> bool:
        """Whether ``header`` carries a valid tag for ``payload`` under ``key``."""
        nonce, mac = header.get("nonce"), header.get("mac")
        if not isinstance(nonce, bytes) or not isinstance(mac, bytes):
            return False
        return self.tag_ok(nonce, mac, self.bound(key, provenance), payload)

    def tag_ok(self, nonce: bytes, mac: bytes, bound: bytes, payload: Any) -> bool:
        """Whether ``mac`` (with ``nonce``: 12 or 16 bytes) is ``payload``'s tag
        for ``bound`` (``PageAuth.bound``: its key and model tag)."""
        if len(nonce) not in (GCM_NONCE, AEGIS_NONCE):
            return False
        return hmac.compare_digest(self._tag(nonce, bound, payload), mac)

    def _tag(self, nonce: bytes, bound: bytes, payload: Any) -> bytes:
        if len(nonce) != AEGIS_NONCE:
            return self._gcm.encrypt(nonce, bound, payload)[-16:]
        mac = getattr(self._macs, "mac", None)
        if mac is None:  # its own nonce all zeros (libaegis allows it): the page's is input
            mac = self._macs.mac = self._mac_type(self._aegis_key, bytes(AEGIS_NONCE), 16)
        mac.reset()
        mac.update(nonce + len(bound).to_bytes(2, "little") + bound)
        mac.update(self._buffer(payload))
        return mac.final()
