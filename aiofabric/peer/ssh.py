"""`connect_peer`: a remote endpoint started over SSH (asyncssh). The only module that imports asyncssh.

asyncssh runs on asyncio only (uvloop included); on trio, `connect_peer` raises `PeerError` saying so, before
asyncssh is even imported.

Security: host keys are checked against ~/.ssh/known_hosts unless the caller passes another file or, explicitly,
`known_hosts=None` (logged as a warning). The remote command is built from a fixed argv, each word `shlex.quote`d,
so no user-supplied text (the python command, a pushed directory) is ever interpreted by the remote shell; request
fields travel as JSON data on stdin, never on a command line.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import anyio
import sniffio

from . import PeerError
from ..taskgroups import own_task_group
from .client import Peer

if TYPE_CHECKING:
    import asyncssh


log = logging.getLogger("aiofabric.peer")
DEFAULT: Any = object()  # known_hosts default: ~/.ssh/known_hosts
STOP_GRACE = 5.0  # seconds the endpoint gets to close its NICs after end of input, before it is signalled
STDERR_TAIL = 12  # remote stderr lines kept for error messages
PACKAGE_DIR = Path(__file__).resolve().parent.parent


class _ProcessCarrier:
    """The endpoint's stdin/stdout over an SSH session channel."""

    def __init__(self, process: asyncssh.SSHClientProcess) -> None:
        self.process = process

    async def send(self, data: bytes) -> None:
        self.process.stdin.write(data)
        await self.process.stdin.drain()

    async def receive(self) -> bytes:
        return await self.process.stdout.read(1 << 16)


class SSHPeer(Peer):
    """A `Peer` whose endpoint runs over SSH. `handshake_s`: SSH connect + endpoint start (+ push) in seconds;
    `pushed_to`: the remote temp dir the package was copied to, if it was."""

    def __init__(self, carrier: _ProcessCarrier, host: str, command_timeout: float) -> None:
        self.process = carrier.process
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.handshake_s = 0.0
        self.pushed_to: str | None = None
        super().__init__(carrier, host, command_timeout=command_timeout, describe_exit=self._exit_text,
                         stop=self._abort)

    async def _exit_text(self) -> str:
        with anyio.move_on_after(1):
            await self.process.wait_closed()
        status, signal = self.process.exit_status, self.process.exit_signal
        how = f"exit status {status}" if status is not None else (
            f"killed by signal {signal[0]}" if signal else "connection closed")
        tail = " | ".join(self.stderr_tail)
        return f"{how}{'; stderr: ' + tail if tail else ''}"

    def _abort(self) -> None:
        """Stop the endpoint now (a timeout or a broken protocol): signal it and close its channel."""
        with contextlib.suppress(Exception):
            self.process.send_signal("KILL")
        with contextlib.suppress(Exception):
            self.process.close()

    async def pump_stderr(self) -> None:
        """Forward the endpoint's stderr to logging, one record per line, prefixed with the host."""
        try:
            async for raw in self.process.stderr:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    self.stderr_tail.append(line)
                    log.warning("%s: %s", self.host, line)
        except Exception:  # the channel went away: the reader reports it
            pass

    async def stop(self) -> None:
        """Close stdin (the endpoint closes its NICs and exits 0), wait STOP_GRACE, then TERM, then KILL."""
        process = self.process
        with contextlib.suppress(Exception):
            process.stdin.write_eof()
        for signal in (None, "TERM", "KILL"):
            if signal is not None:
                with contextlib.suppress(Exception):
                    process.send_signal(signal)
            with anyio.move_on_after(STOP_GRACE if signal is None else 2):
                with contextlib.suppress(Exception):
                    await process.wait_closed()
            if process.exit_status is not None or process.exit_signal is not None:
                break
        process.close()


