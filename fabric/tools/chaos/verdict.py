"""A chaos run's report — requests, faults and their recovery, what was left
held, the audits — and its verdict: why the run is a loss, if it is."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from fabric.tools.chaos.options import COUNTED, Fault, Tally, percentile
from fabric.tools.chaos.state import RunState


def make_report(run: RunState, end: float, after: dict) -> dict:
    """The report of ``run``, ended at ``end`` (seconds since its start), with
    ``after``: what settling found (``Chaos.settle``)."""
    opts, tally = run.opts, run.tally
    assert run.config is not None
    stats = after.get("stats", {})
    warm = opts.warmup_fraction * opts.duration_s
    served = sorted(end for _, end in tally.spans)
    injected = [f for f in run.faults if f.injected]
    recovery = _recovery(injected, [*tally.spans, *([tally.probe] if tally.probe else [])])
    in_warmup = sum(1 for t in served if t < warm)
    report = {
        "seed": opts.seed,
        "duration_s": round(end, 1),
        "nodes": opts.nodes if opts.address is None else None,
        "requests": _requests(tally, len(served)),
        **_faults(run.faults, recovery),
        "throughput_rps": {
            "no_faults": round(in_warmup / warm, 2) if warm else None,
            "with_faults": round((len(served) - in_warmup) / max(1e-9, end - warm), 2),
        },
        "serving_again_s": after["serving_again_s"],
        "settled": after.get("settled", False),
        "wrong_pages": tally.wrong_pages,
        **_held(stats, run.config.cache.page_size),
        "integrity_errors": after["integrity_errors"],
        "adopted_tokens_after_coordinator_kills": [
            f.adopted_tokens for f in injected if f.kind == "coordinator_kill"
        ],
        # Whole-run counters: the coordinators killed during the run, and this one.
        "coordinators": len(run.incarnations) + 1,
        **{
            name: sum(int(s.get("counters", {}).get(name, 0)) for s in (*run.incarnations, stats))
            for name in COUNTED
        },
        "placement": run.placed,
        **_l3(run.l3_mount, after, stats),
    }
    report["loss"] = verdict(
        report, after, opts.max_unverifiable_fraction, opts.max_failed_fraction
    )
    report["ok"] = not report["loss"]
    return report


def _recovery(injected: list[Fault], spans: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Each injected fault's recovery, by kind: from its end (a lasting fault's) or
    its moment to the first request submitted after it being served; a fault
    never recovered from gets no ``recovered_at``."""
    recovery: dict[str, list[float]] = defaultdict(list)
    for fault in injected:
        after_fault = fault.ended if fault.ended is not None else fault.at
        done = [end for start, end in spans if start >= after_fault]
        fault.recovered_at = min(done) if done else None
        if fault.recovered_at is not None:
            recovery[fault.kind].append(fault.recovered_at - (fault.ended or fault.at))
    return recovery


def _faults(faults: list[Fault], recovery: dict[str, list[float]]) -> dict:
    injected = [f for f in faults if f.injected]
    every = [x for xs in recovery.values() for x in xs]
    return {
        "faults_injected": len(injected),
        "faults": dict(Counter(f.kind for f in injected)),
        "faults_not_injected": dict(Counter(f.kind for f in faults if not f.injected)),
        "fault_log": [_logged(f) for f in faults],
        "recovery_s": {
            k: {
                "n": len(v),
                "p50": round(percentile(v, 0.5), 2),
                "p99": round(percentile(v, 0.99), 2),
            }
            for k, v in sorted(recovery.items())
        },
        "recovery_s_p50": round(percentile(every, 0.5), 2),
        "recovery_s_p99": round(percentile(every, 0.99), 2),
        "unrecovered_faults": [f.kind for f in injected if f.recovered_at is None],
    }


def _l3(mount: str | None, after: dict, stats: dict) -> dict:
    return {
        # On a tmpfs of L3's own, l3_full fills it and l3_read_only remounts it
        # read-only: the store fails for real. Else a flag in the storage actor.
        "l3_faults": (
            "tmpfs filled (real ENOSPC), remounted read-only (real EROFS)"
            if mount
            else "storage actor flag"
        ),
        "l3_pages": after.get("l3_pages", {}),
        "l3_refused": {k: v for k, v in stats.get("l3", {}).items() if k.startswith("refused_")},
    }


