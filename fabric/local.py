"""The whole fabric in one process, no Ray: a ``CoordinatorCore`` and one
``RankWorker`` per rank, stepped by hand. For tests, and for seeing the data
plane work without a cluster. Messages still go through the wire encoding."""

from __future__ import annotations

from fabric.config import FabricConfig
from fabric.coordinator import CoordinatorCore, RequestResult
from fabric.messages import decode, encode
from fabric.rank import RankWorker


class LocalFabric:
    def __init__(self, config: FabricConfig) -> None:
        self.core = CoordinatorCore(config)
        self.ranks = [RankWorker(config, i) for i in range(self.core.topology.world_size)]
        self.results: dict[str, RequestResult] = {}

    def step(self, run_ranks: bool = True) -> list[RequestResult]:
        """One coordinator step: send a batch, let ranks work, reduce their reports."""
        wire = encode(self.core.next_batch())
        for rank in self.ranks:
            rank.accept(decode(wire))  # type: ignore[arg-type]
            if run_ranks:
                rank.run_pending()
        reports = [decode(encode(r.report())) for r in self.ranks]
        done = self.core.on_round(reports)  # type: ignore[arg-type]
        self.results.update((r.request_id, r) for r in done)
        return done

    def serve(
        self, tokens: bytes, namespace: str = "default", max_steps: int = 100
    ) -> RequestResult:
        rid = self.core.submit(tokens, namespace)
        for _ in range(max_steps):
            self.step()
            if rid in self.results:
                return self.results.pop(rid)
        raise TimeoutError(f"{rid} did not finish in {max_steps} steps")

    def verify(self, result: RequestResult, tokens: bytes) -> list[bool]:
        """Per rank: does L1 hold exactly the fresh KV of the leased prefix?"""
        lease = result.lease
        assert lease is not None
        cached = tokens[: lease.tokens * 4]
        return [r.verify(lease.namespace, cached, list(lease.device_pages)) for r in self.ranks]
