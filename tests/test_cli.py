"""``kvfabric config``: every key with its value and what is allowed, no Ray."""

from __future__ import annotations

import json

import jsonschema

from fabric.cli import main
from fabric.observe.report import SCHEMA


def test_config_lists_every_key_without_ray(capsys):
    assert main(["config", "--set", "cache.page_size=64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    jsonschema.validate(out, SCHEMA)
    keys = {k["key"]: k for k in out["keys"]}
    assert keys["cache.page_size"]["value"] == 64
    assert "one of" in keys["cache.eviction_policy"]["allowed"]
    assert "events.endpoint" in keys and "runtime.dashboard" in keys
    assert main(["config", "--set", "cache.nope=1"]) == 2
    assert "known in 'cache'" in capsys.readouterr().err


def test_run_s_text_says_what_each_tier_served_what_was_refused_and_the_latency():
    from fabric.cli.render import run_text
    from fabric.observe.report import result, workload

    out = result(
        "run",
        **workload("a trace", 5, {"device": 30, "computed": 10}, {"too long": 1}, 2.0, [0.1, 0.2]),
        resets=0,
    )
    text = run_text(out, ranks=4)
    assert text.startswith("kvfabric ") and "4 of 5 requests from a trace" in text
    assert "4 rank actors" in text and "device" in text and "75.0%" in text
    assert "refused              1 requests: too long" in text
    assert "latency   p50 100.0 ms, p99 100.0 ms" in text


def test_the_first_run_hint_is_said_once_per_user_and_never_fails(tmp_path, monkeypatch, capsys):
    from fabric.cli.hint import first_run_hint

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("KVFABRIC_NO_HINT", raising=False)
    first_run_hint("run")
    assert capsys.readouterr().err.count("kvfabric: first run done. Next:") == 1
    first_run_hint("run")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "other"))
    monkeypatch.setenv("KVFABRIC_NO_HINT", "1")
    first_run_hint("run")
    assert capsys.readouterr().err == "" and not (tmp_path / "other").exists()
    monkeypatch.delenv("KVFABRIC_NO_HINT")
    blocked = tmp_path / "file"
    blocked.write_text("")  # a state directory that cannot be made
    monkeypatch.setenv("XDG_STATE_HOME", str(blocked))
    first_run_hint("run")
    assert capsys.readouterr().err == ""
