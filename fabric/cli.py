"""The ``kvfabric`` command line (click).

Every command prints one JSON object last (``fabric.report.SCHEMA``); with
``--json`` nothing else goes to stdout but ``kvfabric events``' own lines (one
JSON object per event; the last object counts them). Progress goes to stderr (a bar with
rate and ETA on a terminal, plain lines otherwise), logs to stderr at
``--log-level``. Errors are one line naming the value or setting to change,
exit status 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from fabric import __version__
from fabric.chaos import FAULTS
from fabric.config import FabricConfig, load_config
from fabric.errors import FabricError
from fabric.l3 import BACKENDS
from fabric.process_exit import finish
from fabric.progress import Progress
from fabric.report import hit_rate, result, workload

log = logging.getLogger("kvfabric")

# -- shared options -------------------------------------------------------------------


def _config_options(f: Callable) -> Callable:
    f = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help="Override a config value (repeatable; values parsed as YAML). "
        "`kvfabric config` lists every key with its default and what is allowed.",
    )(f)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        help="A config file (.json, .toml or .yaml).",
    )(f)


def _workload_options(default_requests: int) -> Callable:
    def wrap(f: Callable) -> Callable:
        f = click.option(
            "--requests",
            type=int,
            default=default_requests,
            show_default=True,
            help="Requests to replay" + (" (0: all of a trace)." if not default_requests else "."),
        )(f)
        return click.option(
            "--trace",
            type=click.Path(dir_okay=False),
            help="A Mooncake-format JSONL trace (default: synthetic conversations).",
        )(f)

    return wrap


def _json_option(f: Callable) -> Callable:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print only the result, as one JSON object."
    )(f)


def _cluster_options(f: Callable) -> Callable:
    f = click.option(
        "--ray-namespace",
        default="kvfabric",
        show_default=True,
        help="The fabric's Ray namespace (runtime.ray_namespace).",
    )(f)
    f = click.option(
        "--name",
        default="kvfabric",
        show_default=True,
        help="The fabric's name (runtime.name).",
    )(f)
    return click.option(
        "--address",
        default="auto",
        show_default=True,
        help="The Ray cluster the fabric runs on: HOST:PORT, ray://..., or auto (RAY_ADDRESS, "
        "else the local cluster where --name was launched, else the `ray start` cluster, else "
        "the only one).",
    )(f)


def _load(config_file: str | None, overrides: tuple[str, ...]) -> FabricConfig:
    config = load_config(config_file) if config_file else FabricConfig()
    return config.with_overrides(list(overrides))


def _requests(trace: str | None, n: int, whole_trace_ok: bool = False):
    from fabric.workload import read_trace, synthetic_trace

    if n < (0 if whole_trace_ok else 1):
        raise FabricError(
            f"--requests {n} is refused: allowed is an int >= {0 if whole_trace_ok else 1}"
        )
    if trace:
        return read_trace(trace, n or None), trace
    return synthetic_trace(n or 3000), "synthetic conversations"


def _emit(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj))


def _say(as_json: bool, text: str) -> None:
    if not as_json:
        click.echo(text)


def _tiers(tokens: dict[str, int]) -> str:
    served = max(1, sum(tokens.values()))
    return "\n".join(
        f"  {tier:<9} {n:>12,} tokens  {100 * n / served:5.1f}%" for tier, n in tokens.items()
    )


def _connect(address: str, name: str, ray_namespace: str):
    """The running fabric ``name``; says on stderr which cluster it was found on."""
    from fabric.client import connect

    fabric = connect(name, address, ray_namespace)
    click.echo(
        f"kvfabric: fabric {name!r} on the Ray cluster at {fabric.cluster_address}", err=True
    )
    return fabric


# -- the group -------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvfabric")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="warning",
    show_default=True,
    help="How much kvfabric and Ray log to stderr.",
)
def cli(log_level: str) -> None:
    """kvfabric: a hierarchical KV-cache fabric for LLM serving, on Ray.

    Launch a fabric and serve a workload through it (run), look at a running one
    (status, events), manage its L3 (storage) and pins (pin), or ask what-if
    questions of a trace without Ray (simulate, demo).
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# -- run -------------------------------------------------------------------------------


