"""The driver-facing API. Ray is imported inside the functions that need it, so
``import fabric`` never imports Ray.

    fabric = launch()                      # local Ray, TP=2, CPU pools
    result = fabric.submit(token_ids)      # where each prompt token came from
    fabric.release(result.lease)
    fabric.shutdown()

While Ray restarts the coordinator, calls raise ``ray.exceptions.ActorUnavailableError``
(a submit waiting on the coordinator's socket when it ended, ``CallLost``); the
restarted coordinator takes back the L2 pages every rank still holds, old
leases are gone, so a driver simply submits again.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fabric.cache.keys import pack_tokens
from fabric.call_sockets import CallLink, CallLost, SubmitCall, encode_call, open_link
from fabric.config import FabricConfig, RuntimeConfig
from fabric.coordinator.requests import Lease, RequestResult
from fabric.driver import cluster
from fabric.errors import FabricError
from fabric.round_sockets import ray_tls

log = logging.getLogger(__name__)

# After a client-side timeout, how long to wait for a result that raced the abort.
_ABANDON_WAIT_S = 5.0


def _job_id() -> str | None:
    """This driver's Ray job id: the coordinator reclaims its leases when it exits."""
    import ray

    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:
        return None


class Fabric:
    """A handle on a running fabric (its coordinator actor)."""

    def __init__(
        self, coordinator: Any, config: FabricConfig, deployment: Any = None, owns_ray: bool = False
    ):
        self.coordinator = coordinator
        self.config = config
        self._deployment = deployment
        self._owns_ray = owns_ray
        self._recorded = ""
        # Submits over the coordinator's socket (fabric.call_sockets): a link once
        # made; False: Ray calls for good (configured, Ray Client, Ray's traffic
        # encrypted, unreachable).
        rt = config.runtime
        self._calls: CallLink | bool | None = (
            None
            if rt.submit_transport == "zmq" and not (_through_ray_client() or ray_tls())
            else False
        )
        self._calls_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """A handle sent to another process (a Ray task, a Serve replica) links to
        the coordinator's socket anew there: a socket and a lock do not travel."""
        state = self.__dict__.copy()
        state["_calls"] = None if state["_calls"] is not False else False
        del state["_calls_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._calls_lock = threading.Lock()

    @property
    def cluster_address(self) -> str:
        """The GCS address (HOST:PORT) of the Ray cluster this fabric runs on."""
        return cluster.gcs_address() or self.config.runtime.address or "?"

    def _record(self) -> None:
        """Leave a note (machine-local) that this fabric runs on this cluster, so
        ``--address auto`` finds it among several local clusters."""
        address = cluster.gcs_address()
        rt = self.config.runtime
        if address and cluster.record_fabric(rt.name, rt.ray_namespace, address):
            self._recorded = address

    def _call(self, method: Any, *args: Any, timeout: float | None = None) -> Any:
        return self.result(method.remote(*args), timeout=timeout)

    def submit(
        self,
        tokens: Sequence[int] | bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
        session: str | None = None,
        release: Lease | Sequence[Lease] = (),
    ) -> RequestResult:
        """Serve one prompt: returns where its tokens came from and a lease on its
        L1 pages (release it when done; it expires after ``runtime.lease_ttl_s``
        unless renewed). With ``session``, that session keeps its whole pages for
        the next turn when the lease ends. ``release``: a lease (or several) of
        earlier results to let go first, in the same call — cheaper than a
        ``release`` call each. Bad input raises ``InvalidInput`` (nothing released
        then). Past ``timeout`` the request is aborted and ``TimeoutError`` raised;
        nothing stays held."""
        request_id = request_id or uuid.uuid4().hex  # to abort it by, if it times out
        call = SubmitCall(
            [self._pack(tokens)], namespace, priority, [request_id], _job_id(), session,
            self._leases(release),
        )  # fmt: skip
        over = self._over_socket(call)
        if over is not None:
            return self._submit_over(*over, timeout)[0]
        ref = self.submit_async(call.prompts[0], namespace, priority, request_id, session, release)
        try:
            return self.result(ref, timeout=timeout)
        except TimeoutError:
            self._abandon(ref, request_id)
            raise TimeoutError(
                f"request {request_id} did not finish within {timeout} s; it was aborted"
            ) from None

    def _abandon(self, ref: Any, request_id: str) -> None:
        """Abort a request this driver stopped waiting for; if it finished meanwhile,
        release the lease it got."""
        import ray

        with contextlib.suppress(Exception):
            self.abort(request_id)
        with contextlib.suppress(Exception):
            late = ray.get(ref, timeout=_ABANDON_WAIT_S)
            if late.lease is not None:
                self.release(late.lease)

    def submit_async(
        self,
        tokens: Sequence[int] | bytes,
        namespace: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        session: str | None = None,
        release: Lease | Sequence[Lease] = (),
    ) -> Any:
        """Like ``submit`` but returns a Ray object ref; ``result(ref)`` waits for it.
        Without a ``request_id`` one is made up at random."""
        return self.coordinator.submit.remote(
            self._pack(tokens),
            namespace,
            priority,
            request_id or uuid.uuid4().hex,
            _job_id(),
            session,
            self._leases(release),
        )

    def submit_many(
        self,
        prompts: Sequence[Sequence[int] | bytes],
        namespace: str = "default",
        priority: int = 0,
        timeout: float | None = None,
        session: str | None = None,
        release: Lease | Sequence[Lease] = (),
    ) -> list[RequestResult]:
        """Serve several prompts in one call (after letting ``release`` go): one
        result per prompt, in order, each with its own lease. All or nothing on bad
        input (``InvalidInput``). Past ``timeout`` every one of them is aborted and
        ``TimeoutError`` raised; nothing stays held."""
        ids = [uuid.uuid4().hex for _ in prompts]
        call = SubmitCall(
            [self._pack(p) for p in prompts], namespace, priority, list(ids), _job_id(),
            session, self._leases(release),
        )  # fmt: skip
        over = self._over_socket(call)
        if over is not None:
            return self._submit_over(*over, timeout)
        ref = self.coordinator.submit_many.remote(
            call.prompts,
            namespace,
            priority,
            ids,
            _job_id(),
            session,
            self._leases(release),
        )
        try:
            return self.result(ref, timeout=timeout)
        except TimeoutError:
            self._abandon_many(ref, ids)
            raise TimeoutError(
                f"{len(ids)} requests did not finish within {timeout} s; they were aborted"
            ) from None

    def _link(self) -> CallLink | None:
        """The link to the coordinator's call socket, made on first use; ``None``:
        this call goes over Ray (``runtime.submit_transport=ray``, Ray Client, a
        socket that does not answer from here, or a coordinator restarting)."""
        with self._calls_lock:
            if isinstance(self._calls, CallLink) and not self._calls.check():
                self._calls.close()
                self._calls = None  # the coordinator restarted: ask it again
            if self._calls is None:
                made = open_link(
                    lambda: self.result(self.coordinator.call_endpoint.remote(), timeout=30),
                    self.config.runtime.max_message_bytes,
                    self._release_late,
                )
                if made is not True:
                    self._calls = made
            return self._calls if isinstance(self._calls, CallLink) else None

    def _over_socket(self, call: SubmitCall) -> tuple[CallLink, SubmitCall, bytes] | None:
        """The link and the call's bytes when ``call`` goes over the socket (not one
        whose arguments are not of their types, nor one past the message bound)."""
        link = self._link()
        if link is None:
            return None
        data = encode_call(call)
        if data is None or len(data) > self.config.runtime.max_message_bytes:
            return None  # as a Ray call: the coordinator names what is wrong with it
        return link, call, data

    def _submit_over(
        self, link: CallLink, call: SubmitCall, data: bytes, timeout: float | None
    ) -> list[RequestResult]:
        """``call`` (``data``, encoded) over the socket; past ``timeout`` its requests
        are aborted and the leases of any that finished meanwhile released."""
        seq = link.send(data)
        try:
            results = link.receive(seq, timeout)
        except TimeoutError:
            for rid in call.request_ids:
                with contextlib.suppress(Exception):
                    self.abort(rid)  # type: ignore[arg-type]
            with contextlib.suppress(Exception):
                self._release_late(link.receive(seq, _ABANDON_WAIT_S) or [])
            raise TimeoutError(
                f"{len(call.prompts)} request(s) did not finish within {timeout} s; "
                "they were aborted"
            ) from None
        except CallLost as exc:
            raise CallLost(f"{exc}: the coordinator is restarting; submit again") from None
        assert results is not None
        return results

    def _release_late(self, results: Sequence[RequestResult]) -> None:
        """Let go the leases of results no caller waits for any more."""
        for late in results:
            if late.lease is not None:
                with contextlib.suppress(Exception):
                    self.release(late.lease)

    @staticmethod
    def _leases(release: Lease | Sequence[Lease] | None) -> list[Lease]:
        if release is None:
            return []
        return [release] if isinstance(release, Lease) else list(release)

    def _abandon_many(self, ref: Any, request_ids: Sequence[str]) -> None:
        """Abort requests this driver stopped waiting for; release the leases of
        those that finished meanwhile."""
        import ray

        for rid in request_ids:
            with contextlib.suppress(Exception):
                self.abort(rid)
        with contextlib.suppress(Exception):
            for late in ray.get(ref, timeout=_ABANDON_WAIT_S):
                if late.lease is not None:
                    self.release(late.lease)

    def result(self, ref: Any, timeout: float | None = None) -> Any:
        """Wait for a call's result; a ``FabricError`` raised in the actor is re-raised
        here, and Ray's timeout as ``TimeoutError``."""
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, FabricError):
                raise exc.cause from None
            raise
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(str(exc)) from None

    def wait(
        self, refs: Sequence[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any]]:
        """``(ready, pending)`` once at least one of ``refs`` is ready (or ``timeout``)."""
        import ray

        return ray.wait(list(refs), num_returns=1, timeout=timeout)

    @staticmethod
    def _pack(tokens: Sequence[int] | bytes) -> bytes:
        return tokens if isinstance(tokens, bytes) else pack_tokens(tokens)

    def append(
        self, lease: Lease, tokens: Sequence[int] | bytes, timeout: float | None = None
    ) -> RequestResult:
        """Decode: have the ranks compute the KV of ``tokens`` generated after the
        request of ``lease``. The lease is consumed; the result (same request id)
        holds a new one on every token so far. A page the tokens fill joins the
        cache, so the next turn hits through the answer."""
        ref = self.coordinator.append.remote(lease, self._pack(tokens), _job_id())
        try:
            return self.result(ref, timeout=timeout)
        except TimeoutError:
            self._abandon(ref, lease.request_id)
            raise TimeoutError(
                f"decode of {lease.request_id} did not finish within {timeout} s; it was aborted"
            ) from None

    def release(self, lease: Lease, session: str | None = None) -> bool:
        """Let a result's L1 pages be evicted again — or, with ``session``, have that
        session keep its whole pages warm for the next turn (``cache.session_*``:
        tier, budget, TTL). Takes the ``Lease`` itself (a request id is refused);
        ``False`` if it already expired or was reset."""
        return self._call(self.coordinator.release, lease, session)

    def end_session(self, session: str) -> bool:
        """Drop what ``session`` keeps between turns; ``False`` if it kept nothing."""
        return self._call(self.coordinator.end_session, session)

    def pin(self, tokens: Sequence[int] | bytes, ttl_s: float, namespace: str = "default"):
        """Keep the cached prefix of ``tokens`` in L2 for ``ttl_s`` seconds (within
        ``cache.pin_budget_fraction`` of L2); the ``PinResult`` says how much was
        pinned and why not more."""
        return self._call(self.coordinator.pin, self._pack(tokens), namespace, ttl_s)

    def unpin(self, tokens: Sequence[int] | bytes, namespace: str = "default") -> int:
        """Unpin the cached prefix of ``tokens``; returns the tokens unpinned."""
        return self._call(self.coordinator.unpin, self._pack(tokens), namespace)

    def renew(self, lease: Lease) -> bool:
        """Keep a lease for another ``runtime.lease_ttl_s``; ``False`` if it is gone."""
        return self._call(self.coordinator.renew, lease)

    def abort(self, request_id: str) -> bool:
        return self._call(self.coordinator.abort, request_id)

    def verify(self, result: RequestResult, tokens: Sequence[int] | bytes) -> list[bool | None]:
        """Per rank: do the leased L1 pages hold exactly the KV a fresh computation
        of ``tokens`` gives? (The synthetic producer only.) ``None`` from a rank
        that restarted since the lease was granted (the lease is ending)."""
        if result.lease is None:
            raise FabricError(f"{result.request_id} has no lease ({result.error})")
        return self._call(self.coordinator.verify, result.lease, self._pack(tokens))

    def read_kv(self, lease: Lease) -> list:
        """Every rank's shard of the KV a held lease covers, as ``(Shard, tensor)``
        pairs; ``fabric.rank.model.assemble`` joins them into one tensor and
        ``to_cache`` makes a ``transformers`` cache of it."""
        return self._call(self.coordinator.read_kv, lease)

    def read_parts(self, lease: Lease) -> list:
        """For a hybrid model: every rank's shard of the other components a held
        lease covers, as ``(Shard, sliding KV, mamba states)`` triples;
        ``fabric.rank.hybrid.served_states`` joins them with ``read_kv``'s."""
        return self._call(self.coordinator.read_parts, lease)

    def computed_tokens_by_rank(self) -> dict[str, int]:
        """Tokens each rank has run through its share of the model (or made, with
        the synthetic producer) since it started, by rank (``pp0-cp0-tp1``)."""
        return self._call(self.coordinator.computed_tokens_by_rank)

    @property
    def dashboard_url(self) -> str | None:
        """The Ray dashboard's URL, or ``None`` when the cluster runs none."""
        return _dashboard_url()

    def dashboard_hint(self) -> str:
        """Where the dashboard is and how to sign in to it, in one line."""
        url = self.dashboard_url
        if url is None and _through_ray_client():
            return "Ray dashboard: on the cluster's head node (port 8265 unless changed; Ray Client does not say)"
        if url is None:
            return "Ray dashboard: off (runtime.dashboard=false, or the cluster runs none)"
        if not _token_auth():
            return f"Ray dashboard: {url}"
        return (
            f"Ray dashboard: {url} - sign in with the cluster's token: `ray get-auth-token` "
            "prints it (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )

    def status(self) -> dict:
        """Actors (alive, live figures), epoch, per-tier usage, transfers in flight,
        L3 usage: what ``kvfabric status`` prints."""
        return self._call(self.coordinator.status)

    def stats(self) -> dict:
        return self._call(self.coordinator.stats)

    def attach_storage(self, backend: str, options: dict[str, Any] | str | None = None) -> str:
        """Attach an L3 backend (``file``, ``redis``, ``dynamic``) at runtime with its
        options (``fabric.l3.options``): a mapping, or JSON / ``@file`` text."""
        return self._call(self.coordinator.attach_storage, backend, options)

    def detach_storage(self, timeout_s: float = 30.0) -> bool:
        return self._call(self.coordinator.detach_storage, timeout_s)

    def storage_usage(self) -> list[dict[str, Any]]:
        """L3 pages per model tag, with the tag's model, layout, dtype, shard shape,
        component and the engines that wrote pages of it (``kvfabric``, ``sglang``,
        ``vllm``, ``hf``; ``unknown`` where no record says): what ``kvfabric storage
        usage`` prints. ``[]`` with no L3 attached or one that cannot list its keys."""
        import ray

        storage = ray.get_actor(
            f"{self.config.runtime.name}-storage", namespace=self.config.runtime.ray_namespace
        )
        return self._call(storage.usage_by_writer)

    def clear_storage(self) -> bool:
        """Delete every page in L3."""
        return self._call(self.coordinator.clear_storage)

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Wait until the fabric has nothing in flight (backups to L3 included)."""
        return self._call(self.coordinator.settle, timeout_s)

    def take_events(self, limit: int = 10_000, namespace: str | None = None) -> list:
        """Drain KV events (``fabric.cache.events``): which page hashes are stored where;
        only ``namespace``'s when given."""
        return self._call(self.coordinator.take_events, limit, namespace)

    def check_integrity(self) -> None:
        self._call(self.coordinator.check_integrity)

    def shutdown(self) -> None:
        """Stop the actors this handle launched (and Ray, if it started it)."""
        import ray

        with self._calls_lock:
            if isinstance(self._calls, CallLink):
                self._calls.close()
            self._calls = False
        if self._deployment is not None:
            with contextlib.suppress(Exception):
                ray.get(self.coordinator.stop.remote(), timeout=10)
            self._deployment.kill()
            self._deployment = None
        if self._recorded:
            rt = self.config.runtime
            cluster.forget_fabric(rt.name, rt.ray_namespace, self._recorded)
            self._recorded = ""
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _dashboard_url() -> str | None:
    import ray

    if not ray.is_initialized():
        return None
    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:
        return None
    return f"http://{url}" if url else None


def _through_ray_client() -> bool:
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())
    except Exception:
        return False


