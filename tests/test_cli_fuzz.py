"""The CLI's file and value inputs under fuzzing: a trace (``simulate --trace``),
a config file (``--config``) and overrides (``--set``), random and hostile. Each
run either works or ends in exactly one line naming the problem and a non-zero
exit — never a traceback. (Ray is not started: ``simulate`` and ``config`` run
in-process; the deep Hypothesis profile runs thousands of examples.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric.cli import main
from tests.helpers import example_count

EXAMPLES = example_count(150, 3000)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Lines that look like trace rows, with any field taking any value, or anything else.
rows = st.fixed_dictionaries(
    {},
    optional={
        "timestamp": json_values,
        "input_length": json_values | st.integers(0, 10_000),
        "output_length": json_values,
        "hash_ids": json_values | st.lists(st.integers(-5, 2**65), max_size=6),
    },
)
lines = (
    rows.map(json.dumps)
    | json_values.map(lambda v: json.dumps(v, allow_nan=True))
    | st.binary(max_size=40).map(lambda b: b.decode("latin-1"))
    | st.just('{"input_length": 1e400, "hash_ids": [1]}')
)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def one_line_or_success(code: int, stdout: str, stderr: str) -> None:
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    if code == 0:
        json.loads(stdout.strip().splitlines()[-1])
        return
    assert code == 2, (code, stderr)
    said = [line for line in stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("kvfabric: error: "), stderr


@FUZZ
@given(body=st.lists(lines, min_size=1, max_size=4))
def test_any_trace_file_is_served_or_refused_in_one_line(body):
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(body).encode("utf-8", "surrogateescape"))
    try:
        one_line_or_success(*run(["simulate", "--trace", f.name, "--capacities", "1K", "--json"]))
    finally:
        os.unlink(f.name)


config_bodies = (
    st.binary(max_size=60)
    | json_values.map(lambda v: json.dumps(v, allow_nan=True).encode())
    | st.dictionaries(
        st.sampled_from(["cache", "runtime", "storage", "events", "topology", "nope"]),
        st.dictionaries(
            st.sampled_from(
                ["page_size", "lease_ttl_s", "file_mode", "endpoint", "tp", "device_tokens", "x"]
            ),
            json_values,
            max_size=3,
        ),
        max_size=3,
    ).map(lambda d: json.dumps(d, allow_nan=True).encode())
)


@FUZZ
@given(
    body=config_bodies,
    suffix=st.sampled_from([".json", ".yaml", ".toml", ".txt"]),
    overrides=st.lists(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(
                [
                    "cache.page_size", "runtime.lease_ttl_s", "storage.file_mode",
                    "events.endpoint", "cache.session_ttl_s", "nope.x", "cache", "",
                ]
            ),
            st.text(max_size=12),
        ),
        max_size=3,
    ),
)  # fmt: skip
def test_any_config_file_and_overrides_are_taken_or_refused_in_one_line(body, suffix, overrides):
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(body)
    try:
        argv = ["config", "--config", f.name, "--json"]
        for item in overrides:
            argv += ["--set", item]
        one_line_or_success(*run(argv))
    finally:
        os.unlink(f.name)


def test_chaos_refuses_a_bad_override_before_starting_any_ray():
    import sys

    ray = sys.modules.get("ray")
    code, stdout, stderr = run(["chaos", "--duration", "1", "--set", "cache.page_size=many"])
    one_line_or_success(code, stdout, stderr)
    assert code == 2 and "config cache.page_size='many' is refused" in stderr
    assert ray is None or not ray.is_initialized(), "no Ray was started for a bad config"