@cli.command()
@_workload_options(300)
@_config_options
@click.option(
    "--address",
    help="The Ray cluster to launch on: HOST:PORT, ray://..., auto, or local for a new "
    "private Ray (default: runtime.address, else RAY_ADDRESS, else the cluster `ray start` "
    "started on this machine, else a private Ray).",
)
@click.option(
    "--name",
    help="The fabric's name (runtime.name; default kvfabric): two fabrics on one cluster "
    "need two names.",
)
@click.option("--inflight", type=int, default=8, show_default=True, help="Requests in flight.")
@click.option(
    "--keep",
    is_flag=True,
    help="After the workload, keep the fabric up (for status, events, storage, pin) "
    "until interrupted.",
)
@click.option(
    "--model",
    help="Multi-turn conversations through a real model: tiny-llama (seeded random "
    "weights) or a local Hugging Face model directory (pip install 'kvfabric[model]').",
)
@click.option(
    "--check", is_flag=True, help="With --model: also generate without a cache and compare."
)
@click.option("--conversations", type=int, default=4, show_default=True, help="With --model.")
@click.option("--turns", type=int, default=3, show_default=True, help="With --model: turns each.")
@click.option(
    "--new-tokens", type=int, default=8, show_default=True, help="With --model: answer length."
)
@_json_option
def run(
    trace, requests, config_file, overrides, address, name, inflight, keep, model, check,
    conversations, turns, new_tokens, as_json,
) -> None:  # fmt: skip
    """Launch a fabric and serve a workload through it.

    Starts the coordinator, rank and storage actors (on a local Ray unless
    --address or runtime.address names a cluster), replays the workload from
    this driver, checks the cache's integrity and prints the prompt tokens each
    tier served and the latency.
    """
    from fabric.client import launch
    from fabric.workload import drive, iter_packed

    if name is not None:
        overrides = (*overrides, f"runtime.name={name}")
    if model is not None:
        _chat(
            config_file, overrides, address, model, check, conversations, turns, new_tokens, as_json
        )
        return
    config = _load(config_file, overrides)
    reqs, source = _requests(trace, requests)
    if inflight < 1:
        raise FabricError(f"--inflight {inflight} is refused: allowed is an int >= 1")
    topo = config.topology
    click.echo(
        f"kvfabric {__version__}: launching TP={topo.tp} CP={topo.cp} PP={topo.pp} ...", err=True
    )
    fabric = launch(config, address=address)
    try:
        _announce(fabric)
        with Progress(len(reqs), "requests", "serving") as progress:
            prompts = (packed for _, packed in iter_packed(reqs))
            stats = drive(fabric, prompts, inflight, progress.update)
        fabric.settle()  # the last backups reach L3 before the actors go
        fabric.check_integrity()
        resets = fabric.stats()["resets"]
        out = result(
            "run",
            **workload(
                source, len(reqs), stats.tokens.as_dict(), stats.refused, stats.elapsed_s,
                stats.latencies_s,
            ),
            resets=resets,
        )  # fmt: skip
        if not as_json:
            click.echo(
                f"kvfabric {__version__}: {out['served']} of {len(reqs)} requests from {source} "
                f"served by {topo.world_size} rank actors"
            )
            click.echo(_tiers(out["tokens_by_tier"]))
            for reason, n in sorted(stats.refused.items()):
                click.echo(f"  refused   {n:>12,} requests: {reason}")
            lat = out["latency_ms"]
            click.echo(
                f"  latency   p50 {lat['p50']} ms, p99 {lat['p99']} ms; "
                f"{out['requests_per_s']:,} requests/s"
            )
        _emit(out)
        if keep:
            _serve_until_interrupted(fabric)
    finally:
        fabric.shutdown()


def _announce(fabric) -> None:
    """Where to look at a running fabric: the dashboard, metrics, KV events."""
    config = fabric.config  # launch() has printed where the dashboard is
    if config.runtime.metrics_port:
        click.echo(
            f"  Prometheus metrics: http://{config.runtime.metrics_host}:"
            f"{config.runtime.metrics_port}/metrics",
            err=True,
        )
    if config.events.enabled:
        endpoints = fabric.stats().get("kv_events") or {}
        click.echo(
            f"  KV events: {endpoints.get('endpoint', config.events.endpoint)}"
            + (
                f" (replay {endpoints['replay_endpoint']})"
                if endpoints.get("replay_endpoint")
                else ""
            ),
            err=True,
        )


