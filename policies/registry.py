"""The one error for an unknown policy name."""

from __future__ import annotations

from collections.abc import Iterable


def unknown_name(kind: str, name: object, known: Iterable[str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")
