"""The Prometheus export, read back with prometheus_client's own parser."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fabric.cache.keys import pack_tokens
from fabric.coordinator.figures import figures
from fabric.driver.local import LocalFabric
from fabric.observe.metrics import METRICS, MetricsExporter
from tests.helpers import prompt, small_config, storage_options


def scrape(exporter: MetricsExporter) -> dict:
    return {f.name: f for f in text_string_to_metric_families(exporter.text())}


def value(families: dict, name: str, **labels: str) -> float:
    family, sample = name, name
    for suffix in ("_total", "_count", "_sum", "_bucket"):
        if name.endswith(suffix):
            family = name[: -len(suffix)]
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, labels))


def test_every_series_is_there_from_the_first_scrape_with_conventional_names():
    f = LocalFabric(small_config())
    exporter = MetricsExporter()
    exporter.update(figures(f.core))
    families = scrape(exporter)
    assert {s.name for s in METRICS} <= set(families)
    for spec in METRICS:
        fam = families[spec.name]
        assert fam.type == spec.kind
        assert fam.documentation and fam.documentation.replace(" ", "_") != spec.name
        names = {s.name for s in fam.samples}
        if spec.kind == "counter":
            assert names == {f"{spec.name}_total"} or names == {
                f"{spec.name}_total",
                f"{spec.name}_created",
            }
        assert fam.samples, f"{spec.name} has series before anything happened"
    assert value(families, "kvfabric_prompt_tokens_total", source="storage") == 0
    assert value(families, "kvfabric_transfer_bytes_total", direction="host_to_storage") == 0
    assert value(families, "kvfabric_rank_up", rank=str(f.core.topology.ranks[3])) == 1
    units = ("_seconds", "_bytes", "_tokens", "_pages")
    assert not [s.name for s in METRICS if s.name.endswith("_s") or "_ms" in s.name]
    assert any(s.name.endswith(units) for s in METRICS)


def test_counters_histograms_and_labels_follow_what_the_fabric_did(tmp_path):
    f = LocalFabric(small_config(*storage_options(tmp_path)))
    prompts = [pack_tokens(prompt(seed, pages=6, shared=2)) for seed in range(8)]
    for p in prompts + prompts[:2]:
        r = f.serve(p)
        assert r.error is None and f.core.release(r.lease)
    f.settle()
    exporter = MetricsExporter()
    exporter.update(figures(f.core), f.storage.stats())
    m = scrape(exporter)
    served = sum(
        value(m, "kvfabric_prompt_tokens_total", source=s)
        for s in ("device", "host", "storage", "computed")
    )
    assert served == sum(len(p) // 4 for p in prompts + prompts[:2])
    assert value(m, "kvfabric_requests_total", outcome="finished") == 10
    assert value(m, "kvfabric_request_duration_seconds_count") == 10
    assert value(m, "kvfabric_request_duration_seconds_bucket", le="+Inf") == 10
    written = value(m, "kvfabric_transfer_tokens_total", direction="device_to_host")
    assert written > 0
    per_token = f.config.model.kv_bytes_per_token
    assert (
        value(m, "kvfabric_transfer_bytes_total", direction="device_to_host") == written * per_token
    )
    assert value(m, "kvfabric_transfer_size_tokens_sum", direction="device_to_host") == written
    assert value(m, "kvfabric_evicted_tokens_total", tier="device") > 0, "L1 of 24 pages overflowed"
    assert value(m, "kvfabric_l3_written_pages_total") > 0
    assert value(m, "kvfabric_consensus_round_duration_seconds_count") == value(
        m, "kvfabric_consensus_rounds_total"
    )
    pool = {
        s.labels["state"]: s.value
        for s in m["kvfabric_pool_tokens"].samples
        if s.labels["tier"] == "device"
    }
    assert sum(pool.values()) == value(m, "kvfabric_pool_capacity_tokens", tier="device")


def test_a_scrape_does_not_walk_the_tree(monkeypatch):
    f = LocalFabric(small_config())
    f.core.release(f.serve(pack_tokens(prompt(1, pages=3))).lease)

    def walked(*_a, **_k):
        pytest.fail("a scrape walked the tree")

    monkeypatch.setattr(type(f.core.cache.tree), "walk", walked)
    monkeypatch.setattr(type(f.core.cache.tree), "host_pages", walked)
    exporter = MetricsExporter()
    exporter.update(figures(f.core))
    assert "kvfabric_requests_total" in exporter.text()


def test_the_docs_name_every_metric_and_config_key():
    from pathlib import Path

    from fabric.config import describe_keys

    docs = Path(__file__).resolve().parents[1] / "docs"
    observing = (docs / "observing.md").read_text()
    for spec in METRICS:
        name = spec.name + ("_total" if spec.kind == "counter" else "")
        assert f"`{name}`" in observing, f"docs/observing.md lacks metric {name}"
    reference = (docs / "configuration.md").read_text()
    for key in describe_keys():
        assert f"`{key['key']}`" in reference, f"docs/configuration.md lacks {key['key']}"


def test_a_counter_annotated_where_it_is_defined_is_exported_and_in_stats_with_no_other_change():
    """What adding a counter takes: its field, with its Series, and the code that
    counts it. The exporter and ``stats()`` find it by walking the figures."""
    import dataclasses
    from typing import Annotated

    from fabric.coordinator.requests import FabricStats
    from fabric.observe.series import Series, to_builtins

    @dataclasses.dataclass
    class WithWidgets(FabricStats):
        widgets: Annotated[int, Series("kvfabric_widgets", "counter", "Widgets made.")] = 0

    f = LocalFabric(small_config())
    counted = WithWidgets(**vars(figures(f.core).counters))
    counted.widgets += 3  # the code that counts
    tree = dataclasses.replace(figures(f.core), counters=counted)
    exporter = MetricsExporter()
    exporter.update(tree)
    assert value(scrape(exporter), "kvfabric_widgets_total") == 3
    assert to_builtins(tree)["counters"]["widgets"] == 3
