"""What the engine adapters stand on, without the engines: key mapping, the page
store they open (a directory, checked reads), the manifest of who wrote what."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from fabric.cache.keys import TokenKey, namespace_seed, pack_tokens
from fabric.engines.keys import (
    PageNamer,
    check_tenant,
    sglang_hash,
    shard_suffix,
    tenant_hash,
    vllm_hash,
)
from fabric.engines.store import DirectStore, StoreOptions, open_store, parse_options
from fabric.errors import ConfigError, InvalidInput
from fabric.l3.format import Provenance
from fabric.l3.manifest import Manifest, usage_by_tag

PROV = Provenance("m", "layer_first", "bfloat16", (2, 4, 1, 1, 8), 4)
ROW = 2 * 4 * 8 * 2


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, ROW), dtype=np.uint8)


def test_sglang_namespaces_seed_as_sglang_does():
    assert namespace_seed("sglang") == b""
    assert len(namespace_seed("sglang:tenant")) == 32
    assert namespace_seed("sglang:a") != namespace_seed("sglang:b") != namespace_seed("a")
    unseeded = TokenKey(list(range(8)), 4, "sglang").page_hashes()[0]
    import hashlib

    assert unseeded == hashlib.sha256(pack_tokens(range(4))).digest()


def test_an_unseeded_chain_refuses_a_first_page_that_spells_a_seed_preimage():
    """Tokens whose bytes spell ``kvfabric/ns\\0<ns>`` would hash, unseeded, to
    namespace <ns>'s seed: the next page's key would be that tenant's."""
    forged = b"kvfabric/ns\0abcd"  # 16 bytes: one page of 4 tokens
    tokens = [*list(np.frombuffer(forged, dtype="<u4")), 1, 2, 3, 4]
    with pytest.raises(InvalidInput, match="unseeded"):
        TokenKey([int(t) for t in tokens], 4, "sglang")
    with pytest.raises(InvalidInput, match="unseeded"):
        TokenKey(
            pack_tokens(np.frombuffer(b"sglang-cache-namespace-v1xxx", dtype="<u4").tolist()),
            7,
            "sglang",
        )
    # The same tokens in a seeded namespace cannot reach another chain: allowed.
    assert TokenKey([int(t) for t in tokens], 4, "tenant").num_pages == 2


def test_engine_keys_map_into_domains_of_their_own():
    h = bytes(range(32))
    assert sglang_hash(h.hex()) == h
    for bad in ["", h.hex().upper(), h.hex()[:-1], h.hex() + "\n", None, 5, "../" + h.hex()[3:]]:
        assert sglang_hash(bad) is None
    assert tenant_hash("a", h) != tenant_hash("b", h) != h
    key = h + (0).to_bytes(4, "big")
    assert vllm_hash("", key) != vllm_hash("", h + (1).to_bytes(4, "big")), "groups differ"
    assert vllm_hash("", key) != vllm_hash("t", key), "tenants differ"
    assert vllm_hash("", key) != tenant_hash("", key)
    with pytest.raises(ConfigError, match="namespace='sglang:x'"):
        check_tenant("sglang:x")
    with pytest.raises(ConfigError, match="namespace"):
        check_tenant("")
    assert shard_suffix(1, 0, 3) == "1-0-3"
    with pytest.raises(ConfigError, match="tp rank 10000"):
        shard_suffix(0, 0, 10000)


def test_store_options_name_one_place():
    with pytest.raises(ConfigError, match="exactly one of path"):
        parse_options(StoreOptions, {}, "an adapter")
    with pytest.raises(ConfigError, match="exactly one of path"):
        parse_options(StoreOptions, {"path": "/x", "fabric": "f"}, "an adapter")
    with pytest.raises(
        ConfigError, match=r"an adapter: backend='redis' is refused: allowed is segment or file"
    ):
        parse_options(StoreOptions, {"path": "/x", "backend": "redis"}, "an adapter")
    with pytest.raises(ConfigError, match="'colour' is unknown"):
        parse_options(StoreOptions, {"path": "/x", "colour": 1}, "an adapter")


@pytest.mark.parametrize("backend", ["segment", "file"])
def test_a_page_a_read_refused_is_absent_until_stored_anew(tmp_path, backend, monkeypatch):
    store = open_store(StoreOptions(path=str(tmp_path), backend=backend), "sglang")
    assert isinstance(store, DirectStore)
    namer = PageNamer(PROV, "0-0-0")
    keys = namer.keys([bytes([i]) * 32 for i in range(3)])
    data = rows(3)
    assert store.store(keys, data, PROV) == [True] * 3
    out = np.empty_like(data)
    assert store.load(keys, out, PROV) == 3 and np.array_equal(out, data)
    wrong = Provenance("m", "layer_first", "float16", PROV.shard_shape, 4)
    assert store.load(keys, out, wrong) == 0, "another provenance is refused"
    assert store.present(keys) == [False, True, True], "and remembered"
    assert store.exists(keys) == 0
    assert store.store(keys[:1], data[:1], PROV) == [True]
    assert store.exists(keys) == 3
    assert store.stats()["l3"]["refused_provenance"] == 1
    # The fabric's deletes of the page it forgot, come after the new copy: not
    # carried out for a while; later ones are.
    assert store.delete(keys[:2]) == 1 and store.present(keys) == [True, False, True]
    assert store.delete(keys[:1]) == 0 and store.present(keys)[0] is True
    monkeypatch.setattr(time, "monotonic", lambda: 1e12)
    assert store.delete(keys[:1]) == 1 and store.present(keys)[0] is False


