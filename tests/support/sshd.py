"""A real SSH server for the peer tests and bench/peer.py (asyncssh): public-key auth, SFTP (asyncssh's, on the real
filesystem), and each session's command really runs as `/bin/sh -c COMMAND` in a subprocess (with SSH_CONNECTION
set), as OpenSSH's sshd runs it, with stdin/stdout/stderr bridged to the channel.

When the channel closes while the command still runs (the client dropped the connection), the command's whole
process group gets SIGTERM, then SIGKILL, as sshd does with a pty. Without a pty OpenSSH's sshd does not: the command
only sees its stdin and stdout close (openssh.py runs the tests that depend on it against OpenSSH too).

In-process: `await start_server(...)` (the `server` fixture of tests/system/conftest.py). As a process (inside a
network namespace: tests/system/test_peer_netns.py; bench/peer.py):
`python tests/support/sshd.py --host IP --port 0 --host-key F --authorized-key F --cwd DIR` prints `listening PORT`
and serves until its stdin closes; with `--keys DIR` instead of the two key files it makes a host and a client key
in DIR (make_keys), authorizes the client's and writes DIR/known_hosts, which trusts it, before it says so.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

import asyncssh

CHILDREN: set[int] = set()  # pids of the commands running now (their process groups)
STARTED: list[int] = []  # every command ever started: its pid is its session id (tests look for leftovers)


def make_keys(directory: str) -> dict[str, str]:
    """Host and client keys in `directory`: paths of the host key, the client key, its public key."""
    paths = {}
    for name in ("host", "client"):
        key = asyncssh.generate_private_key("ssh-ed25519")
        path = os.path.join(directory, f"{name}_key")
        key.write_private_key(path)
        key.write_public_key(path + ".pub")
        os.chmod(path, 0o600)
        paths[name] = path
    return paths


def known_hosts_line(host: str, port: int, host_key_path: str) -> str:
    public = asyncssh.read_private_key(host_key_path).export_public_key().decode().strip()
    return f"[{host}]:{port} {public}\n" if port != 22 else f"{host} {public}\n"


async def _copy(source, sink, close_sink=None) -> None:
    try:
        while True:
            data = await source.read(1 << 16)
            if not data:
                break
            sink.write(data)
            if hasattr(sink, "drain"):
                await sink.drain()
    except Exception:
        pass
    finally:
        if close_sink is not None:
            with contextlib.suppress(Exception):
                close_sink()


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def make_handler(cwd: str):
    async def handle(process: asyncssh.SSHServerProcess) -> None:
        client, server = process.get_extra_info("peername"), process.get_extra_info("sockname")
        environment = {**os.environ, "SSH_CONNECTION": f"{client[0]} {client[1]} {server[0]} {server[1]}"}
        child = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", process.command or "", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=cwd, start_new_session=True, env=environment)
        CHILDREN.add(child.pid)
        STARTED.append(child.pid)
        copy_in = asyncio.ensure_future(_copy(process.stdin, child.stdin, child.stdin.close))
        outputs = asyncio.gather(_copy(child.stdout, process.stdout), _copy(child.stderr, process.stderr))
        finished = asyncio.ensure_future(asyncio.gather(child.wait(), outputs))
        closed = asyncio.ensure_future(process.channel.wait_closed())
        try:
            await asyncio.wait({finished, closed}, return_when=asyncio.FIRST_COMPLETED)
            if finished.done():
                process.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)
        finally:
            if child.returncode is None:  # the client went away first: stop the command, then make sure
                _signal_group(child.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(child.wait(), 3)
                except asyncio.TimeoutError:
                    _signal_group(child.pid, signal.SIGKILL)
                    await child.wait()
            _signal_group(child.pid, signal.SIGKILL)  # whatever the command left in its group
            CHILDREN.discard(child.pid)
            for task in (copy_in, finished, closed):
                task.cancel()
    return handle


class _Server(asyncssh.SSHServer):
    """Allows what OpenSSH allows by default: remote port forwarding (AllowTcpForwarding yes), which a launcher
    uses to relay a rendezvous to the hosts it starts."""

    def server_requested(self, listen_host, listen_port):
        return listen_host in ("127.0.0.1", "localhost")


async def start_server(host: str, port: int, host_key: str, authorized_key: str, cwd: str) -> asyncssh.SSHAcceptor:
    """Listen on host:port (0: any free port; `server.sockets[0].getsockname()[1]` says which)."""
    return await asyncssh.listen(
        host, port, server_factory=_Server, server_host_keys=[host_key],
        authorized_client_keys=asyncssh.import_authorized_keys(open(authorized_key).read()),
        process_factory=make_handler(cwd), encoding=None, allow_scp=False, sftp_factory=True)


async def _main(args: argparse.Namespace) -> None:
    if args.keys:
        keys = make_keys(args.keys)
        args.host_key, args.authorized_key = keys["host"], keys["client"] + ".pub"
    server = await start_server(args.host, args.port, args.host_key, args.authorized_key, args.cwd)
    port = server.sockets[0].getsockname()[1]
    if args.keys:
        with open(os.path.join(args.keys, "known_hosts"), "w") as known_hosts:
            known_hosts.write(known_hosts_line(args.host, port, args.host_key))
    print(f"listening {port}", flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_reader(sys.stdin.fileno(), lambda: done.set() if not os.read(sys.stdin.fileno(), 4096) else None)
    await done.wait()
    server.close()
    for pid in list(CHILDREN):
        _signal_group(pid, signal.SIGTERM)
    await asyncio.sleep(0.5)
    for pid in list(CHILDREN):
        _signal_group(pid, signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--host", "--cwd"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, default=0)
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--keys", help="a directory to make the keys and known_hosts in")
    keys.add_argument("--host-key")
    parser.add_argument("--authorized-key")
    arguments = parser.parse_args()
    if arguments.host_key and not arguments.authorized_key:
        parser.error("--host-key needs --authorized-key")
    asyncio.run(_main(arguments))
