"""The Prometheus endpoint as every long-running command takes it (`harvest`, `outbox-harvest`, `outbox_consume`,
`outbox_redeliver`): its two flags, a port out of range refused by the parser as a usage error naming the flag
(not a traceback from the socket), and an endpoint that cannot be served said in one line naming its address and
port. Port 0 takes
any free port, and the one taken is what the command logs."""

from __future__ import annotations

import argparse
from typing import Any

#: The most a TCP port can be.
MAX_PORT = 65535


class EndpointFailure(Exception):
    """The endpoint cannot be served (the port taken, the address not this host's): one line."""


def port_number(text: str) -> int:
    """--metrics-port's type: a port from 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to {MAX_PORT}, got {text!r}")
    return port


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=port_number, metavar="PORT",
                        help="serve Prometheus metrics on this port (http://ADDRESS:PORT/metrics; 0: any free port, "
                             "logged)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDRESS",
                        help="address for --metrics-port (default 0.0.0.0)")


def start(port: int, address: str, registry: Any) -> int:
    """Serve `registry` on http://address:port/metrics from a thread of its own; the port it serves on."""
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=address, registry=registry)
    except (OSError, OverflowError, ValueError) as error:  # ValueError: an address IDNA cannot encode ("a..b")
        raise EndpointFailure(f"cannot serve metrics on {address}:{port}: {error}") from None
    return int(server.server_port)
