"""How engines' page names become kvfabric L3 keys.

An L3 key is ``<chain hash hex>.<model tag>.<pp>-<cp>-<tp>`` (``fabric.l3.format``):
64 hex digits naming the page's content, the tag of the pages' provenance
(model, layout, dtype, shard shape, page size, component), and the shard.

- **SGLang** names a page by its storage chain hash, 64 hex digits: SHA-256 over
  the page's tokens as little-endian uint32 after the previous page's hash,
  seeded by nothing (a request without extra key or cache salt) or by its
  namespace seed. That is kvfabric's own chain (``fabric.cache.keys``) in the
  namespaces ``sglang`` and ``sglang:<extra key>``, so the hash is the key's
  first part as it is: an SGLang worker and a fabric serving those namespaces
  share pages. An adapter configured with a kvfabric tenant (``namespace``)
  moves its pages into that tenant's own domain instead (``tenant_hash``).
- **vLLM** names a block by its block hash (32 bytes for the SHA-256 hashes,
  fewer for the others) and a 4-byte KV cache group index. Its hash covers the
  block's tokens, its parent and the request's extra keys (LoRA, cache salt),
  but not over kvfabric's chain, so vLLM's blocks are shared between vLLM
  workers only: ``vllm_hash`` maps the whole key (hash and group) into a domain
  of its own, seeded by the tenant.

Why none of these collide: every mapped hash is SHA-256 of a fixed, distinct
prefix (``kvfabric/tenant``, ``kvfabric/vllm``), the namespace's 32-byte seed
and the engine's whole key, so two keys collide only if their tenants and their
engine keys are equal (groups included, as the group index is part of the
key); the chain hashes of kvfabric and SGLang start from a 32-byte hash or seed,
and the one unseeded chain (``sglang``) refuses first pages that spell out a
``kvfabric/`` or SGLang seed preimage (``fabric.cache.keys.check_unseeded``).
And the model tag differs for every engine page layout, so even equal hashes
under two engines' provenances are two keys.
"""

from __future__ import annotations

import hashlib
import re

from fabric.cache.keys import SGLANG_NAMESPACE, check_namespace, namespace_seed
from fabric.errors import ConfigError
from fabric.l3.format import Provenance, page_key

_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_RANK = 9999


def sglang_hash(key: object) -> bytes | None:
    """The chain hash SGLang's page key names (64 lowercase hex digits), or
    ``None`` for anything else (never a page: a miss, never an error)."""
    if isinstance(key, str) and _HEX64.fullmatch(key):
        return bytes.fromhex(key)
    return None


def check_tenant(namespace: str) -> str:
    """A kvfabric tenant an engine adapter serves: a namespace, not one of the
    SGLang-compatible ones (those are what the adapter uses when no tenant is set)."""
    try:
        check_namespace(namespace)
    except ValueError as exc:
        raise ConfigError(f"namespace: {exc}") from None
    if namespace == SGLANG_NAMESPACE or namespace.startswith(SGLANG_NAMESPACE + ":"):
        raise ConfigError(
            f"namespace={namespace!r} is refused: leave it empty to share SGLang's own keys "
            "(a fabric reads them in namespaces sglang and sglang:<extra key>), or name a "
            "kvfabric tenant"
        )
    return namespace


def tenant_hash(namespace: str, page_hash: bytes) -> bytes:
    """An engine's page hash moved into tenant ``namespace``'s own domain."""
    return hashlib.sha256(b"kvfabric/tenant\0" + namespace_seed(namespace) + page_hash).digest()


def vllm_hash(namespace: str, key: bytes) -> bytes:
    """A vLLM offload key (block hash and group index) as a page hash of tenant
    ``namespace``."""
    return hashlib.sha256(b"kvfabric/vllm\0" + namespace_seed(namespace) + bytes(key)).digest()


def shard_suffix(pp: int, cp: int, tp: int) -> str:
    """A key's shard part; ``ConfigError`` for ranks a key cannot name."""
    for name, rank in (("pp", pp), ("cp", cp), ("tp", tp)):
        if not (isinstance(rank, int) and 0 <= rank <= _MAX_RANK):
            raise ConfigError(f"{name} rank {rank!r} is refused: allowed is 0..{_MAX_RANK}")
    return f"{pp}-{cp}-{tp}"


class PageNamer:
    """Full L3 keys of one engine shard's pages of one provenance."""

    def __init__(self, provenance: Provenance, suffix: str) -> None:
        self.provenance = provenance
        self.tag = provenance.tag
        self.suffix = suffix

    def key(self, page_hash: bytes) -> str:
        return page_key(page_hash, self.tag, self.suffix)

    def keys(self, page_hashes: list[bytes]) -> list[str]:
        tag, suffix = self.tag, self.suffix
        return [page_key(h, tag, suffix) for h in page_hashes]
