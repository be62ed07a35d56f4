"""The SSH servers the peer tests run against, as the fixture `server` (tests/system/conftest.py) hands them out:
sshd.py's asyncssh server (in this process; the default) or, with `@BOTH_SERVERS`, also OpenSSH's sshd (openssh.py;
skipped with the reason where it cannot run). And how a test finds what a run left behind: the processes of a
server's sessions (each carries SSH_CONNECTION naming the server's port, as sshd sets it) and the emulators of a
driver process."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import anyio
import pytest

from tests.support import sshd

BOTH_SERVERS = pytest.mark.parametrize("server", ["asyncssh", "openssh"], indirect=True)


class Server:
    """An SSH server on 127.0.0.1: its port, keys, a known_hosts file that trusts it, and the options to reach it
    with this interpreter as the remote python."""

    def __init__(self, kind: str, directory: Path, keys: dict[str, str], port: int,
                 commands_started: Callable[[], int]) -> None:
        self.kind, self.directory, self.keys, self.port = kind, directory, keys, port
        self._commands_started = commands_started
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(sshd.known_hosts_line("127.0.0.1", port, keys["host"]))

    def options(self, **overrides):
        return {"identity": self.keys["client"], "known_hosts": str(self.known_hosts), "python": sys.executable,
                "connect_timeout": 20.0, "command_timeout": 30.0, **overrides}

    def cli_flags(self, python: str = sys.executable) -> list[str]:
        return ["--port", str(self.port), "--identity", self.keys["client"], "--known-hosts", str(self.known_hosts),
                "--python", python]

    def commands_started(self) -> int:
        """Commands the server ran since it started (SFTP sessions not counted)."""
        return self._commands_started()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:
        return b""


def leftovers(port: int | None = None, drivers: Iterable[int] = ()) -> list[str]:
    """Live processes (not zombies) started through the SSH server on `port`, or emulators whose driver is one of
    `drivers`. Empty when everything went away."""
    found = []
    marker = f" {port}".encode()
    drivers = set(drivers)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        command = _read(f"/proc/{entry}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        if not command:
            continue
        environment = _read(f"/proc/{entry}/environ").split(b"\0")
        if (port is not None and any(variable.startswith(b"SSH_CONNECTION=") and variable.endswith(marker)
                                     for variable in environment)) \
                or any(f'"driver_pid": {driver},' in command for driver in drivers):
            found.append(f"{entry}: {command[:120]}")
    return found


async def assert_no_leftovers(port: int | None = None, drivers: Iterable[int] = (), within: float = 8.0) -> None:
    deadline = time.monotonic() + within
    while (found := leftovers(port, drivers)) and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    assert not found, found
