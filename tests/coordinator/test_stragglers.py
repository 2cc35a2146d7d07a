"""Stragglers: a rank that answers every round but finishes its commands late is
named within a bounded number of its own slow rounds, in the status and the
metrics; the restart policy hands it to the shell once; it is let go after as
many normal rounds."""

from __future__ import annotations

import pytest

from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.coordinator.stragglers import Progress, Stragglers
from fabric.driver.local import LocalFabric
from fabric.errors import ConfigError
from fabric.observe.metrics import MetricsExporter
from tests.helpers import FakeClock, prompt, small_config


def tracker(policy="report", rounds=3, clock=None, named=None):
    return Stragglers(
        ["a", "b", "c", "d"],
        lag_s=0.25,
        factor=4.0,
        rounds=rounds,
        policy=policy,
        clock=clock or FakeClock(),
        on_named=(lambda name, s: named.append(name)) if named is not None else lambda n, s: None,
    )


def test_a_rank_slow_for_its_rounds_in_a_row_is_named_once_then_let_go():
    named: list[str] = []
    s = tracker(named=named)
    assert s.observe([0.01, 2.5, 0.01, 0.02]) == [] and s.status() == {}
    s.observe([0.01, 0.01, 0.01, 0.01])  # one normal round breaks the run
    for _ in range(2):
        s.observe([0.01, 2.5, 0.01, 0.02])
    assert s.status() == {}, "two slow rounds in a row are not three"
    s.observe([None, 2.5, None, None])  # the others made no progress: their latest stand
    assert list(s.status()) == ["b"] and named == ["b"] and s.named == 1
    assert s.status()["b"]["latency_s"] == 2.5 and s.status()["b"]["others_s"] == 0.01
    s.observe([0.01, 3.0, 0.01, 0.02])
    assert named == ["b"], "named once per episode"
    assert s.status()["b"]["latency_s"] == 3.0
    for _ in range(2):
        s.observe([0.01, 0.02, 0.01, 0.02])
    assert list(s.status()) == ["b"], "let go only after as many normal rounds"
    s.observe([0.01, 0.02, 0.01, 0.02])
    assert s.status() == {} and s.seconds[1].count == 9


@pytest.mark.parametrize(
    "lags",
    [
        [0.01, 0.2, 0.01, 0.01],  # late, but by less than straggler_lag_s
        [2.0, 3.0, 2.0, 2.0],  # everyone is slow: a slow model, not a straggler
    ],
)
def test_lateness_below_either_bound_is_no_straggler(lags):
    s = tracker(rounds=1)
    for _ in range(5):
        s.observe(lags)
    assert s.status() == {} and s.named == 0


def test_the_restart_policy_hands_a_straggler_over_once_and_forgets_it_when_restarted():
    s = tracker(policy="restart", rounds=2)
    assert s.observe([0.0, 0.0, 1.0, 0.0]) == []
    assert s.observe([0.0, 0.0, 1.0, 0.0]) == [2]
    assert s.observe([0.0, 0.0, 1.0, 0.0]) == [], "already named"
    assert s.take_restart() == [2] and s.take_restart() == []
    s.forget(2)
    assert s.status() == {} and s.slow[2] == 0


def test_one_rank_has_nobody_to_compare_with():
    s = Stragglers(["only"], 0.25, 4.0, 1, "restart", FakeClock())
    assert s.observe([9.0]) == [] and s.status() == {}
    with pytest.raises(ValueError, match="policy 'kill'"):
        Stragglers(["a"], 0.25, 4.0, 1, "kill", FakeClock())


def test_progress_measures_each_rank_against_the_first_to_finish():
    p = Progress(3)
    assert p.lags([2, 0, 2], epoch=1, now=10.0) == [0.0, None, 0.0]
    assert p.lags([4, 1, 3], epoch=1, now=11.0) == [0.0, 1.0, 0.0]
    assert p.lags([4, 4, 4], epoch=1, now=12.5) == [None, 2.5, 1.5]
    assert p.marks == [], "counts every rank reached are forgotten"
    assert p.lags([1, 1, 1], epoch=2, now=20.0) == [0.0, 0.0, 0.0], "a new epoch starts over"


def test_a_rank_that_finishes_late_in_a_local_fabric_is_named_in_status_and_metrics():
    clock = FakeClock()
    f = LocalFabric(small_config("runtime.straggler_rounds=2"), clock=clock)
    for seed in range(4):
        rid = f.core.submit(pack_tokens(prompt(seed, pages=2)))
        for _ in range(3):  # rank 1 holds back while the others work
            f.step(lagging={1})
            clock.advance(0.5)
        while rid not in f.results:
            f.step()
        f.core.release(f.results[rid].lease)
    straggling = figures(f.core).ranks.stragglers
    rank1 = str(f.core.topology.ranks[1])
    assert list(straggling) == [rank1] and straggling[rank1]["latency_s"] >= 1.0
    exporter = MetricsExporter()
    exporter.update(figures(f.core))
    text = exporter.text()
    assert f'kvfabric_rank_straggling{{rank="{rank1}"}} 1.0' in text
    assert "kvfabric_stragglers_named_total" in text
    for seed in range(4):  # every rank in step again: let go
        f.core.release(f.serve(pack_tokens(prompt(10 + seed, pages=2))).lease)
    assert figures(f.core).ranks.stragglers == {}


def test_the_straggler_settings_are_checked():
    with pytest.raises(ConfigError, match="straggler_policy"):
        small_config("runtime.straggler_policy=kill")
    with pytest.raises(ConfigError, match="straggler_factor"):
        small_config("runtime.straggler_factor=0.5")