def _requests(tally: Tally, served: int) -> dict:
    failed = sum(tally.failed.values())
    tried = served + tally.load["append"] + failed
    asked = tally.verified + tally.unverifiable
    return {
        "served": served,
        "failed": failed,
        "failed_by_reason": dict(tally.failed),
        "verified": tally.verified,
        "unverifiable": tally.unverifiable,
        "load": dict(sorted(tally.load.items())),
        "latency_s_p50": round(percentile(tally.latencies, 0.5), 3),
        "latency_s_p99": round(percentile(tally.latencies, 0.99), 3),
        "refused_rank_absent": tally.refused_absent,
        # Refusals for a rank absent too long are the fabric's answer, not failures.
        "failed_fraction": round((failed - tally.refused_absent) / max(1, tried), 4),
        "unverifiable_fraction": round(tally.unverifiable / max(1, asked), 4),
    }


def _logged(f: Fault) -> dict:
    return {
        "kind": f.kind,
        "at_s": round(f.at, 2),
        "lasted_s": round((f.ended or f.at) - f.at, 2),
        "target": f.target,
        "injected": f.injected,
        **({"adopted_tokens": f.adopted_tokens} if f.kind == "coordinator_kill" else {}),
    }


def _held(stats: dict, page_size: int) -> dict[str, int]:
    """What settling left held. At idle with every lease released nothing holds an
    L1 page; L2 and L1 pages owned by nothing at all are integrity errors (free +
    owned == pool)."""
    now = stats.get("now", {})
    stuck = sum(int(now.get(stage, 0)) for stage in ("waiting", "running", "prefetching"))
    stuck += sum(int(n) for n in now.get("inflight", {}).values())  # every direction
    return {
        "leaked_slots": int(stats.get("device", {}).get("protected", 0)) // page_size,
        "leaked_leases": int(now.get("leases", 0)),
        "stuck_requests": stuck,
    }


def verdict(
    report: dict, after: dict, max_unverifiable_fraction: float, max_failed_fraction: float
) -> list[str]:
    """Why the run is a loss (empty: it is not). Strict: a wrong page, anything
    left held or stuck, an integrity error, a fault that was not injected or not
    recovered from, an L3 page the audit refused, or more failed or unverifiable
    requests than the bounds allow."""
    req = report["requests"]
    loss = []
    for name, what in (
        ("wrong_pages", "wrong pages served"),
        ("leaked_slots", "L1 slots left held"),
        ("leaked_leases", "leases left held"),
        ("stuck_requests", "requests left in flight"),
    ):
        if report[name]:
            loss.append(f"{report[name]} {what}")
    if report["integrity_errors"]:
        loss.append(f"integrity errors: {report['integrity_errors'][0][:200]}")
    if after["serving_again_s"] is None:
        loss.append("never served again after the faults")
    if not req["served"]:
        loss.append("no request served")
    if report["faults_not_injected"]:
        loss.append(f"faults not injected: {report['faults_not_injected']}")
    if report["unrecovered_faults"]:
        loss.append(f"faults not recovered from: {report['unrecovered_faults']}")
    refused = {
        k: v
        for k, v in report["l3_pages"].items()
        if k not in ("valid", "foreign", "get_miss", "miss", "skipped")
    }
    if refused:
        loss.append(f"L3 pages the audit refused: {refused}")
    if req["unverifiable_fraction"] > max_unverifiable_fraction:
        loss.append(
            f"{req['unverifiable']} leases unverifiable ({req['unverifiable_fraction']:.1%} "
            f"> {max_unverifiable_fraction:.1%})"
        )
    if req["failed_fraction"] > max_failed_fraction:
        loss.append(
            f"{req['failed']} requests failed ({req['failed_fraction']:.1%} > "
            f"{max_failed_fraction:.1%})"
        )
    return loss


def summary(report: dict[str, Any]) -> str:
    r = report["requests"]
    lines = [
        f"served {r['served']} requests, {r['failed']} failed "
        f"({', '.join(f'{k} {v}' for k, v in r['failed_by_reason'].items()) or 'none'}); "
        f"verified {r['verified']} leases on every rank",
        f"{report['faults_injected']} faults: "
        + ", ".join(f"{k} {v}" for k, v in report["faults"].items()),
    ]
    for kind, rec in report["recovery_s"].items():
        lines.append(f"  recovery {kind:<22} p50 {rec['p50']:6.2f} s  p99 {rec['p99']:6.2f} s")
    t = report["throughput_rps"]
    lines.append(f"throughput {t['no_faults']} req/s without faults, {t['with_faults']} with")
    lines.append(
        f"wrong pages {report['wrong_pages']}, leaked slots {report['leaked_slots']}, "
        f"leaked leases {report['leaked_leases']}, stuck requests {report['stuck_requests']}, "
        f"integrity errors {len(report['integrity_errors'])}: "
        + ("nothing lost" if report["ok"] else "LOSS")
    )
    lines += [f"  loss: {why}" for why in report["loss"]]
    audit = report["l3_pages"]
    if "skipped" in audit:
        lines.append(f"L3 audit skipped: {audit['skipped']}")
    return "\n".join(lines)
