"""`connect_peer`: a remote endpoint started over SSH (asyncssh). The only module that imports asyncssh.

Here are the SSH connection (`connect`), the peer object over its session channel (`SSHPeer`), `connect_peer`, and
the SFTP half of a push; what the remote side runs is `aiofabric.peer.launch`, what a push copies
`aiofabric.peer.push`.

asyncssh runs on asyncio only (uvloop included); on trio, `connect_peer` raises `PeerError` saying so, before
asyncssh is even imported.

Security: host keys are checked against ~/.ssh/known_hosts unless the caller passes another file or, explicitly,
`known_hosts=None` (logged as a warning). The remote command is built from a fixed argv, each word `shlex.quote`d,
so no user-supplied text (the python command, a pushed directory) is ever interpreted by the remote shell; request
fields travel as JSON data on stdin, never on a command line.

Remote processes: the endpoint exits at the end of its stdin. Nothing more can be counted on: OpenSSH's sshd does
not signal a command when its channel closes, and ignores a channel's signal requests for root logins. So the
command reports its pid on stderr before it becomes the endpoint, and one that does not exit in time is signalled by
pid over a second session (`kill`); its emulators exit with their driver.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
from collections import deque
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import anyio

from .client import Peer
from .launch import PID_MARKER, python_argv, remote_command, start_error
from .push import endpoint_distributions, probe_answer, probe_command, push_plan
from ..errors import PeerError
from ..util.taskgroups import own_task_group, run_in
from ..verbs import CLOSE_TIMEOUT

if TYPE_CHECKING:
    import asyncssh


log = logging.getLogger("aiofabric.peer")
DEFAULT: Any = object()  # known_hosts default: ~/.ssh/known_hosts
# Seconds the endpoint gets to close its NICs after end of input, before it is signalled: the whole close budget, so a
# slow firmware is waited for rather than the endpoint killed mid-close (a kill is safe all the same: the function is
# reset when its VFIO file closes, and on the raw sysfs path at the next open).
STOP_GRACE = CLOSE_TIMEOUT + 1.0
ABORT_GRACE = 1.0  # the same for an aborted endpoint (its input ended and it was signalled already)
SIGNAL_WAIT = 2.0  # seconds each signal gets to end the endpoint, and to be delivered by `kill`
STDERR_TAIL = 12  # remote stderr lines kept for error messages
# Bytes: a longer stderr line is forwarded (and kept) in pieces, so a remote that writes gigabytes, newline or not,
# costs this side at most STDERR_TAIL pieces.
STDERR_LINE_MAX = 1024
PUSH_IN_FLIGHT = 16  # files a push copies at once: numpy alone is some 1,500 files, each a few round trips


class ProcessCarrier:
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
    `pushed_to`: the remote temp dir the package was copied to, if it was; `endpoint_pid`: the remote process."""

    def __init__(self, carrier: ProcessCarrier, connection: asyncssh.SSHClientConnection, host: str,
                 command_timeout: float) -> None:
        self.process = carrier.process
        self.connection = connection
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.stderr_done = anyio.Event()
        self.endpoint_pid = 0
        self.handshake_s = 0.0
        self.pushed_to: str | None = None
        super().__init__(carrier, host, command_timeout=command_timeout, describe_exit=self._exit_text,
                         stop=self._abort)

    async def _exit_text(self) -> str:
        with anyio.move_on_after(1):
            await self.process.wait_closed()
            await self.stderr_done.wait()  # its last lines say why
        status, signal = self.process.exit_status, self.process.exit_signal
        how = f"exit status {status}" if status is not None else (
            f"killed by signal {signal[0]}" if signal else "connection closed")
        tail = " | ".join(self.stderr_tail)
        return f"{how}{'; stderr: ' + tail if tail else ''}"

    def _abort(self) -> None:
        """Stop the endpoint now (a timeout or a broken protocol): signal it and end its input. The channel stays
        open for its exit status; `stop` kills it by pid if it is still there."""
        with contextlib.suppress(Exception):
            self.process.send_signal("KILL")
        with contextlib.suppress(Exception):
            self.process.stdin.write_eof()

    async def pump_stderr(self) -> None:
        """Forward the endpoint's stderr to logging, one record per line (or piece of STDERR_LINE_MAX bytes),
        prefixed with the host; keep the last STDERR_TAIL for errors; take the wrapper's pid line."""
        pending = b""
        try:
            while chunk := await self.process.stderr.read(1 << 16):
                *lines, pending = (pending + chunk).split(b"\n")
                if len(pending) >= STDERR_LINE_MAX:  # no newline for a while: forward what came
                    lines.append(pending)
                    pending = b""
                for line in lines:
                    self._stderr_line(line)
            self._stderr_line(pending)
        except Exception:  # the channel went away: the reader reports it
            pass
        finally:
            self.stderr_done.set()

    def _stderr_line(self, raw: bytes) -> None:
        for start in range(0, len(raw), STDERR_LINE_MAX):
            line = raw[start:start + STDERR_LINE_MAX].decode(errors="replace").rstrip()
            pid = line.removeprefix(PID_MARKER + " ")
            if not self.endpoint_pid and pid != line and pid.isdigit():
                self.endpoint_pid = int(pid)
            elif line:
                self.stderr_tail.append(line)
                log.warning("%s: %s", self.host, line)

    async def signal_endpoint(self, signal: str) -> None:
        """Signal the endpoint over its channel, and by pid over a second session (OpenSSH ignores the first for
        root logins)."""
        with contextlib.suppress(Exception):
            self.process.send_signal(signal)
        pid = self.endpoint_pid or self.remote_pid
        if pid:
            with anyio.move_on_after(SIGNAL_WAIT), contextlib.suppress(Exception):
                await self.connection.run(f"kill -s {signal} {pid}", check=False)

    async def stop(self) -> None:
        """End the endpoint's input (it closes its NICs and exits 0) and give it STOP_GRACE s (ABORT_GRACE if the
        peer failed), then TERM, then KILL, each given SIGNAL_WAIT s; close the channel."""
        process = self.process
        with contextlib.suppress(Exception):
            process.stdin.write_eof()
        grace = STOP_GRACE if self.failure is None else ABORT_GRACE
        for wait, signal in ((grace, "TERM"), (SIGNAL_WAIT, "KILL"), (SIGNAL_WAIT, None)):
            with anyio.move_on_after(wait), contextlib.suppress(Exception):
                await process.wait_closed()
            if process.exit_status is not None or process.exit_signal is not None or signal is None:
                break
            await self.signal_endpoint(signal)
        process.close()


