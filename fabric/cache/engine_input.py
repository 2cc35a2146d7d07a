"""What engines attached through a connector (``fabric.engines.vllm_connector``)
send the coordinator's tree (``fabric.cache.engine_tree``): the runs of pages a
rank stored, and the bounds and checks every engine call passes first, each
refusal naming the bad value."""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fabric.cache.keys import check_namespace
from fabric.errors import InvalidInput

HASH_BYTES = 32
MAX_WORLD = 4096
# Pages one chain or run may name (a 2M-token prompt at 32-token pages is 65,536),
# and chains or runs one call may carry (an engine step's requests).
MAX_PAGES_PER_CALL = 1 << 17
MAX_CHAINS_PER_CALL = 1 << 12
# Leases held at once (the oldest ends first beyond), their longest life, and
# the longest lease name (an engine's id and a request id).
MAX_LEASES = 1 << 16
MAX_LEASE_S = 600.0
MAX_LEASE_NAME = 256
# The largest page of one rank, and the longest name of a place (a node).
MAX_PAGE_BYTES = 1 << 40
MAX_PLACE = 256
_TAG = re.compile(r"[0-9a-f]{16}")

# Where an engine page lives: the fabric's L3, a node's shared-memory L2
# (``L2_AT + node``), or one engine replica's device blocks (``L1_AT + replica``:
# vLLM keeps and evicts them; the tree is told).
L3 = "l3"
L2_AT = "l2@"
L1_AT = "l1@"


def node_place(directory: str = "") -> str:
    """This node's L2 as a place: the host, and the directory of its regions when
    it is not the node's shared memory."""
    host = socket.gethostname() or "node"
    return f"{L2_AT}{host}:{directory}" if directory else f"{L2_AT}{host}"


@dataclass(frozen=True)
class StoredRun:
    """Pages one rank stored, in chain order: ``hashes`` follow the page hashed
    ``parent`` (``None``: they start ``namespace``'s chain). ``place`` says where
    (``L3``, or a node's L2); ``page_bytes`` is one of the rank's pages (0:
    not said)."""

    namespace: str
    parent: bytes | None
    hashes: tuple[bytes, ...]
    place: str = L3
    page_bytes: int = 0


@dataclass(frozen=True)
class PageName:
    """The engine's own name of the page ``page``: its block hash in the engine
    (vLLM's, as vLLM's KV events carry it) and its ``tokens`` (packed uint32).
    The fabric's KV events of engine pages use them, so that a router indexing
    the engine's events sees the same keys in the fabric's tiers."""

    page: bytes
    engine_hash: bytes
    tokens: bytes


# The longest engine block hash a name may carry, and the most tokens of one page.
MAX_ENGINE_HASH = 64
MAX_PAGE_TOKENS = 1 << 16


def part(run: StoredRun, start: int, end: int) -> StoredRun:
    """Pages ``[start, end)`` of ``run``, after their parent."""
    parent = run.hashes[start - 1] if start else run.parent
    return replace(run, parent=parent, hashes=run.hashes[start:end])


def stored_runs(run: StoredRun, ok: list[bool]) -> list[StoredRun]:
    """The runs of consecutive pages of ``run`` that were stored."""
    runs, start = [], None
    for i, good in enumerate([*ok, False]):
        if good and start is None:
            start = i
        elif not good and start is not None:
            runs.append(part(run, start, i))
            start = None
    return runs


def check_group(tag: object, world: object) -> None:
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise InvalidInput(f"tag {tag!r} is refused: allowed is 16 lowercase hex digits")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD:
        raise InvalidInput(f"world {world!r} is refused: allowed is an int in [1, {MAX_WORLD}]")


def check_hashes(hashes: object, what: str) -> None:
    if not isinstance(hashes, (list, tuple)) or len(hashes) > MAX_PAGES_PER_CALL:
        raise InvalidInput(
            f"{what} is refused: allowed is a list of at most {MAX_PAGES_PER_CALL} page hashes"
        )
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise InvalidInput(f"page hash {h!r:.80} is refused: allowed is {HASH_BYTES} bytes")


# Component groups a lookup may name (``EngineTree.lookup``'s ``needs``).
MAX_NEEDS = 64


def check_needs(needs: object, world: int) -> None:
    """A hybrid engine's component groups: ``(tag, before)`` pairs, ``before`` the
    pages before a hit point the group must hold (0: every page)."""
    if not isinstance(needs, (list, tuple)) or len(needs) > MAX_NEEDS:
        raise InvalidInput(f"needs are refused: allowed is a list of at most {MAX_NEEDS}")
    for need in needs:
        if not isinstance(need, (list, tuple)) or len(need) != 2:
            raise InvalidInput(f"need {need!r:.80} is refused: allowed is a (tag, pages) pair")
        tag, before = need
        check_group(tag, world)
        if not isinstance(before, int) or isinstance(before, bool) or not 0 <= before <= 1 << 20:
            raise InvalidInput(
                f"need pages {before!r} are refused: allowed is an int in [0, 2**20]"
            )


