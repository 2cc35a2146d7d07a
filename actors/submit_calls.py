"""The coordinator's socket for drivers' submits and engines' calls
(``runtime.submit_transport``, ``fabric.call_sockets``): made on the first
asking, served in the actor's event loop, answered by the actor's own
``submit_many`` and ``engine_*`` calls."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import ray

from fabric.call_sockets import (
    Call,
    CallServer,
    EngineDropCall,
    EngineForgetCall,
    EngineHoldCall,
    EngineLookupCall,
    EngineReportCall,
)
from fabric.config import FabricConfig
from fabric.coordinator.requests import RequestResult
from fabric.errors import FabricError
from fabric.round_sockets import ray_tls


class SubmitCalls:
    """Mixed into ``CoordinatorActor``: ``config`` is its configuration,
    ``submit_many`` and the ``engine_*`` calls the calls it serves."""

    config: FabricConfig
    submit_many: Callable[..., Awaitable[list[RequestResult]]]
    engine_lookup: Callable[..., Awaitable[list[int]]]
    engine_report: Callable[..., Awaitable[Any]]
    engine_forget: Callable[..., Awaitable[int]]
    engine_hold: Callable[..., Awaitable[str | None]]
    engine_drop: Callable[..., Awaitable[int]]
    _call_server: CallServer | None = None

    async def call_endpoint(self) -> tuple[str, bytes]:
        """Where drivers send their submits, and the secret each must carry
        (``runtime.submit_transport = "zmq"``)."""
        if self.config.runtime.submit_transport != "zmq" or ray_tls():
            raise FabricError(
                "this fabric takes submits as Ray calls (runtime.submit_transport=ray, or "
                "Ray's traffic encrypted: RAY_USE_TLS)"
            )
        if self._call_server is None:
            host = ray.util.get_node_ip_address()
            max_bytes = self.config.runtime.max_message_bytes
            self._call_server = CallServer(self._serve_call, host, max_bytes)
        return self._call_server.endpoint, self._call_server.secret

    async def _serve_call(self, call: Call) -> Any:
        if isinstance(call, EngineLookupCall):
            c = call
            return await self.engine_lookup(
                c.engine_tag,
                c.world,
                c.chains,
                c.leases,
                c.lease_s,
                c.release,
                c.place,
                c.needs,
            )
        if isinstance(call, EngineReportCall):
            return await self.engine_report(
                call.engine_tag, call.world, call.reports, call.place, call.place_bytes,
                call.names,
            )  # fmt: skip
        if isinstance(call, EngineForgetCall):
            return await self.engine_forget(call.engine_tag, call.world, call.hashes)
        if isinstance(call, EngineDropCall):
            c2 = call
            return await self.engine_drop(
                c2.engine_tag, c2.world, c2.place, c2.hashes, c2.everything
            )
        if isinstance(call, EngineHoldCall):
            c = call
            return await self.engine_hold(c.engine_tag, c.world, c.chain, c.name, c.kind, c.ttl_s)
        return await self.submit_many(
            call.prompts,
            call.namespace,
            call.priority,
            call.request_ids,
            call.owner,
            call.session,
            call.release,
        )

    def _close_calls(self) -> None:
        if self._call_server is not None:
            self._call_server.close()
            self._call_server = None
