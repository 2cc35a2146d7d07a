"""Text for a person: what the commands print without ``--json``."""

from __future__ import annotations

from typing import Any

from fabric import __version__


def tiers_text(tokens: dict[str, int]) -> str:
    served = max(1, sum(tokens.values()))
    return "\n".join(
        f"  {tier:<9} {n:>12,} tokens  {100 * n / served:5.1f}%" for tier, n in tokens.items()
    )


def run_text(out: dict[str, Any], ranks: int) -> str:
    """``kvfabric run``'s result: the tokens each tier served, refusals, latency."""
    lines = [
        f"kvfabric {__version__}: {out['served']} of {out['requests']} requests from "
        f"{out['source']} served by {ranks} rank actors",
        tiers_text(out["tokens_by_tier"]),
    ]
    lines += [
        f"  refused   {n:>12,} requests: {reason}" for reason, n in sorted(out["refused"].items())
    ]
    lat = out["latency_ms"]
    lines.append(
        f"  latency   p50 {lat['p50']} ms, p99 {lat['p99']} ms; {out['requests_per_s']:,} requests/s"
    )
    return "\n".join(lines)


def chat_text(out: dict[str, Any], checked: bool) -> str:
    """``kvfabric run --model``'s result: tokens by tier and by rank, the check."""
    m = out["model"]
    by_rank = ", ".join(f"{r} {n}" for r, n in out["computed_tokens_by_rank"].items())
    lines = [
        f"kvfabric {__version__}: {m['turns']} turns of {m['conversations']} conversations "
        f"with {m['model_id']}",
        tiers_text(out["tokens_by_tier"]),
        f"  computed tokens by rank: {by_rank}",
    ]
    if checked:
        lines.append(
            f"  checked   {m['checked_requests']} answers against generation without a cache: "
            f"{m['mismatches']} mismatched (next-token logits at most "
            f"{m['max_logits_diff']:.2g} apart)"
        )
    if m.get("unserved_turns"):
        lines.append(
            f"  {m['unserved_turns']} turns found a component missing at their lease's end "
            "(no room in L1) and were continued from no cache"
        )
    return "\n".join(lines)


def status_text(st: dict[str, Any], dashboard: str) -> str:
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
    lines += _engines_text(st.get("engines") or {})
    lines.append(f"  {dashboard}")
    return "\n".join(lines)


def _engines_text(engines: dict[str, Any]) -> list[str]:
    """Engine pages in the tree, per place, with its tenants; hits per tier."""
    places = engines.get("places") or {}
    if not any(p["pages"] for p in places.values()):
        return []
    hits = engines.get("hit_pages", {})
    lines = [f"  engine pages (hits: L2 {hits.get('l2', 0):,}, L3 {hits.get('l3', 0):,}):"]
    for place, p in places.items():
        tenants = ", ".join(f"{t} {n:,}" for t, n in sorted(p["tenants"].items()))
        lines.append(f"    {place:<24} {p['pages']:>10,} pages {p['bytes']:>16,} bytes  {tenants}")
    return lines


def simulate_text(out: dict[str, Any]) -> str:
    """``kvfabric simulate``'s result: the core's shares by tier, then its components,
    its policies and the bounds."""
    c = out["core"]
    lines = [
        f"kvfabric {__version__} simulate: {out['requests']} requests from {out['source']}; "
        f"core at L1 {c['device_tokens']:,} + L2 {c['host_tokens']:,} tokens, page "
        f"{c['page_size']}, {c['eviction_policy']}: hit rate {out['hit_rate']:.1%}"
    ]
    lines += [f"  {tier:<9} {share:6.1%}" for tier, share in c["by_tier"].items()]
    if out["refused_requests"]:
        lines.append(
            f"  refused   {out['refused_requests']} requests larger than L1 "
            "(raise cache.device_tokens)"
        )
    if "components" in c:
        lines += _components_text(c["components"])
    if "policies" in out:
        lines.append(
            "  the core by eviction policy: "
            + ", ".join(f"{k} {v:.1%}" for k, v in out["policies"].items())
        )
    served = out["requests"] - out["refused_requests"]
    lines.append(
        f"  {'capacity':>14}  {'LRU':>6}  {'Belady':>6}  {'infinite':>8}   (512-token blocks; "
        f"the {served} requests the core served"
        + (f", not the {out['refused_requests']} refused)" if out["refused_requests"] else ")")
    )
    lines += [
        f"  {b['capacity_tokens']:>14,}  {b['lru']:6.1%}  {b['belady']:6.1%}  {b['infinite']:8.1%}"
        for b in out["bounds"]
    ]
    return "\n".join(lines)


def _components_text(comp: dict[str, Any]) -> list[str]:
    lines = [
        f"  L1 {name:<8} {pool['capacity']:>12,} {pool['unit']:<6} "
        f"{pool['bytes'] / 2**30:8.2f} GiB  in use {pool['in_use']:,}"
        for name, pool in comp["pools"].items()
    ]
    rates = comp["hit_rates"]
    lines.append(
        "  could serve alone (L1 + L2, at admission): "
        + ", ".join(f"{k} {v:.1%}" for k, v in rates.items() if k != "all")
        + f"; every component together {rates.get('all', 0):.1%}"
    )
    if "checkpoints" in comp:
        cp = comp["checkpoints"]
        lines.append(
            f"  mamba checkpoints every {cp['interval_tokens']:,} tokens: "
            + "; ".join(
                f"{k} hit rate {cp[k]['hit_rate']:.1%} (mamba alone "
                f"{cp[k]['hit_rates'].get('mamba', 0):.1%}, {cp[k]['saved']:,} saved, "
                f"{cp[k]['skipped']:,} skipped for want of a free slot)"
                for k in ("on", "off")
            )
        )
    n = comp["counters"]
    lines.append(
        f"  L1 memory {comp['bytes'] / 2**30:.2f} GiB; every attention layer as full "
        f"attention: {comp['all_full_attention_bytes'] / 2**30:.2f} GiB; "
        f"{n['truncated_matches']} matches stopped short of a component, "
        f"{n['tombstones_removed']} dead leaves removed; evicted from L2 alone: "
        f"{n['host_sliding_evicted_pages']} sliding pages, "
        f"{n['host_mamba_evicted_states']} mamba states"
    )
    return lines
