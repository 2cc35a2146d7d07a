"""What makes a figure a Prometheus series: a ``Series`` attached to its field's type
(``Annotated[int, Series(...)]``) where the figure is defined and counted. The
exporter walks the figures tree (``walk``) and finds every annotated field: adding a
counter is its field, with its ``Series``, and the code that counts it.

A field holds one sample (with ``labels`` fixed for it: the three request outcomes
are three fields of one series), or, with ``by``, one sample per key of a mapping
(or per field of a dataclass) under that label; ``keys`` names the label values that
exist from the first scrape, zeros included."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fabric.observe.histogram import Histogram


@dataclass(frozen=True)
class Series:
    name: str  # without ``_total`` for a counter
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[tuple[str, str], ...] = ()  # fixed for this field
    by: str | None = None  # the label whose values are a mapping's keys
    keys: tuple[str, ...] = ()  # those that exist from the first scrape


Samples = list[tuple[tuple[str, ...], Any]]


@functools.cache
def _series_of(cls: type) -> tuple[tuple[str, Series | None], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        meta = getattr(hints.get(f.name), "__metadata__", ())
        out.append((f.name, next((m for m in meta if isinstance(m, Series)), None)))
    return tuple(out)


def _fields(obj: Any) -> Iterator[tuple[str, Any, Series | None]]:
    for name, series in _series_of(type(obj)):
        yield name, getattr(obj, name), series


def walk(obj: Any) -> Iterator[tuple[Series, Samples]]:
    """Every annotated field of the dataclass ``obj`` and those it holds, with its
    samples as ``(label values, value)``; fields of one series come out one after
    another in the order they are defined."""
    for _, value, series in _fields(obj):
        if series is None:
            if dataclasses.is_dataclass(value):
                yield from walk(value)
            continue
        fixed = tuple(v for _, v in series.labels)
        if series.by is None:
            yield series, [(fixed, value)]
            continue
        items = (
            {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            if dataclasses.is_dataclass(value)
            else dict(value)
        )
        zero = Histogram(()) if series.kind == "histogram" else 0
        keys = [*series.keys, *(k for k in items if k not in series.keys)]
        yield series, [((*fixed, str(k)), items.get(k, zero)) for k in keys]


def label_names(series: Series) -> tuple[str, ...]:
    return tuple(k for k, _ in series.labels) + ((series.by,) if series.by else ())


def to_builtins(obj: Any) -> Any:
    """The figures as plain data (dicts, lists, numbers, strings): what ``stats()``
    hands a driver. A histogram becomes its count, sum and cumulative buckets."""
    if isinstance(obj, Histogram):
        return {"count": obj.count, "sum": obj.sum, "buckets": obj.buckets()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_builtins(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_builtins(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_builtins(v) for v in obj]
    return obj


def declared(cls: type) -> Iterator[Series]:
    """Every ``Series`` the dataclass ``cls`` and the dataclasses its fields hold
    declare, each name once, in the order of definition."""
    seen: set[str] = set()
    hints = typing.get_type_hints(cls, include_extras=True)
    for name, series in _series_of(cls):
        if series is not None:
            if series.name not in seen:
                seen.add(series.name)
                yield series
            continue
        inner = typing.get_origin(hints[name]) or hints[name]
        if dataclasses.is_dataclass(inner):
            for s in declared(inner):
                if s.name not in seen:
                    seen.add(s.name)
                    yield s
