"""Each L3 backend's options, typed (pydantic): unknown keys and values of the wrong
type or range are refused with a ``ConfigError`` naming ``storage.options.<key>``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fabric.errors import ConfigError

# L3 files and directories: the owner's, at most readable by the group (a shared
# store for one group of users); never writable by the group, nothing for others.
Mode = Annotated[
    str,
    Field(
        pattern=r"^0?[0-7][0145]0$",
        description="an octal mode such as 0600 or 0640: no write bit for the group, no bit for others",
    ),
]


class BackendOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @classmethod
    def parse(cls, options: Any, backend: str) -> Any:
        """``options`` validated, or ``ConfigError`` naming the key, value and rule."""
        try:
            return cls.model_validate(dict(options or {}))
        except (TypeError, ValueError) as exc:
            if not isinstance(exc, ValidationError):
                raise ConfigError(
                    f"storage.options for {backend!r} must be a mapping, got {options!r}"
                ) from None
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                raise ConfigError(
                    f"storage.options key {key!r} is unknown for backend {backend!r}; "
                    f"known: {sorted(cls.model_fields)}"
                ) from None
            field = cls.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            if field is None and err["loc"]:  # an alias ("class")
                field = next(
                    (f for f in cls.model_fields.values() if f.alias == err["loc"][0]), None
                )
            allowed = (field.description if field else None) or err["msg"]
            if err["type"] == "missing":
                raise ConfigError(
                    f"storage.options.{key} is missing for backend {backend!r}: give {allowed}"
                ) from None
            raise ConfigError(
                f"storage.options.{key}={err.get('input')!r} for backend {backend!r} is refused: "
                f"allowed is {allowed}"
            ) from None


class FileOptions(BackendOptions):
    path: str = Field("kvfabric-l3", min_length=1, description="a directory path")
    max_bytes: int = Field(1 << 30, ge=0, description="an integer >= 0 (0: no cap)")
    fsync: bool = Field(False, description="true or false")
    file_mode: Mode = "0600"
    dir_mode: Mode = "0700"


class SegmentOptions(FileOptions):
    segment_bytes: int = Field(
        64 << 20, ge=1 << 20, description="an integer >= 1048576 (bytes per segment file)"
    )


class RedisOptions(BackendOptions):
    host: str = Field("127.0.0.1", min_length=1, description="a host name or address")
    port: int = Field(6379, ge=1, lt=65536, description="a TCP port")
    db: int = Field(0, ge=0, description="an integer >= 0")
    username: str | None = Field(None, description="a user name, or none")
    password: str | None = Field(None, description="a password, or none")
    prefix: str = Field(
        "kvfabric:",
        pattern=r"^[A-Za-z0-9_:.\-]{1,64}$",
        description="1-64 letters, digits or _:.-",
    )
    timeout_s: float = Field(5.0, gt=0, description="a number > 0")
    ssl: bool = Field(False, description="true or false")
    ssl_ca_certs: str | None = Field(None, description="a CA bundle path, or none")
    ssl_certfile: str | None = Field(None, description="a client certificate path, or none")
    ssl_keyfile: str | None = Field(None, description="a client key path, or none")
    ssl_cert_reqs: Literal["required", "optional", "none"] = Field(
        "required", description="required, optional or none"
    )


class DynamicOptions(BackendOptions):
    module: str = Field(min_length=1, description="a module listed in storage.dynamic_modules")
    class_name: str = Field(
        alias="class", min_length=1, description="the name of an L3Backend subclass"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="a mapping handed to the class"
    )
