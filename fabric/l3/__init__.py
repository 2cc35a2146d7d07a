"""L3 storage: backends by name, their extra config, and the page format.

``make_backend(name, provenance, page_bytes, extra, allowed_modules)`` builds
``file``, ``redis`` or ``dynamic`` (a user's class: ``extra = {"module":
"pkg.mod", "class": "Name", ...}``, a subclass of
``fabric.l3.backend.L3Backend``, from a module named in ``allowed_modules`` —
``storage.dynamic_modules`` of the launch config; nothing else is imported).
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

BACKENDS = ("file", "redis", "dynamic")


def parse_extra_config(text: str) -> dict[str, Any]:
    """A backend's extra config: a JSON object, or ``@path`` to a .json, .toml or
    .yaml file. Errors name the problem; an empty string is ``{}``."""
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("@"):
        data = read_structured_file(text[1:], "storage.extra_config")
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"storage.extra_config={text!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"storage.extra_config must be an object of keys, got {type(data).__name__}"
        )
    return data


_KNOWN_EXTRA = {
    "file": {"path", "max_bytes", "fsync", "file_mode", "dir_mode"},
    "redis": {
        "host",
        "port",
        "db",
        "username",
        "password",
        "prefix",
        "timeout_s",
        "ssl",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_cert_reqs",
    },
}


def make_backend(
    name: str,
    provenance: Provenance,
    page_bytes: int,
    extra: Mapping[str, Any],
    allowed_modules: Collection[str] = (),
) -> L3Backend:
    if name == "file":
        from fabric.l3.file import FileBackend as cls
    elif name == "redis":
        from fabric.l3.redis import RedisBackend as cls  # type: ignore[assignment]
    elif name == "dynamic":
        return _dynamic(provenance, page_bytes, extra, allowed_modules)
    else:
        raise ConfigError(
            f"storage.backend={name!r} is refused: allowed is one of {', '.join(BACKENDS)}"
        )
    unknown = sorted(set(extra) - _KNOWN_EXTRA[name])
    if unknown:
        raise ConfigError(
            f"storage.extra_config key(s) {unknown} unknown for backend {name!r}; "
            f"known: {sorted(_KNOWN_EXTRA[name])}"
        )
    try:
        return cls(provenance, page_bytes, extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"storage.extra_config for {name!r}: {exc}") from None


def _dynamic(
    provenance: Provenance,
    page_bytes: int,
    extra: Mapping[str, Any],
    allowed_modules: Collection[str],
) -> L3Backend:
    module, cls_name = extra.get("module"), extra.get("class")
    if not isinstance(module, str) or not isinstance(cls_name, str):
        raise ConfigError(
            "storage.extra_config for 'dynamic' needs string keys 'module' and 'class'"
        )
    if module not in allowed_modules:
        raise ConfigError(
            f"storage.extra_config: module {module!r} is not allowed; the launch config's "
            f"storage.dynamic_modules allows {sorted(allowed_modules) or 'none'}"
        )
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"storage.extra_config: cannot load {module}.{cls_name}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, L3Backend)):
        raise ConfigError(f"storage.extra_config: {module}.{cls_name} is not an L3Backend subclass")
    rest = {k: v for k, v in extra.items() if k not in ("module", "class")}
    try:
        return cls(provenance, page_bytes, rest)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"storage.extra_config for {module}.{cls_name}: {exc}") from None
