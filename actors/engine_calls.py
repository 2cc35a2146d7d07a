"""The coordinator's calls for engines attached through a connector
(``fabric.engines.vllm_connector``): one lookup and one report per engine step,
answered from ``CoordinatorCore.engine_pages``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


class EngineCalls:
    """Mixed into ``CoordinatorActor``: ``core`` is its ``CoordinatorCore``,
    ``_wake`` starts its next step."""

    core: Any

    def _wake(self) -> None:
        raise NotImplementedError

    async def engine_lookup(
        self,
        tag: str,
        world: int,
        chains: list[list[bytes]],
        leases: list[str] | None = None,
        lease_s: float = 0.0,
        release: list[str] | None = None,
    ) -> list[int]:
        """One engine step's lookups: per chain, the leading pages every rank
        stored, leased under ``leases`` (one name a chain) for ``lease_s``; the
        leases ``release`` names end first."""
        return self.core.engine_lookup(tag, world, chains, leases, lease_s, release or ())

    async def engine_report(self, tag: str, world: int, reports: dict[int, list]) -> int:
        """One engine step's stores, by rank; the pages that became whole."""
        whole = self.core.engine_report(tag, world, reports)
        if whole:
            self._wake()  # their KV events go out with the next step
        return whole

    async def engine_forget(self, tag: str, world: int, page_hashes: list[bytes]) -> int:
        """Pages a rank could not load; how many whole ones are forgotten."""
        return self.core.engine_forget(tag, world, page_hashes)

    def engine_stats(self) -> dict[str, int]:
        """``EnginePages``' counters and how many pages it knows now."""
        pages = self.core.engine_pages
        return {**asdict(pages.stats), "known": len(pages), "leased": pages.leased}