def _serve_until_interrupted(fabric) -> None:
    name, ns = fabric.config.runtime.name, fabric.config.runtime.ray_namespace
    click.echo(
        f"kvfabric: fabric {name!r} keeps running; `kvfabric status --name {name} "
        f"--ray-namespace {ns}` from another shell; Ctrl-C stops it",
        err=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("kvfabric: stopping", err=True)


def _chat(config_file, overrides, address, model, check, conversations, turns, new_tokens, as_json):
    from fabric.chat import converse, model_overrides
    from fabric.client import launch

    for flag, value in (
        ("--conversations", conversations),
        ("--turns", turns),
        ("--new-tokens", new_tokens),
    ):
        if value < 1:
            raise FabricError(f"{flag} {value} is refused: allowed is an int >= 1")
    config = load_config(config_file) if config_file else FabricConfig()
    config = config.with_overrides([*model_overrides(model), *overrides])
    total = conversations * turns
    click.echo(
        f"kvfabric {__version__}: launching with model {config.model.model_id} ...", err=True
    )
    fabric = launch(config, address=address)
    try:
        _announce(fabric)
        started = time.perf_counter()
        with Progress(total, "turns", "conversing") as progress:
            stats = converse(
                fabric, config, conversations, turns, new_tokens, check, progress=progress.update
            )
        elapsed = time.perf_counter() - started
        fabric.check_integrity()
    finally:
        fabric.shutdown()
    out = result(
        "run",
        **workload(
            f"model {config.model.model_id}", stats.turns, stats.tokens.as_dict(), {}, elapsed
        ),
        model={
            "model_id": config.model.model_id,
            "conversations": conversations,
            "turns": stats.turns,
            "checked_requests": stats.checked,
            "mismatches": stats.mismatches,
            "max_logits_diff": stats.max_logits_diff,
            "generated_tokens": stats.generated_tokens,
        },
        topology={"tp": config.topology.tp, "pp": config.topology.pp, "cp": config.topology.cp},
        computed_tokens_by_rank=stats.computed_tokens_by_rank,
    )
    if not as_json:
        click.echo(
            f"kvfabric {__version__}: {stats.turns} turns of {conversations} conversations "
            f"with {config.model.model_id}"
        )
        click.echo(_tiers(out["tokens_by_tier"]))
        by_rank = ", ".join(f"{r} {n}" for r, n in stats.computed_tokens_by_rank.items())
        click.echo(f"  computed tokens by rank: {by_rank}")
        if check:
            click.echo(
                f"  checked   {stats.checked} answers against generation without a cache: "
                f"{stats.mismatches} mismatched (next-token logits at most "
                f"{stats.max_logits_diff:.2g} apart)"
            )
    _emit(out)
    if stats.mismatches:
        raise SystemExit(1)


# -- demo, simulate --------------------------------------------------------------------


@cli.command()
@_workload_options(2000)
@_config_options
@_json_option
def demo(trace, requests, config_file, overrides, as_json) -> None:
    """Serve a workload through the cache core alone (no Ray, an in-memory L3)."""
    from fabric.cache.inprocess import CoreReplay
    from fabric.workload import iter_packed

    config = _load(config_file, overrides)
    reqs, source = _requests(trace, requests)
    replay = CoreReplay(config)
    started = time.perf_counter()
    with Progress(len(reqs), "requests", "core") as progress:
        stats = replay.run((p for _, p in iter_packed(reqs)), progress.update)
    elapsed = time.perf_counter() - started
    replay.cache.check_integrity()
    refused = (
        {"larger than L1 or no room": stats.refused_requests} if stats.refused_requests else {}
    )
    out = result(
        "demo", **workload(source, stats.requests, stats.tokens.as_dict(), refused, elapsed)
    )
    if not as_json:
        click.echo(f"kvfabric {__version__} core demo: {stats.requests} requests from {source}")
        click.echo(_tiers(out["tokens_by_tier"]))
        click.echo(
            f"  refused   {stats.refused_requests:>12,} requests (larger than L1 or no room)"
        )
        click.echo(f"  {out['requests_per_s']:,} requests/s through the core")
    _emit(out)


@cli.command()
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the faults and the workload."
)
@click.option(
    "--duration", type=float, default=60.0, show_default=True, help="Seconds of workload."
)
@click.option(
    "--nodes",
    type=int,
    default=2,
    show_default=True,
    help="Nodes of the local Ray cluster made for the run (the head and workers).",
)
@click.option(
    "--address",
    default=None,
    help="Run on this existing Ray cluster instead (node loss needs a local one).",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    help="Comma-separated fault kinds, or all: " + ", ".join(FAULTS) + ".",
)
@click.option(
    "--fault-every", type=float, default=4.0, show_default=True, help="Mean seconds between faults."
)
@click.option(
    "--hold", type=float, default=3.0, show_default=True, help="Seconds a lasting fault lasts."
)
@click.option("--clients", type=int, default=2, show_default=True, help="Concurrent clients.")
@click.option("--set", "overrides", multiple=True, help="A config override for the fabric.")
@_json_option
def chaos(
    seed, duration, nodes, address, faults, fault_every, hold, clients, overrides, as_json
) -> None:
    """Inject seeded faults into a fabric under load and prove nothing was lost.

    Exits 1 on any loss (a wrong page served, a leaked slot or lease, a stuck
    request, an integrity error, a fault not injected or not recovered from, an
    L3 page the audit refused, too many unverifiable leases or failed requests)
    or when it never served again, and 3 when the harness itself broke (no
    verdict); the last line is the report as one JSON object."""
    from fabric.chaos import ChaosOptions, run_chaos, summary

    kinds = FAULTS if faults == "all" else tuple(k.strip() for k in faults.split(",") if k.strip())
    opts = ChaosOptions(
        seed=seed,
        duration_s=duration,
        nodes=nodes,
        address=address,
        faults=kinds,
        fault_every_s=fault_every,
        fault_hold_s=hold,
        clients=clients,
        overrides=tuple(overrides),
    )
    # Progress goes to stderr, and so does whatever the Ray nodes the run starts
    # and stops print (a removed node's raylet dumps its state): stdout keeps
    # only the summary and the report.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        report = run_chaos(opts, progress=lambda line: click.echo(line, err=True))
    except (FabricError, OSError):
        raise  # a setting or the machine: one line, exit 2
    except Exception as exc:  # the harness broke: no verdict either way
        click.echo(
            f"kvfabric chaos: the harness failed, no verdict: {type(exc).__name__}: "
            f"{str(exc)[:300]}",
            err=True,
        )
        raise SystemExit(3) from None
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if not as_json:
        click.echo(summary(report))
    _emit(report)
    if not report["ok"]:
        raise SystemExit(1)


