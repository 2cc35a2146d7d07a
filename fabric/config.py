"""The typed, validated configuration of kvfabric (pydantic models).

Every section is frozen and forbids unknown keys; types are strict (a bool is
not an int, ``"5"`` is not a number). A bad value is refused at construction
with a ``ConfigError`` naming the dotted key, the value and what is allowed —
each field's description says that. Files are JSON, TOML or YAML;
``--set section.key=value`` overrides parse values as YAML scalars (or lists).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from fabric.errors import ConfigError
from policies import EVICTION_POLICIES, PREFETCH_STOP_POLICIES, WRITE_POLICIES

# Where a session keeps its conversation between turns: L1 (a lock) or L2.
SESSION_TIERS = ("device", "host")
# Where a rank's L2 lives (``cache.host_memory``).
HOST_MEMORY = ("shared", "process")
# What a straggling rank gets: named only, or treated as failed (restarted).
STRAGGLER_POLICIES = ("report", "restart")


def _allowed(description: str, **constraints: Any) -> Any:
    return Field(description=description, **constraints)


PositiveInt = Annotated[int, _allowed("an integer >= 1", ge=1)]
NonNegativeInt = Annotated[int, _allowed("an integer >= 0", ge=0)]
# Seconds and sizes are finite: an infinite TTL would hold a budget for ever.
NonNegativeFloat = Annotated[float, _allowed("a finite number >= 0", ge=0, allow_inf_nan=False)]
PositiveFloat = Annotated[float, _allowed("a finite number > 0", gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, _allowed("a number in [0, 1]", ge=0, le=1)]
Text = Annotated[str, _allowed("a non-empty str", min_length=1)]
# L3 files and directories: the owner's, at most readable by the group (a shared
# store for one group of users); never writable by the group, nothing for others.
Mode = Annotated[
    str,
    _allowed(
        "an octal mode such as 0600 or 0640: no write bit for the group, no bit for others",
        pattern=r"^0?[0-7][0145]0$",
        min_length=3,
    ),
]


def _one_of(names: Iterable[str], default: str) -> Any:
    known = sorted(names)
    return Field(
        default, description=f"one of {', '.join(known)}", json_schema_extra={"enum": known}
    )


class _Section(BaseModel):
    """Validation shared by every config section."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    section: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(exc, self.section) from None

    @model_validator(mode="after")
    def _choices(self) -> _Section:
        for name, info in type(self).model_fields.items():
            known = (info.json_schema_extra or {}).get("enum")  # type: ignore[union-attr]
            if known is not None and getattr(self, name) not in known:
                raise ValueError(
                    f"{self.section}.{name}={getattr(self, name)!r} is refused: "
                    f"allowed is {info.description}"
                )
        return self

    def _multiple(self, name: str, of: int, what: str) -> None:
        value = getattr(self, name)
        if value % of:
            raise ValueError(
                f"{self.section}.{name}={value!r} is refused: allowed is a multiple of {what} ({of})"
            )


def _config_error(exc: ValidationError, prefix: str) -> ConfigError:
    """The first problem of ``exc`` as ``config <key>=<value> is refused: allowed is ...``."""
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"]]
    if err["type"] == "value_error":  # our own checks say everything themselves
        cause = err["ctx"]["error"]
        if isinstance(cause, ConfigError):
            return cause
        if not loc:
            return ConfigError(f"config {cause}")
    dotted = ".".join([prefix, *loc] if prefix else loc)
    owner = _model_at(exc.title, loc[:-1])
    if err["type"] == "extra_forbidden":
        known = sorted(owner.model_fields) if owner else []
        where = ".".join([prefix, *loc[:-1]] if prefix else loc[:-1])
        return ConfigError(
            f"unknown config key(s) {dotted}; known in {where!r}: {', '.join(known)}"
        )
    field = owner.model_fields.get(loc[-1]) if owner and loc else None
    allowed = (field.description if field else None) or err["msg"]
    return ConfigError(f"config {dotted}={err['input']!r} is refused: allowed is {allowed}")