def check_chains(chains: object) -> None:
    if not isinstance(chains, (list, tuple)) or len(chains) > MAX_CHAINS_PER_CALL:
        size = len(chains) if hasattr(chains, "__len__") else "?"  # type: ignore[arg-type]
        raise InvalidInput(
            f"chains must be a list of at most {MAX_CHAINS_PER_CALL} page-hash lists, "
            f"got {type(chains).__name__} of {size}"
        )
    for chain in chains:
        check_hashes(chain, "chain")


def check_place(place: object) -> str:
    """``place`` when it names one (``L3``, ``L2_AT`` and a node, ``L1_AT`` and a
    replica)."""
    if (
        isinstance(place, str)
        and len(place) <= MAX_PLACE
        and (place == L3 or (place.startswith((L2_AT, L1_AT)) and len(place) > len(L2_AT)))
    ):
        return place
    raise InvalidInput(
        f"place {place!r:.80} is refused: allowed is {L3!r}, {L2_AT!r} and a node's name, or "
        f"{L1_AT!r} and an engine replica's (at most {MAX_PLACE} characters)"
    )


def check_count(value: object, what: str) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 0 <= value <= MAX_PAGE_BYTES << 12
    ):
        raise InvalidInput(f"{what} {value!r:.80} is refused: allowed is an int >= 0")
    return value


def check_leases(leases: object, chains: Sequence, lease_s: object) -> None:
    if not isinstance(leases, (list, tuple)) or len(leases) != len(chains):
        raise InvalidInput(
            f"leases are refused: allowed is one lease name per chain ({len(chains)})"
        )
    for name in leases:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LEASE_NAME:
            raise InvalidInput(
                f"lease name {name!r:.80} is refused: allowed is a str of 1..{MAX_LEASE_NAME} "
                f"characters"
            )
    if (
        not isinstance(lease_s, (int, float))
        or isinstance(lease_s, bool)
        or not 0 <= lease_s <= MAX_LEASE_S
    ):
        raise InvalidInput(
            f"lease_s {lease_s!r} is refused: allowed is a number in [0, {MAX_LEASE_S:g}]"
        )


def check_reports(world: int, reports: object) -> None:
    if not isinstance(reports, dict):
        raise InvalidInput(f"reports must map a rank to its stored runs, got {type(reports)}")
    for rank, runs in reports.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
            raise InvalidInput(f"rank {rank!r} is refused: allowed is an int in [0, {world})")
        if not isinstance(runs, (list, tuple)) or len(runs) > MAX_CHAINS_PER_CALL:
            raise InvalidInput(
                f"rank {rank}'s runs are refused: allowed is a list of at most "
                f"{MAX_CHAINS_PER_CALL} stored runs"
            )
        for run in runs:
            check_run(run)


def check_run(run: object) -> None:
    if not isinstance(run, StoredRun):
        raise InvalidInput(f"a stored run must be a StoredRun, got {type(run).__name__}")
    try:
        check_namespace(run.namespace)
    except InvalidInput as exc:
        raise InvalidInput(f"stored run: {exc}") from None
    if run.parent is not None and (
        not isinstance(run.parent, bytes) or len(run.parent) != HASH_BYTES
    ):
        raise InvalidInput(f"parent {run.parent!r:.80} is refused: allowed is 32 bytes or None")
    check_hashes(run.hashes, "hashes")
    check_place(run.place)
    size = run.page_bytes
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PAGE_BYTES:
        raise InvalidInput(
            f"page_bytes {size!r} is refused: allowed is an int in [0, {MAX_PAGE_BYTES}]"
        )


def check_names(names: object) -> None:
    if not isinstance(names, (list, tuple)) or len(names) > MAX_PAGES_PER_CALL:
        raise InvalidInput(
            f"names are refused: allowed is a list of at most {MAX_PAGES_PER_CALL} page names"
        )
    for name in names:
        if not isinstance(name, PageName):
            raise InvalidInput(f"a page name must be a PageName, got {type(name).__name__}")
        check_hashes([name.page], "page")
        engine_hash, tokens = name.engine_hash, name.tokens
        if not isinstance(engine_hash, bytes) or not 0 < len(engine_hash) <= MAX_ENGINE_HASH:
            raise InvalidInput(
                f"engine hash {engine_hash!r:.80} is refused: allowed is 1..{MAX_ENGINE_HASH} bytes"
            )
        if not isinstance(tokens, bytes) or len(tokens) % 4 or len(tokens) > 4 * MAX_PAGE_TOKENS:
            raise InvalidInput(
                f"tokens {tokens!r:.80} are refused: allowed is packed uint32 token ids, at "
                f"most {MAX_PAGE_TOKENS}"
            )