SIZES = (2 * 1024**2, 20 * 1024**2)


def _capacities(text: str | None, config: FabricConfig) -> list[int]:
    if not text:  # the config's tiers, and the 2M / 20M points the README quotes
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


@cli.command()
@_workload_options(0)
@_config_options
@click.option(
    "--capacities",
    help="Capacities in tokens for the bounds, comma-separated, K and M allowed "
    "(default: L1, and L1 + L2 of the config, 2M and 20M).",
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
@_json_option
def simulate(trace, requests, config_file, overrides, capacities, policies, plot, as_json) -> None:
    """What-if on a trace, with no Ray and no KV bytes.

    Serves the trace through the core at the configured sizes and policies and
    prints the share of prompt tokens each tier served, next to block-level
    bounds at given capacities: LRU, Belady (the offline optimum) and an
    infinite cache. With --policies, the core's hit rate under each named
    eviction policy too.
    """
    from fabric.simulate import bounds, core_replay
    from fabric.simulate import plot as draw

    config = _load(config_file, overrides)
    others = _policies(policies)
    reqs, source = _requests(trace, requests, whole_trace_ok=True)
    caps = _capacities(capacities, config)
    started = time.perf_counter()
    with Progress(len(reqs), "requests", "core") as progress:
        stats = core_replay(reqs, config, progress.update)
    elapsed = time.perf_counter() - started
    by_policy = {}
    for name in others:
        if name == config.cache.eviction_policy:
            continue  # the run above
        variant = config.with_overrides([f"cache.eviction_policy={name}"])
        with Progress(len(reqs), "requests", name) as progress:
            served = core_replay(reqs, variant, progress.update).tokens.as_dict()
        by_policy[name] = hit_rate(served)
    limits = bounds(reqs, caps)
    refused = (
        {"larger than L1 (raise cache.device_tokens)": stats.refused_requests}
        if stats.refused_requests
        else {}
    )
    tokens = stats.tokens.as_dict()
    total = max(1, sum(tokens.values()))
    cache = config.cache
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
        **({"policies": {cache.eviction_policy: hit_rate(tokens), **by_policy}} if others else {}),
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
    if not as_json:
        c = out["core"]
        click.echo(
            f"kvfabric {__version__} simulate: {len(reqs)} requests from {source}; core at "
            f"L1 {c['device_tokens']:,} + L2 {c['host_tokens']:,} tokens, page {c['page_size']}, "
            f"{c['eviction_policy']}: hit rate {out['hit_rate']:.1%}"
        )
        for tier, share in c["by_tier"].items():
            click.echo(f"  {tier:<9} {share:6.1%}")
        if stats.refused_requests:
            click.echo(
                f"  refused   {stats.refused_requests} requests larger than L1 "
                "(raise cache.device_tokens)"
            )
        if stats.components:
            comp = stats.components
            for name, pool in comp["pools"].items():
                click.echo(
                    f"  L1 {name:<8} {pool['capacity']:>12,} {pool['unit']:<6} "
                    f"{pool['bytes'] / 2**30:8.2f} GiB  in use {pool['in_use']:,}"
                )
            rates = comp["hit_rates"]
            click.echo(
                "  could serve alone (L1 + L2, at admission): "
                + ", ".join(f"{k} {v:.1%}" for k, v in rates.items() if k != "all")
                + f"; every component together {rates.get('all', 0):.1%}"
            )
            n = comp["counters"]
            click.echo(
                f"  L1 memory {comp['bytes'] / 2**30:.2f} GiB; every attention layer as full "
                f"attention: {comp['all_full_attention_bytes'] / 2**30:.2f} GiB; "
                f"{n['truncated_matches']} matches stopped short of a component, "
                f"{n['tombstones_removed']} dead leaves removed"
            )
        if others:
            click.echo(
                "  the core by eviction policy: "
                + ", ".join(f"{k} {v:.1%}" for k, v in out["policies"].items())
            )
        click.echo(
            f"  {'capacity':>14}  {'LRU':>6}  {'Belady':>6}  {'infinite':>8}   (512-token blocks)"
        )
        for b in out["bounds"]:
            click.echo(
                f"  {b['capacity_tokens']:>14,}  {b['lru']:6.1%}  {b['belady']:6.1%}  "
                f"{b['infinite']:8.1%}"
            )
    if plot:
        draw(plot, limits, (cache.device_tokens + cache.host_tokens, out["hit_rate"]))
        click.echo(f"  chart: {plot}", err=True)
    _emit(out)


# -- a running fabric ------------------------------------------------------------------


@cli.command()
@_cluster_options
@click.option(
    "--watch",
    type=float,
    default=0.0,
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (0: once).",
)
@click.option("--count", type=int, default=0, help="With --watch: stop after this many (0: never).")
@_json_option
def status(address, name, ray_namespace, watch, count, as_json) -> None:
    """Show a running fabric: actors, epoch, per-tier usage, transfers in flight, L3 usage."""
    if watch < 0 or count < 0:
        raise FabricError(
            f"--watch {watch} / --count {count} are refused: allowed are numbers >= 0"
        )
    fabric = _connect(address, name, ray_namespace)
    shown = 0
    while True:
        st = {**fabric.status(), "cluster": fabric.cluster_address}
        if not as_json:
            if watch and sys.stdout.isatty():
                click.clear()
            click.echo(_status_text(st, fabric.dashboard_hint()))
        _emit(result("status", fabric=st["fabric"], status=st))
        shown += 1
        if not watch or (count and shown >= count):
            return
        time.sleep(watch)


@cli.command()
@_cluster_options
@click.option(
    "--interval", type=float, default=1.0, show_default=True, help="Seconds between frames."
)
@click.option("--count", type=int, default=0, help="Stop after this many frames (0: never).")
def top(address, name, ray_namespace, interval, count) -> None:
    """A live view of a running fabric: tokens moved per direction per second,
    hit rate per tier, requests in flight, pool use (Ctrl-C stops)."""
    from fabric.top import watch

    if interval <= 0 or count < 0:
        raise FabricError(
            f"--interval {interval} / --count {count} are refused: allowed are "
            "--interval > 0 and --count >= 0"
        )
    fabric = _connect(address, name, ray_namespace)
    shown = watch(fabric.status, interval, count)
    _emit(result("top", fabric=name, frames=shown))


def _status_text(st: dict[str, Any], dashboard: str) -> str:
    lines = [
        f"kvfabric {st['fabric']} on the Ray cluster at {st['cluster']}: epoch {st['epoch']}, "
        f"{st['rounds']} rounds, {st['resets']} resets"
    ]
    for a in st["actors"]:
        mark = "up  " if a["alive"] else "DOWN"
        lines.append(f"  {mark} {a['role']:<11} {a['name']:<14} {a['describe']}")
    for tier, sizes in st["tiers"].items():
        cap = max(1, sizes["capacity"])
        used = cap - sizes["free"]
        lines.append(
            f"  {tier:<6} {used:>12,} / {sizes['capacity']:,} tokens used ({100 * used / cap:.1f}%)"
        )
    flight = ", ".join(f"{k} {v}" for k, v in st["inflight_transfers"].items())
    lines.append(f"  in flight: {flight}")
    now = st["requests_now"]
    lines.append(
        f"  requests: {st['requests']['finished']} served, {st['requests']['failed']} failed; "
        f"now waiting {now['waiting']}, prefetching {now['prefetching']}, running {now['running']}; "
        f"{st['leases']} leases, {st['sessions']} sessions, {st['pinned_tokens']} pinned tokens"
    )
    for rank, slow in (st.get("stragglers") or {}).items():
        lines.append(
            f"  STRAGGLER rank {rank}: finishes {slow['latency_s']:.3f} s after the first rank, "
            f"the others {slow['others_s']:.3f} s"
        )
    queue = st.get("events_queue")
    if queue and queue["dropped"]:
        lines.append(
            f"  KV events: {queue['queued']:,} queued, {queue['dropped']:,} DROPPED (the queue "
            "was full: nobody takes them; see take_events or events.endpoint)"
        )
    l3 = st["l3"]
    if l3.get("attached"):
        lines.append(
            f"  L3 {l3.get('backend')}: {l3.get('pages', '?')} pages, {l3.get('bytes', 0):,} bytes"
            f" (cap {l3.get('max_bytes', 0):,}); read {l3.get('get_pages', 0)}, "
            f"written {l3.get('set_pages', 0)} pages"
        )
        if l3.get("write_error"):
            lines.append(
                f"  L3 WRITES FAIL ({l3['write_error']}): {l3.get('set_failed', 0):,} pages not "
                "stored so far; the pages it holds are still served"
            )
    else:
        lines.append(f"  L3: {l3.get('error', 'not attached')}")
    lines.append(f"  {dashboard}")
    return "\n".join(lines)


@cli.command()
@_cluster_options
@click.option(
    "--limit", type=int, default=1000, show_default=True, help="Events per poll (take_events)."
)
@click.option("--namespace", help="Only this namespace's events.")
@click.option("--follow", is_flag=True, help="Keep printing events as they come (Ctrl-C stops).")
@click.option(
    "--interval",
    type=float,
    default=1.0,
    show_default=True,
    help="With --follow: seconds between polls.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Accepted for uniformity: the output is JSON already (a line per event, then the count).",
)
def events(address, name, ray_namespace, limit, namespace, follow, interval, as_json) -> None:
    """Print a running fabric's KV events, one JSON line each (the routers' maps).

    A fabric without events.endpoint keeps its events for take_events: they are
    drained here (a router taking them too would miss these). A fabric that
    publishes on ZMQ is read there instead, as a router reads it: the replay
    socket's buffer first, then (--follow) the live feed.
    """
    fabric = _connect(address, name, ray_namespace)
    published = fabric.stats().get("kv_events")
    shown = 0

    def show(batch: list[dict[str, Any]]) -> None:
        nonlocal shown
        for e in batch:
            # A clear of every namespace (namespace "") concerns each of them.
            if namespace is None or e.get("namespace") in (namespace, ""):
                click.echo(json.dumps(e))  # one JSON line per event, with --json too
                shown += 1

    try:
        if published:
            _zmq_events(published, fabric.config.events.topic, follow, show)
        else:
            from fabric.coordinator.publisher import to_wire

            page = fabric.config.cache.page_size
            while True:
                show([_event_dict(e) for e in to_wire(fabric.take_events(limit, namespace), page)])
                if not follow:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    _emit(result("events", fabric=name, events=shown))


def _zmq_events(
    published: dict[str, Any], topic: str, follow: bool, show: Callable[[list], None]
) -> None:
    """Read a publishing fabric's events: replay from batch 0, then the live feed."""
    import msgspec
    import zmq

    replay, endpoint = published.get("replay_endpoint"), published["endpoint"]
    if not replay and not follow:
        raise FabricError(
            f"the fabric publishes KV events at {endpoint} with no events.replay_endpoint: "
            "pass --follow to read the live feed"
        )
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if follow:  # subscribe first: nothing published after the replay is missed
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        seen = -1
        if replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send((0).to_bytes(8, "big"))
            while dealer.poll(5000):
                # [topic, seq, payload] (vllm dialect) or [seq, payload] (sglang)
                *_, seq, payload = dealer.recv_multipart()
                if not payload:
                    break  # the end-of-replay marker
                seen = int.from_bytes(seq, "big")
                show(msgspec.msgpack.decode(payload)[1])
            else:
                raise FabricError(f"no answer from the KV event replay socket at {replay}")
        while follow:
            if sub.poll(1000):
                _, seq, payload = sub.recv_multipart()
                if int.from_bytes(seq, "big") > seen:  # not one the replay gave
                    show(msgspec.msgpack.decode(payload)[1])
    finally:
        ctx.destroy(linger=0)


def _event_dict(event: Any) -> dict[str, Any]:
    """An event as the routers' map (``type`` first), for a JSON line."""
    import msgspec

    return msgspec.to_builtins(event)


@cli.group()
def storage() -> None:
    """Manage a running fabric's L3: attach, detach, clear, usage."""


@storage.command()
@_cluster_options
@click.argument("backend", type=click.Choice(list(BACKENDS)))
@click.option(
    "--options",
    "options",
    default="{}",
    show_default=True,
    help="The backend's options: JSON, or @file.json/.toml/.yaml (see fabric/l3/options.py).",
)
@_json_option
def attach(address, name, ray_namespace, backend, options, as_json) -> None:
    """Attach an L3 backend at runtime."""
    from fabric.l3 import parse_options

    parsed = parse_options(options)  # here: an @file is this machine's
    fabric = _connect(address, name, ray_namespace)
    outcome = fabric.attach_storage(backend, parsed)
    _say(as_json, f"kvfabric {name}: L3 {backend} {outcome}")
    _emit(
        result(
            "storage",
            fabric=name,
            storage={"action": "attach", "backend": backend, "outcome": outcome},
        )
    )


@storage.command()
@_cluster_options
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to drain in-flight L3 traffic.",
)
@_json_option
def detach(address, name, ray_namespace, timeout, as_json) -> None:
    """Detach L3 (in-flight prefetches and backups drain first)."""
    fabric = _connect(address, name, ray_namespace)
    done = fabric.detach_storage(timeout)
    _say(as_json, f"kvfabric {name}: L3 {'detached' if done else 'not detached (still draining)'}")
    _emit(result("storage", fabric=name, storage={"action": "detach", "done": bool(done)}))


