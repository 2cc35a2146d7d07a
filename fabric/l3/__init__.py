"""L3 storage: backends by name, their typed options, and the page format.

``make_backend(name, provenance, page_bytes, options, allowed_modules)`` builds
``file``, ``segment``, ``redis`` or ``dynamic`` (a user's class: ``options = {"module":
"pkg.mod", "class": "Name", "options": {...}}``, a subclass of
``fabric.l3.backend.L3Backend``, from a module named in ``allowed_modules`` —
``storage.dynamic_modules`` of the launch config; nothing else is imported).
Options are validated by ``fabric.l3.options``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection, Mapping
from typing import Any

from fabric.config import read_structured_file
from fabric.errors import ConfigError
from fabric.l3.backend import L3Backend
from fabric.l3.format import Provenance
from fabric.l3.options import DynamicOptions

# The built-in backends by name: module and class, imported when first made
# (the Redis client is an optional extra). Adding one is a line here and its
# name in ``StorageConfig.backend``.
BUILT_IN: dict[str, tuple[str, str]] = {
    "file": ("fabric.l3.file", "FileBackend"),
    "segment": ("fabric.l3.segment", "SegmentBackend"),
    "redis": ("fabric.l3.redis", "RedisBackend"),
}
BACKENDS = (*BUILT_IN, "dynamic")


def parse_options(text: str) -> dict[str, Any]:
    """Backend options written as text (the CLI, a driver): a JSON object, or
    ``@path`` to a .json, .toml or .yaml file. Errors name the problem; an empty
    string is ``{}``."""
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("@"):
        data = read_structured_file(text[1:], "storage options")
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"storage options {text!r} are not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"storage options must be an object of keys, got {type(data).__name__}")
    return data


def make_backend(
    name: str,
    provenance: Provenance,
    page_bytes: int,
    options: Mapping[str, Any],
    allowed_modules: Collection[str] = (),
) -> L3Backend:
    """The backend ``name`` with its ``options`` (validated by its options model)."""
    if name == "dynamic":
        return _dynamic(provenance, page_bytes, options, allowed_modules)
    where = BUILT_IN.get(name)
    if where is None:
        raise ConfigError(
            f"storage.backend={name!r} is refused: allowed is one of {', '.join(BACKENDS)}"
        )
    cls = getattr(importlib.import_module(where[0]), where[1])
    return cls(provenance, page_bytes, options)


def _dynamic(
    provenance: Provenance,
    page_bytes: int,
    options: Mapping[str, Any],
    allowed_modules: Collection[str],
) -> L3Backend:
    spec = DynamicOptions.parse(options, "dynamic")
    module, cls_name = spec.module, spec.class_name
    if module not in allowed_modules:
        raise ConfigError(
            f"storage.options.module={module!r} is not allowed; the launch config's "
            f"storage.dynamic_modules allows {sorted(allowed_modules) or 'none'}"
        )
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"storage.options: cannot load {module}.{cls_name}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, L3Backend)):
        raise ConfigError(f"storage.options: {module}.{cls_name} is not an L3Backend subclass")
    try:
        return cls(provenance, page_bytes, spec.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"storage.options for {module}.{cls_name}: {exc}") from None
