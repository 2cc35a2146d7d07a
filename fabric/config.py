"""The typed, validated configuration of kvfabric.

Every section is a frozen dataclass; each field says what it allows, and a bad
value is refused at construction with the dotted key, the value and the rule.
Files are JSON, TOML or YAML; unknown keys are refused, listing the known ones.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import yaml

from fabric.errors import ConfigError
from policies import EVICTION_POLICIES, PREFETCH_STOP_POLICIES, WRITE_POLICIES


def _setting(default: Any, kind: type, allowed: str, ok: Callable[[Any], bool]) -> Any:
    return field(default=default, metadata={"kind": kind, "allowed": allowed, "ok": ok})


def _positive_int(default: int) -> Any:
    return _setting(default, int, "an integer >= 1", lambda v: v >= 1)


def _non_negative_int(default: int) -> Any:
    return _setting(default, int, "an integer >= 0", lambda v: v >= 0)


def _non_negative_float(default: float) -> Any:
    return _setting(default, float, "a number >= 0", lambda v: v >= 0)


def _one_of(default: str, names: Iterable[str]) -> Any:
    known = sorted(names)
    return _setting(default, str, f"one of {', '.join(known)}", lambda v: v in known)


def _fraction(default: float) -> Any:
    return _setting(default, float, "a number in [0, 1]", lambda v: 0 <= v <= 1)


def _octal(value: str) -> bool:
    try:
        return 0 <= int(value, 8) <= 0o777
    except ValueError:
        return False


def _boolean(default: bool) -> Any:
    return _setting(default, bool, "true or false", lambda v: True)


class _Section:
    """Validation shared by every config section."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind, allowed = f.metadata["kind"], f.metadata["allowed"]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, f.name, value)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise self.refuse(f.name, value, allowed)
            if not f.metadata["ok"](value):
                raise self.refuse(f.name, value, allowed)
        self.check()

    def check(self) -> None:
        """Rules that tie several fields together."""

    def refuse(self, name: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(
            f"config {self.section}.{name}={value!r} is refused: allowed is {allowed}"
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config section {cls.section!r} must be a mapping, got {data!r}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(f'{cls.section}.{k}' for k in unknown)}; "
                f"known in {cls.section!r}: {', '.join(sorted(known))}"
            )
        return cls(**data)


@dataclass(frozen=True)
class CacheConfig(_Section):
    """The radix tree and its two in-memory tiers (sizes in tokens)."""

    section: ClassVar[str] = "cache"
    page_size: int = _positive_int(16)
    device_tokens: int = _positive_int(32768)
    host_tokens: int = _positive_int(131072)
    eviction_policy: str = _one_of("lru", EVICTION_POLICIES)
    write_policy: str = _one_of("write_through", WRITE_POLICIES)
    load_back_threshold: int = _non_negative_int(16)
    pin_budget_fraction: float = _fraction(0.2)
    kv_events: bool = _boolean(True)

    def check(self) -> None:
        for name in ("device_tokens", "host_tokens"):
            value = getattr(self, name)
            if value % self.page_size:
                raise self.refuse(name, value, f"a multiple of page_size ({self.page_size})")

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size


@dataclass(frozen=True)
class PrefetchConfig(_Section):
    """L3 -> L2 prefetch: when to start, when to stop waiting, how much may be in flight."""

    section: ClassVar[str] = "prefetch"
    threshold_tokens: int = _non_negative_int(256)
    stop_policy: str = _one_of("timeout", PREFETCH_STOP_POLICIES)
    timeout_base_s: float = _non_negative_float(1.0)
    timeout_per_ki_token_s: float = _non_negative_float(0.25)
    timeout_max_s: float = _non_negative_float(10.0)
    max_inflight_fraction: float = _fraction(0.5)
    query_batch_pages: int = _positive_int(128)


LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelConfig(_Section):
    """The KV cache's shape: what one token's KV is, for the whole model."""

    section: ClassVar[str] = "model"
    model_id: str = _setting("kvfabric-synthetic", str, "a non-empty str", bool)
    layers: int = _positive_int(4)
    kv_heads: int = _positive_int(4)
    head_dim: int = _positive_int(32)
    dtype: str = _one_of("bfloat16", DTYPES)
    layout: str = _one_of("layer_first", LAYOUTS)


@dataclass(frozen=True)
class TopologyConfig(_Section):
    """Model parallelism: one rank actor per (pp, cp, tp)."""

    section: ClassVar[str] = "topology"
    tp: int = _positive_int(2)
    cp: int = _positive_int(1)
    pp: int = _positive_int(1)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp


@dataclass(frozen=True)
class RuntimeConfig(_Section):
    """How the fabric runs on Ray."""

    section: ClassVar[str] = "runtime"
    name: str = _setting(
        "kvfabric",
        str,
        "a non-empty str of [A-Za-z0-9_-]",
        lambda v: bool(v) and v.replace("-", "").replace("_", "").isalnum(),
    )
    ray_namespace: str = _setting("kvfabric", str, "a non-empty str", bool)
    address: str = _setting("", str, "a Ray address, or empty to start a local Ray", lambda v: True)
    device: str = _one_of("auto", ("auto", "cpu", "cuda"))
    namespaces: str = _setting(
        "*", str, "'*' (any namespace) or a comma-separated list of namespaces", bool
    )
    step_interval_s: float = _non_negative_float(0.001)
    rank_timeout_s: float = _setting(30.0, float, "a number > 0", lambda v: v > 0)
    rank_absent_timeout_s: float = _setting(60.0, float, "a number > 0", lambda v: v > 0)
    max_request_retries: int = _non_negative_int(3)
    lease_ttl_s: float = _setting(300.0, float, "a number > 0", lambda v: v > 0)
    max_message_bytes: int = _setting(64 << 20, int, "an integer >= 4096", lambda v: v >= 4096)
    max_pending_requests: int = _positive_int(4096)
    metrics_port: int = _setting(
        0, int, "a TCP port, or 0 for no metrics endpoint", lambda v: 0 <= v < 65536
    )
    metrics_host: str = _setting(
        "127.0.0.1", str, "an address to bind the metrics endpoint to", bool
    )

    def allowed_namespaces(self) -> frozenset[str] | None:
        """``None`` when any namespace is allowed."""
        if self.namespaces.strip() == "*":
            return None
        return frozenset(n.strip() for n in self.namespaces.split(",") if n.strip())


@dataclass(frozen=True)
class StorageConfig(_Section):
    """L3: which backend, where, and how pages move to and from it."""

    section: ClassVar[str] = "storage"
    backend: str = _one_of("file", ("none", "file", "redis", "dynamic"))
    path: str = _setting("kvfabric-l3", str, "a directory path (file backend)", bool)
    max_bytes: int = _setting(1 << 30, int, "an integer >= 0 (0: no cap)", lambda v: v >= 0)
    fsync: bool = _boolean(False)
    file_mode: str = _setting("0600", str, "an octal mode such as 0600", _octal)
    dir_mode: str = _setting("0700", str, "an octal mode such as 0700", _octal)
    dynamic_modules: str = _setting(
        "", str, "comma-separated module names the dynamic backend may load", lambda v: True
    )
    extra_config: str = _setting(
        "", str, "a JSON object, or @file.json/.toml/.yaml, of backend options", lambda v: True
    )
    transfer_batch_pages: int = _positive_int(64)

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    def allowed_modules(self) -> frozenset[str]:
        return frozenset(m.strip() for m in self.dynamic_modules.split(",") if m.strip())


@dataclass(frozen=True)
class FabricConfig:
    """The whole configuration. ``FabricConfig()`` runs on a laptop: TP=2, one
    pipeline stage, CPU pools."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    _sections: ClassVar[dict[str, type[_Section]]] = {
        "cache": CacheConfig,
        "prefetch": PrefetchConfig,
        "model": ModelConfig,
        "topology": TopologyConfig,
        "runtime": RuntimeConfig,
        "storage": StorageConfig,
    }

    def __post_init__(self) -> None:
        topo, model, cache = self.topology, self.model, self.cache
        for key, value, divisor, what in (
            ("model.layers", model.layers, topo.pp, "topology.pp"),
            ("model.kv_heads", model.kv_heads, topo.tp, "topology.tp"),
            ("cache.page_size", cache.page_size, topo.cp, "topology.cp"),
        ):
            if value % divisor:
                raise ConfigError(
                    f"config {key}={value} is refused: allowed is a multiple of {what} ({divisor})"
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FabricConfig:
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a mapping of sections, got {data!r}")
        unknown = sorted(set(data) - set(cls._sections))
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(cls._sections))}"
            )
        return cls(**{k: cls._sections[k].from_dict(v) for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_overrides(self, overrides: Iterable[str]) -> FabricConfig:
        """A copy with ``section.key=value`` overrides applied. Values of string keys
        are taken as written; others are parsed as YAML scalars, so
        ``cache.page_size=64`` gives an int and ``cache.kv_events=false`` a bool."""
        data = self.to_dict()
        for item in overrides:
            dotted, sep, raw = item.partition("=")
            section, dot, key = dotted.strip().partition(".")
            if not sep or not dot or not key:
                raise ConfigError(f"override {item!r} is refused: allowed is section.key=value")
            if section not in data:
                raise ConfigError(
                    f"unknown config section {section!r} in override {item!r}; "
                    f"known: {', '.join(sorted(data))}"
                )
            kinds = {f.name: f.metadata["kind"] for f in fields(self._sections[section])}  # type: ignore[arg-type]
            if kinds.get(key) is str:
                data[section][key] = raw  # strings are taken as written (JSON stays JSON)
                continue
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ConfigError(
                    f"override {item!r}: value {raw!r} does not parse: {exc}"
                ) from None
            data[section][key] = value
        return FabricConfig.from_dict(data)

    def replace(self, **sections: Any) -> FabricConfig:
        return replace(self, **sections)


def read_structured_file(path: str | Path, what: str) -> Any:
    """The data in a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file; ``ConfigError``
    naming ``what`` is being read and the problem otherwise."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what}: {str(path)!r} does not parse: {exc}") from None
    raise ConfigError(
        f"{what}: {str(path)!r} has suffix {suffix!r}; allowed: .json, .toml, .yaml, .yml"
    )


def load_config(path: str | Path) -> FabricConfig:
    """Read a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file into a validated config."""
    return FabricConfig.from_dict(read_structured_file(path, "config file"))