def destination(host: str, port: int, user: str | None) -> str:
    """`[user@]host:port`: how errors name an SSH destination."""
    return f"{user + '@' if user else ''}{host}:{port}"


def check_asyncio(what: str, where: str, advice: str = "") -> None:
    """PeerError unless the running async library is asyncio ("asyncio" under uvloop too): asyncssh runs on nothing
    else. Not sniffio: it is not a dependency (current anyio no longer needs it); anyio's cancellation class is the
    running backend's own (asyncio's or trio's)."""
    library = anyio.get_cancelled_exc_class().__module__.partition(".")[0]
    if library != "asyncio":
        raise PeerError(f"{what} needs asyncio or uvloop (asyncssh is asyncio-only), not {library}{advice}",
                        host=where)


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


async def connect(host: str, port: int, user: str | None, identity: str | os.PathLike | None, known_hosts: Any,
                  connect_timeout: float, where: str) -> asyncssh.SSHClientConnection:
    """An SSH connection to `host`, its host key checked (see the module docstring); PeerError naming `where` and
    what to do otherwise."""
    import asyncssh
    file = "~/.ssh/known_hosts" if known_hosts is DEFAULT else str(known_hosts)
    known = _known_hosts_option(known_hosts, where)
    options: dict[str, Any] = {"known_hosts": known, "connect_timeout": connect_timeout}
    if user is not None:
        options["username"] = user
    if identity is not None:
        try:  # asyncssh reads it only after connecting, and a missing one read as "cannot reach the SSH server"
            with open(identity, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"identity {os.fspath(identity)!r}: cannot read the private key file: "
                             f"{exc.strerror or exc}") from None
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


async def _upload(sftp: asyncssh.SFTPClient, remote_dir: str, files: list[tuple[Path, PurePath]]) -> None:
    """Put each (root, file) at `remote_dir`/file, PUSH_IN_FLIGHT files at a time."""
    for directory in sorted({file.parent.as_posix() for _, file in files}):
        await sftp.makedirs(f"{remote_dir}/{directory}", exist_ok=True)
    limiter = anyio.CapacityLimiter(PUSH_IN_FLIGHT)

    async def put(root: Path, file: PurePath) -> None:
        async with limiter:
            await sftp.put(os.fspath(root / file), f"{remote_dir}/{file.as_posix()}")

    async with anyio.create_task_group() as tasks:
        for root, file in files:
            tasks.start_soon(put, root, file)


async def _remove(connection: asyncssh.SSHClientConnection, remote_dir: str) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(Exception):
        await connection.run(f"rm -rf -- {shlex.quote(remote_dir)}", check=False)


