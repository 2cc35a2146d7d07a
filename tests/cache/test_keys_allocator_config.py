import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric.cache.allocator import PagedAllocator
from fabric.cache.keys import TokenKey, namespace_seed, pack_tokens
from fabric.config import CacheConfig, FabricConfig, load_config
from fabric.errors import ConfigError, InvalidInput
from policies import get_eviction_policy, get_prefetch_stop_policy, get_write_policy


def test_key_cuts_unaligned_tail_and_chains_hashes_from_namespace():
    key = TokenKey(list(range(10)), 4, "tenant-a")
    assert key.num_tokens == 8 and key.num_pages == 2
    assert key.tokens() == list(range(8))
    h0 = hashlib.sha256(namespace_seed("tenant-a") + pack_tokens(range(4))).digest()
    h1 = hashlib.sha256(h0 + pack_tokens(range(4, 8))).digest()
    assert key.page_hashes() == [h0, h1]
    assert TokenKey(list(range(8)), 4, "tenant-b").page_hashes()[0] != h0


@pytest.mark.parametrize(
    "tokens", [[1, -1], [1, 2.5], [2**32], "ab", None, [1, "2"], [1, True], (False, 2)]
)
def test_bad_tokens_are_refused_naming_the_token(tokens):
    with pytest.raises(InvalidInput, match="token|tokens"):
        TokenKey(tokens, 4)


@pytest.mark.parametrize("namespace", ["", None, 3, "x" * 300, "tenant-\udcff", "\ud800"])
def test_bad_namespaces_are_refused(namespace):
    with pytest.raises(InvalidInput, match="namespace"):
        TokenKey([1, 2, 3, 4], 4, namespace)


def test_allocator_hands_out_free_pages_in_order_and_refuses_double_free():
    a = PagedAllocator(4, 16)
    assert tuple(a.alloc(3)) == (0, 1, 2)
    assert a.alloc(2) is None
    a.free([1])
    assert tuple(a.alloc(2)) == (1, 3)
    with pytest.raises(InvalidInput, match="double free of page 0"):
        a.free([2, 0, 0])
    assert not a.is_free(2), "a refused free frees nothing"
    with pytest.raises(InvalidInput, match="not a page of this pool"):
        a.free([7])
    assert a.slots([1]) == list(range(16, 32))


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 12),
            st.lists(st.integers(0, 40), max_size=6),
            st.sampled_from(["", "free", "repeat", "range"]),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_allocator_agrees_with_a_stack_model(ops):
    # Free pages form a stack: a free pushes its pages first on top, an
    # allocation pops. A free with any page not held (out of range, already
    # free, repeated), in any order, is refused whole; so is a release (the
    # tree's free of one node's distinct pages) out of range or already free.
    a, stack = PagedAllocator(16, 4), list(range(15, -1, -1))
    for is_alloc, n, picks, corrupt, release in ops:
        if is_alloc:
            got = a.alloc(n)
            if n > len(stack):
                assert got is None
            else:
                assert list(got) == stack[::-1][:n]
                del stack[len(stack) - n :]
            continue
        held = sorted(set(range(16)) - set(stack))
        # Any order: picks index the held pages.
        freed = list(dict.fromkeys(held[i % len(held)] for i in picks)) if held else []
        bad = {"free": stack[-1:], "repeat": freed[:1], "range": [16]}.get(corrupt, [])
        give_back = a.release if release and corrupt != "repeat" else a.free
        if bad:
            with pytest.raises(InvalidInput, match="double free|not a page"):
                give_back(freed + bad)
        else:
            give_back(freed)
            stack.extend(reversed(freed))
        assert a.available_pages == len(stack)
        assert all(a.is_free(p) == (p in stack) for p in range(-1, 17))
        assert a.violations() == []


def test_allocator_integrity_sees_a_page_stacked_twice():
    a = PagedAllocator(4, 16)
    a.alloc(2)
    a._stack[a._top] = 3  # what a release of a repeated page would leave
    a._top += 1
    assert a.violations() == ["pool: 2 pages flagged free, 3 stacked"]


