"""What runs on a remote host: pure (no SSH, no I/O).

`remote_command` is the command line `connect_peer` and `run_remote` start: `python -m aiofabric ARGS`, every word
quoted, behind a wrapper that reports its pid. `start_error` turns an endpoint that died for want of a module into
one line saying what to install where. What a push copies there is `aiofabric.peer.push`; the SSH side of all this
is `aiofabric.peer.ssh`.
"""
from __future__ import annotations

import importlib.metadata
import re
import shlex
from typing import Iterable, Mapping, Sequence

from ..errors import PeerError

PID_MARKER = "aiofabric-endpoint-pid"  # the stderr line of the remote command's wrapper, before it execs python
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")
MISSING_NAME = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'")


def python_argv(python: str | Sequence[str]) -> list[str]:
    """The remote interpreter as argv: a command line is split as a shell would."""
    argv = shlex.split(python) if isinstance(python, str) else list(python)
    if not argv:
        raise ValueError("python must name a command, e.g. 'python3'")
    return argv


def quoted(argv: Iterable[str]) -> str:
    """`argv` as one command line the remote shell only splits: every word quoted."""
    return " ".join(shlex.quote(word) for word in argv)


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
            *python_argv(python)]
    return quoted(["sh", "-c", f'echo {PID_MARKER} $$ >&2; exec "$@"', "sh", *argv, "-m", "aiofabric", *args])


def start_error(exc: PeerError, stderr_tail: Sequence[str], where: str, python: str | Sequence[str],
                push: bool) -> PeerError:
    """An endpoint that exited before it was ready for want of a module, or of a name in one (another version than
    this side's): one line saying what to install where (else `exc` itself)."""
    argv = python_argv(python)
    started = f"{where}: the remote endpoint exited before it was ready: the remote python ({quoted(argv)})"
    found = next((match for line in reversed(stderr_tail)
                  if (match := MISSING_MODULE.search(line) or MISSING_NAME.search(line))), None)
    if found is None:
        return exc
    if found.re is MISSING_NAME:
        module = found[2].partition(".")[0]
        pin = _this_sides(module)
        return PeerError(f"{started} has a {module} without {found[1]}, another version than this side's: install "
                         f"this side's there ({quoted([*argv, '-m', 'pip', 'install', pin])})" +
                         ("" if push else " or use push=True (connect --push), which copies the versions here"),
                         host=where)
    module = found[1].partition(".")[0]
    if module == "aiofabric":
        advice = "install aiofabric there or use push=True (connect --push)"
    else:
        advice = f"install it there ({quoted([*argv, '-m', 'pip', 'install', module])})" + (
            "" if push else " or use push=True (connect --push), which also copies the packages aiofabric needs")
    return PeerError(f"{started} has no module named {module}: {advice}", host=where)


def _this_sides(module: str) -> str:
    """`distribution==version` of the distribution that installed `module` here, or the module's name."""
    names = importlib.metadata.packages_distributions().get(module, [])
    try:
        return f"{names[0]}=={importlib.metadata.version(names[0])}"
    except (IndexError, importlib.metadata.PackageNotFoundError):
        return module
