"""``kvfabric run``: launch a fabric and serve a workload (or conversations with a
model) through it."""

from __future__ import annotations

import time

import click

from fabric import __version__
from fabric.cli.hint import first_run_hint
from fabric.cli.options import (
    config_options,
    emit,
    json_option,
    load,
    read_requests,
    workload_options,
)
from fabric.cli.render import chat_text, run_text
from fabric.config import FabricConfig, load_config
from fabric.errors import FabricError
from fabric.observe.progress import Progress
from fabric.observe.report import result, workload


@click.command()
@workload_options(300)
@config_options
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
    help="Multi-turn conversations through a real model: tiny-llama, tiny-gemma3 (sliding "
    "window), tiny-bamba (Mamba2) or tiny-qwen3next (gated delta net), all with seeded "
    "random weights, or a local Hugging Face model directory (pip install "
    "'kvfabric[model]').",
)
@click.option(
    "--check", is_flag=True, help="With --model: also generate without a cache and compare."
)
@click.option("--conversations", type=int, default=4, show_default=True, help="With --model.")
@click.option("--turns", type=int, default=3, show_default=True, help="With --model: turns each.")
@click.option(
    "--new-tokens", type=int, default=8, show_default=True, help="With --model: answer length."
)
@json_option
def run(
    trace, workload_kind, requests, config_file, overrides, address, name, inflight, keep, model,
    check, conversations, turns, new_tokens, as_json,
) -> None:  # fmt: skip
    """Launch a fabric and serve a workload through it.

    Starts the coordinator, rank and storage actors (on a local Ray unless
    --address or runtime.address names a cluster), replays the workload from
    this driver, checks the cache's integrity and prints the prompt tokens each
    tier served and the latency.
    """
    from fabric.client import launch
    from fabric.tools.workload import drive, iter_packed

    if name is not None:
        overrides = (*overrides, f"runtime.name={name}")
    _refuse_unused(model is not None)
    if model is not None:
        _chat(
            config_file, overrides, address, model, check, conversations, turns, new_tokens, as_json
        )
        return
    config = load(config_file, overrides)
    reqs, source = read_requests(trace, requests, workload_kind)
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
        out = result(
            "run",
            **workload(
                source, len(reqs), stats.tokens.as_dict(), stats.refused, stats.elapsed_s,
                stats.latencies_s,
            ),
            resets=fabric.stats()["counters"]["resets"],
        )  # fmt: skip
        if not as_json:
            click.echo(run_text(out, topo.world_size))
        emit(out)
        first_run_hint("run")
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


# The options that mean something only with --model, and those only without it.
_MODEL_ONLY = ("check", "conversations", "turns", "new_tokens")
_WORKLOAD_ONLY = ("trace", "workload_kind", "requests", "inflight", "keep")


def _refuse_unused(with_model: bool) -> None:
    """Refuse an option given on the command line that this kind of run would not
    use (a model run serves --conversations x --turns turns, not --requests),
    rather than ignore it."""
    ctx = click.get_current_context()
    unused = _WORKLOAD_ONLY if with_model else _MODEL_ONLY
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = [
        flags[name]
        for name in unused
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise FabricError(
            f"{', '.join(given)} refused "
            + (
                "with --model: it serves --conversations x --turns turns"
                if with_model
                else "without --model: they set a model's conversations"
            )
        )


def _chat(config_file, overrides, address, model, check, conversations, turns, new_tokens, as_json):
    from fabric.client import launch
    from fabric.tools.chat import converse, model_overrides, refuse_check

    for flag, value in (
        ("--conversations", conversations),
        ("--turns", turns),
        ("--new-tokens", new_tokens),
    ):
        if value < 1:
            raise FabricError(f"{flag} {value} is refused: allowed is an int >= 1")
    config = load_config(config_file) if config_file else FabricConfig()
    config = config.with_overrides([*model_overrides(model), *overrides])
    if check:
        refuse_check(config)
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
            "unserved_turns": stats.unserved,
            "max_logits_diff": stats.max_logits_diff,
            "generated_tokens": stats.generated_tokens,
        },
        topology={"tp": config.topology.tp, "pp": config.topology.pp, "cp": config.topology.cp},
        computed_tokens_by_rank=stats.computed_tokens_by_rank,
    )
    if not as_json:
        click.echo(chat_text(out, check))
    emit(out)
    if stats.mismatches:
        raise SystemExit(1)