def _model_at(title: str, loc: list[str]) -> type[BaseModel] | None:
    """The model that ``loc`` (a path of field names) leads to from model ``title``."""
    model: type[BaseModel] | None = _MODELS.get(title)
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) else None
    return model


class CacheConfig(_Section):
    """The radix tree and its two in-memory tiers (sizes in tokens)."""

    section: ClassVar[str] = "cache"
    page_size: PositiveInt = 16
    device_tokens: PositiveInt = 32768
    host_tokens: PositiveInt = 131072
    eviction_policy: str = _one_of(EVICTION_POLICIES, "a2q")
    write_policy: str = _one_of(WRITE_POLICIES, "write_through")
    load_back_threshold: NonNegativeInt = 16
    pin_budget_fraction: Fraction = 0.2
    kv_events: bool = Field(True, description="true or false")
    chunk_tokens: NonNegativeInt = Field(
        0, description="an integer >= 0, a multiple of page_size (0: the whole prompt at once)"
    )
    # Where a Ray rank keeps L2: "shared" (the node's shared memory, so a rank
    # restarted on its node finds it: fabric.rank.shared_l2) or "process".
    host_memory: str = _one_of(HOST_MEMORY, "shared")
    session_tier: str = _one_of(SESSION_TIERS, "device")
    session_budget_fraction: Fraction = 0.25
    session_ttl_s: PositiveFloat = 300.0
    # One tenant (namespace) holds at most this share of the pin budget and of the
    # session budget, so one tenant cannot take either whole.
    tenant_share: Fraction = 0.5
    # Hybrid models (``model.layer_kinds``): L1 pools of the non-base components.
    sliding_tokens: NonNegativeInt = Field(
        0,
        description="an integer >= 0, a multiple of page_size (0: as many as device_tokens)",
    )
    mamba_states: NonNegativeInt = Field(0, description="an integer >= 0 (0: one per L1 page)")
    host_sliding_tokens: NonNegativeInt = Field(
        0,
        description="an integer >= 0, a multiple of page_size (0: as many as host_tokens)",
    )
    host_mamba_states: NonNegativeInt = Field(0, description="an integer >= 0 (0: one per L2 page)")
    # A mamba state saved every this many tokens inside a filled prefix (a node is
    # split there), so prefixes ending between node ends are served from the last
    # checkpoint before them. Checkpoints take free L1 state slots only.
    mamba_checkpoint_tokens: NonNegativeInt = Field(
        0,
        description="an integer >= 0, a multiple of page_size (0: states at node ends only)",
    )

    @model_validator(mode="after")
    def _whole_pages(self) -> CacheConfig:
        for name in (
            "device_tokens",
            "host_tokens",
            "chunk_tokens",
            "sliding_tokens",
            "host_sliding_tokens",
            "mamba_checkpoint_tokens",
        ):
            self._multiple(name, self.page_size, "page_size")
        return self

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size

    @property
    def sliding_pages(self) -> int:
        return (self.sliding_tokens or self.device_tokens) // self.page_size

    @property
    def mamba_slots(self) -> int:
        return self.mamba_states or self.device_pages

    @property
    def host_sliding_pages(self) -> int:
        return (self.host_sliding_tokens or self.host_tokens) // self.page_size

    @property
    def host_mamba_slots(self) -> int:
        return self.host_mamba_states or self.host_pages


class PrefetchConfig(_Section):
    """L3 -> L2 prefetch: when to start, when to stop waiting, how much may be in flight."""

    section: ClassVar[str] = "prefetch"
    threshold_tokens: NonNegativeInt = 256
    stop_policy: str = _one_of(PREFETCH_STOP_POLICIES, "timeout")
    timeout_base_s: NonNegativeFloat = 1.0
    timeout_per_ki_token_s: NonNegativeFloat = 0.25
    timeout_max_s: NonNegativeFloat = 10.0
    max_inflight_fraction: Fraction = 0.5
    query_batch_pages: PositiveInt = 128


LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = ("bfloat16", "float16", "float32")
FILLERS = ("synthetic", "constant", "llama", "hybrid")
# The fillers that run a transformer: they need the tokens before a fill, and
# every token within the model's vocabulary.
MODEL_FILLERS = ("llama", "hybrid")
# What a layer keeps per position: KV for every token (``full``, the base
# component), KV for the last ``sliding_window - 1`` tokens (``sliding``), or one
# fixed-size recurrent state (``mamba``).
LAYER_KINDS = ("full", "sliding", "mamba")
# The family of a hybrid model's recurrent (``mamba``) layers, for
# ``model.filler=hybrid``: Mamba2 (Bamba) or a gated delta net (Qwen3-Next).
RECURRENT_LAYERS = ("mamba2", "gated_delta_net")


class ModelConfig(_Section):
    """The KV cache's shape: what one token's KV is, for the whole model."""

    section: ClassVar[str] = "model"
    model_id: Text = "kvfabric-synthetic"
    layers: PositiveInt = 4
    kv_heads: PositiveInt = 4
    head_dim: PositiveInt = 32
    dtype: str = _one_of(DTYPES, "bfloat16")
    layout: str = _one_of(LAYOUTS, "layer_first")
    # Who computes new KV: the synthetic producer (every value a checkable function
    # of its prefix), ``constant`` (no compute: one cheap value per token from its
    # page's chain and its id, to measure the fabric itself: bench/fabric_load.py),
    # or a Llama-architecture transformer (``pip install 'kvfabric[model]'``):
    # seeded random weights of the shape above, or the weights in ``path`` (a
    # local Hugging Face model directory).
    filler: str = _one_of(FILLERS, "synthetic")
    path: str = ""
    seed: NonNegativeInt = 0
    vocab_size: PositiveInt = 1000
    attention_heads: NonNegativeInt = Field(0, description="an integer >= 0 (0: 2 x kv_heads)")
    intermediate_size: NonNegativeInt = Field(0, description="an integer >= 0 (0: 2 x hidden)")
    initializer_range: PositiveFloat = 0.2
    layer_kinds: tuple[str, ...] = Field(
        (),
        strict=False,
        description="a list of one layer kind per layer (full, sliding or mamba), "
        "or [] for every layer full",
    )
    sliding_window: NonNegativeInt = Field(
        0, description="an integer >= 0: the window of sliding layers in tokens (>= 2 when used)"
    )
    mamba_state_bytes: PositiveInt = Field(
        65536, description="an integer >= 1: one mamba layer's state (conv + SSM) in bytes"
    )
    recurrent_layer: str = _one_of(RECURRENT_LAYERS, "mamba2")

    @model_validator(mode="after")
    def _kinds(self) -> ModelConfig:
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(
                f"model.layer_kinds has {bad[0]!r}: allowed is a list of {', '.join(LAYER_KINDS)}"
            )
        if self.layer_kinds and len(self.layer_kinds) != self.layers:
            raise ValueError(
                f"model.layer_kinds has {len(self.layer_kinds)} entries: allowed is one per "
                f"layer (model.layers={self.layers}), or []"
            )
        if "full" not in self.kinds:
            raise ValueError(
                "model.layer_kinds has no full layer: allowed is a list with at least one "
                "full-attention layer (the base component)"
            )
        if "sliding" in self.kinds and self.sliding_window < 2:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} is refused: allowed is an "
                "integer >= 2 when model.layer_kinds has sliding layers"
            )
        return self

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind (every layer ``full`` when ``layer_kinds`` is empty)."""
        return self.layer_kinds or ("full",) * self.layers

    @property
    def runs_model(self) -> bool:
        """Whether a transformer computes the KV (``MODEL_FILLERS``)."""
        return self.filler in MODEL_FILLERS

    @property
    def components(self) -> tuple[str, ...]:
        """The cache components the model has, ``full`` (the base) first."""
        return tuple(k for k in LAYER_KINDS if k in self.kinds)

    def window_pages(self, page_size: int) -> int:
        """Pages of sliding-window KV a prefix end needs before it (the last
        ``sliding_window - 1`` tokens); 0 without sliding layers."""
        if "sliding" not in self.components:
            return 0
        return -(-(self.sliding_window - 1) // page_size)

    def mamba_elems(self, tp: int) -> int:
        """float32 values of one TP rank's share of one mamba layer's state."""
        return max(1, self.mamba_state_bytes // 4 // tp)

    def component_bytes(self) -> dict[str, int]:
        """Bytes of one unit of each component over the whole model, all ranks
        together: a token of KV over the full-attention layers, a token over the
        sliding layers, one state over the mamba layers."""
        size = 4 if self.dtype == "float32" else 2
        kv = 2 * self.kv_heads * self.head_dim * size
        kinds = self.kinds
        out = {"full": kinds.count("full") * kv}
        if "sliding" in kinds:
            out["sliding"] = kinds.count("sliding") * kv
        if "mamba" in kinds:
            out["mamba"] = kinds.count("mamba") * self.mamba_state_bytes
        return out

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V over every layer and head, all ranks together."""
        size = 4 if self.dtype == "float32" else 2
        return 2 * self.layers * self.kv_heads * self.head_dim * size