@storage.command()
@_cluster_options
@click.option("--yes", is_flag=True, help="Do not ask; delete every page.")
@_json_option
def clear(address, name, ray_namespace, yes, as_json) -> None:
    """Delete every page in L3."""
    if not yes:
        click.confirm(f"Delete every L3 page of fabric {name!r}?", abort=True, err=True)
    fabric = _connect(address, name, ray_namespace)
    done = fabric.clear_storage()
    _say(as_json, f"kvfabric {name}: L3 {'cleared' if done else 'not cleared (none attached)'}")
    _emit(result("storage", fabric=name, storage={"action": "clear", "done": bool(done)}))


@storage.command()
@_cluster_options
@click.option(
    "--path",
    "store_path",
    default=None,
    help="Read this L3 directory itself (no fabric, no Ray): its pages per model and engine.",
)
@click.option(
    "--backend",
    type=click.Choice(["segment", "file"]),
    default="segment",
    show_default=True,
    help="With --path: the directory's backend (storage.backend).",
)
@_json_option
def usage(address, name, ray_namespace, store_path, backend, as_json) -> None:
    """Show L3 usage, traffic counters, and which engine wrote which model's pages."""
    if store_path is not None:
        from fabric.engines.store import StoreOptions, open_store

        store = open_store(StoreOptions(path=store_path, backend=backend, max_bytes=0), "kvfabric")
        try:
            l3 = {"attached": True, **store.backend.stats()}
            writers = store.backend.usage_by_writer()
        finally:
            store.close()
        where = store_path
    else:
        fabric = _connect(address, name, ray_namespace)
        l3 = fabric.status()["l3"]
        writers = fabric.storage_usage() if l3.get("attached") else []
        where = f"kvfabric {name}"
    if not as_json:
        if not l3.get("attached"):
            click.echo(f"{where}: no L3 attached")
        else:
            click.echo(f"{where}: L3 {l3.get('backend')}")
            for key, value in sorted(l3.items()):
                if key not in ("attached", "backend"):
                    click.echo(f"  {key:<22} {value}")
            if writers:
                click.echo("  pages by model and writer:")
            for row in writers:
                shape = "x".join(map(str, row["shard_shape"] or [])) or "?"
                click.echo(
                    f"  {row['pages']:>10,}  {','.join(row['writers']):<22} {row['model_id'] or '?'}"
                    f"  {row['layout'] or '?'} {row['dtype'] or '?'} {shape} {row['component'] or '?'}"
                )
    _emit(result("storage", fabric=name, storage={"action": "usage", **l3, "writers": writers}))


