"""``kvfabric top``'s frames from two status snapshots (no Ray, no terminal)."""

from rich.console import Console

from fabric.tools.top import frame, rates


def snapshot(moved: int, computed: int, device: int, finished: int) -> dict:
    return {
        "fabric": "f",
        "epoch": 2,
        "resets": 1,
        "leases": 3,
        "requests": {"finished": finished},
        "requests_now": {"waiting": 1, "prefetching": 0, "running": 2},
        "transfer_tokens": {
            "device_to_host": moved,
            "host_to_device": 0,
            "host_to_storage": 0,
            "storage_to_host": 0,
        },
        "prompt_tokens": {"device": device, "host": 0, "storage": 0, "computed": computed},
        "inflight_transfers": {"device_to_host": 4},
        "tiers": {"device": {"capacity": 100, "free": 25}},
    }


def test_rates_are_per_second_between_snapshots_and_zero_first():
    a, b = snapshot(100, 50, 0, 10), snapshot(300, 70, 40, 14)
    first = rates(None, a, 1.0)
    assert first["moved"]["device_to_host"] == 0 and first["requests"] == 0
    r = rates(a, b, 2.0)
    assert r["moved"]["device_to_host"] == 100.0
    assert r["served"] == {"device": 20.0, "host": 0.0, "storage": 0.0, "computed": 10.0}
    assert r["requests"] == 2.0
    # A counter that went back (a restarted coordinator) is not a negative rate.
    assert rates(b, a, 1.0)["moved"]["device_to_host"] == 0


def test_a_frame_shows_transfers_hit_shares_pools_and_requests_in_flight():
    console = Console(width=120, record=True)
    console.print(frame(snapshot(100, 50, 0, 10), snapshot(300, 70, 40, 14), 2.0))
    text = console.export_text()
    assert "L1 > L2" in text and "100" in text and "4" in text
    assert "36.4%" in text  # 40 of 110 prompt tokens from L1
    assert "75 / 100 (75.0%)" in text
    assert "waiting 1" in text and "running 2" in text and "resets 1" in text


def test_a_frame_shows_engine_pages_per_place_and_tenant_once_there_are_any():
    console = Console(width=140, record=True)
    quiet = snapshot(0, 0, 0, 0)
    console.print(frame(None, quiet, 1.0))
    assert "engine pages" not in console.export_text()
    busy = {
        **quiet,
        "engines": {
            "places": {
                "l3": {"pages": 120, "bytes": 4096, "tenants": {"a": 100, "b": 20}},
                "l2@node-1": {"pages": 7, "bytes": 512, "tenants": {"a": 7}},
            },
            "hit_pages": {"l2": 5, "l3": 60},
        },
    }
    console.print(frame(quiet, busy, 1.0))
    text = console.export_text()
    assert "engine pages (hits: L2 5, L3 60)" in text
    assert "l2@node-1" in text and "a 100, b 20" in text and "4,096" in text
