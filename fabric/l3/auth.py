"""Authenticated L3 pages: a keyed tag over each page, so that whoever can write
the store (shared storage: other tenants' workers, other engines, operators)
cannot make a page the fabric serves without the secret.

A tag binds the page's key and model tag (the *bound*) and every payload byte,
with a random nonce per page whose length names the MAC:

- **AEGIS-128X4** (``pyaegis``, libaegis), a 32-byte nonce, for payloads of
  ``AEGIS_FROM`` bytes and more: the AEAD's tag over the payload as associated
  data and an empty message, under a nonce derived from the page's
  (``aegis_nonce``: SHA-256 of the page's nonce and the bound, its first 16
  bytes). An AEAD with an empty message is a MAC of its associated data (GMAC is
  AES-GCM used so): a tag that verifies for a nonce and payload never tagged
  together is a forgery against the AEAD's integrity, which AEGIS's analysis
  covers while the tagging side never repeats a nonce; a fresh random 32-byte
  nonce per page sees to that, and the bound cannot change without the derived
  nonce changing (short of a second preimage of its 128 bits). One call into libaegis a
  page (one GIL hand-off, as the CRC's): 34 GB/s at 256 KiB on one core of the
  project's machine, the CRC's speed, against AES-GCM's 18.5
  (``bench/auth_tags.py``).
- **AES-GCM** (``cryptography``), a 12-byte nonce, for smaller payloads, where
  its call costs as little: the bound as the (discarded) plaintext, the payload as
  associated data. Random 96-bit nonces keep a key safe for about 2**32 such
  pages (NIST SP 800-38D): rotate the secret (and clear L3) well before.
- **AEGIS-128X4's MAC mode**, a 16-byte nonce: read, never written. Pages from
  64 KiB carried it from kvfabric's first AEGIS tags until these (four calls a
  page, so more GIL hand-offs between a rank's reader threads).

A reader accepts each, whatever the page's length (a store written before is
still served). Each has its own key: SHA-256 of its domain string and the
secret. A page without a valid tag is a miss counted ``refused_auth``.
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
_AEGIS_DOMAIN = b"kvfabric/l3-page-auth/aegis-128x4-aead/v1\0"
_NONCE_DOMAIN = b"kvfabric/l3-page-auth/aegis-128x4-nonce/v1\0"
_MAC_DOMAIN = b"kvfabric/l3-page-auth/aegis-128x4/v1\0"  # the MAC mode's (read only)
MIN_SECRET_BYTES = 16
# Payloads from this length on are tagged with AEGIS-128X4: below it AES-GCM's
# call costs as little (one thread, ``bench/auth_tags.py --page-kib N``: at 32 KiB
# GCM 7.2 GB/s, AEGIS 7.4; at 64 KiB 10.9 and 13.0; at 128 KiB 12.5 and 20.5).
AEGIS_FROM = 64 << 10
GCM_NONCE, AEGIS_NONCE, AEGIS_MAC_NONCE = 12, 32, 16
_NONCES = (GCM_NONCE, AEGIS_NONCE, AEGIS_MAC_NONCE)


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
        self._buffer = cffi.FFI().from_buffer  # a payload handed to libaegis uncopied
        aegis_key = hashlib.sha256(_AEGIS_DOMAIN + secret).digest()[:16]
        self._aegis_tag, self._aegis_ok = _aegis_128x4(aegis_key, self._buffer)
        self._mac_type = AegisMac128X4
        self._mac_key = hashlib.sha256(_MAC_DOMAIN + secret).digest()[:16]
        self._macs = threading.local()  # a MAC state a thread, reset for each tag

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
        (it names the MAC: 32 bytes AEGIS-128X4's, 12 AES-GCM's)."""
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
        """Whether ``mac`` (with ``nonce``: 12, 16 or 32 bytes) is ``payload``'s
        tag for ``bound`` (``PageAuth.bound``: its key and model tag)."""
        if len(nonce) == AEGIS_NONCE:
            return len(mac) == 16 and self._aegis_checked(nonce, mac, bound, payload)
        if len(nonce) not in _NONCES:
            return False
        return hmac.compare_digest(self._tag(nonce, bound, payload), mac)

    def checker(self, nonce_len: int) -> Any:
        """``tag_ok`` for tags whose nonce is ``nonce_len`` bytes and whose tag is
        16 (their lengths known: ``FastCheck``'s), with fewer steps where it can."""
        return self._aegis_checked if nonce_len == AEGIS_NONCE else self.tag_ok

    def _aegis_checked(self, nonce: bytes, mac: bytes, bound: bytes, payload: Any) -> bool:
        return self._aegis_ok(aegis_nonce(nonce, bound), mac, payload)  # in constant time

    def _tag(self, nonce: bytes, bound: bytes, payload: Any) -> bytes:
        if len(nonce) == AEGIS_NONCE:  # the AEAD's tag of an empty message
            return self._aegis_tag(aegis_nonce(nonce, bound), payload)
        if len(nonce) == GCM_NONCE:
            return self._gcm.encrypt(nonce, bound, payload)[-16:]
        mac = getattr(self._macs, "mac", None)  # the MAC mode (pages written before)
        if mac is None:  # its own nonce all zeros (libaegis allows it): the page's is input
            mac = self._macs.mac = self._mac_type(self._mac_key, bytes(AEGIS_MAC_NONCE), 16)
        mac.reset()
        mac.update(nonce + len(bound).to_bytes(2, "little") + bound)
        mac.update(self._buffer(payload))
        return mac.final()


