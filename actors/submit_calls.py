"""The coordinator's socket for drivers' submits (``runtime.submit_transport``,
``fabric.call_sockets``): made on the first driver's asking, served in the actor's
event loop, answered by the actor's own ``submit_many``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import ray

from fabric.call_sockets import CallServer, SubmitCall
from fabric.config import FabricConfig
from fabric.coordinator.requests import RequestResult
from fabric.errors import FabricError
from fabric.round_sockets import ray_tls


class SubmitCalls:
    """Mixed into ``CoordinatorActor``: ``config`` is its configuration and
    ``submit_many`` its call."""

    config: FabricConfig
    submit_many: Callable[..., Awaitable[list[RequestResult]]]
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
            self._call_server = CallServer(self._submit_call, host, max_bytes)
        return self._call_server.endpoint, self._call_server.secret

    async def _submit_call(self, call: SubmitCall) -> list[RequestResult]:
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