def _known_hosts_option(known_hosts: Any, where: str) -> Any:
    if known_hosts is None:
        log.warning("%s: host key NOT checked (known_hosts=None): anyone on the path can impersonate this host",
                    where)
        return None
    if known_hosts is DEFAULT:
        known_hosts = os.path.expanduser("~/.ssh/known_hosts")
    if isinstance(known_hosts, (str, os.PathLike)):
        import asyncssh
        path = os.fspath(known_hosts)
        return asyncssh.read_known_hosts(path) if os.path.exists(path) else asyncssh.import_known_hosts("")
    return known_hosts


def _host_key_error(exc: Exception, known: Any, host: str, port: int, where: str, file: str) -> PeerError:
    import asyncssh
    try:
        listed = known is not None and bool(asyncssh.match_known_hosts(known, host, host, port)[0])
    except Exception:
        listed = False
    if listed:
        return PeerError(f"{where}: host key does NOT match the one in {file}: someone may be impersonating the "
                         f"host, or its key changed; check it before removing the old entry ({exc})", host=where)
    return PeerError(f"{where}: host key unknown (not in {file}): add it (ssh-keyscan -p {port} {host} >> {file}) or "
                     f"pass known_hosts=None / --known-hosts none to skip the check ({exc})", host=where)


async def _connect(host: str, port: int, user: str | None, identity: str | os.PathLike | None, known_hosts: Any,
                   connect_timeout: float, where: str) -> asyncssh.SSHClientConnection:
    import asyncssh
    file = "~/.ssh/known_hosts" if known_hosts is DEFAULT else str(known_hosts)
    known = _known_hosts_option(known_hosts, where)
    options: dict[str, Any] = {"known_hosts": known, "connect_timeout": connect_timeout}
    if user is not None:
        options["username"] = user
    if identity is not None:
        options["client_keys"] = [os.fspath(identity)]
        options["agent_path"] = None
    try:
        with anyio.fail_after(connect_timeout):
            return await asyncssh.connect(host, port, **options)
    except TimeoutError:
        raise PeerError(f"{where}: SSH connection timed out after {connect_timeout:g} s", host=where) from None
    except asyncssh.HostKeyNotVerifiable as exc:
        raise _host_key_error(exc, known, host, port, where, file) from None
    except asyncssh.PermissionDenied as exc:
        keys = os.fspath(identity) if identity is not None else "the agent's and ~/.ssh's default keys"
        raise PeerError(f"{where}: authentication refused for user {user or 'default'} (tried {keys}): {exc}",
                        host=where) from None
    except asyncssh.Error as exc:
        raise PeerError(f"{where}: SSH failed: {type(exc).__name__}: {exc}", host=where) from None
    except OSError as exc:
        raise PeerError(f"{where}: cannot reach the SSH server: {exc.strerror or exc}", host=where) from None


def _package_files() -> list[Path]:
    return sorted(path for path in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in path.parts)


async def push(connection: asyncssh.SSHClientConnection, where: str = "") -> str:
    """Copy this aiofabric package (its .py files) into a new private (0700) temp dir on the remote host over SFTP;
    the dir, to put on PYTHONPATH. The caller removes it (`connect_peer` does, on the way out)."""
    result = await connection.run("mktemp -d -t aiofabric-push.XXXXXXXX", check=False)
    remote_dir = str(result.stdout or "").strip()
    if result.exit_status != 0 or not remote_dir.startswith("/"):
        raise PeerError(f"{where}: push: cannot make a temp dir on the remote host: {str(result.stderr).strip()}",
                        host=where)
    async with connection.start_sftp_client() as sftp:
        files = _package_files()
        for directory in sorted({path.parent for path in files}):
            relative = directory.relative_to(PACKAGE_DIR.parent).as_posix()
            await sftp.makedirs(f"{remote_dir}/{relative}", exist_ok=True)
            await sftp.put([os.fspath(path) for path in files if path.parent == directory],
                           f"{remote_dir}/{relative}")
    return remote_dir


def remote_command(python: str | Sequence[str], pushed_to: str | None = None) -> str:
    """The endpoint's command line: every word quoted, so the remote shell only splits it."""
    argv = shlex.split(python) if isinstance(python, str) else list(python)
    if not argv:
        raise ValueError("python must name a command, e.g. 'python3'")
    if pushed_to is not None:
        argv = ["env", f"PYTHONPATH={pushed_to}", *argv]
    return " ".join(shlex.quote(word) for word in [*argv, "-m", "aiofabric", "serve"])


