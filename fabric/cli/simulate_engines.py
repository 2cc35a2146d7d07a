"""``kvfabric simulate --engine-pages``: what the engine tree serves engines attached
through a connector (``fabric.tools.engine_replay``), under each write policy,
beside the flat LRU index kvfabric had before the tree."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fabric import __version__
from fabric.config import FabricConfig
from fabric.observe.progress import Progress
from fabric.observe.report import result
from fabric.tools.engine_replay import EngineReplay, EngineSetup, replay

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")


@dataclass(frozen=True)
class EngineShape:
    engines: int
    nodes: int
    page_bytes: int
    l2_bytes: int


def setup_of(config: FabricConfig, shape: EngineShape, write_policy: str) -> EngineSetup:
    return EngineSetup(
        page_bytes=shape.page_bytes,
        l2_bytes=shape.l2_bytes,
        l3_bytes=config.storage.max_bytes,
        engines=shape.engines,
        nodes=shape.nodes,
        eviction_policy=config.cache.eviction_policy,
        write_policy=write_policy,
        stop_policy=config.prefetch.stop_policy,
    )


def figures(r: EngineReplay, page_bytes: int) -> dict[str, Any]:
    return {
        "hit_rate": round(r.hit_rate(), 4),
        "by_tier": {tier: round(r.hit_rate(tier), 4) for tier in r.hit_pages},
        "l3_bytes_written": r.l3_pages_written * page_bytes,
    }


def engine_what_if(
    config: FabricConfig, reqs: list, source: str, shape: EngineShape
) -> dict[str, Any]:
    """Per write policy, the tree's hit rate by tier and L3 bytes written, and the
    flat LRU index's, on ``reqs`` (each hash id one page)."""
    hash_ids = [r.hash_ids for r in reqs]
    started = time.perf_counter()
    by_policy: dict[str, Any] = {}
    for write in WRITE_POLICIES:
        setup = setup_of(config, shape, write)
        with Progress(2 * len(reqs), "requests", write) as progress:
            tree = replay(hash_ids, setup, progress=progress.update)
            flat = replay(hash_ids, setup, flat_lru=True, progress=progress.update)
        by_policy[write] = {
            "tree": figures(tree, shape.page_bytes),
            "flat_lru": figures(flat, shape.page_bytes),
        }
    pages = sum(max(len(ids) - 1, 0) for ids in hash_ids)
    return result(
        "simulate",
        source=source,
        requests=len(reqs),
        asked_pages=pages,
        elapsed_s=round(time.perf_counter() - started, 3),
        engine_pages={
            "engines": shape.engines,
            "nodes": shape.nodes,
            "page_bytes": shape.page_bytes,
            "l2_bytes": shape.l2_bytes,
            "l3_bytes": config.storage.max_bytes,
            "eviction_policy": config.cache.eviction_policy,
            "stop_policy": config.prefetch.stop_policy,
            "by_write_policy": by_policy,
        },
    )


def engine_text(out: dict[str, Any]) -> str:
    e = out["engine_pages"]
    l3 = f"{e['l3_bytes']:,}" if e["l3_bytes"] else "uncapped"
    lines = [
        f"kvfabric {__version__} simulate --engine-pages: {out['requests']} requests from "
        f"{out['source']} on {e['engines']} engines, {e['nodes']} node(s); pages of "
        f"{e['page_bytes']:,} bytes, node L2 {e['l2_bytes']:,} bytes, L3 {l3} bytes; "
        f"{e['eviction_policy']}, prefetch {e['stop_policy']}",
        f"  {'write policy':<24} {'tree':>7} {'(L2':>6} {'L3)':>6} {'flat LRU':>9}"
        f" {'L3 written: tree':>17} {'flat':>14}",
    ]
    for write, f in e["by_write_policy"].items():
        t, lru = f["tree"], f["flat_lru"]
        lines.append(
            f"  {write:<24} {t['hit_rate']:7.1%} {t['by_tier']['l2']:6.1%} "
            f"{t['by_tier']['l3']:6.1%} {lru['hit_rate']:9.1%} "
            f"{t['l3_bytes_written']:17,} {lru['l3_bytes_written']:14,}"
        )
    return "\n".join(lines)
