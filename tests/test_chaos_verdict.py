"""The chaos verdict without a cluster: what a served lease's answers count as,
which run is a loss, and counters summed over every coordinator of the run."""

from __future__ import annotations

import pytest

from fabric.cli import main
from fabric.errors import InvalidInput
from fabric.tools import chaos as chaos_module
from fabric.tools.chaos import Chaos, ChaosOptions, Fault, chaos_config, percentile


class _Lease:
    tokens = 32


class _Served:
    lease = _Lease()


class _Fabric:
    def __init__(self, answer):
        self.answer = answer

    def verify(self, r, tokens):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def harness(tmp_path, **options) -> Chaos:
    c = Chaos(ChaosOptions(**options), progress=lambda line: None)
    c.config = chaos_config(c.opts, str(tmp_path))
    return c


@pytest.mark.parametrize(
    ("answer", "wrong", "unverifiable"),
    [
        ([True, True], 0, 0),
        ([True, False], 1, 0),
        ([False, None], 1, 0),  # a rank's no counts, whatever another could not say
        ([None, False, False], 2, 0),
        ([True, None], 0, 1),
        (RuntimeError("rank gone"), 0, 1),
    ],
)
def test_any_rank_answering_no_is_a_wrong_page(tmp_path, answer, wrong, unverifiable):
    c = harness(tmp_path)
    c.fabric = _Fabric(answer)
    c.check(_Served(), [1] * 32)
    pages = 32 // c.config.cache.page_size
    assert c.tally.wrong_pages == wrong * pages
    assert c.tally.unverifiable == unverifiable


def clean_after(stats=None) -> dict:
    return {
        "serving_again_s": 0.5,
        "settled": True,
        "integrity_errors": [],
        "l3_pages": {"valid": 10},
        "stats": {
            "now": {"leases": 0},
            "counters": {"resets": 2, "leases_reclaimed": 1},
            **(stats or {}),
        },
    }


def served_run(c: Chaos, n: int = 20) -> None:
    c.tally.spans = [(float(i), float(i) + 0.1) for i in range(n)]
    c.tally.latencies = [0.1] * n
    c.tally.verified = n


def test_a_clean_run_is_no_loss_and_counters_sum_over_coordinators(tmp_path):
    c = harness(tmp_path, duration_s=20)
    served_run(c)
    c.faults = [Fault("coordinator_kill", 5.0, ended=5.0, injected=True)]
    c.incarnations = [{"counters": {"resets": 3, "leases_reclaimed": 4, "adopted_tokens": 64}}]
    report = c.report(20.0, clean_after())
    assert report["ok"] and report["loss"] == []
    assert report["resets"] == 5 and report["leases_reclaimed"] == 5
    assert report["coordinators"] == 2 and report["adopted_tokens"] == 64


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c, a: c.faults.append(Fault("l3_full", 6.0, injected=False)), "not injected"),
        (lambda c, a: c.faults.append(Fault("rank_kill", 30.0, injected=True)), "not recovered"),
        (lambda c, a: a["l3_pages"].update(checksum=1), "the audit refused"),
        (lambda c, a: setattr(c.tally, "unverifiable", 5), "unverifiable"),
        (lambda c, a: c.tally.failed.update({"timeout": 30}), "requests failed"),
        (lambda c, a: setattr(c.tally, "wrong_pages", 1), "wrong pages"),
        (lambda c, a: a["stats"]["now"].update(leases=1), "leases left held"),
        (lambda c, a: a.update(serving_again_s=None), "never served again"),
    ],
)
def test_each_kind_of_loss_fails_the_verdict_and_says_why(tmp_path, change, said):
    c = harness(tmp_path, duration_s=20)
    served_run(c)
    after = clean_after()
    change(c, after)
    report = c.report(20.0, after)
    assert not report["ok"]
    assert any(said in why for why in report["loss"]), report["loss"]
    assert said in chaos_module.summary(report)


def test_an_audit_a_backend_cannot_make_is_reported_skipped_not_a_loss(tmp_path):
    c = harness(tmp_path, duration_s=20)
    served_run(c)
    after = clean_after()
    after["l3_pages"] = {"skipped": "NotImplementedError: cannot list"}
    report = c.report(20.0, after)
    assert report["ok"]
    assert "L3 audit skipped" in chaos_module.summary(report)


def test_percentiles_interpolate_so_two_values_do_not_make_p50_p99():
    assert percentile([1.0, 3.0], 0.5) == 2.0
    assert percentile([1.0, 3.0], 0.99) == pytest.approx(2.98)
    assert percentile([4.0], 0.99) == 4.0 and percentile([], 0.5) == 0.0


def test_bounds_are_fractions_and_a_broken_harness_exits_3(monkeypatch, capsys):
    with pytest.raises(Exception, match="max_failed_fraction=2"):
        ChaosOptions(max_failed_fraction=2)

    def broken(opts, progress):
        raise RuntimeError("the audit fell over")

    monkeypatch.setattr(chaos_module, "run_chaos", broken)
    assert main(["chaos", "--duration", "1"]) == 3
    err = capsys.readouterr().err
    assert "the harness failed, no verdict: RuntimeError: the audit fell over" in err


def test_every_fault_kind_has_one_injector_and_every_injector_a_kind():
    from fabric.tools.chaos.faults import INJECTORS
    from fabric.tools.chaos.options import FAULTS, OVERLAPPABLE

    assert set(INJECTORS) == set(FAULTS) - {"overlapping"}  # two at once: `overlap`
    assert set(OVERLAPPABLE) <= set(INJECTORS)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
def test_max_faults_is_a_whole_number_from_one(bad, capsys):
    with pytest.raises(InvalidInput, match=f"max_faults={bad!r}"):
        ChaosOptions(max_faults=bad)
    assert ChaosOptions(max_faults=1).max_faults == 1


def test_the_cli_refuses_max_faults_zero_before_any_ray(capsys):
    assert main(["chaos", "--max-faults", "0"]) == 2
    assert "max_faults=0" in capsys.readouterr().err


def test_the_killer_stops_after_max_faults(tmp_path, monkeypatch):
    import time

    from fabric.tools.chaos import harness as harness_module

    c = harness(tmp_path, duration_s=20, max_faults=2, warmup_fraction=0.0, fault_every_s=0.01)
    c.t0 = time.monotonic()

    def inject(run, fault, index=None):  # recovered at once: a request served after it
        run.tally.spans.append((run.now() + 1.0, run.now() + 1.0))

    monkeypatch.setattr(harness_module, "inject", inject)
    c.killer()
    assert [f.injected for f in c.faults] == [True, True]
    assert not c.stop.is_set(), "the killer returns; run() then stops the load"
