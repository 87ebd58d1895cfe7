"""The Prometheus endpoint's flags and start (outbox/metrics_endpoint.py), as every long-running command meets them:
a port out of range is one line from the parser, an endpoint that cannot be served one line naming its address
and port, and port 0 serves on the free port it logs."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from prometheus_client import CollectorRegistry, Counter

from outbox.harvest import cli
from outbox.metrics_endpoint import EndpointFailure, start


@pytest.mark.parametrize("port", ["99999", "-1", "ninety"])
def test_a_port_out_of_range_is_one_line_from_the_stand_alone_parser(capsys, port):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--metrics-port", port], {})
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"--metrics-port: must be a port number from 0 to 65535, got {port!r}" in err


@pytest.mark.parametrize("command", ["harvest", "outbox_consume", "outbox_redeliver"])
def test_a_port_out_of_range_is_refused_by_every_command(command):
    with pytest.raises(CommandError, match=r"--metrics-port: must be a port number from 0 to 65535, got '70000'"):
        call_command(command, "--metrics-port", "70000", *(["orders"] if command == "outbox_consume" else []))


def test_port_0_serves_on_the_free_port_it_says():
    registry = CollectorRegistry()
    Counter("endpoint_probe", "a counter to find on the page", registry=registry).inc()
    port = start(0, "127.0.0.1", registry)
    assert port > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        assert "endpoint_probe_total 1.0" in page.read().decode()


def test_a_port_taken_or_an_address_not_this_hosts_is_one_line_naming_both():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EndpointFailure, match=rf"^cannot serve metrics on 127\.0\.0\.1:{port}: .*in use"):
            start(port, "127.0.0.1", CollectorRegistry())
    with pytest.raises(EndpointFailure, match=r"^cannot serve metrics on a\.\.b:0: "):
        start(0, "a..b", CollectorRegistry())  # not a name: refused before any lookup
    if Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() == "0":  # else any address binds
        with pytest.raises(EndpointFailure, match=r"^cannot serve metrics on 192\.0\.2\.1:0: "):
            start(0, "192.0.2.1", CollectorRegistry())  # TEST-NET-1: no interface of this host has it