def _token_auth() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return bool(is_token_auth_enabled())
    except Exception:  # a Ray without token authentication
        return False


def launch(
    config: FabricConfig | None = None, address: str | None = None, announce: bool = True
) -> Fabric:
    """Start a fabric: connect to Ray at ``address`` (or ``runtime.address``; see
    ``fabric.driver.cluster.resolve`` for empty, ``auto`` and ``local``), or start a
    private local Ray; then create its actors. A fabric of the same name already
    on that cluster is refused in one line. With ``announce``, print which
    cluster it is, where the Ray dashboard is and how to sign in (stderr)."""
    import ray

    from actors.factory import deploy

    config = config or FabricConfig()
    # Actors run in other working directories: pin a relative L3 path to this one.
    path = str(Path(config.storage.path).expanduser().resolve())
    config = config.replace(storage={**config.storage.model_dump(), "path": path})
    runtime = config.runtime
    owns, reason = False, "this process's Ray"
    if not ray.is_initialized():
        owns, reason = _start_ray(runtime, address)
    try:
        deployment = deploy(config)
    except FabricError:
        if owns:
            ray.shutdown()  # the local Ray this call started goes with it
        raise
    fabric = Fabric(deployment.coordinator, config, deployment, owns_ray=owns)
    fabric._record()
    if announce:
        print(
            f"kvfabric: fabric {runtime.name!r} on the Ray cluster at {fabric.cluster_address} "
            f"({reason})\nkvfabric: {fabric.dashboard_hint()}",
            file=sys.stderr,
            flush=True,
        )
    return fabric


