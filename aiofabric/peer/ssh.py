"""`connect_peer`: a remote endpoint started over SSH (asyncssh). The only module that imports asyncssh.

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
import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import shlex
import sysconfig
import time
from collections import deque
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Mapping, Sequence

import anyio

from . import PeerError
from .client import Peer
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
PID_MARKER = "aiofabric-endpoint-pid"  # the stderr line of the remote command's wrapper, before it execs python
PACKAGE_DIR = Path(__file__).resolve().parent.parent
PUSH_IN_FLIGHT = 16  # files a push copies at once: numpy alone is some 1,500 files, each a few round trips
CLIENT_ONLY = {"asyncssh"}  # requirements only this side imports: the endpoint never opens SSH
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")
# The remote python's side of a push: a private (0700) temp dir, its version, ABI and platform, and which of the
# distributions named in argv it lacks. One line (any login shell passes it on) in Python 3.8's syntax.
PROBE = ("import importlib.metadata as m, json, sys, sysconfig, tempfile; print(json.dumps({"
         "'dir': tempfile.mkdtemp(prefix='aiofabric-push.'), 'python': sys.version.split()[0], "
         "'abi': [sysconfig.get_config_var('SOABI'), sysconfig.get_platform()], "
         "'missing': [name for name in sys.argv[1:] if next(iter(m.distributions(name=name)), None) is None]}))")


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
    `pushed_to`: the remote temp dir the package was copied to, if it was; `endpoint_pid`: the remote process."""

    def __init__(self, carrier: _ProcessCarrier, connection: asyncssh.SSHClientConnection, host: str,
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

    async def _signal(self, signal: str) -> None:
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
            await self._signal(signal)
        process.close()


def _async_library() -> str:
    """The running async library, "asyncio" under uvloop too. Not sniffio: it is not a dependency (current anyio
    no longer needs it); anyio's cancellation class is the running backend's own (asyncio's or trio's)."""
    return anyio.get_cancelled_exc_class().__module__.partition(".")[0]


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


def _argv(python: str | Sequence[str]) -> list[str]:
    argv = shlex.split(python) if isinstance(python, str) else list(python)
    if not argv:
        raise ValueError("python must name a command, e.g. 'python3'")
    return argv


def _quoted(argv: Iterable[str]) -> str:
    return " ".join(shlex.quote(word) for word in argv)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def endpoint_distributions() -> dict[str, tuple[importlib.metadata.Distribution, str]]:
    """The installed distributions the endpoint imports besides aiofabric, {normalized name: (distribution,
    requirement)}: aiofabric's requirements but CLIENT_ONLY, and theirs, without extras. A requirement not installed
    here is left out (its marker excludes this python), and all are when aiofabric runs from a source tree."""
    try:
        todo = importlib.metadata.requires("aiofabric") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found: dict[str, tuple[importlib.metadata.Distribution, str]] = {}
    while todo:
        requirement, _, marker = todo.pop(0).partition(";")
        name = _normalized(re.split(r"[\s<>=!~\[(@]", requirement.strip(), maxsplit=1)[0])
        if "extra" in marker or name in found or name in CLIENT_ONLY:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = (distribution, requirement.strip())
        todo += distribution.requires or []
    return found


def _distribution_files(distribution: importlib.metadata.Distribution) -> list[PurePath]:
    """Its installed files (its RECORD), relative to its site directory (`locate_file("")`), without scripts or
    bytecode."""
    root = Path(str(distribution.locate_file("")))
    return [file for file in distribution.files or [] if file.parts[0] != ".." and "__pycache__" not in file.parts
            and (root / file).is_file()]


def _is_pure(distribution: importlib.metadata.Distribution) -> bool:
    return not any(file.suffix in (".so", ".pyd") or ".so." in file.name for file in distribution.files or [])


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
    """Copy this aiofabric package (its .py files), and the distributions it needs that the remote `python` lacks,
    into a new private (0700) temp dir on the remote host over SFTP; the dir, to put on PYTHONPATH. Pure-Python
    distributions are copied from this side's installation; compiled ones (numpy, isal) only to the same Python ABI
    and platform, else a PeerError says what to install there. The caller removes the dir (`connect_peer` does)."""
    argv = _argv(python)
    needed = endpoint_distributions()
    names = [distribution.metadata["Name"] for distribution, _ in needed.values()]
    result = await connection.run(_quoted([*argv, "-c", PROBE, *names]), check=False)
    try:
        remote = json.loads(str(result.stdout).strip().splitlines()[-1])
        remote_dir = remote["dir"]
    except (ValueError, IndexError, KeyError, TypeError):
        stderr = str(result.stderr or "").strip().splitlines()
        raise PeerError(f"{where}: push: the remote python ({_quoted(argv)}) did not run: "
                        f"{stderr[-1] if stderr else f'exit status {result.exit_status}'}", host=where) from None
    try:
        missing = [needed[_normalized(name)] for name in remote["missing"]]
        here = [sysconfig.get_config_var("SOABI"), sysconfig.get_platform()]
        blocked = [requirement for distribution, requirement in missing
                   if remote["abi"] != here and not _is_pure(distribution)]
        if blocked:
            install = _quoted([*argv, "-m", "pip", "install", *blocked])
            raise PeerError(f"{where}: push: the remote python ({_quoted(argv)}: {remote['python']}, "
                            f"{' '.join(map(str, remote['abi']))}) lacks compiled packages built here for "
                            f"{' '.join(map(str, here))}: install them there: {install}", host=where)
        files: list[tuple[Path, PurePath]] = [(PACKAGE_DIR.parent, path.relative_to(PACKAGE_DIR.parent))
                                               for path in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in path.parts]
        for distribution, _ in missing:
            root = Path(str(distribution.locate_file("")))
            files += [(root, file) for file in _distribution_files(distribution)]
        async with connection.start_sftp_client() as sftp:
            await _upload(sftp, remote_dir, files)
    except BaseException:
        await _remove(connection, remote_dir)
        raise
    return remote_dir


def remote_command(python: str | Sequence[str], pushed_to: str | None = None, args: Sequence[str] = ("serve",),
                   env: Mapping[str, str] | None = None) -> str:
    """`python -m aiofabric ARGS` (the endpoint: `serve`) as a command line, every word quoted so the remote shell
    only splits it: a wrapper that reports its pid on stderr (PID_MARKER), then execs it in the same process, with
    `env` (and PYTHONPATH for a push) set through env(1): sshd passes a client's environment only where AcceptEnv
    says so."""
    variables = {**(env or {}), **({"PYTHONPATH": pushed_to} if pushed_to is not None else {})}
    for name in variables:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name")
    argv = [*(["env", *(f"{name}={value}" for name, value in variables.items())] if variables else []),
            *_argv(python)]
    return _quoted(["sh", "-c", f'echo {PID_MARKER} $$ >&2; exec "$@"', "sh", *argv, "-m", "aiofabric", *args])


def _start_error(exc: PeerError, peer: SSHPeer, python: str | Sequence[str], push: bool) -> PeerError:
    """An endpoint that exited before it was ready for want of a module: one line saying what to install where."""
    module = next((match[1].partition(".")[0] for line in reversed(peer.stderr_tail)
                   if (match := MISSING_MODULE.search(line))), None)
    if module is None:
        return exc
    where, argv = peer.host, _argv(python)
    if module == "aiofabric":
        advice = "install aiofabric there or use push=True (connect --push)"
    else:
        advice = f"install it there ({_quoted([*argv, '-m', 'pip', 'install', module])})" + (
            "" if push else " or use push=True (connect --push), which also copies the packages aiofabric needs")
    return PeerError(f"{where}: the remote endpoint exited before it was ready: the remote python ({_quoted(argv)}) "
                     f"has no module named {module}: {advice}", host=where)


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
    needs that the remote python lacks (see `push`).

    Leaving the block, or cancelling it, closes the endpoint's stdin (it closes its NICs and exits), signals it if
    it does not exit (over the channel and by pid), closes the connection and removes a pushed dir: no process
    outlives the block on either side.
    """
    where = f"{user + '@' if user else ''}{host}:{port}"
    library = _async_library()
    if library != "asyncio":
        raise PeerError(f"connect_peer needs asyncio or uvloop (asyncssh is asyncio-only), not {library}: run with "
                        "anyio.run(..., backend='asyncio') or aiofabric --backend asyncio", host=where)
    started = time.perf_counter()
    connection = await _connect(host, port, user, identity, known_hosts, connect_timeout, where)
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
                            pushed_to = await _push_step(connection, python, where)
                        try:
                            process = await connection.create_process(remote_command(python, pushed_to),
                                                                      encoding=None)
                        except Exception as exc:
                            raise PeerError(f"{where}: cannot start the remote endpoint: {exc}",
                                            host=where) from None
                except TimeoutError:
                    raise PeerError(f"{where}: the remote endpoint did not start within {connect_timeout:g} s",
                                    host=where) from None
                peer = SSHPeer(_ProcessCarrier(process), connection, where, command_timeout)
                peer.pushed_to = pushed_to
                for function, scope in zip((peer.reader, peer.pump_stderr), background):
                    tasks.start_soon(run_in, scope, function)
                try:
                    await peer.wait_ready(max(0.1, connect_timeout - (time.perf_counter() - started)),
                                          budget=connect_timeout)
                except PeerError as exc:
                    raise _start_error(exc, peer, python, push) from None
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
        if pushed_to:
            await _remove(connection, pushed_to)
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            connection.close()
            with contextlib.suppress(Exception):
                await connection.wait_closed()


async def _push_step(connection: asyncssh.SSHClientConnection, python: str | Sequence[str], where: str) -> str:
    try:
        return await push(connection, python, where)
    except PeerError:
        raise
    except Exception as exc:
        raise PeerError(f"{where}: push over SFTP failed: {type(exc).__name__}: {exc}", host=where) from None


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
    where = f"{user + '@' if user else ''}{host}:{port}"
    if _async_library() != "asyncio":
        raise PeerError(f"run_remote needs asyncio or uvloop (asyncssh is asyncio-only), not {_async_library()}",
                        host=where)
    connection = await _connect(host, port, user, identity, known_hosts, connect_timeout, where)
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
            pushed_to = await _push_step(connection, python, where)
        try:
            process = await connection.create_process(remote_command(python, pushed_to, args, env), encoding=None)
        except Exception as exc:
            raise PeerError(f"{where}: cannot start `aiofabric {' '.join(args)}`: {exc}", host=where) from None
        peer = SSHPeer(_ProcessCarrier(process), connection, where, timeout)  # for its stderr pump and signals
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
                    await peer._signal(signal)
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
        with anyio.CancelScope(shield=True):
            if pushed_to:
                await _remove(connection, pushed_to)
            with anyio.move_on_after(5):
                connection.close()
                with contextlib.suppress(Exception):
                    await connection.wait_closed()
