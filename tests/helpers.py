"""Helpers shared by every test package: fake clock, small caches and fabrics,
prompts, L3 pages, Hypothesis settings, polling."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
from hypothesis import HealthCheck, settings

from fabric.cache.hicache import HiCache
from fabric.cache.inprocess import InProcessController
from fabric.config import CacheConfig, FabricConfig, ModelConfig, PrefetchConfig
from fabric.l3.format import Provenance

# ``ci`` (the default) keeps the suite moderate; ``quick`` (``make test-fast``, the
# loop a developer runs all day) a quarter of it; ``deep`` runs thousands of examples
# per state machine with fresh random seeds:
# KVFABRIC_HYPOTHESIS=deep python3 -m pytest tests -k Machine
HYPOTHESIS_PROFILE = os.environ.get("KVFABRIC_HYPOTHESIS", "ci")
_PROFILES = ("quick", "ci", "deep")


def example_count(ci: int, deep: int) -> int:
    """How many examples a property runs: ``ci`` under the ci profile, a quarter of it
    (at least 10) under ``quick``, ``deep`` under ``deep``."""
    if HYPOTHESIS_PROFILE not in _PROFILES:
        raise ValueError(
            f"KVFABRIC_HYPOTHESIS={HYPOTHESIS_PROFILE!r} is refused: allowed is "
            + ", ".join(_PROFILES)
        )
    return {"quick": min(ci, max(10, ci // 4)), "ci": ci, "deep": deep}[HYPOTHESIS_PROFILE]


def machine_settings(examples: int, steps: int) -> settings:
    """Settings of a Hypothesis state machine: ``examples`` under the ci profile, a
    quarter (at least 10) under ``quick``, at least 2,000 (and 10x as many) under
    ``deep``."""
    return settings(
        max_examples=example_count(examples, max(2000, 10 * examples)),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=False,
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` until it holds (``True``) or ``timeout`` seconds pass (``False``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def where_now(actor, timeout: float = 10.0) -> tuple[int, str] | None:
    """An actor's ``(pid, node id)``, or ``None`` while Ray restarts it (or has lost it):
    polls of a killed actor see errors before they see its next incarnation."""
    import ray

    try:
        return tuple(ray.get(actor.where.remote(), timeout=timeout))
    except ray.exceptions.RayError:
        return None


# -- the cache core ------------------------------------------------------------

P = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_cache(
    device_pages: int = 8,
    host_pages: int = 16,
    immediate: bool = False,
    clock: FakeClock | None = None,
    prefetch: PrefetchConfig | None = None,
    model: ModelConfig | None = None,
    **cache_options,
) -> HiCache:
    cfg = CacheConfig(
        page_size=P,
        device_tokens=device_pages * P,
        host_tokens=host_pages * P,
        **{"load_back_threshold": 0, **cache_options},
    )
    ctl = InProcessController(device_pages, host_pages, P, immediate=immediate)
    return HiCache(cfg, ctl, prefetch, clock=clock or FakeClock(), model=model)


def hybrid_model(kinds: str, window: int = 6) -> ModelConfig:
    """A four-layer model with sliding (``window`` tokens) and/or mamba layers
    besides full attention: ``kinds`` is ``sliding``, ``mamba`` or ``both``."""
    layers = {
        "sliding": ("full", "sliding", "full", "sliding"),
        "mamba": ("full", "mamba", "mamba", "mamba"),
        "both": ("full", "sliding", "mamba", "sliding"),
    }[kinds]
    return ModelConfig(layer_kinds=layers, sliding_window=window if "sliding" in layers else 0)


def toks(*pages: int) -> list[int]:
    """Tokens of whole pages, page ``n`` being ``[n, n, n, n]``."""
    return [t for p in pages for t in [p] * P]


def put(cache: HiCache, tokens: list[int], namespace: str = "default", priority: int = 0):
    """Insert like a server would: match, lease pages for the rest, insert."""
    key = cache.key(tokens, namespace)
    m = cache.placement.match_prefix(key)
    pages = cache.placement.alloc_device(key.num_tokens - m.device_tokens)
    assert pages is not None
    result = cache.placement.insert(key, m.device_pages + pages, priority)
    cache.writes.write_through()
    return result


# -- fabrics and prompts ----------------------------------------------------------


def small_config(*overrides: str) -> FabricConfig:
    """TP=2 x PP=2, tiny pools and model: every path of the data plane in milliseconds."""
    return FabricConfig().with_overrides(
        [
            "topology.tp=2",
            "topology.pp=2",
            "cache.page_size=4",
            "cache.device_tokens=96",
            "cache.host_tokens=192",
            "cache.load_back_threshold=0",
            "model.layers=2",
            "model.kv_heads=2",
            "model.head_dim=8",
            "runtime.step_interval_s=0",
            "storage.backend=none",
            *overrides,
        ]
    )


def prompt(seed: int, pages: int, shared: int = 0, page_size: int = 4) -> list[int]:
    """``shared`` pages common to every seed, then pages unique to ``seed``."""
    common = [7000 + t for t in range(shared * page_size)]
    return common + [seed * 1000 + t for t in range((pages - shared) * page_size)]


# -- L3 pages ---------------------------------------------------------------------

PROV = Provenance("m", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4)
PAGE_BYTES = 2 * 4 * 1 * 1 * 8 * 2


def keys(n: int, suffix: str = "0-0-0", start: int = 0, prov: Provenance = PROV) -> list[str]:
    return [f"{i:064x}.{prov.tag}.{suffix}" for i in range(start, start + n)]


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE_BYTES), dtype=np.uint8)


def storage_options(tmp_path, *more: str) -> list[str]:
    return [f"storage.path={tmp_path / 'l3'}", "storage.backend=file", *more]


class RouterView:
    """What a KV-aware router indexing the events believes each medium holds;
    ``check`` compares L1 and L2 with the tree (hashes computed here, none stored
    on the nodes) and L3 with the pages the fabric knows its store holds."""

    def __init__(self) -> None:
        from fabric.cache.events import Medium

        self.held: dict = {Medium.DEVICE: set(), Medium.HOST: set(), Medium.STORAGE: set()}

    def apply(self, events) -> None:
        from fabric.cache.events import AllBlocksCleared, BlockRemoved, BlockStored

        for e in events:
            if isinstance(e, AllBlocksCleared):
                for held in self.held.values():
                    held -= {x for x in held if e.namespace in ("", x[0])}
                continue
            pages = {(e.namespace, h) for h in e.page_hashes}
            held = self.held[e.medium]
            if isinstance(e, BlockStored):
                assert not pages & held, f"{e.medium} pages stored twice"
                held |= pages
            else:
                assert isinstance(e, BlockRemoved)
                assert pages <= held, f"{e.medium} pages removed before being stored"
                held -= pages

    def check(self, tree, l3: dict | None = None) -> None:
        """``l3``: the cache's ``events.l3`` (hash -> namespace), when it has one."""
        from fabric.cache.events import Medium
        from fabric.cache.keys import chain_hashes, namespace_seed

        truth: dict = {Medium.DEVICE: set(), Medium.HOST: set(), Medium.STORAGE: set()}
        stack = [(child, namespace_seed(child.namespace)) for child in tree.root.children.values()]
        while stack:
            node, prev = stack.pop()
            hashes = chain_hashes(prev, node.key, tree.page_bytes)
            pages = {(node.namespace, h) for h in hashes}
            if node.device_value is not None:
                truth[Medium.DEVICE] |= pages
            if node.host_value is not None and node.write_op is None:
                truth[Medium.HOST] |= pages
            stack.extend((child, hashes[-1]) for child in node.children.values())
        if l3 is None:
            truth[Medium.STORAGE] = self.held[Medium.STORAGE]
        else:
            truth[Medium.STORAGE] = {(ns, h) for h, ns in l3.items()}
        assert self.held == truth
