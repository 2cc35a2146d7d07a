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
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from fabric.client import launch  # noqa: E402
from tests.helpers import prompt, small_config, wait_for  # noqa: E402

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


def test_each_actor_s_repr_names_its_role_and_live_figures(fabric):
    from ray.util.state import list_actors

    def reprs() -> list[str]:
        actors = list_actors(detail=True, filters=[("state", "=", "ALIVE")])
        return [a.repr_name or "" for a in actors]

    names = reprs()
    assert any(n.startswith(f"kvfabric coordinator {NAME}") for n in names), names
    assert sum(n.startswith("kvfabric rank ") for n in names) == 4, names
    assert any(n.startswith("kvfabric storage") for n in names), names
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
        text = asyncio.run(_page_text(ws_url, url, token))
    finally:
        browser.kill()
        browser.wait(10)
    assert "CoordinatorActor" in text and "RankActor" in text, text[:2000]
    assert NAME in text


async def _page_text(ws_url: str, dashboard: str, token: str) -> str:
    """Open the dashboard's actors page with the token cookie set (what signing in
    sets) and return the page's text once the kvfabric actors are listed."""
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
