"""``kvfabric simulate``: what-if on a trace, with no Ray and no KV bytes."""

from __future__ import annotations

import time

import click

from fabric.cli.options import (
    config_options,
    emit,
    json_option,
    load,
    read_requests,
    workload_options,
)
from fabric.cli.render import simulate_text
from fabric.cli.simulate_engines import EngineShape, engine_text, engine_what_if
from fabric.config import FabricConfig
from fabric.errors import FabricError
from fabric.observe.progress import Progress
from fabric.observe.report import hit_rate, result, workload

SIZES = (2 * 1024**2, 20 * 1024**2)


def _capacities(text: str | None, config: FabricConfig) -> list[int]:
    if not text:  # the config's tiers, and the 2M / 20M points docs/running.md quotes
        cache = config.cache
        return sorted({cache.device_tokens, cache.device_tokens + cache.host_tokens, *SIZES})
    out = []
    for item in text.split(","):
        item = item.strip()
        scale = {"K": 1024, "M": 1024**2}.get(item[-1:].upper(), 1)
        number = item[:-1] if scale > 1 else item
        if not number.isdigit() or int(number) < 1:
            raise FabricError(
                f"--capacities item {item!r} is refused: allowed is a count of tokens >= 1, "
                "with an optional K or M"
            )
        out.append(int(number) * scale)
    return out


def _policies(text: str | None) -> list[str]:
    from policies import EVICTION_POLICIES

    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in EVICTION_POLICIES]
    if unknown:
        raise FabricError(
            f"--policies {', '.join(unknown)} refused: allowed are {', '.join(EVICTION_POLICIES)}"
        )
    return list(dict.fromkeys(names))


@click.command()
@workload_options(0)
@config_options
@click.option(
    "--capacities",
    help="Capacities in tokens for the bounds, comma-separated; K is 1024 tokens and M "
    "1024 K (default: L1, and L1 + L2 of the config, 2M and 20M).",
)
@click.option(
    "--policies",
    metavar="NAMES",
    help="Also serve the trace through the core with each of these eviction policies, "
    "comma-separated (e.g. lru,2q), and print their hit rates side by side.",
)
@click.option(
    "--plot",
    metavar="FILE.png",
    help="Also draw hit rate against capacity (pip install 'kvfabric[plot]').",
)
@click.option(
    "--engine-pages",
    "engine_pages",
    is_flag=True,
    help="Instead: what the engine tree serves engines attached through a connector "
    "(each hash id one page; --engines, --nodes, --page-bytes, --l2-bytes; L3's cap is "
    "storage.max_bytes, the policies the config's), beside the flat LRU index before it.",
)
@click.option("--engines", type=click.IntRange(1), default=2, show_default=True)
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True)
@click.option(
    "--page-bytes", type=click.IntRange(1), default=65536, show_default=True,
    help="One page of one rank (--engine-pages).",
)  # fmt: skip
@click.option(
    "--l2-bytes", type=click.IntRange(0), default=16 << 20, show_default=True,
    help="Each node's L2 regions (--engine-pages; 0: none). The tree fills half.",
)  # fmt: skip
@json_option
def simulate(
    trace, workload_kind, requests, config_file, overrides, capacities, policies, plot,
    engine_pages, engines, nodes, page_bytes, l2_bytes, as_json,
) -> None:  # fmt: skip
    """What-if on a trace, with no Ray and no KV bytes.

    Serves the trace through the core at the configured sizes and policies and
    prints the share of prompt tokens each tier served, next to block-level
    bounds at given capacities: LRU, Belady (the offline optimum) and an
    infinite cache. With --policies, the core's hit rate under each named
    eviction policy too. With --engine-pages, what the engine tree serves
    engines attached through a connector instead (each hash id one page),
    per write policy, beside the flat LRU index kvfabric had before it.
    """
    from fabric.tools.simulate import plot as draw

    config = load(config_file, overrides)
    others = _policies(policies)
    reqs, source = read_requests(trace, requests, workload_kind, whole_trace_ok=True)
    if engine_pages:
        out = engine_what_if(
            config, reqs, source, EngineShape(engines, nodes, page_bytes, l2_bytes)
        )
        if not as_json:
            click.echo(engine_text(out))
        emit(out)
        return
    out, limits = _what_if(config, reqs, source, _capacities(capacities, config), others)
    if not as_json:
        click.echo(simulate_text(out))
    if plot:
        cache = config.cache
        draw(plot, limits, (cache.device_tokens + cache.host_tokens, out["hit_rate"]))
        click.echo(f"  chart: {plot}", err=True)
    emit(out)