class TopologyConfig(_Section):
    """Model parallelism: one rank actor per (pp, cp, tp)."""

    section: ClassVar[str] = "topology"
    tp: PositiveInt = 2
    cp: PositiveInt = 1
    pp: PositiveInt = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp


class RuntimeConfig(_Section):
    """How the fabric runs on Ray."""

    section: ClassVar[str] = "runtime"
    name: Annotated[
        str, _allowed("a non-empty str of [A-Za-z0-9_-]", pattern=r"^[A-Za-z0-9_-]+$")
    ] = "kvfabric"
    ray_namespace: Text = "kvfabric"
    address: str = Field("", description="a Ray address, or empty to start a local Ray")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto, cpu or cuda")
    namespaces: tuple[Text, ...] = Field(
        ("*",),
        strict=False,
        min_length=1,
        description="a list of allowed namespaces, or ['*'] for any",
    )
    step_interval_s: NonNegativeFloat = 0.001
    # A rank holds its reply to a round while it has work in flight and nothing new
    # to report, up to this long: the coordinator hears of each finished command at
    # once instead of polling for it with empty rounds (0: reply at once).
    round_wait_s: NonNegativeFloat = 0.02
    # Past a round's first news, how long more a rank that the round brought
    # commands holds its reply for the computes and loads still queued (what
    # requests wait on), within round_wait_s: news of one compute of an engine
    # step's many would otherwise end the reply, and the rest need a round of
    # their own (0: reply at the first news).
    round_settle_s: NonNegativeFloat = 0.005
    rank_timeout_s: PositiveFloat = 30.0
    # How long the ranks of a sharded model (model.filler=llama) wait in one
    # collective (forming their groups, an all-reduce or all-gather, a stage's send
    # or receive) before the compute fails and the epoch resets; at most half of
    # rank_timeout_s (a rank stuck longer would miss its round).
    collective_timeout_s: PositiveFloat = 10.0
    # Consensus rounds on a Ray Compiled Graph (shared-memory channels instead of
    # one RPC per rank): faster rounds, but every rank actor and the coordinator
    # then poll their channels on a core each, busy or idle. Off by default.
    compiled_rounds: bool = Field(False, description="true or false")
    # How a round's batch reaches the ranks and their reports come back: "zmq", a
    # socket per rank (each rank binds one on its node's address and hands the
    # coordinator its address and a secret by a Ray call), or "ray", one actor
    # call per rank (4-6x the coordinator's CPU per round: bench/ray_call_floor.py).
    # Compiled rounds, when on, take precedence over both.
    round_transport: Literal["zmq", "ray"] = Field("zmq", description="zmq or ray")
    # How a driver's submit and submit_many reach the coordinator: "zmq", a socket
    # the coordinator binds (its address and a secret asked by a Ray call; a driver
    # that cannot reach it goes on over Ray), or "ray", an actor call each.
    submit_transport: Literal["zmq", "ray"] = Field("zmq", description="zmq or ray")
    rank_absent_timeout_s: PositiveFloat = 60.0
    # Stragglers (fabric.coordinator.stragglers): a rank slow in a round replies
    # later than the others' median by more than straggler_lag_s and more than
    # straggler_factor times it; straggler_rounds such rounds in a row name it.
    straggler_lag_s: PositiveFloat = 0.25
    straggler_factor: Annotated[float, _allowed("a number >= 1", ge=1, allow_inf_nan=False)] = 4.0
    straggler_rounds: PositiveInt = 3
    straggler_policy: str = _one_of(STRAGGLER_POLICIES, "report")
    max_request_retries: NonNegativeInt = 3
    lease_ttl_s: PositiveFloat = 300.0
    max_message_bytes: Annotated[
        int, _allowed("an integer in [4096, 268435456] (256 MiB)", ge=4096, le=256 << 20)
    ] = 64 << 20
    max_pending_requests: PositiveInt = 4096
    # Engine pages (a vLLM engine's, through fabric.engines.vllm_connector) the
    # coordinator remembers, whole or reported by some ranks only; the least
    # recently used are forgotten past it (their L3 pages stay).
    engine_pages: PositiveInt = 1 << 20
    metrics_port: Annotated[int, _allowed("a TCP port, or 0 for none", ge=0, lt=65536)] = 0
    metrics_host: Text = "127.0.0.1"
    # The Ray dashboard of a Ray that launch() starts (a cluster's is its own).
    dashboard: bool = Field(True, description="true or false")
    dashboard_host: Text = "127.0.0.1"
    dashboard_port: Annotated[int, _allowed("a TCP port", ge=1, lt=65536)] = 8265
    log_to_driver: bool = Field(True, description="true or false")
    # Where the coordinator and the storage actor run: nodes with this custom
    # resource (cluster.yaml gives it to the head node); empty: anywhere.
    control_resource: Annotated[
        str, _allowed("a Ray resource name, or empty for any node", pattern=r"^[A-Za-z0-9_.-]*$")
    ] = "kvfabric_head"

    @model_validator(mode="after")
    def _round_wait_fits(self) -> RuntimeConfig:
        if self.round_wait_s > self.rank_timeout_s / 2:
            raise ValueError(
                f"runtime.round_wait_s={self.round_wait_s} is refused: allowed is at most half "
                f"of runtime.rank_timeout_s={self.rank_timeout_s} (a rank holding its reply "
                "longer would count as absent)"
            )
        if self.round_settle_s > self.round_wait_s:
            raise ValueError(
                f"runtime.round_settle_s={self.round_settle_s} is refused: allowed is at most "
                f"runtime.round_wait_s={self.round_wait_s} (the reply's whole bound)"
            )
        return self

    def allowed_namespaces(self) -> frozenset[str] | None:
        """``None`` when any namespace is allowed."""
        return None if "*" in self.namespaces else frozenset(self.namespaces)


