"""How a command reaches other hosts over SSH (bench and lat --peer, the collectives' --hosts, connect): the flags,
connect_peer's keywords from them, and --hosts' list."""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..arguments import port_number, readable_file, seconds

SSH_PORT = 22


def add_ssh_flags(parser: Any, short_port: bool = False) -> None:
    """How to reach a host over SSH (connect, bench --peer); `short_port`: -p too, as perftest spells its port."""
    parser.add_argument(*(("-p",) if short_port else ()), "--port", type=port_number,
                        help="SSH port (default 22); for bench --server / SERVER_HOST the TCP port (default 18515; "
                             "--server: 0 picks one)")
    parser.add_argument("--user", help="SSH user (default: the SSH default)")
    parser.add_argument("--identity", type=readable_file, metavar="FILE",
                        help="private key (default: the agent and ~/.ssh keys)")
    parser.add_argument("--known-hosts", metavar="FILE|none",
                        help="known_hosts file (default ~/.ssh/known_hosts); 'none' skips the check (insecure)")
    parser.add_argument("--push", action="store_true",
                        help="copy this aiofabric over SFTP to a private temp dir on the host and run it from there, "
                             "with the packages it needs in the versions installed here")
    parser.add_argument("--python", default="python3", help="the remote interpreter (default python3)")
    parser.add_argument("--connect-timeout", type=seconds, default=20.0, metavar="S",
                        help="seconds for SSH connect + endpoint start (default 20)")
    parser.add_argument("--command-timeout", type=seconds, default=60.0, metavar="S",
                        help="seconds per remote request (default 60)")


def ssh_options(args: argparse.Namespace) -> dict[str, Any]:
    """connect_peer's keywords from the SSH flags (add_ssh_flags)."""
    from ...peer.ssh import DEFAULT
    known_hosts = DEFAULT if args.known_hosts is None else None if args.known_hosts == "none" else args.known_hosts
    return {"identity": args.identity, "known_hosts": known_hosts, "python": args.python, "push": args.push,
            "connect_timeout": args.connect_timeout, "command_timeout": args.command_timeout}


def parsed_hosts(parser: argparse.ArgumentParser, text: str, port: int | None) -> list[tuple[str | None, str, int]]:
    """--hosts' hosts, one per slot (SSH's port by default), a usage error naming a bad one."""
    try:
        return _hosts(text, SSH_PORT if port is None else port)
    except (ValueError, OSError) as exc:
        parser.error(f"--hosts {text}: {exc}")


def _hosts(text: str, port: int) -> list[tuple[str | None, str, int]]:
    """`--hosts`: a file with one `[user@]host[:port] [slots=N]` per line, as an MPI hostfile (peer/hostfile.py), or
    a comma-separated list of them."""
    from ...peer.hostfile import host_slots
    if "," not in text and os.path.isfile(text):
        with open(text) as file:
            return host_slots(file.read().splitlines(), port, numbered=True)
    return host_slots(text.split(","), port, numbered=False)
