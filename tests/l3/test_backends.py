"""The page format and the file backend: verified reads, atomic writes, LRU cap."""

import json

import numpy as np
import pytest

from fabric.errors import ConfigError
from fabric.l3 import make_backend, parse_options
from fabric.l3.file import FileBackend
from fabric.l3.format import Provenance, decode_page, encode_page
from tests.helpers import PAGE_BYTES, PROV, keys, pages


def test_set_get_exists_round_trip(file_backend):
    data = pages(3)
    assert file_backend.set(keys(3), data) == [True] * 3
    assert file_backend.exists(keys(4)) == 3
    out = np.zeros((3, PAGE_BYTES), dtype=np.uint8)
    assert file_backend.get(keys(3), out) == 3
    assert np.array_equal(out, data)


def _path(backend, key):
    return backend.root / key[:2] / f"{key}.kv"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:-5], "refused_truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "refused_checksum"),
        (lambda b: b"garbage" + b, "refused_format"),
        (
            lambda b: encode_page(
                b"\0" * PAGE_BYTES,
                Provenance("other", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4),
                keys(2)[1],
            ),
            "refused_provenance",
        ),
    ],
)
def test_damaged_pages_are_misses_counted_by_reason(file_backend, damage, reason):
    file_backend.set(keys(2), pages(2))
    path = _path(file_backend, keys(2)[1])
    path.write_bytes(damage(path.read_bytes()))
    out = np.zeros((2, PAGE_BYTES), dtype=np.uint8)
    assert file_backend.get(keys(2), out) == 1, "the first page is served, the damaged one is not"
    assert file_backend.stats()[reason] == 1


def test_nothing_user_supplied_becomes_a_path(file_backend):
    good = keys(1)[0]
    for bad in [
        "../../etc/passwd",
        "0" * 64,
        good + "/x",
        good + "\n",
        "ZZ" * 32 + good[64:],
        "0" * 64 + ".0-0-0",  # no model tag
    ]:
        with pytest.raises(ValueError, match="not a page key"):
            file_backend.exists([bad])


def test_writes_are_atomic_and_leave_no_temp_files(file_backend):
    file_backend.set(keys(5), pages(5))
    assert not list(file_backend.root.rglob("*.tmp"))
    assert len(list(file_backend.root.rglob("*.kv"))) == 5


def test_size_cap_evicts_least_recently_used_pages(tmp_path):
    blob = len(encode_page(b"\0" * PAGE_BYTES, PROV, keys(1)[0]))
    b = FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path), "max_bytes": 3 * blob})
    b.set(keys(3), pages(3))
    out = np.zeros((1, PAGE_BYTES), dtype=np.uint8)
    assert b.get(keys(1), out) == 1  # page 0 is now the most recently used
    b.set(keys(1, start=3), pages(1))
    present = [b.exists([k]) for k in keys(4)]
    assert present == [1, 0, 1, 1], "page 1 was least recently used"
    assert b.stats()["evicted_pages"] == 1 and b.stats()["bytes"] <= 3 * blob


def test_a_new_backend_on_the_same_directory_sees_the_pages(tmp_path):
    FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path)}).set(keys(2), pages(2, seed=4))
    again = FileBackend(PROV, PAGE_BYTES, {"path": str(tmp_path)})
    out = np.zeros((2, PAGE_BYTES), dtype=np.uint8)
    assert again.get(keys(2), out) == 2 and np.array_equal(out, pages(2, seed=4))
    assert again.stats()["pages"] == 2
    again.clear()
    assert again.exists(keys(2)) == 0 and not list(tmp_path.rglob("*.kv"))


def test_decode_refuses_wrong_lengths():
    key = keys(1)[0]
    blob = encode_page(b"\1" * PAGE_BYTES, PROV, key)
    assert decode_page(blob, PROV, PAGE_BYTES + 1, key) == "truncated"
    assert bytes(decode_page(blob, PROV, PAGE_BYTES, key)) == b"\1" * PAGE_BYTES
    assert decode_page(blob, PROV, PAGE_BYTES, keys(2)[1]) == "key"


def test_options_text_parses_json_and_files_and_names_errors(tmp_path):
    assert parse_options('{"path": "x"}') == {"path": "x"}
    assert parse_options("") == {}
    (tmp_path / "e.yaml").write_text("path: y\n")
    (tmp_path / "e.toml").write_text('path = "z"\n')
    (tmp_path / "e.json").write_text(json.dumps({"path": "w"}))
    assert parse_options(f"@{tmp_path / 'e.yaml'}") == {"path": "y"}
    assert parse_options(f"@{tmp_path / 'e.toml'}") == {"path": "z"}
    assert parse_options(f"@{tmp_path / 'e.json'}") == {"path": "w"}
    with pytest.raises(ConfigError, match="are not JSON"):
        parse_options("{path: x}")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_options(f"@{tmp_path / 'missing.json'}")
    with pytest.raises(ConfigError, match="must be an object"):
        parse_options("[1, 2]")


def test_make_backend_refuses_unknown_names_and_keys(tmp_path):
    with pytest.raises(ConfigError, match="storage.backend='s3'"):
        make_backend("s3", PROV, PAGE_BYTES, {})
    with pytest.raises(ConfigError, match=r"key 'pth' is unknown for backend 'file'"):
        make_backend("file", PROV, PAGE_BYTES, {"pth": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"storage\.options\.module is missing .*'dynamic'"):
        make_backend("dynamic", PROV, PAGE_BYTES, {})
    with pytest.raises(ConfigError, match="cannot load"):
        make_backend("dynamic", PROV, PAGE_BYTES, {"module": "no.such", "class": "X"}, {"no.such"})
    with pytest.raises(ConfigError, match="not an L3Backend"):
        make_backend(
            "dynamic", PROV, PAGE_BYTES, {"module": "json", "class": "JSONDecoder"}, {"json"}
        )


def test_dynamic_backend_loads_a_user_class_by_module_path():
    b = make_backend(
        "dynamic",
        PROV,
        PAGE_BYTES,
        {
            "module": "tests.l3.memory_backend",
            "class": "MemoryBackend",
            "options": {"label": "mine"},
        },
        allowed_modules={"tests.l3.memory_backend"},
    )
    assert b.label == "mine"
    b.set(keys(2), pages(2))
    assert b.exists(keys(3)) == 2 and b.stats()["backend"] == "memory"


def test_the_config_allows_exactly_the_backends_made_by_name():
    from typing import get_args

    from fabric.config import StorageConfig
    from fabric.l3 import BACKENDS

    allowed = set(get_args(StorageConfig.model_fields["backend"].annotation)) - {"none"}
    assert allowed == set(BACKENDS)
