"""The one JSON object every ``kvfabric`` command prints last, and its schema.

Workload figures have one name whatever command measured them (``run``,
``demo``, ``run --model``, ``simulate``): ``requests``, ``served``,
``refused_requests`` (and ``refused`` by reason), ``tokens_by_tier``,
``hit_rate``, ``requests_per_s``, ``latency_ms``. Command-specific parts sit
under their own keys. ``SCHEMA`` is a JSON Schema (draft 2020-12) of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fabric import __version__

TIERS = ("device", "host", "storage", "computed")
COMMANDS = ("run", "demo", "simulate", "status", "top", "events", "storage", "pin", "config")

_count = {"type": "integer", "minimum": 0}
_ms = {"type": ["number", "null"], "minimum": 0}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvfabric command result",
    "type": "object",
    "required": ["command", "version"],
    "additionalProperties": False,
    "properties": {
        "command": {"enum": list(COMMANDS)},
        "version": {"type": "string"},
        # A workload's figures (run, demo, simulate).
        "source": {"type": "string"},
        "requests": _count,
        "served": _count,
        "refused_requests": _count,
        "refused": {"type": "object", "additionalProperties": _count},
        "tokens_by_tier": {
            "type": "object",
            "required": list(TIERS),
            "additionalProperties": False,
            "properties": {t: _count for t in TIERS},
        },
        "hit_rate": {"type": "number", "minimum": 0, "maximum": 1},
        "requests_per_s": {"type": "number", "minimum": 0},
        "latency_ms": {
            "type": "object",
            "required": ["p50", "p99"],
            "additionalProperties": False,
            "properties": {"p50": _ms, "p99": _ms},
        },
        "resets": _count,
        # run --model
        "model": {
            "type": "object",
            "required": ["model_id", "conversations", "turns", "mismatches"],
            "properties": {
                "model_id": {"type": "string"},
                "conversations": _count,
                "turns": _count,
                "checked_requests": _count,
                "mismatches": _count,
                "max_logits_diff": {"type": "number", "minimum": 0},
                "generated_tokens": _count,
            },
        },
        "topology": {
            "type": "object",
            "required": ["tp", "pp", "cp"],
            "properties": {"tp": _count, "pp": _count, "cp": _count},
        },
        "computed_tokens_by_rank": {"type": "object", "additionalProperties": _count},
        # simulate
        "core": {"type": "object"},
        "policies": {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "bounds": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["capacity_tokens", "lru", "belady", "infinite"],
                "properties": {
                    "capacity_tokens": _count,
                    "lru": {"type": "number"},
                    "belady": {"type": "number"},
                    "infinite": {"type": "number"},
                },
            },
        },
        # status, events, storage, pin, config
        "fabric": {"type": "string"},
        "status": {"type": "object"},
        "events": _count,  # kvfabric events: the event lines printed before it
        "frames": _count,  # kvfabric top: frames drawn
        "storage": {"type": "object"},
        "pin": {"type": "object"},
        "keys": {"type": "array"},
    },
}


def result(command: str, **parts: Any) -> dict[str, Any]:
    """The object ``command`` prints last: its parts, after command and version."""
    return {"command": command, "version": __version__, **parts}


def hit_rate(tokens: Mapping[str, int]) -> float:
    """The share of prompt tokens a cache tier served (``tokens`` by tier)."""
    prompt = sum(tokens.values())
    return round(1 - tokens.get("computed", 0) / prompt, 4) if prompt else 0.0


def workload(
    source: str,
    requests: int,
    tokens: Mapping[str, int],
    refused: Mapping[str, int],
    elapsed_s: float,
    latencies_s: Sequence[float] = (),
) -> dict[str, Any]:
    """A workload's figures under their shared names."""
    n_refused = sum(refused.values())
    served = requests - n_refused
    xs = sorted(latencies_s)

    def pct(q: float) -> float | None:
        return round(1000 * xs[int(q * (len(xs) - 1))], 2) if xs else None

    return {
        "source": source,
        "requests": requests,
        "served": served,
        "refused_requests": n_refused,
        "refused": dict(refused),
        "tokens_by_tier": {t: int(tokens.get(t, 0)) for t in TIERS},
        "hit_rate": hit_rate(tokens),
        "requests_per_s": round(served / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99)},
    }