def aegis_nonce(nonce: bytes, bound: bytes) -> bytes:
    """The AEGIS-128X4 nonce of a page's tag: SHA-256 of the page's own nonce and
    the bound (its length first), its first 16 bytes."""
    made = hashlib.sha256(_NONCE_DOMAIN + nonce + len(bound).to_bytes(2, "little") + bound)
    return made.digest()[:16]


def _aegis_128x4(key: bytes, buffer: Any) -> tuple[Any, Any]:
    """AEGIS-128X4's tag of an empty message over associated data under ``key``,
    made and checked in one call into libaegis: ``tag(nonce, payload)`` and
    ``ok(nonce, mac, payload)`` (16-byte nonce and tag; ``buffer`` hands the
    payload over uncopied). Through ``pyaegis``'s own cffi module where it has
    one, else through its ``Aegis128X4`` class (the same call, behind a few more
    Python steps)."""
    try:
        from pyaegis._aegis_ffi import ffi, lib
    except ImportError:
        return _aegis_class(key, buffer)
    encrypt, decrypt = lib.aegis128x4_encrypt_detached, lib.aegis128x4_decrypt_detached
    null = ffi.NULL

    def tag(nonce: bytes, payload: Any) -> bytes:
        out, data = ffi.new("uint8_t[16]"), buffer(payload)
        if encrypt(null, out, 16, null, 0, data, len(data), nonce, key) != 0:
            raise RuntimeError("libaegis failed to tag a page")
        return bytes(ffi.buffer(out))

    def ok(nonce: bytes, mac: bytes, payload: Any) -> bool:
        data = buffer(payload)
        return decrypt(null, null, 0, mac, 16, data, len(data), nonce, key) == 0

    return tag, ok


def _aegis_class(key: bytes, buffer: Any) -> tuple[Any, Any]:
    from pyaegis import Aegis128X4, DecryptionError

    aegis = Aegis128X4(tag_size=16)

    def tag(nonce: bytes, payload: Any) -> bytes:
        return aegis.encrypt(key, nonce, b"", buffer(payload))

    def ok(nonce: bytes, mac: bytes, payload: Any) -> bool:
        try:
            aegis.decrypt(key, nonce, mac, buffer(payload))
        except DecryptionError:
            return False
        return True

    return tag, ok