class StorageConfig(_Section):
    """L3: which backend, where, and how pages move to and from it."""

    section: ClassVar[str] = "storage"
    backend: Literal["none", "file", "segment", "redis", "dynamic"] = Field(
        "segment", description="one of none, file, segment, redis, dynamic"
    )
    path: Text = "kvfabric-l3"
    max_bytes: Annotated[int, _allowed("an integer >= 0 (0: no cap)", ge=0)] = 1 << 30
    fsync: bool = Field(False, description="true or false")
    file_mode: Mode = "0600"
    dir_mode: Mode = "0700"
    # Ranks read prefetched pages from a file or segment L3 themselves (the
    # storage actor says where they lie) instead of through the storage actor:
    # no page crosses Ray. Needs the path on every rank's node (shared storage);
    # a rank without it reads through the storage actor.
    direct_reads: bool = Field(True, description="true or false")
    # L3 keys are spread over this many storage actors by consistent hashing on
    # the page hash (``fabric.l3.shards``); each hashes, reads and writes its own
    # share. They all open the same backend (one shared store).
    actors: Annotated[int, _allowed("an integer 1..64", ge=1, le=64)] = 1
    dynamic_modules: tuple[Text, ...] = Field(
        (), strict=False, description="a list of modules the dynamic backend may import"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the backend's options, a mapping (see fabric.l3.options)",
    )
    transfer_batch_pages: PositiveInt = 64
    auth_key_file: str = Field(
        "",
        description="a file holding a secret of 16+ bytes (Ray's ~/.ray/auth_token will do): "
        "L3 pages are written with a keyed tag and only pages with a valid one are served; "
        "empty: no authentication",
    )

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    def allowed_modules(self) -> frozenset[str]:
        return frozenset(self.dynamic_modules)


