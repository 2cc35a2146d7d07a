"""The small Ray calls the coordinator's parts share: an actor call's reference
as an awaitable (for ``asyncio.wait_for`` and ``gather``), an actor's one-line
description for ``kvfabric status``, and the drivers that have exited."""

from __future__ import annotations

import asyncio
from typing import Any


async def awaited(ref: Any) -> Any:
    """An ``ObjectRef`` as a coroutine (``asyncio.wait_for`` wants one)."""
    return await ref


async def described(role: str, name: str, actor: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """``actor``'s line in ``kvfabric status``: its ``describe()``, or why it gave none
    within ``timeout_s`` (then it counts as not alive)."""
    try:
        text = await asyncio.wait_for(awaited(actor.describe.remote()), timeout_s)
        return {"role": role, "name": name, "alive": True, "describe": text}
    except Exception as exc:
        return {"role": role, "name": name, "alive": False, "describe": type(exc).__name__}


def dead_jobs() -> set[str]:
    """Ray job ids of drivers that have exited (empty if Ray cannot say)."""
    try:
        from ray._private.state import jobs
    except ImportError:  # pragma: no cover - a Ray without the private state API
        return set()
    return {job["JobID"] for job in jobs() if job.get("IsDead")}