def test_the_manifest_says_who_wrote_which_models_pages(tmp_path):
    store = open_store(StoreOptions(path=str(tmp_path)), "hf")
    namer = PageNamer(PROV, "0-0-0")
    store.store(namer.keys([b"\1" * 32, b"\2" * 32]), rows(2), PROV)
    other = Provenance("m2", "vllm/abc", "uint8", (ROW,), 16, "vllm")
    open_store(StoreOptions(path=str(tmp_path)), "vllm").store(
        PageNamer(other, "0-0-0").keys([b"\3" * 32]), rows(1), other
    )
    usage = store.backend.usage_by_writer()
    assert [(r["writers"], r["model_id"], r["pages"]) for r in usage] == [
        (["hf"], "m", 2),
        (["vllm"], "m2", 1),
    ]
    assert usage[1]["component"] == "vllm" and usage[0]["shard_shape"] == [2, 4, 1, 1, 8]
    assert oct(os.stat(tmp_path / "provenance").st_mode & 0o777) == "0o700"


def test_a_manifest_record_that_lies_about_its_tag_is_ignored(tmp_path):
    manifest = Manifest(tmp_path, 0o600, 0o700)
    manifest.record(PROV, "sglang")
    lying = tmp_path / "provenance" / f"{'0' * 16}.kvfabric.json"
    lying.write_text(json.dumps({"writer": "kvfabric", "provenance": PROV.as_wire()}))
    (tmp_path / "provenance" / f"{PROV.tag}.hf.json").symlink_to(lying)
    entries = manifest.entries()
    assert entries == {PROV.tag: {"provenance": PROV.as_wire(), "writers": ["sglang"]}}
    rows_ = usage_by_tag(
        [f"{'ab' * 32}.{PROV.tag}.0-0-0", f"{'cd' * 32}.{'f' * 16}.0-0-0"], entries
    )
    assert [(r["writers"], r["pages"]) for r in rows_] == [(["sglang"], 1), (["unknown"], 1)]
    with pytest.raises(ValueError, match="writer 'nobody'"):
        manifest.record(PROV, "nobody")


def test_a_read_the_store_could_not_answer_forgets_nothing(tmp_path, monkeypatch):
    store = open_store(StoreOptions(path=str(tmp_path)), "vllm")
    keys = PageNamer(PROV, "0-0-0").keys([b"\7" * 32])
    store.store(keys, rows(1), PROV)

    def broken(*args, **kwargs):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(store.backend, "get", broken)
    assert store.load(keys, np.empty((1, ROW), dtype=np.uint8), PROV) == 0
    assert store.present(keys) == [True], "an error is no evidence the page is bad"
    assert store.stats()["errors"] == 1


def test_an_engine_writing_to_an_authenticated_store_tags_its_pages(tmp_path):
    """With the fabric's secret (``auth_key_file``), an engine's direct store writes
    pages the authenticating fabric serves; without it, they are refused there."""
    import os

    import numpy as np

    from fabric.engines.store import DirectStore, StoreOptions
    from fabric.errors import ConfigError
    from fabric.l3 import make_backend
    from fabric.l3.auth import PageAuth
    from tests.helpers import PAGE_BYTES, PROV, keys, pages

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    path = str(tmp_path / "l3")
    tagged = DirectStore(StoreOptions(path=path, auth_key_file=str(secret)), "sglang")
    untagged = DirectStore(StoreOptions(path=str(tmp_path / "l3b")), "sglang")
    tagged.backend.set(keys(2), pages(2), PROV)
    untagged.backend.set(keys(2), pages(2), PROV)
    for where, served in ((path, 2), (str(tmp_path / "l3b"), 0)):
        fabric_side = make_backend("segment", PROV, PAGE_BYTES, {"path": where})
        fabric_side.auth = PageAuth.from_file(str(secret))
        out = np.zeros((2, PAGE_BYTES), np.uint8)
        assert fabric_side.get(keys(2), out) == served
    tagged.close()
    untagged.close()
    with pytest.raises(ConfigError, match=r"auth_key_file=.* cannot be read"):
        DirectStore(StoreOptions(path=path, auth_key_file=str(tmp_path / "none")), "sglang")
