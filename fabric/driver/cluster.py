"""Which Ray cluster a command talks to, decided once and said aloud.

Ray's own ``address=None`` joins the cluster a ``ray start`` left behind (and
then refuses a local Ray's arguments), and its ``auto`` picks any one of the
local clusters when there are several, a different one from call to call. A
kvfabric command resolves the address itself, in this order:

- an explicit ``HOST:PORT`` or ``ray://...``: that cluster;
- ``local``: a new private Ray for this process;
- empty (``launch()``'s default): ``RAY_ADDRESS``, else the cluster that
  ``ray start`` started on this machine if it is alive, else a private Ray;
- ``auto``: ``RAY_ADDRESS``, else the one local cluster running the named
  fabric (launch() leaves a record of where each fabric runs), else the one
  ``ray start`` cluster, else the only local cluster; several candidates and no
  way to tell them apart is a one-line refusal listing them.

Ray is imported inside the functions: ``fabric`` stays importable without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric.errors import FabricError

LOCAL = "local"


@dataclass(frozen=True)
class Target:
    """Where to connect: ``address`` for ``ray.init`` (``None``: start a private
    Ray) and why, for the one line a command prints."""

    address: str | None
    reason: str


def _live_local_clusters() -> list[str]:
    """GCS addresses of the Ray clusters running on this machine (sorted)."""
    from ray._private import services

    return sorted(set(services.find_gcs_addresses()))


def _ray_start_cluster() -> str | None:
    """The cluster ``ray start`` last started here, if its GCS still runs."""
    from ray._private import services

    address = services.find_bootstrap_address(None)
    if not address:
        return None
    return address if _accepts(address) else None


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=2).close()
    except (OSError, ValueError):
        return False
    return True


def records_dir() -> Path:
    return Path(tempfile.gettempdir()) / "kvfabric" / "fabrics"


def _record_path(name: str, namespace: str) -> Path:
    return records_dir() / f"{namespace}.{name}.json"


def record_fabric(name: str, namespace: str, address: str) -> Path | None:
    """Note that fabric ``name`` runs on the cluster at ``address`` (machine-local;
    what ``auto`` uses to tell local clusters apart)."""
    path = _record_path(name, namespace)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"name": name, "namespace": namespace, "address": address}))
        tmp.replace(path)
    except OSError:
        return None  # a read-only /tmp costs only the disambiguation
    return path


def forget_fabric(name: str, namespace: str, address: str) -> None:
    path = _record_path(name, namespace)
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("address") == address:
            path.unlink()


def _recorded(name: str, namespace: str) -> str | None:
    try:
        return json.loads(_record_path(name, namespace).read_text()).get("address")
    except (OSError, ValueError):
        return None


def resolve(
    address: str | None, name: str = "kvfabric", namespace: str = "kvfabric", setting: str = ""
) -> Target:
    """Decide which cluster to use (see the module docstring)."""
    setting = setting or "--address"
    address = (address or "").strip()
    if address == LOCAL:
        return Target(None, "a new local Ray (--address local)")
    if address and address != "auto":
        _check_reachable(address, setting)
        return Target(address, f"{setting}={address}")
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        if env == LOCAL:
            return Target(None, "a new local Ray (RAY_ADDRESS=local)")
        if env != "auto":
            _check_reachable(env, "RAY_ADDRESS")
            return Target(env, "RAY_ADDRESS")
    started = _ray_start_cluster()
    if not address:  # launch(): a cluster `ray start` left running, else our own Ray
        if started:
            return Target(started, "the cluster `ray start` started on this machine")
        return Target(None, "a new local Ray")
    live = _live_local_clusters()
    recorded = _recorded(name, namespace)
    if recorded and recorded in live:
        return Target(recorded, f"where fabric {name!r} was launched")
    if started:
        return Target(started, "the cluster `ray start` started on this machine")
    if len(live) == 1:
        return Target(live[0], "the only Ray cluster on this machine")
    if not live:
        raise FabricError(
            f"no Ray cluster runs on this machine for {setting}=auto: start the fabric first "
            "(kvfabric run --keep) or pass the cluster's address (HOST:PORT or ray://...)"
        )
    raise FabricError(
        f"{len(live)} Ray clusters run on this machine ({', '.join(live)}) and none is known "
        f"to run fabric {name!r}: pass {setting} with one of them"
    )


def _check_reachable(address: str, setting: str) -> None:
    """Fail at once, in one line, when ``address`` (host:port of a Ray head) does
    not accept connections: Ray itself would retry for minutes."""
    if "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise FabricError(
            f"{setting}={address!r} is refused: allowed is HOST:PORT, auto, local or ray://..."
        )
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=3).close()
    except OSError as exc:
        raise FabricError(
            f"no Ray cluster at {setting}={address!r} ({exc.strerror or exc}): start one "
            "(ray start --head) or fix the address"
        ) from None


def free_port(host: str, preferred: int) -> int:
    """``preferred`` when nothing listens there, else any free port on ``host``."""
    with socket.socket() as s:
        try:
            s.bind((host, preferred))
            return preferred
        except OSError:
            pass
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_log_level() -> int:
    """Ray's own log lines only when kvfabric logs at debug."""
    return (
        logging.INFO if logging.getLogger("kvfabric").isEnabledFor(logging.DEBUG) else logging.ERROR
    )


def quiet_ray() -> None:
    """Before ``ray.init``: keep Ray's connection chatter (INFO and WARNING lines)
    off stderr unless kvfabric logs at debug."""
    level = ray_log_level()
    for logger in ("ray", "ray._private", "ray._private.worker"):
        logging.getLogger(logger).setLevel(level)


def use_token_if_any() -> None:
    """Before connecting to an existing cluster: use this machine's Ray token when
    there is one and ``RAY_AUTH_MODE`` is unset. Ray does so itself only for a
    cluster it finds on its own; a cluster started by ``ray start`` (Ray 2.60
    turns token authentication on there) would otherwise refuse an explicit
    address, and a token costs nothing against a cluster without authentication."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    level = logging.getLogger("ray").level
    logging.getLogger("ray").setLevel(ray_log_level())
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        logging.getLogger("ray").setLevel(level)


def init_ray(address: str, namespace: str, log_to_driver: bool, what: str, **local: Any) -> None:
    """``ray.init`` with Ray's own lines kept quiet and this machine's token used;
    a failure to connect is one line naming ``what`` was asked for."""
    import ray

    quiet_ray()
    if address != LOCAL:
        use_token_if_any()
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=log_to_driver,
            logging_level=ray_log_level(),
            **local,
        )
    except ConnectionError as exc:
        raise FabricError(
            f"no Ray cluster at {what} ({exc.__class__.__name__}): start one "
            "(ray start --head) or pass another address"
        ) from None
    except ray.exceptions.AuthenticationError:
        raise FabricError(
            f"the Ray cluster at {what} refused this process's token: use the cluster's "
            "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        ) from None


def gcs_address() -> str:
    """The GCS address of the cluster this process is connected to."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # Ray Client: the context has no GCS address
        return ""
