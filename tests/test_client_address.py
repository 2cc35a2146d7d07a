"""An address with no Ray behind it fails at once, in one line (Ray itself
retries for minutes)."""

import socket

import pytest

from fabric.client import _check_reachable
from fabric.errors import FabricError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


def test_nothing_listening_is_refused_at_once_naming_the_setting():
    port = closed_port()
    with pytest.raises(FabricError, match=rf"no Ray cluster at --address='127.0.0.1:{port}'"):
        _check_reachable(f"127.0.0.1:{port}", "--address")
    with pytest.raises(FabricError, match=r"\[::1\]"):
        _check_reachable(f"[::1]:{port}", "--address")


def test_a_listening_port_auto_and_client_addresses_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _check_reachable(f"127.0.0.1:{s.getsockname()[1]}", "--address")
    _check_reachable("auto", "--address")
    _check_reachable("ray://head:10001", "--address")
    _check_reachable(None, "--address")


def test_a_malformed_address_names_what_is_allowed():
    with pytest.raises(FabricError, match="allowed is HOST:PORT, auto or ray://"):
        _check_reachable("just-a-host", "runtime.address")
