"""The coordinator's way to its storage actors (``storage.actors`` of them, L3
keys spread by ``fabric.l3.shards``): every call the coordinator makes to L3
goes out to each actor from here, and the answers come back as one store's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any

import ray

from actors.calls import awaited, described
from fabric.config import FabricConfig
from fabric.l3.shards import merge_stats, union

Spec = tuple[str, dict[str, Any]] | None


def storage_names(config: FabricConfig) -> list[str]:
    """The storage actors' names: the first keeps the name a single one has."""
    base = f"{config.runtime.name}-storage"
    return [base] + [f"{base}-{i}" for i in range(1, config.storage.actors)]


class StorageGroup:
    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    @classmethod
    def named(cls, config: FabricConfig, names: Sequence[str]) -> StorageGroup:
        ns = config.runtime.ray_namespace
        return cls([ray.get_actor(name, namespace=ns) for name in names])

    def __len__(self) -> int:
        return len(self.handles)

    def query(self, queries: list) -> Awaitable[dict[int, Any]]:
        """The hit queries' answers (``HitAnswer`` per op id), asked now; await the
        result. With several actors, each leads its turn of the queries (hashes
        them, asks the owners of their pages, merges: ``StorageActor.lead``)."""
        if len(self.handles) == 1:
            return self.handles[0].query.remote(queries)
        n = len(self.handles)
        refs = [h.lead.remote(queries[i::n]) for i, h in enumerate(self.handles) if queries[i::n]]
        return self._joined(refs)

    async def _joined(self, refs: list) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for answers in await asyncio.gather(*refs):
            out.update(answers)
        return out

    async def spec(self) -> Spec:
        return await self.handles[0].spec.remote()

    async def attach(self, name: str, options: dict[str, Any]) -> str:
        outcomes = await asyncio.gather(*(h.attach.remote(name, options) for h in self.handles))
        return outcomes[0]

    async def detach(self) -> bool:
        return any(await asyncio.gather(*(h.detach.remote() for h in self.handles)))

    async def clear(self) -> bool:
        return all(await asyncio.gather(*(h.clear.remote() for h in self.handles)))

    async def ensure(self, spec: Spec, timeout_s: float) -> tuple[int, int]:
        """Make every actor hold ``spec``: how many had to restore it, and how many
        did not answer (a restarting actor asks for it itself)."""
        restored = failed = 0
        for outcome in await asyncio.gather(
            *(asyncio.wait_for(awaited(h.ensure.remote(spec)), timeout_s) for h in self.handles),
            return_exceptions=True,
        ):
            if isinstance(outcome, BaseException):
                failed += 1
            elif outcome == "restored":
                restored += 1
        return restored, failed

    async def take_removed(self, timeout_s: float) -> list[bytes]:
        """Pages that left L3 on their own, by any actor's account."""
        found = []
        for h in self.handles:
            with contextlib.suppress(Exception):
                found.append(await asyncio.wait_for(awaited(h.take_removed.remote()), timeout_s))
        return union(found)

    async def stats(self, timeout_s: float) -> dict[str, Any]:
        """L3's figures as one store's (``merge_stats``); an ``error`` when an actor
        does not answer."""
        got = await asyncio.gather(
            *(asyncio.wait_for(awaited(h.stats.remote()), timeout_s) for h in self.handles),
            return_exceptions=True,
        )
        bad = [g for g in got if isinstance(g, BaseException)]
        if bad:
            return {"error": type(bad[0]).__name__}
        return merge_stats(got)  # type: ignore[arg-type]

    async def describe(self) -> list[dict[str, Any]]:
        """Every storage actor's line in ``kvfabric status``."""
        return list(
            await asyncio.gather(
                *(
                    described("storage", n, h)
                    for n, h in zip(self.names(), self.handles, strict=True)
                )
            )
        )

    def names(self) -> list[str]:
        """How ``kvfabric status`` names each actor."""
        if len(self.handles) == 1:
            return ["storage"]
        return [f"storage-{i}" for i in range(len(self.handles))]
