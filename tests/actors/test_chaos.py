"""``kvfabric chaos`` on a two-node local Ray: a short seeded run injects faults
into a fabric under load and its report proves nothing was lost. (The long
soak with every fault kind is a documented command: docs/chaos.md.)"""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from fabric.cli import main  # noqa: E402
from fabric.errors import InvalidInput  # noqa: E402
from fabric.tools.chaos import FAULTS, ChaosOptions, run_chaos  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.chaos]


def test_a_short_seeded_chaos_run_loses_nothing():
    assert not ray.is_initialized(), "the harness makes its own cluster"
    lines: list[str] = []
    report = run_chaos(
        ChaosOptions(
            seed=7,
            duration_s=45,  # at most: it ends after its fifth fault
            max_faults=5,
            nodes=2,
            fault_every_s=1.0,
            fault_hold_s=2.0,
            warmup_fraction=0.1,  # 4.5 s of traffic before the first fault
            # The kinds that recover fastest here, so a minute sees several.
            faults=(
                "coordinator_kill",
                "storage_kill",
                "rank_sigstop",
                "l3_full",
                "l3_read_only",
                "duplicate_messages",
                "rank_kill_no_restart",
                "client_exit",
                "l3_latency",
                "storage_sigkill",
                "overlapping",
            ),
        ),
        progress=lines.append,
    )
    assert not ray.is_initialized(), "the harness shut its cluster down"
    assert report["ok"], json.dumps(report)
    assert report["wrong_pages"] == 0 and report["leaked_slots"] == 0
    assert report["stuck_requests"] == 0 and report["integrity_errors"] == []
    assert report["faults_injected"] >= 3, report["fault_log"]
    assert report["requests"]["served"] > 0 and report["requests"]["verified"] > 0
    # As root, L3 is a tmpfs of its own: l3_full fills it (real ENOSPC) and
    # l3_read_only remounts it read-only (real EROFS); else each sets a flag.
    real = report["l3_faults"].startswith("tmpfs")
    for kind, says in (("l3_full", "tmpfs filled"), ("l3_read_only", "remounted read-only")):
        log = [f for f in report["fault_log"] if f["kind"] == kind]
        assert all((says in f["target"]) == real for f in log), (report["l3_faults"], log)
    load = report["requests"]["load"]  # decode, sessions, pins and tenants, not only submit
    assert load["append"] > 0 and load["session kept"] > 0 and load["pin"] > 0
    assert {"namespace default", "namespace tenant-a", "namespace tenant-b"} <= set(load)
    assert report["loss"] == [] and report["coordinators"] == 1 + report["faults"].get(
        "coordinator_kill", 0
    )
    # Every fault it injected was recovered from: a request served after it.
    assert report["unrecovered_faults"] == []
    assert set(report["recovery_s"]) == set(report["faults"])
    assert any("coordinator_kill" in line or "storage_kill" in line for line in lines)
    # The coordinator and the storage actor on the head node (runtime.control_resource),
    # each pipeline stage's ranks packed on one node, before and after the faults.
    for when in ("start", "end"):
        placed = report["placement"][when]
        assert placed["coordinator_on_control_node"] and placed["storage_on_control_node"]
        assert placed["stages_packed"], placed


def test_chaos_refuses_unknown_fault_kinds_and_bad_sizes(capsys):
    with pytest.raises(InvalidInput, match="bogus"):
        ChaosOptions(faults=("rank_kill", "bogus"))
    with pytest.raises(InvalidInput, match="duration_s=0"):
        ChaosOptions(duration_s=0)
    with pytest.raises(InvalidInput, match="nodes=1"):
        ChaosOptions(nodes=1)
    assert main(["chaos", "--faults", "rank_kill,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert set(FAULTS) >= {"node_loss", "coordinator_kill", "l3_read_only"}


def test_chaos_prompts_fit_a_models_vocabulary_and_keep_their_families():
    import random

    from fabric.tools.chaos import prompt

    rng = random.Random(3)
    prompts = [prompt(rng, 4, vocab=400) for _ in range(200)]
    assert max(max(p) for p in prompts) < 400
    assert len({tuple(p[:4]) for p in prompts}) == 6  # the shared prefixes, apart
    assert max(max(prompt(rng, 4)) for _ in range(50)) >= 100_000  # synthetic: as before


def test_a_node_lost_for_good_is_refused_fast_and_served_again_when_capacity_returns():
    """The only worker node goes with no replacement: requests are refused naming
    the absent rank (not held until their own timeout), then a node joins and the
    fabric serves again — and nothing is lost."""
    report = run_chaos(
        ChaosOptions(
            seed=3,
            duration_s=50,  # at most: it ends once its fault was recovered from
            max_faults=1,
            nodes=2,
            fault_every_s=30.0,
            warmup_fraction=0.1,
            faults=("node_lost_for_good",),
            overrides=("runtime.rank_absent_timeout_s=5",),
        ),
        progress=lambda line: None,
    )
    assert report["ok"], json.dumps(report)
    (fault,) = [f for f in report["fault_log"] if f["kind"] == "node_lost_for_good"][:1]
    assert fault["injected"] and "requests refused naming the rank" in fault["target"]
    assert report["requests"]["refused_rank_absent"] > 0
    assert report["unrecovered_faults"] == [] and "node_lost_for_good" in report["recovery_s"]