@cli.command()
@_cluster_options
@click.argument("tokens")
@click.option("--namespace", default="default", show_default=True, help="The tokens' namespace.")
@click.option("--ttl", type=float, default=300.0, show_default=True, help="Seconds the pin lasts.")
@click.option("--undo", is_flag=True, help="Unpin instead.")
@_json_option
def pin(address, name, ray_namespace, tokens, namespace, ttl, undo, as_json) -> None:
    """Pin the cached prefix of TOKENS (comma-separated ids, or @file with one JSON list)."""
    ids = _token_ids(tokens)
    fabric = _connect(address, name, ray_namespace)
    if undo:
        n = fabric.unpin(ids, namespace)
        _say(as_json, f"kvfabric {name}: {n} tokens unpinned")
        _emit(result("pin", fabric=name, pin={"action": "unpin", "tokens": n}))
        return
    got = fabric.pin(ids, ttl, namespace)
    _say(
        as_json,
        f"kvfabric {name}: {got.pinned_tokens} tokens pinned for {ttl:g} s"
        + (f" ({got.reason})" if got.reason else ""),
    )
    _emit(
        result(
            "pin",
            fabric=name,
            pin={"action": "pin", "tokens": got.pinned_tokens, "reason": got.reason},
        )
    )


def _token_ids(text: str) -> list[int]:
    try:
        if text.startswith("@"):
            with open(text[1:]) as f:
                ids = json.load(f)
        else:
            ids = [int(t) for t in text.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        raise FabricError(
            f"TOKENS {text[:40]!r} is refused: allowed is comma-separated ints or @file "
            f"holding a JSON list ({exc})"
        ) from None
    if not isinstance(ids, list) or not ids:
        raise FabricError(f"TOKENS {text[:40]!r} is refused: it names no token")
    return ids


# -- config ----------------------------------------------------------------------------


@cli.command("config")
@_config_options
@_json_option
def config_keys(config_file, overrides, as_json) -> None:
    """List every config key: its value (default, or from --config/--set) and what is allowed."""
    from fabric.config import describe_keys

    keys = describe_keys(_load(config_file, overrides))
    if not as_json:
        width = max(len(k["key"]) for k in keys)
        for k in keys:
            click.echo(f"{k['key']:<{width}}  {json.dumps(k['value']):<24} {k['allowed']}")
    _emit(result("config", keys=keys))


# -- entry point -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; the exit status (2 on an error, printed as one line)."""
    try:
        cli.main(args=argv, prog_name="kvfabric", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("kvfabric: aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return 2
    except (FabricError, OSError) as exc:
        click.echo(f"kvfabric: error: {exc}", err=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


def entry() -> None:
    """The ``kvfabric`` command: :func:`main`, then the process ends through
    :func:`fabric.process_exit.finish` (Ray's threads outlive ``ray.shutdown`` and can
    crash the native exit handlers after a command that succeeded)."""
    finish(main())


if __name__ == "__main__":
    entry()
