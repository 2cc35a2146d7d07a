"""What an operator sees in Ray: kvfabric's series in Ray's metrics export, the
actors' reprs, and the dashboard itself in a headless browser with the
cluster's token. One local Ray (dashboard on) and one fabric for the module."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from tests.helpers import prompt, small_config, wait_for  # noqa: E402

pytestmark = pytest.mark.ray

NAME = "kvfabric-dash"
NS = "kvfabric-dashboard-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_EXPORT_PORT = free_port()
DASHBOARD_PORT = free_port()


@pytest.fixture(scope="module")
def fabric():
    ray.init(
        num_cpus=2,
        namespace=NS,
        log_to_driver=False,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=DASHBOARD_PORT,
        _metrics_export_port=METRICS_EXPORT_PORT,
        _system_config={"metrics_report_interval_ms": 500},
    )
    f = launch(small_config(f"runtime.name={NAME}", f"runtime.ray_namespace={NS}"))
    try:
        for seed in range(6):  # enough to fill L1 (24 pages): evictions, L2 traffic
            r = f.submit(prompt(seed, pages=6), timeout=60)
            assert r.error is None and f.release(r.lease)
        assert f.settle()
        yield f
    finally:
        f.shutdown()
        ray.shutdown()


def ray_metrics() -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_EXPORT_PORT}", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_kvfabric_series_reach_ray_s_metrics_export_with_labels(fabric):
    ranks_in = re.compile(r'^ray_kvfabric_rank_transfer_bytes\S*\{[^}]*rank="([^"]+)"', re.M)
    all_ranks = {"pp0-cp0-tp0", "pp0-cp0-tp1", "pp1-cp0-tp0", "pp1-cp0-tp1"}

    def exported() -> bool:  # each process reports on its own schedule
        text = ray_metrics()
        return (
            set(ranks_in.findall(text)) == all_ranks
            and "ray_kvfabric_transfer_bytes" in text
            and "ray_kvfabric_consensus_round_duration_seconds_bucket" in text
            and "ray_kvfabric_pool_tokens" in text
        )

    assert wait_for(exported, timeout=90), " ".join(
        sorted(set(re.findall(r"^(ray_kvfabric\w+)", ray_metrics(), re.M)))
    )
    text = ray_metrics()
    assert re.search(r'ray_kvfabric_rank_transfer_bytes\S*\{[^}]*direction="device_to_host"', text)
    assert re.search(r'ray_kvfabric_prompt_tokens\S*\{[^}]*source="computed"', text)
    assert re.search(r'ray_kvfabric_pool_tokens\{[^}]*tier="device"', text)


def test_each_actor_s_repr_names_what_does_not_change_and_describe_the_rest(fabric):
    """Ray reads an actor's repr once, at start: it names role, shard and node
    (figures there would stay frozen at 0); the live figures are ``describe``."""
    from ray.util.state import list_actors

    actors = list_actors(detail=True, filters=[("state", "=", "ALIVE")])
    names = [a.repr_name or "" for a in actors]
    node = ray.util.get_node_ip_address()
    assert f"kvfabric coordinator of {NAME}, node {node}" in names, names
    assert f"kvfabric storage of {NAME}, node {node}" in names, names
    ranks = sorted(n for n in names if n.startswith("kvfabric rank "))
    assert ranks == [
        f"kvfabric rank {r} of {NAME} on cpu, node {node}"
        for r in ("pp0-cp0-tp0", "pp0-cp0-tp1", "pp1-cp0-tp0", "pp1-cp0-tp1")
    ], names
    assert not any(re.search(r"\d+ (served|rounds)|moved", n) for n in names), names
    live = ray.get(fabric.coordinator.describe.remote(), timeout=30)
    assert re.search(r"[1-9]\d* served", live) and "L1>L2" in live, live


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _token() -> str:
    from ray._raylet import AuthenticationTokenLoader

    header = AuthenticationTokenLoader.instance().get_token_for_http_header()
    value = next(iter(header.values()), "") if header else ""
    if value:
        return value.removeprefix("Bearer ")
    return (Path.home() / ".ray" / "auth_token").read_text().strip()


@pytest.mark.skipif(
    _chromium() is None,
    reason="no Chromium here (.ci/run installs Debian's chromium; where it cannot, "
    "this one test is skipped)",
)
@pytest.mark.browser
def test_the_dashboard_in_headless_chromium_lists_the_kvfabric_actors(fabric, tmp_path):
    url = fabric.dashboard_url
    assert url == f"http://127.0.0.1:{DASHBOARD_PORT}"
    assert "ray get-auth-token" in fabric.dashboard_hint()
    with urllib.request.urlopen(f"{url}/api/authentication_mode", timeout=10) as r:
        mode = json.loads(r.read())["authentication_mode"]
    token = _token() if mode == "token" else ""
    browser = subprocess.Popen(
        [
            _chromium(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ws_url = None
        for line in browser.stderr:  # "DevTools listening on ws://..."
            if "DevTools listening on" in line:
                ws_url = line.split("on", 1)[1].strip()
                break
        assert ws_url, "Chromium did not start its DevTools endpoint"
        shots = Path(os.environ.get("KVFABRIC_SCREENSHOTS", tmp_path))
        shots.mkdir(parents=True, exist_ok=True)
        text = asyncio.run(_page_text(ws_url, url, token, shots / "ray-dashboard-actors.png"))
    finally:
        browser.kill()
        browser.wait(10)
    assert "CoordinatorActor" in text and "RankActor" in text, text[:2000]
    assert NAME in text
    # The Repr column: what does not change, not figures frozen at the actor's start.
    assert f"kvfabric coordinator of {NAME}" in text and " served" not in text, text[:3000]
    assert (shots / "ray-dashboard-actors.png").stat().st_size > 10_000


async def _page_text(ws_url: str, dashboard: str, token: str, screenshot: Path) -> str:
    """Open the dashboard's actors page with the token cookie set (what signing in
    sets) and return the page's text once the kvfabric actors are listed; save a
    screenshot of it (``KVFABRIC_SCREENSHOTS=dir`` keeps it)."""
    import base64

    import aiohttp

    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
        ids = iter(range(1, 1_000_000))

        async def call(method: str, params: dict | None = None, session: str | None = None):
            msg_id = next(ids)
            msg = {"id": msg_id, "method": method, "params": params or {}}
            if session:
                msg["sessionId"] = session
            await ws.send_str(json.dumps(msg))
            while True:
                reply = json.loads((await ws.receive()).data)
                if reply.get("id") == msg_id:
                    assert "error" not in reply, reply
                    return reply["result"]

        target = (await call("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await call("Target.attachToTarget", {"targetId": target, "flatten": True}))[
            "sessionId"
        ]
        await call("Network.enable", session=session)
        if token:
            await call(
                "Network.setCookie",
                {"name": "ray-authentication-token", "value": token, "url": dashboard},
                session=session,
            )
        await call("Page.navigate", {"url": f"{dashboard}/#/actors"}, session=session)
        text = ""
        for _ in range(120):
            await asyncio.sleep(0.5)
            result = await call(
                "Runtime.evaluate",
                {"expression": "document.body ? document.body.innerText : ''"},
                session=session,
            )
            text = result["result"].get("value", "")
            if "RankActor" in text and "CoordinatorActor" in text:
                break
        await call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1600, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        await asyncio.sleep(1.0)
        shot = await call("Page.captureScreenshot", {"format": "png"}, session=session)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return text


def test_the_dashboard_refuses_requests_without_the_token(fabric):
    with urllib.request.urlopen(f"{fabric.dashboard_url}/api/authentication_mode", timeout=10) as r:
        mode = json.loads(r.read())["authentication_mode"]
    if mode != "token":
        pytest.skip(f"this Ray runs without token authentication ({mode})")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{fabric.dashboard_url}/api/v0/actors", timeout=10)
    assert err.value.code == 401
    request = urllib.request.Request(
        f"{fabric.dashboard_url}/api/v0/actors?limit=100",
        headers={"Authorization": f"Bearer {_token()}"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        body = r.read().decode()
    assert "RankActor" in body and os.environ.get("RAY_AUTH_MODE", "token") == "token"


ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docs" / "grafana" / "kvfabric.json"


def _prometheus() -> str | None:
    return shutil.which("prometheus")


def _promql(base: str, query: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(fabric, tmp_path_factory):
    """A real Prometheus on loopback, with the documented scrape config (Ray's
    service-discovery file of metrics endpoints), scraping every second; its
    data in a temporary directory, its life bounded by the module."""
    if _prometheus() is None:
        pytest.skip("no prometheus here (.ci/run installs Debian's prometheus package)")
    import yaml

    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "docs" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            _prometheus(),
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            "--storage.tsdb.retention.time=1h",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"),  # noqa: SIM115 - the process keeps it
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return bool(_promql(base, "up"))
            except OSError:
                return False

        assert wait_for(up, 60), (tmp / "prometheus.log").read_text()[-2000:]
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_real_prometheus_scrapes_kvfabric_series_and_transfers_are_non_zero(fabric, prometheus):
    seeds = iter(range(100, 10_000))

    def moved() -> list:
        return _promql(
            prometheus, "sum by (direction) (increase(ray_kvfabric_transfer_bytes_total[5m]))"
        )

    def traffic_seen() -> bool:
        # Traffic while Prometheus watches: a counter's first sample is not an
        # increase, so the bytes must grow after the first scrape of the series.
        r = fabric.submit(prompt(next(seeds), pages=6), timeout=60)
        assert r.error is None and fabric.release(r.lease)
        time.sleep(0.5)
        return any(float(s["value"][1]) > 0 for s in moved())

    assert wait_for(traffic_seen, 120)
    directions = {s["metric"]["direction"] for s in moved() if float(s["value"][1]) > 0}
    assert "device_to_host" in directions, directions
    ranks = _promql(prometheus, "count by (rank) (ray_kvfabric_rank_transfer_bytes_total)")
    assert len(ranks) == 4, ranks


def test_the_grafana_dashboard_is_well_formed_and_each_of_its_queries_runs(fabric, prometheus):
    """Grafana's dashboard model, checked by its schema (below), and every panel's
    PromQL accepted by the real Prometheus, naming only series that exist."""
    import jsonschema

    dashboard = json.loads(GRAFANA.read_text())
    jsonschema.validate(dashboard, GRAFANA_DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    wanted = {
        "tier", "hit", "moved", "latency", "l3", "round", "reset",
    }  # fmt: skip
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in wanted:
        assert word in titles, (word, titles)
    names = set()
    with urllib.request.urlopen(f"{prometheus}/api/v1/label/__name__/values", timeout=10) as r:
        names = set(json.loads(r.read())["data"])

    def present() -> bool:  # every series the panels name has been scraped
        with urllib.request.urlopen(f"{prometheus}/api/v1/label/__name__/values", timeout=10) as r:
            names.update(json.loads(r.read())["data"])
        return all(set(re.findall(r"ray_kvfabric_\w+", t["expr"])) <= names for t in targets)

    targets = [t for p in dashboard["panels"] for t in p["targets"]]
    assert targets
    assert wait_for(present, 60), sorted(
        {m for t in targets for m in re.findall(r"ray_kvfabric_\w+", t["expr"])} - names
    )
    for t in targets:
        expr = t["expr"].replace("$fabric", NAME).replace("$__rate_interval", "1m")
        _promql(prometheus, expr)  # a query Prometheus refuses fails here


# Grafana's dashboard JSON model (the parts a provisioned dashboard must have).
_TARGET = {
    "type": "object",
    "required": ["expr", "refId", "datasource"],
    "properties": {"expr": {"type": "string", "minLength": 1}, "refId": {"type": "string"}},
}
GRAFANA_DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time", "refresh"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {"type": "object", "required": ["name", "type"]},
                }
            },
        },
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
                "properties": {
                    "id": {"type": "integer"},
                    "type": {"enum": ["timeseries", "stat", "gauge", "bargauge"]},
                    "gridPos": {
                        "type": "object",
                        "required": ["h", "w", "x", "y"],
                        "properties": {
                            k: {
                                "type": "integer",
                                "minimum": 0,
                                "maximum": 24 if k in "wx" else 999,
                            }
                            for k in "hwxy"
                        },
                    },
                    "targets": {"type": "array", "minItems": 1, "items": _TARGET},
                },
            },
        },
    },
}
