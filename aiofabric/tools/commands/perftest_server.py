"""bench's and lat's two-host mode over TCP, as perftest's: the server (`--server`: it waits for clients, lets each
drive the server side under its policy and limits, and prints each client's report) and its client (SERVER_HOST)."""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import sys
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from ..arguments import positive_int, seconds, size, sized
from ..perftest_flags import PARAMETER_FLAGS
from ..runs import open_nics
from ...verbs import NIC

if TYPE_CHECKING:
    from ..bench_config import BenchConfig
    from ..lat_config import LatConfig

MAX_REPORT_ROWS = 64  # rows of a client's report a server prints: a sweep of every power of two up to 1 GiB has 31


def add_server_limits(parser: argparse.ArgumentParser) -> None:
    """What one client of `bench --server` may hold (aiofabric/peer/policy.py); defaults are Limits'."""
    from ...peer.policy import PCAP_MAX_BYTES, PCAP_MAX_FILES, Limits
    group = parser.add_argument_group("server limits (with --server, per client)")
    defaults = Limits()
    group.add_argument("--max-nics", type=positive_int, default=defaults.nics, metavar="N",
                       help=f"NICs a client may open at once (default {defaults.nics}, as perftest)")
    group.add_argument("--max-memory", type=sized(1), default=defaults.memory, metavar="BYTES",
                       help="DMA memory a client's NICs may hold: registered memory, rings and the NIC's own "
                            f"(default {defaults.memory >> 20}M)")
    group.add_argument("--max-requests", type=positive_int, default=defaults.in_flight, metavar="N",
                       help=f"requests of a client in flight at once (default {defaults.in_flight})")
    group.add_argument("--max-line", type=sized(1), default=defaults.line, metavar="BYTES",
                       help=f"bytes per request line (default {defaults.line >> 10}K)")
    group.add_argument("--max-depth", type=positive_int, default=defaults.depth, metavar="N",
                       help=f"JSON nesting of a request (default {defaults.depth})")
    group.add_argument("--idle-timeout", type=seconds, default=defaults.idle, metavar="S",
                       help=f"drop a client that sends no request or reads no answer for S seconds (default "
                            f"{defaults.idle:g}; our clients ping while their test runs)")
    group.add_argument("--allow-peer", type=ipaddress.ip_network, action="append", metavar="NETWORK",
                       help="a network the server's QPs may also connect to (default: only the address each "
                            "client connects from); repeatable")
    captures = parser.add_argument_group("server captures (with --server --pcap FILE, for the whole server)")
    captures.add_argument("--pcap-max-bytes", type=pcap_bytes, default=PCAP_MAX_BYTES, metavar="BYTES",
                          help="size limit of each capture file: the packets past it are not recorded (default "
                               f"{PCAP_MAX_BYTES >> 30}G; a default bench write run takes about 350M)")
    captures.add_argument("--pcap-max-files", type=positive_int, default=PCAP_MAX_FILES, metavar="N",
                          help="capture files to write, one per client NIC (FILE, FILE.1, ...); later NICs are not "
                               f"captured (default {PCAP_MAX_FILES}; the captures take at most N x BYTES)")


def pcap_bytes(text: str) -> int:
    value = size(text)
    if value < 24:
        raise argparse.ArgumentTypeError(f"must be at least 24 (the pcap file header), not {value}")
    return value


async def client(args: argparse.Namespace, config: BenchConfig | LatConfig,
                 run: Callable[[Any, list[NIC]], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """perftest's client: open the NIC here, connect to the server from its address (the server's QPs talk only
    to the address a connection comes from), run the test (`run`, on the NIC opened here; lat's first tells the
    server its parameters, which it refuses unless they are its own) with the server side there, hand it the
    result."""
    from ...peer import PeerError
    from ...peer.tcp import DEFAULT_PORT, connect_tcp, source_address
    config.check()
    port = DEFAULT_PORT if args.port is None else args.port
    if config.ip is None and config.emulated:  # the address that reaches the server (None: loopback, where the
        config.ip = await source_address(args.server_host, port)  # emulator picks a free 127.0.0.x)
    async with open_nics(config, 1) as nics, \
            connect_tcp(args.server_host, port, local_host=nics[0].ip, connect_timeout=args.connect_timeout,
                        command_timeout=args.command_timeout) as peer:
        config.remote = peer
        result = await run(config, nics)
        try:
            await peer.request("report", result=result)  # the server prints the same table
        except PeerError as exc:  # the run itself is done and measured here
            logging.getLogger(__name__).warning("the server did not take the report: %s", exc)
    return result


async def serve(args: argparse.Namespace, config: BenchConfig | LatConfig,
                format_report: Callable[[dict[str, Any], Any], str],
                expect: dict[str, Any]) -> dict[str, Any]:
    """perftest's server: wait for `aiofabric <command> ... SERVER_HOST` clients over TCP (one at a time; --forever:
    one after another), let each drive the server side through the command's exchange under this server's policy
    (its NIC, address, capture file and limits; `expect`: the parameters a client must match, lat's test, size and
    MTU, bench's symmetric flags), and print each one's table. Without --forever, a client whose session failed
    makes the server fail too."""
    from ...peer.policy import Limits, ServerPolicy
    from ...peer.tcp import DEFAULT_PORT, serve_tcp
    limits = Limits(nics=args.max_nics, memory=args.max_memory, in_flight=args.max_requests, line=args.max_line,
                    depth=args.max_depth, idle=args.idle_timeout)
    policy = ServerPolicy(nic=args.nic, ip=args.ip, pcap=args.pcap, allow_peers=tuple(args.allow_peer or ()),
                          pcap_max_bytes=args.pcap_max_bytes, pcap_max_files=args.pcap_max_files,
                          limits=limits, tool=args.command, expect=expect, flags=PARAMETER_FLAGS)

    shown: list[str] = []  # the client whose report was printed last: one table per session (clients come in turn)

    def show(result: dict[str, Any], client: str) -> None:  # `result` is the client's, its text already escaped
        if shown and shown[-1] == client:
            raise ValueError("report: a client reports its run once (its table was printed)")
        rows = result.get("rows")
        if isinstance(rows, list) and len(rows) > MAX_REPORT_ROWS:
            raise ValueError(f"report: {len(rows)} rows; a sweep has at most {MAX_REPORT_ROWS}")
        if args.json:
            shown[:] = [client]
            return
        try:
            first = result.get("rows", [result])[0]
            names = ("test", "qps", "size", "depth", "mtu", "nics", "warmup")
            fields = {name: first[name] for name in names if name in first and hasattr(config, name)}
            if args.command == "lat":  # its -n, the samples (bench's must be the server's: a symmetric flag)
                fields["iters"] = first["iterations"]
            table = format_report(result, dataclasses.replace(config, **fields))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"report: not a {args.command} result ({type(exc).__name__}: {exc})") from None
        shown[:] = [client]
        print(f"aiofabric {args.command} server: the report of client {client} (its own measurements):\n{table}",
              flush=True)

    def listening(port: int) -> None:
        print(f"aiofabric {args.command} server: waiting for a client on {args.bind} TCP port {port}",
              file=sys.stderr, flush=True)

    summary = await serve_tcp(args.bind, DEFAULT_PORT if args.port is None else args.port, forever=args.forever,
                              policy=policy, ready=listening, on_report=show)
    session_error = summary.pop("error", None)
    result = {"server": True, **summary, "client_error": session_error}
    if session_error and not args.forever:
        result["error"] = session_error if summary.get("outcome") == "parameters differ" else \
            f"the client's session failed: {session_error}"
    return result
