"""The commands of remote peers: `serve` (the endpoint connect_peer starts over SSH) and `connect` (a write and
read back between this host and another, or around a ring of hosts)."""
from __future__ import annotations

import argparse
import functools
import time
from typing import Any, Callable

from .ssh import SSH_PORT, add_ssh_flags, parsed_hosts, ssh_options
from ..arguments import Subcommands, ipv4, ipv4_or_ssh, sized


def add_serve(sub: Subcommands) -> None:
    serve = sub.add_parser("serve", help="the remote endpoint connect_peer starts over SSH: JSON-lines requests on "
                                         "stdin, answers on stdout (protocol: aiofabric/peer/protocol.py)")
    serve.set_defaults(run=cmd_serve, json=False)


def add_connect(sub: Subcommands) -> None:
    connect = sub.add_parser("connect", help="start an endpoint on HOST over SSH, RDMA WRITE to it and READ back, "
                                             "bytes verified by sha256 on both sides (--hosts: a ring)")
    connect.add_argument("host", nargs="?", metavar="HOST", help="[user@]host[:port] to reach over SSH")
    connect.add_argument("--hosts", metavar="FILE|h1,h2", help="a ring over these hosts (a file with one "
                                                               "[user@]host[:port] per line, or a comma list)")
    connect.add_argument("--nic", default="sim", help="local NIC: 'sim', 'sim:NAME' or a PCI address (default sim)")
    connect.add_argument("--remote-nic", default="sim", help="the remote host's NIC (default sim)")
    connect.add_argument("--local-ip", type=ipv4, help="local NIC's IPv4 address (emulated: a free 127.0.0.x)")
    connect.add_argument("--remote-ip", type=ipv4_or_ssh,
                         help="remote NIC's IPv4 address (emulated: a free 127.0.0.x there); 'ssh': the address the "
                              "SSH connection reached (with --hosts: on every host)")
    connect.add_argument("--size", type=sized(1), default=1 << 20,
                         help="bytes to write and read back, with an optional K/M/G suffix (default 1M)")
    add_ssh_flags(connect)
    connect.add_argument("--json", action="store_true", help="print one JSON object")
    connect.set_defaults(run=cmd_connect, check=_check_connect(connect))


async def cmd_serve(args: argparse.Namespace) -> dict[str, Any]:
    from ...peer.serve import serve  # the remote endpoint: stdout carries the protocol, so no --json here
    await serve()
    return {}


async def cmd_connect(args: argparse.Namespace) -> dict[str, Any]:
    from ...peer.connect import open_all, ring, two_hosts
    from ...peer.ssh import connect_peer
    ssh = ssh_options(args)
    started = time.perf_counter()
    if args.hosts:
        hosts = args.host_list  # _check_connect's
        openers = [functools.partial(connect_peer, host, port, user=user or args.user, **ssh)
                   for user, host, port in hosts]
        async with open_all(openers) as peers:
            options = [{"ip": args.remote_ip}] * len(peers) if args.remote_ip else None
            result = await ring(peers, nic=args.remote_nic, size=args.size, options=options, started=started)
        if not args.json:
            print(f"ring of {len(peers)} hosts ({' -> '.join(result['hosts'])} -> back): RDMA WRITE of {args.size} "
                  f"bytes around it: {'verified' if result['verified'] else 'MISMATCH'} (handshake "
                  f"{result['handshake_ms']:.0f} ms, transfer {result['transfer_ms']:.1f} ms)")
        return result
    user, host, port = args.target  # _check_connect's
    async with connect_peer(host, port, user=user or args.user, **ssh) as peer:
        result = await two_hosts(peer, nic=args.nic, remote_nic=args.remote_nic, local_ip=args.local_ip,
                                 remote_ip=args.remote_ip, size=args.size, started=started)
        result = {**result, "remote_host": peer.host, "pushed": peer.pushed_to is not None}
    if not args.json:
        print(f"{result['local_ip']} -> {peer.host} ({result['remote_ip']}): RDMA WRITE + READ of {args.size} bytes: "
              f"{'verified' if result['verified'] else 'MISMATCH'} (handshake {result['handshake_ms']:.0f} ms, "
              f"transfer {result['transfer_ms']:.1f} ms, write {result['write_MiBps']} MiB/s)")
    return result


def _check_connect(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        from ...peer.client import parse_host
        if (args.host is None) == (args.hosts is None):
            parser.error("give one HOST or --hosts FILE|h1,h2 (not both)")
        if args.hosts is not None:
            args.host_list = parsed_hosts(parser, args.hosts, args.port)
            if len(args.host_list) < 2:
                parser.error(f"--hosts {args.hosts}: a ring needs at least 2 hosts, not {len(args.host_list)}")
            return
        try:
            args.target = parse_host(args.host, SSH_PORT if args.port is None else args.port)
        except ValueError as exc:
            parser.error(f"HOST: {exc}")
    return check
