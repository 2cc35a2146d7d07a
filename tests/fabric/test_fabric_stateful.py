"""Random sequences against the whole fabric in one process (with a file L3):
submit, step (some ranks lagging), release, abort, restart a rank. After every
step the tree's invariants hold and every held lease verifies on every rank."""

from __future__ import annotations

import tempfile

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fabric.keys import pack_tokens
from fabric.local import LocalFabric
from fabric.rank import RankWorker
from tests.helpers import machine_settings

from .conftest import small_config


class FabricMachine(RuleBasedStateMachine):
    @initialize(
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        stop_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        storage=st.booleans(),
    )
    def setup(self, write_policy, stop_policy, storage):
        self.tmp = tempfile.TemporaryDirectory()
        options = [
            f"cache.write_policy={write_policy}",
            f"prefetch.stop_policy={stop_policy}",
            "prefetch.threshold_tokens=4",
            "storage.transfer_batch_pages=2",
        ]
        if storage:
            options += ["storage.backend=file", f"storage.path={self.tmp.name}"]
        self.config = small_config(*options)
        self.fabric = LocalFabric(self.config)
        self.tokens: dict[str, bytes] = {}
        self.held: dict[str, object] = {}
        self.n = 0
        self.restart_unseen = False

    def teardown(self):
        if hasattr(self, "tmp"):
            self.tmp.cleanup()

    @rule(first=st.integers(0, 2), rest=st.lists(st.integers(0, 3), min_size=0, max_size=8))
    def submit(self, first, rest):
        pages = [first, *rest]
        tokens = pack_tokens(
            [p * 10 + i % 4 + 1000 * j for j, p in enumerate(pages) for i in range(4)]
        )
        self.n += 1
        rid = self.fabric.core.submit(tokens, request_id=f"r{self.n}")
        self.tokens[rid] = tokens

    @rule(
        prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), min_size=1, max_size=4)
    )
    def burst(self, prompts):
        """Several prompts sharing short prefixes, served to completion: fills L1,
        so later ones evict, load back and prefetch."""
        for first, seed in prompts:
            self.submit(first, [(seed >> k) % 4 for k in range(seed % 7)])
        for _ in range(4):
            self.step(set())

    @rule(lagging=st.sets(st.integers(0, 3), max_size=2))
    def step(self, lagging):
        for result in self.fabric.step(lagging=lagging):
            if result.lease is not None:
                self.held[result.request_id] = result
        self.restart_unseen = False

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        result = self.held.pop(rid)
        self.fabric.core.release(result.lease)

    @rule(data=st.data())
    def abort(self, data):
        rids = sorted(set(self.tokens) - set(self.held))
        if rids:
            self.fabric.core.abort(data.draw(st.sampled_from(rids)))

    @rule(index=st.integers(0, 3))
    def restart_rank(self, index):
        self.fabric.ranks[index] = RankWorker(self.config, index, storage=self.fabric.storage)
        # Until the next round shows the new incarnation, leases point at pages
        # this rank lost; that round resets the fabric and ends them.
        self.restart_unseen = True

    @invariant()
    def consistent(self):
        if not hasattr(self, "fabric"):
            return
        f = self.fabric
        f.core.cache.check_integrity()
        live = {rid for rid in self.held if rid in f.core.leases}
        for rid in set(self.held) - live:
            del self.held[rid]  # a reset ended it
        if self.restart_unseen:
            return
        for rid in live:
            assert f.verify(self.held[rid], self.tokens[rid]) == [True] * 4, rid


FabricMachine.TestCase.settings = machine_settings(examples=60, steps=30)
TestFabricMachine = FabricMachine.TestCase
