"""What-if on a trace, with no Ray and no KV bytes: the hit rate per tier that
the core would give at given sizes and policies (``CoreReplay``, the request
lifecycle itself), next to block-level bounds at given capacities:

- **LRU**: one cache of trace blocks, least recently used evicted;
- **Belady**: the block whose next use is furthest evicted (the offline optimum
  of a block cache);
- **infinite**: every block ever seen stays.

A block is keyed by its whole prefix — the block and every block before it —
as a radix tree keys it: the same block id after a different prefix is another
block. A request hits the leading run of its blocks that the cache holds; its
blocks are then cached. Both evictions take a block before its prefix (LRU
counts a prefix as used after the blocks under it; Belady, whose prefix is
never used later than the blocks under it, breaks ties towards the block seen
last), so the cache always holds whole prefixes, as a radix tree does. Hit
rates count prompt tokens.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

from fabric.cache.hicache import HiCache
from fabric.cache.inprocess import CoreReplay, ReplayStats
from fabric.config import FabricConfig
from fabric.errors import InvalidInput
from fabric.tools.workload import BLOCK_TOKENS, Request, iter_packed

NEVER = 1 << 62


@dataclass(frozen=True)
class Bounds:
    capacity_tokens: int
    lru: float
    belady: float
    infinite: float


def prefix_keys(requests: Sequence[Request]) -> list[tuple[int, ...]]:
    """Each request's blocks as ids of their prefix chains: two blocks get one id
    only where they and everything before them are the same ids."""
    ids: dict[tuple[int, int], int] = {}
    out = []
    for r in requests:
        prev, chain = -1, []
        for h in r.hash_ids:
            prev = ids.setdefault((prev, h), len(ids))
            chain.append(prev)
        out.append(tuple(chain))
    return out


def _hit_tokens(
    request: Request, keys: tuple[int, ...], held: Callable[[int], bool], block: int, page: int
) -> int:
    leading = 0
    for k in keys:
        if not held(k):
            break
        leading += 1
    return min(leading * block, _whole_pages(request, page))


def _whole_pages(request: Request, page: int) -> int:
    """The prompt's tokens a cache of ``page``-token pages can hold: its whole pages."""
    return request.input_length - request.input_length % page


def _prompt_tokens(requests: Sequence[Request], page: int) -> int:
    return max(1, sum(_whole_pages(r, page) for r in requests))


def lru_hit_rate(
    requests: Sequence[Request], capacity_blocks: int, block: int = BLOCK_TOKENS, page: int = 1
) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for r, keys in zip(requests, prefix_keys(requests), strict=True):
        hit += _hit_tokens(r, keys, cache.__contains__, block, page)
        for k in reversed(keys):  # a block is used after its children: leaves go first
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hit / _prompt_tokens(requests, page)


def belady_hit_rate(
    requests: Sequence[Request], capacity_blocks: int, block: int = BLOCK_TOKENS, page: int = 1
) -> float:
    keyed = prefix_keys(requests)
    next_use: list[list[int]] = [[] for _ in requests]
    later: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [later.get(k, NEVER) for k in keyed[i]]
        for k in keyed[i]:
            later[k] = i
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hit = 0
    for i, r in enumerate(requests):
        hit += _hit_tokens(r, keyed[i], cache.__contains__, block, page)
        for k, n in zip(keyed[i], next_use[i], strict=True):
            cache[k] = n
            heapq.heappush(heap, (-n, -k))  # of equal next use, the block seen last
        while len(cache) > capacity_blocks:
            n, k = heapq.heappop(heap)
            if cache.get(-k) == -n:
                del cache[-k]
    return hit / _prompt_tokens(requests, page)


def infinite_hit_rate(
    requests: Sequence[Request], block: int = BLOCK_TOKENS, page: int = 1
) -> float:
    seen: set[int] = set()
    hit = 0
    for r, keys in zip(requests, prefix_keys(requests), strict=True):
        hit += _hit_tokens(r, keys, seen.__contains__, block, page)
        seen.update(keys)
    return hit / _prompt_tokens(requests, page)


def bounds(
    requests: Sequence[Request], capacities_tokens: Iterable[int], page: int = 1
) -> list[Bounds]:
    """LRU, Belady and infinite block-level hit rates at each capacity, counting
    each prompt's whole ``page``-token pages (as the core counts them)."""
    infinite = infinite_hit_rate(requests, page=page)
    out = []
    for cap in capacities_tokens:
        blocks = cap // BLOCK_TOKENS
        out.append(
            Bounds(
                cap,
                lru_hit_rate(requests, blocks, page=page),
                belady_hit_rate(requests, blocks, page=page),
                infinite,
            )
        )
    return out


def core_replay(
    requests: Sequence[Request],
    config: FabricConfig,
    progress: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Serve the trace through the core at ``config``'s sizes and policies (L3
    unbounded, in memory): prompt tokens by the tier that served them, and the
    requests it refused (larger than L1)."""
    replay = CoreReplay(config, storage=config.storage.backend != "none")
    stats = replay.run((p for _, p in iter_packed(list(requests))), progress)
    replay.cache.check_integrity()
    stats.components = component_report(replay.cache, config, stats.prompt_tokens)
    return stats


def component_report(cache: HiCache, config: FabricConfig, prompt_tokens: int = 0) -> dict:
    """A hybrid model's L1 memory per component (pool sizes in their units and in
    bytes, what is in use at the end) and the component counters, next to the
    bytes the same L1 would take with every attention layer cached as full
    attention (``all_full_attention_bytes``); and per component the share of the
    ``prompt_tokens`` it alone could have served at admission from L1 or L2
    (``hit_rates``; ``all``: every component together, what a hybrid prefix
    needs). Empty for full attention only."""
    parts = cache.parts
    if parts is None:
        return {}
    per = config.model.component_bytes()
    device = cache.config.device_tokens
    pools = {
        "full": {
            "unit": "tokens",
            "capacity": device,
            "in_use": device - cache.ctl.device.available_pages * cache.page_size,
            "bytes": device * per["full"],
        }
    }
    for name, sizes in cache.component_sizes().items():
        pools[name] = {
            "unit": "states" if name == "mamba" else "tokens",
            "capacity": sizes.capacity,
            "in_use": sizes.capacity - sizes.free,
            "bytes": sizes.capacity * per[name],
        }
    return {
        "pools": pools,
        "bytes": sum(p["bytes"] for p in pools.values()),
        "all_full_attention_bytes": device * (per["full"] + per.get("sliding", 0)),
        "hit_rates": {
            name: round(tokens / max(1, prompt_tokens), 6)
            for name, tokens in parts.stats.match_tokens.items()
        },
        "counters": asdict(parts.stats),
    }


def plot(path: str, curves: list[Bounds], core: tuple[int, float] | None = None) -> None:
    """A chart of hit rate against capacity (LRU, Belady, infinite; the core's
    point at its L1 + L2 size) as a PNG. Needs matplotlib (``kvfabric[plot]``)."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidInput("--plot needs matplotlib: pip install 'kvfabric[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [b.capacity_tokens for b in curves]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("lru", "belady", "infinite"):
        ax.plot(caps, [100 * getattr(b, name) for b in curves], marker="o", label=name)
    if core is not None:
        ax.scatter(
            [core[0]],
            [100 * core[1]],
            color="black",
            zorder=3,
            label="kvfabric core at L1 + L2 (L3 unbounded)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