def _start_ray(runtime: RuntimeConfig, address: str | None) -> tuple[bool, str]:
    """Connect to the Ray ``launch`` is to use, or start a private local one: whether
    this process started it (then it shuts it down with the fabric), and why
    that Ray (``fabric.driver.cluster.resolve``)."""
    from actors.factory import HEAD_RESOURCE

    target = cluster.resolve(
        address if address is not None else runtime.address,
        runtime.name,
        runtime.ray_namespace,
        "--address / runtime.address",
    )
    local = {
        # A private Ray is its own head node (a cluster's comes from cluster.yaml).
        "resources": {HEAD_RESOURCE: 1000},
        "include_dashboard": runtime.dashboard,
        "dashboard_host": runtime.dashboard_host,
        # Another local Ray (a second kvfabric run) may hold the port: take a free one.
        "dashboard_port": cluster.free_port(runtime.dashboard_host, runtime.dashboard_port),
    }
    cluster.init_ray(
        target.address if target.address is not None else "local",
        runtime.ray_namespace,
        runtime.log_to_driver,
        f"--address / runtime.address ({target.reason})",
        **({} if target.address else local),
    )
    return target.address is None, target.reason


def connect(
    name: str = "kvfabric", address: str = "auto", ray_namespace: str = "kvfabric"
) -> Fabric:
    """Attach to a running fabric by its ``runtime.name`` (from another driver);
    the handle's ``config`` is the running fabric's own. ``address`` as
    ``fabric.driver.cluster.resolve`` reads it (``auto``: the local cluster that runs
    ``name``)."""
    import ray

    if not ray.is_initialized():
        target = cluster.resolve(address or "auto", name, ray_namespace, "--address")
        if target.address is None:
            raise FabricError(
                f"--address={address!r} names no running cluster: a fabric is reached on "
                "the cluster it was launched on (HOST:PORT, auto or ray://...)"
            )
        cluster.init_ray(target.address, ray_namespace, False, f"--address={target.address!r}")
    where = cluster.gcs_address() or address
    try:
        coordinator = ray.get_actor(f"{name}-coordinator", namespace=ray_namespace)
    except ValueError:
        raise FabricError(
            f"no fabric named {name!r} in Ray namespace {ray_namespace!r} on the cluster "
            f"at {where}: check --name (runtime.name), --ray-namespace "
            "(runtime.ray_namespace) and --address"
        ) from None
    config = FabricConfig.from_dict(ray.get(coordinator.running_config.remote(), timeout=60))
    return Fabric(coordinator, config)
