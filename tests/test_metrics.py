from fabric.cache.keys import pack_tokens
from fabric.local import LocalFabric
from fabric.metrics import MetricsExporter, flatten
from tests.helpers import prompt, small_config


def test_every_number_in_a_snapshot_becomes_a_gauge():
    f = LocalFabric(small_config())
    f.core.release(f.serve(pack_tokens(prompt(1, pages=3))).lease)
    snapshot = f.core.snapshot()
    names = dict(flatten(snapshot))
    assert names["kvfabric_requests_finished"] == 1
    assert names["kvfabric_tokens_computed"] == 12
    exporter = MetricsExporter()
    exporter.update(snapshot)
    exporter.update(snapshot)  # gauges are reused, not registered twice
    text = exporter.text()
    assert "kvfabric_requests_finished 1.0" in text
    assert "kvfabric_device_capacity 96.0" in text