async def push(connection: asyncssh.SSHClientConnection, python: str | Sequence[str] = "python3",
               where: str = "") -> str:
    """Copy this aiofabric package and the distributions it needs that the remote `python` lacks or has in another
    version (`push_plan`) into a new private (0700) temp dir on the remote host over SFTP; the dir, to put on
    PYTHONPATH. The caller removes the dir (`connect_peer` does)."""
    argv = python_argv(python)
    needed = endpoint_distributions()
    result = await connection.run(probe_command(argv, needed), check=False)
    remote = probe_answer(result.stdout, result.stderr, result.exit_status, argv, where)
    remote_dir = remote["dir"]
    try:
        plan = push_plan(remote, needed, argv, where)
        log.info("%s: push: aiofabric%s", where, "".join(f", {named}" for named in plan.shipped))
        if plan.kept:
            log.warning("%s: push: %s: the remote's own version runs (compiled packages built here for another "
                        "Python or platform cannot be copied)", where, ", ".join(plan.kept))
        async with connection.start_sftp_client() as sftp:
            await _upload(sftp, remote_dir, plan.files)
    except BaseException:
        await _remove(connection, remote_dir)
        raise
    return remote_dir


async def push_step(connection: asyncssh.SSHClientConnection, python: str | Sequence[str], where: str) -> str:
    """`push`, any failure a PeerError naming `where`."""
    try:
        return await push(connection, python, where)
    except PeerError:
        raise
    except Exception as exc:
        raise PeerError(f"{where}: push over SFTP failed: {type(exc).__name__}: {exc}", host=where) from None


async def close_connection(connection: asyncssh.SSHClientConnection, pushed_to: str | None) -> None:
    """Remove a pushed dir, then close the connection (at most 5 s), shielded: cancellation still cleans up."""
    with anyio.CancelScope(shield=True):
        if pushed_to:
            await _remove(connection, pushed_to)
        with anyio.move_on_after(5):
            connection.close()
            with contextlib.suppress(Exception):
                await connection.wait_closed()


@contextlib.asynccontextmanager
async def connect_peer(host: str, port: int = 22, *, user: str | None = None,
                       identity: str | os.PathLike | None = None, known_hosts: Any = DEFAULT,
                       python: str | Sequence[str] = "python3", connect_timeout: float = 20.0,
                       command_timeout: float = 60.0, push: bool = False) -> AsyncIterator[SSHPeer]:
    """Start `python -m aiofabric serve` on `host` over SSH and talk to it as an `SSHPeer`.

    `identity`: a private key file (default: the SSH agent and ~/.ssh's keys). `known_hosts`: a known_hosts file
    (default ~/.ssh/known_hosts), or None to skip the host key check (insecure, logged). `python`: the remote
    interpreter, a command or argv (quoted word by word). `connect_timeout` bounds the SSH connection and the
    endpoint's start (and a push); `command_timeout` each request. `push=True` copies this package over SFTP into a
    private temp dir on the host and runs it from there, for hosts that cannot import aiofabric, with the packages it
    needs that the remote python lacks or has in another version (see `push`).

    Leaving the block, or cancelling it, closes the endpoint's stdin (it closes its NICs and exits), signals it if
    it does not exit (over the channel and by pid), closes the connection and removes a pushed dir: no process
    outlives the block on either side.
    """
    where = destination(host, port, user)
    check_asyncio("connect_peer", where, ": run with anyio.run(..., backend='asyncio') or aiofabric --backend asyncio")
    started = time.perf_counter()
    connection = await connect(host, port, user, identity, known_hosts, connect_timeout, where)
    peer: SSHPeer | None = None
    pushed_to: str | None = None
    # The reader and the stderr pump are shielded from the caller's cancellation (Ctrl-C in the CLI): its shielded
    # clean-up (closing remote objects) still needs the answers read. They end when these scopes are cancelled.
    background = [anyio.CancelScope(shield=True), anyio.CancelScope(shield=True)]
    try:
        async with own_task_group() as tasks:
            try:
                try:
                    with anyio.fail_after(max(0.1, connect_timeout - (time.perf_counter() - started))):
                        if push:
                            pushed_to = await push_step(connection, python, where)
                        try:
                            process = await connection.create_process(remote_command(python, pushed_to),
                                                                      encoding=None)
                        except Exception as exc:
                            raise PeerError(f"{where}: cannot start the remote endpoint: {exc}",
                                            host=where) from None
                except TimeoutError:
                    raise PeerError(f"{where}: the remote endpoint did not start within {connect_timeout:g} s",
                                    host=where) from None
                peer = SSHPeer(ProcessCarrier(process), connection, where, command_timeout)
                peer.pushed_to = pushed_to
                for function, scope in zip((peer.reader, peer.pump_stderr), background):
                    tasks.start_soon(run_in, scope, function)
                try:
                    await peer.wait_ready(max(0.1, connect_timeout - (time.perf_counter() - started)),
                                          budget=connect_timeout)
                except PeerError as exc:
                    raise start_error(exc, peer.stderr_tail, where, python, push) from None
                peer.handshake_s = time.perf_counter() - started
                yield peer
            finally:
                with anyio.CancelScope(shield=True):
                    if peer is not None:
                        with anyio.move_on_after(STOP_GRACE + 3 * SIGNAL_WAIT + 2):
                            await peer.stop()
                    for scope in background:
                        scope.cancel()
                    tasks.cancel_scope.cancel()
    finally:
        await close_connection(connection, pushed_to)