@contextlib.asynccontextmanager
async def connect_peer(host: str, port: int = 22, *, user: str | None = None,
                       identity: str | os.PathLike | None = None, known_hosts: Any = DEFAULT,
                       python: str | Sequence[str] = "python3", connect_timeout: float = 20.0,
                       command_timeout: float = 60.0, push: bool = False) -> AsyncIterator[SSHPeer]:
    """Start `python -m aiofabric serve` on `host` over SSH and talk to it as an `SSHPeer`.

    `identity`: a private key file (default: the SSH agent and ~/.ssh's keys). `known_hosts`: a known_hosts file
    (default ~/.ssh/known_hosts), or None to skip the host key check (insecure, logged). `python`: the remote
    interpreter, a command or argv (quoted word by word). `connect_timeout` bounds the SSH connection and the
    endpoint's start; `command_timeout` each request. `push=True` copies this package over SFTP into a private temp
    dir on the host and runs it from there, for hosts that cannot import aiofabric (its dependencies must be there).

    Leaving the block, or cancelling it, closes the endpoint's stdin (it closes its NICs and exits), signals it if
    it does not exit, closes the connection and removes a pushed dir: no process outlives the block on either side.
    """
    where = f"{user + '@' if user else ''}{host}:{port}"
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = "no event loop"
    if library != "asyncio":
        raise PeerError(f"connect_peer needs asyncio or uvloop (asyncssh is asyncio-only), not {library}: run with "
                        "anyio.run(..., backend='asyncio') or aiofabric --backend asyncio", host=where)
    started = time.perf_counter()
    connection = await _connect(host, port, user, identity, known_hosts, connect_timeout, where)
    peer: SSHPeer | None = None
    pushed_to: str | None = None
    try:
        async with own_task_group() as tasks:
            try:
                try:
                    with anyio.fail_after(max(0.1, connect_timeout - (time.perf_counter() - started))):
                        if push:
                            pushed_to = await _push_step(connection, where)
                        try:
                            process = await connection.create_process(remote_command(python, pushed_to),
                                                                      encoding=None)
                        except Exception as exc:
                            raise PeerError(f"{where}: cannot start the remote endpoint: {exc}",
                                            host=where) from None
                except TimeoutError:
                    raise PeerError(f"{where}: the remote endpoint did not start within {connect_timeout:g} s",
                                    host=where) from None
                peer = SSHPeer(_ProcessCarrier(process), where, command_timeout)
                peer.pushed_to = pushed_to
                tasks.start_soon(peer.reader)
                tasks.start_soon(peer.pump_stderr)
                try:
                    await peer.wait_ready(max(0.1, connect_timeout - (time.perf_counter() - started)),
                                          budget=connect_timeout)
                except PeerError as exc:
                    hint = ("; the remote python cannot import aiofabric: install it there or use push=True "
                            "(connect --push)") if "No module named aiofabric" in str(exc) else ""
                    raise PeerError(f"{exc}{hint}", host=where) from None
                peer.handshake_s = time.perf_counter() - started
                yield peer
            finally:
                with anyio.CancelScope(shield=True):
                    if peer is not None:
                        with anyio.move_on_after(STOP_GRACE + 6):
                            await peer.stop()
                    tasks.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            if pushed_to:
                with contextlib.suppress(Exception):
                    await connection.run(f"rm -rf -- {shlex.quote(pushed_to)}", check=False)
            connection.close()
            with contextlib.suppress(Exception):
                await connection.wait_closed()


async def _push_step(connection: asyncssh.SSHClientConnection, where: str) -> str:
    try:
        return await push(connection, where)
    except PeerError:
        raise
    except Exception as exc:
        raise PeerError(f"{where}: push over SFTP failed: {type(exc).__name__}: {exc}", host=where) from None
