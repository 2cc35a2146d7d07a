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
