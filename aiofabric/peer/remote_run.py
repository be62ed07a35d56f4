"""`run_remote`: one `python -m aiofabric ARGS` command on a host over SSH, run to its end (a rank of a collective
launched over SSH), with its exit status, its output and the last lines of its stderr.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Mapping, Sequence

import anyio

from .launch import remote_command
from .ssh import (DEFAULT, SIGNAL_WAIT, ProcessCarrier, SSHPeer, check_asyncio, close_connection, connect, destination,
                  push_step)
from ..errors import PeerError


@dataclasses.dataclass
class RemoteRun:
    """What `run_remote` saw: the command's exit status (None: killed by a signal, or stopped by us), its stdout,
    the last lines of its stderr, and why it was stopped (`stopped`: "" if it ended by itself)."""
    host: str
    exit_status: int | None
    stdout: str
    stderr_tail: list[str]
    stopped: str = ""


async def run_remote(host: str, port: int = 22, *, args: Sequence[str], env: Mapping[str, str] | None = None,
                     tunnel: tuple[str, int] | None = None, user: str | None = None,
                     identity: str | os.PathLike | None = None, known_hosts: Any = DEFAULT,
                     python: str | Sequence[str] = "python3", connect_timeout: float = 20.0, timeout: float = 600.0,
                     push: bool = False) -> RemoteRun:
    """Run `python -m aiofabric ARGS` on `host` with `env`, and return how it ended. With `tunnel` (a host and port
    that this side reaches), SSH forwards a port of the host's 127.0.0.1 to it (remote port forwarding, which
    OpenSSH allows by default) and MASTER_ADDR/MASTER_PORT name that port: the torchrun convention for a rendezvous,
    relayed over SSH so the host needs no route to this side. A command that runs past `timeout`, or whose run is
    cancelled, is signalled by pid (TERM, then KILL) and the connection closed: nothing outlives the call."""
    where = destination(host, port, user)
    check_asyncio("run_remote", where)
    connection = await connect(host, port, user, identity, known_hosts, connect_timeout, where)
    pushed_to: str | None = None
    try:
        env = dict(env or {})
        if tunnel is not None:
            try:
                listener = await connection.forward_remote_port("127.0.0.1", 0, tunnel[0], tunnel[1])
            except Exception as exc:
                raise PeerError(f"{where}: the SSH server refused to forward a port for the rendezvous ({exc}); "
                                "allow TCP forwarding (sshd_config AllowTcpForwarding)", host=where) from None
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener.get_port()))
        if push:
            pushed_to = await push_step(connection, python, where)
        try:
            process = await connection.create_process(remote_command(python, pushed_to, args, env), encoding=None)
        except Exception as exc:
            raise PeerError(f"{where}: cannot start `aiofabric {' '.join(args)}`: {exc}", host=where) from None
        peer = SSHPeer(ProcessCarrier(process), connection, where, timeout)  # for its stderr pump and signals
        output: list[bytes] = []
        stopped = ""

        async def read_stdout() -> None:
            with contextlib.suppress(Exception):
                while chunk := await process.stdout.read(1 << 16):
                    output.append(chunk)

        def running() -> bool:
            return process.exit_status is None and process.exit_signal is None

        async def kill() -> None:
            with anyio.CancelScope(shield=True):
                for signal in ("TERM", "KILL"):
                    await peer.signal_endpoint(signal)
                    with anyio.move_on_after(SIGNAL_WAIT):
                        await process.wait_closed()
                    if not running():
                        break
                process.close()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(peer.pump_stderr)
                group.start_soon(read_stdout)
                with anyio.move_on_after(timeout):
                    await process.wait_closed()
                if running():
                    stopped = f"still running after {timeout:g} s"
                    await kill()  # its output ends with it, and with that the readers
        finally:
            if running():  # cancelled
                await kill()
        return RemoteRun(where, process.exit_status, b"".join(output).decode(errors="replace"),
                         list(peer.stderr_tail), stopped)
    finally:
        await close_connection(connection, pushed_to)