def _tcp_port(address: str) -> str:
    """A ``tcp://`` address names a port in 1..65535 or ``*`` (ZMQ would bind a
    random port for 99999 and 65535 for -1)."""
    if address.startswith("tcp://"):
        port = address.rpartition(":")[2]
        if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"port {port!r} is not 1..65535 or *")
    return address


ZmqAddress = Annotated[
    str,
    _allowed(
        "a ZMQ address to bind (tcp://HOST:PORT with PORT 1..65535, tcp://HOST:* for any "
        "free port, ipc://PATH or inproc://NAME), or empty for none",
        pattern=r"^((tcp|ipc|inproc)://\S+)?$",
    ),
    AfterValidator(_tcp_port),
]


class EventsConfig(_Section):
    """KV events over ZMQ for a KV-aware router, in the layout vLLM and SGLang
    publish (docs/observing.md): a PUB socket at ``endpoint`` (none while empty) and
    a ROUTER at ``replay_endpoint`` answering replay requests from the last
    ``buffer_batches`` batches. Needs ``cache.kv_events``."""

    section: ClassVar[str] = "events"
    endpoint: ZmqAddress = ""
    replay_endpoint: ZmqAddress = ""
    topic: str = Field("", description="a str (the first frame of every message)")
    buffer_batches: PositiveInt = 10_000
    hwm: PositiveInt = 100_000
    max_queue_batches: PositiveInt = 10_000
    hash_format: Literal["uint64", "bytes"] = Field(
        "uint64",
        description="uint64 (the low 64 bits of each SHA-256 page hash) or bytes (all 32)",
    )
    data_parallel_rank: NonNegativeInt = 0
    dialect: Literal["vllm", "sglang"] = Field(
        "vllm",
        description="vllm (media GPU/CPU/STORAGE, replay replies [topic, seq, payload]) or "
        "sglang (media GPU/CPU_PINNED/DISK, replay replies [seq, payload])",
    )

    @model_validator(mode="after")
    def _replay_needs_pub(self) -> EventsConfig:
        if self.replay_endpoint and not self.endpoint:
            raise ValueError(
                f"events.replay_endpoint={self.replay_endpoint!r} needs events.endpoint (the PUB socket it replays)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


class FabricConfig(BaseModel):
    """The whole configuration. ``FabricConfig()`` runs on a laptop: TP=2, one
    pipeline stage, CPU pools, file L3 in ``./kvfabric-l3``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    cache: CacheConfig = Field(default_factory=CacheConfig)
    prefetch: PrefetchConfig = Field(default_factory=PrefetchConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(exc, "") from None

    @model_validator(mode="after")
    def _shapes_split(self) -> FabricConfig:
        topo, model, cache = self.topology, self.model, self.cache
        for key, value, divisor, what in (
            ("model.layers", model.layers, topo.pp, "topology.pp"),
            ("model.kv_heads", model.kv_heads, topo.tp, "topology.tp"),
            ("cache.page_size", cache.page_size, topo.cp, "topology.cp"),
        ):
            if value % divisor:
                raise ValueError(
                    f"{key}={value} is refused: allowed is a multiple of {what} ({divisor})"
                )
        hybrid = len(model.components) > 1
        if model.filler == "hybrid" and {"sliding", "mamba"} <= set(model.components):
            raise ValueError(
                "model.filler='hybrid' is refused for sliding and mamba layers together: "
                "allowed is full with sliding layers (Gemma 3) or full with mamba layers (Bamba)"
            )
        if (hybrid and model.filler == "llama") or (not hybrid and model.filler == "hybrid"):
            raise ValueError(
                f"model.filler={model.filler!r} is refused for model.layer_kinds="
                f"{list(model.layer_kinds)}: allowed is synthetic, or hybrid for a model "
                "with sliding or mamba layers, llama for full attention only"
            )
        if cache.mamba_checkpoint_tokens and "mamba" not in model.components:
            raise ValueError(
                f"cache.mamba_checkpoint_tokens={cache.mamba_checkpoint_tokens} is refused for a "
                "model without mamba layers (model.layer_kinds): allowed is 0"
            )
        if self.events.enabled and not cache.kv_events:
            raise ValueError(
                f"events.endpoint={self.events.endpoint!r} needs cache.kv_events=true "
                "(the cache makes no events while it is false)"
            )
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> FabricConfig:
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a mapping of sections, got {data!r}")
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(cls.model_fields))}"
            )
        for name, value in data.items():
            if not isinstance(value, Mapping):
                raise ConfigError(f"config section {name!r} must be a mapping, got {value!r}")
        return cls(**{name: dict(value) for name, value in data.items()})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def with_overrides(self, overrides: Iterable[str]) -> FabricConfig:
        """A copy with ``section.key=value`` overrides applied. Values of string keys
        are taken as written; others are parsed as YAML (``cache.page_size=64`` is
        an int, ``cache.kv_events=false`` a bool, ``runtime.namespaces=[a, b]`` a
        list; a bare ``a,b`` for a list key is split at commas)."""
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
            fields = type(getattr(self, section)).model_fields
            annotation = fields[key].annotation if key in fields else None
            if annotation is str:
                data[section][key] = raw  # strings are taken as written (JSON stays JSON)
                continue
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise ConfigError(
                    f"override {item!r}: value {raw!r} does not parse: {one_line(exc)}"
                ) from None
            if isinstance(data[section].get(key), tuple) and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, list) and isinstance(data[section].get(key), tuple):
                value = tuple(value)
            data[section][key] = value
        return FabricConfig.from_dict(data)

    def replace(self, **sections: Any) -> FabricConfig:
        """A copy with whole sections replaced (validated again)."""
        return FabricConfig.from_dict(
            {**self.to_dict(), **{k: _plain(v) for k, v in sections.items()}}
        )


def _plain(section: Any) -> Any:
    return section.model_dump() if isinstance(section, BaseModel) else section


_MODELS: dict[str, type[BaseModel]] = {
    cls.__name__: cls
    for cls in (
        CacheConfig,
        PrefetchConfig,
        ModelConfig,
        TopologyConfig,
        RuntimeConfig,
        StorageConfig,
        EventsConfig,
        FabricConfig,
    )
}


def one_line(exc: BaseException, limit: int = 200) -> str:
    """A parser's message on one line, at most ``limit`` characters (YAML's span
    several, with a caret drawing)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_structured_file(path: str | Path, what: str) -> Any:
    """The data in a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file; ``ConfigError``
    naming ``what`` is being read and the problem otherwise."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what}: {str(path)!r} is not UTF-8 text (byte {exc.start}); allowed: "
            ".json, .toml, .yaml or .yml text"
        ) from None
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            return yaml.safe_load(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what}: {str(path)!r} does not parse: {one_line(exc)}") from None
    raise ConfigError(
        f"{what}: {str(path)!r} has suffix {suffix!r}; allowed: .json, .toml, .yaml, .yml"
    )


def load_config(path: str | Path) -> FabricConfig:
    """Read a ``.json``, ``.toml``, ``.yaml`` or ``.yml`` file into a validated config."""
    return FabricConfig.from_dict(read_structured_file(path, "config file"))


def describe_keys(config: FabricConfig | None = None) -> list[dict[str, Any]]:
    """Every ``section.key`` with its value in ``config`` (the defaults when
    ``None``) and what is allowed: what ``kvfabric config`` lists."""
    config = config or FabricConfig()
    out = []
    for section in FabricConfig.model_fields:
        model = getattr(config, section)
        for key, info in type(model).model_fields.items():
            value = getattr(model, key)
            if isinstance(value, tuple):
                value = list(value)
            allowed = info.description or _allowed_from(info.annotation)
            out.append({"key": f"{section}.{key}", "value": value, "allowed": allowed})
    return out


def _allowed_from(annotation: Any) -> str:
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return "a str"
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    return str(annotation)