def test_config_refuses_bad_values_naming_key_value_and_rule():
    with pytest.raises(ConfigError, match=r"cache\.page_size=0 .*>= 1"):
        FabricConfig.from_dict({"cache": {"page_size": 0}})
    with pytest.raises(ConfigError, match=r"cache\.device_tokens=100 .*multiple of page_size"):
        CacheConfig(device_tokens=100)
    with pytest.raises(ConfigError, match=r"cache\.eviction_policy='nope'.*lru"):
        CacheConfig(eviction_policy="nope")
    with pytest.raises(ConfigError, match=r"prefetch\.max_inflight_fraction=1\.5"):
        FabricConfig.from_dict({"prefetch": {"max_inflight_fraction": 1.5}})
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) cache\.pagesize"):
        FabricConfig.from_dict({"cache": {"pagesize": 4}})
    with pytest.raises(ConfigError, match="unknown config section"):
        FabricConfig.from_dict({"caches": {}})
    with pytest.raises(ConfigError, match=r"cache\.kv_events=1"):
        CacheConfig(kv_events=1)
    with pytest.raises(ConfigError, match=r"storage\.file_mode='rw-r--r--' .*octal"):
        FabricConfig().with_overrides(["storage.file_mode=rw-r--r--"])
    with pytest.raises(ConfigError, match=r"runtime\.max_request_retries=-1"):
        FabricConfig().with_overrides(["runtime.max_request_retries=-1"])
    with pytest.raises(ConfigError, match=r"runtime\.lease_ttl_s=0"):
        FabricConfig().with_overrides(["runtime.lease_ttl_s=0"])
    with pytest.raises(ConfigError, match=r"runtime\.round_wait_s=3\.0 .*rank_timeout_s=5\.0"):
        FabricConfig().with_overrides(["runtime.round_wait_s=3", "runtime.rank_timeout_s=5"])
    with pytest.raises(ConfigError, match=r"runtime\.round_settle_s=0\.03 .*round_wait_s=0\.02"):
        FabricConfig().with_overrides(["runtime.round_settle_s=0.03"])
    with pytest.raises(ConfigError, match=r"runtime\.round_settle_s=-1"):
        FabricConfig().with_overrides(["runtime.round_settle_s=-1"])
    assert FabricConfig().with_overrides(["runtime.round_settle_s=0"]).runtime.round_settle_s == 0


def test_config_loads_json_toml_yaml_and_overrides(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"cache": {"page_size": 32}}))
    (tmp_path / "c.toml").write_text("[cache]\npage_size = 32\n")
    (tmp_path / "c.yaml").write_text("cache:\n  page_size: 32\n")
    for name in ("c.json", "c.toml", "c.yaml"):
        assert load_config(tmp_path / name).cache.page_size == 32
    (tmp_path / "c.ini").write_text("")
    with pytest.raises(ConfigError, match="suffix '.ini'"):
        load_config(tmp_path / "c.ini")
    cfg = FabricConfig().with_overrides(["cache.kv_events=false", "prefetch.timeout_base_s=2"])
    assert cfg.cache.kv_events is False and cfg.prefetch.timeout_base_s == 2.0
    with pytest.raises(ConfigError, match="section.key=value"):
        FabricConfig().with_overrides(["page_size"])


def test_unknown_policy_names_list_the_known_ones():
    for get in (get_eviction_policy, get_write_policy, get_prefetch_stop_policy):
        with pytest.raises(ValueError, match="known: "):
            get("nope")
    assert get_write_policy("write_through_selective").hit_threshold == 2
    assert get_write_policy("write_back").write_back


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("events.endpoint=tcp://127.0.0.1:99999", "events.endpoint"),  # ZMQ: a random port
        ("events.endpoint=tcp://127.0.0.1:-1", "events.endpoint"),  # ZMQ: port 65535
        ("events.replay_endpoint=tcp://127.0.0.1:0", "events.replay_endpoint"),
        ("runtime.lease_ttl_s=.inf", "runtime.lease_ttl_s"),
        ("cache.session_ttl_s=.inf", "cache.session_ttl_s"),
        ("runtime.rank_timeout_s=.nan", "runtime.rank_timeout_s"),
        ("storage.file_mode=0777", "storage.file_mode"),  # nothing for others
        ("storage.file_mode=0660", "storage.file_mode"),  # the group never writes
        ("storage.dir_mode=0705", "storage.dir_mode"),
    ],
)
def test_values_that_would_be_taken_wrongly_are_refused_naming_the_key(override, named):
    with pytest.raises(ConfigError) as caught:
        FabricConfig().with_overrides([override])
    message = str(caught.value)
    assert message.startswith(f"config {named}=") and "\n" not in message, message


def test_ports_in_range_and_owner_only_modes_pass():
    cfg = FabricConfig().with_overrides(
        ["events.endpoint=tcp://127.0.0.1:5557", "storage.file_mode=0640", "storage.dir_mode=750"]
    )
    assert cfg.events.endpoint.endswith(":5557")
    FabricConfig().with_overrides(["events.endpoint=tcp://127.0.0.1:*"])


def test_an_infinite_pin_is_refused():
    from fabric.errors import InvalidInput
    from tests.helpers import make_cache

    c = make_cache()
    for ttl in (float("inf"), float("nan"), 0, -1):
        with pytest.raises(InvalidInput, match="finite number > 0"):
            c.pin_prefix(c.key([1, 2, 3, 4]), ttl)