# Mamba checkpoints compared with none when the config has none: every 8 pages.
CHECKPOINT_PAGES = 8


def _checkpoints(config: FabricConfig, reqs, stats) -> dict:
    """A mamba model's core with state checkpoints inside long prefixes and without:
    the hit rate and per-component rates of each (the replay already run is one of
    them; the other runs here). The interval is the config's, or ``CHECKPOINT_PAGES``
    pages when it has none."""
    from fabric.tools.simulate import core_replay

    cache = config.cache
    every = cache.mamba_checkpoint_tokens or CHECKPOINT_PAGES * cache.page_size
    other = 0 if cache.mamba_checkpoint_tokens else every
    variant = config.with_overrides([f"cache.mamba_checkpoint_tokens={other}"])
    with Progress(len(reqs), "requests", "checkpoints " + ("off" if other == 0 else "on")) as p:
        second = core_replay(reqs, variant, p.update)
    on, off = (second, stats) if other else (stats, second)

    def figures(s) -> dict:
        n = s.components["counters"]
        return {
            "hit_rate": hit_rate(s.tokens.as_dict()),
            "hit_rates": s.components["hit_rates"],
            "saved": n["checkpoints_saved"],
            "skipped": n["checkpoints_skipped"],
        }

    return {"interval_tokens": every, "on": figures(on), "off": figures(off)}


def _what_if(config: FabricConfig, reqs, source: str, caps: list[int], others: list[str]):
    """The core's replay of ``reqs`` (and under each of ``others``' eviction policies)
    and the bounds at ``caps``: the command's result, and the bounds for a chart."""
    from fabric.tools.simulate import bounds, core_replay

    started = time.perf_counter()
    with Progress(len(reqs), "requests", "core") as progress:
        stats = core_replay(reqs, config, progress.update)
    elapsed = time.perf_counter() - started
    if "mamba" in config.model.components:
        stats.components["checkpoints"] = _checkpoints(config, reqs, stats)
    cache = config.cache
    tokens = stats.tokens.as_dict()
    by_policy = {cache.eviction_policy: hit_rate(tokens)}
    for name in others:
        if name not in by_policy:
            variant = config.with_overrides([f"cache.eviction_policy={name}"])
            with Progress(len(reqs), "requests", name) as progress:
                by_policy[name] = hit_rate(
                    core_replay(reqs, variant, progress.update).tokens.as_dict()
                )
    # The bounds on the requests the core served: a refused request is in neither.
    refused_at = set(stats.refused_at)
    served = [r for i, r in enumerate(reqs) if i not in refused_at]
    limits = bounds(served, caps, config.cache.page_size)
    refused = (
        {"larger than L1 (raise cache.device_tokens)": stats.refused_requests}
        if stats.refused_requests
        else {}
    )
    total = max(1, sum(tokens.values()))
    out = result(
        "simulate",
        **workload(source, len(reqs), tokens, refused, elapsed),
        core={
            "device_tokens": cache.device_tokens,
            "host_tokens": cache.host_tokens,
            "eviction_policy": cache.eviction_policy,
            "page_size": cache.page_size,
            "by_tier": {tier: round(n / total, 4) for tier, n in tokens.items()},
            **({"components": stats.components} if stats.components else {}),
        },
        **({"policies": by_policy} if others else {}),
        bounds=[
            {
                "capacity_tokens": b.capacity_tokens,
                "lru": round(b.lru, 4),
                "belady": round(b.belady, 4),
                "infinite": round(b.infinite, 4),
            }
            for b in limits
        ],
    )
    return out, limits
