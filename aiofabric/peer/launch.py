"""What runs on a remote host, and what it needs there: pure (no SSH, no I/O beyond reading this installation).

`remote_command` is the command line `connect_peer` and `run_remote` start: `python -m aiofabric ARGS`, every word
quoted, behind a wrapper that reports its pid. A push (`connect --push`) copies this package, and the distributions
it needs that the remote python lacks, to a temp dir there: `PROBE` asks the remote python what it has, and
`push_files` says what to copy. `start_error` turns an endpoint that died for want of a module into one line saying
what to install where. The SSH side of all this is `aiofabric.peer.ssh`.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import sysconfig
from pathlib import Path, PurePath
from typing import Any, Iterable, Mapping, Sequence

from ..errors import PeerError

PID_MARKER = "aiofabric-endpoint-pid"  # the stderr line of the remote command's wrapper, before it execs python
PACKAGE_DIR = Path(__file__).resolve().parent.parent
CLIENT_ONLY = {"asyncssh"}  # requirements only this side imports: the endpoint never opens SSH
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")
# The remote python's side of a push: a private (0700) temp dir, its version, ABI and platform, and which of the
# distributions named in argv it lacks. One line (any login shell passes it on) in Python 3.8's syntax.
PROBE = ("import importlib.metadata as m, json, sys, sysconfig, tempfile; print(json.dumps({"
         "'dir': tempfile.mkdtemp(prefix='aiofabric-push.'), 'python': sys.version.split()[0], "
         "'abi': [sysconfig.get_config_var('SOABI'), sysconfig.get_platform()], "
         "'missing': [name for name in sys.argv[1:] if next(iter(m.distributions(name=name)), None) is None]}))")

Distributions = dict[str, tuple[importlib.metadata.Distribution, str]]  # normalized name -> (distribution, requirement)


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


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def endpoint_distributions() -> Distributions:
    """The installed distributions the endpoint imports besides aiofabric, {normalized name: (distribution,
    requirement)}: aiofabric's requirements but CLIENT_ONLY, and theirs, without extras. A requirement not installed
    here is left out (its marker excludes this python), and all are when aiofabric runs from a source tree."""
    try:
        todo = importlib.metadata.requires("aiofabric") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    found: Distributions = {}
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


def probe_command(argv: list[str], needed: Distributions) -> str:
    """The command that runs PROBE with the remote python, asking about the distributions `needed`."""
    return quoted([*argv, "-c", PROBE, *(distribution.metadata["Name"] for distribution, _ in needed.values())])


def probe_answer(stdout: Any, stderr: Any, exit_status: int | None, argv: list[str], where: str) -> dict[str, Any]:
    """What PROBE printed (its last line: "dir", "python", "abi", "missing"); PeerError if the python did not run."""
    try:
        remote = json.loads(str(stdout).strip().splitlines()[-1])
        remote["dir"]  # KeyError or TypeError: not PROBE's answer
    except (ValueError, IndexError, KeyError, TypeError):
        lines = str(stderr or "").strip().splitlines()
        raise PeerError(f"{where}: push: the remote python ({quoted(argv)}) did not run: "
                        f"{lines[-1] if lines else f'exit status {exit_status}'}", host=where) from None
    return remote


def push_files(remote: dict[str, Any], needed: Distributions, argv: list[str],
               where: str) -> list[tuple[Path, PurePath]]:
    """What a push copies, as (root, file relative to it): this package's .py files and the files of each
    distribution the remote python lacks. Pure-Python distributions come from this side's installation; compiled
    ones (numpy, isal) only to the same Python ABI and platform, else a PeerError says what to install there."""
    missing = [needed[_normalized(name)] for name in remote["missing"]]
    here = [sysconfig.get_config_var("SOABI"), sysconfig.get_platform()]
    blocked = [requirement for distribution, requirement in missing
               if remote["abi"] != here and not _is_pure(distribution)]
    if blocked:
        install = quoted([*argv, "-m", "pip", "install", *blocked])
        raise PeerError(f"{where}: push: the remote python ({quoted(argv)}: {remote['python']}, "
                        f"{' '.join(map(str, remote['abi']))}) lacks compiled packages built here for "
                        f"{' '.join(map(str, here))}: install them there: {install}", host=where)
    files: list[tuple[Path, PurePath]] = [(PACKAGE_DIR.parent, path.relative_to(PACKAGE_DIR.parent))
                                          for path in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in path.parts]
    for distribution, _ in missing:
        root = Path(str(distribution.locate_file("")))
        files += [(root, file) for file in _distribution_files(distribution)]
    return files


def start_error(exc: PeerError, stderr_tail: Sequence[str], where: str, python: str | Sequence[str],
                push: bool) -> PeerError:
    """An endpoint that exited before it was ready for want of a module: one line saying what to install where
    (else `exc` itself)."""
    module = next((match[1].partition(".")[0] for line in reversed(stderr_tail)
                   if (match := MISSING_MODULE.search(line))), None)
    if module is None:
        return exc
    argv = python_argv(python)
    if module == "aiofabric":
        advice = "install aiofabric there or use push=True (connect --push)"
    else:
        advice = f"install it there ({quoted([*argv, '-m', 'pip', 'install', module])})" + (
            "" if push else " or use push=True (connect --push), which also copies the packages aiofabric needs")
    return PeerError(f"{where}: the remote endpoint exited before it was ready: the remote python ({quoted(argv)}) "
                     f"has no module named {module}: {advice}", host=where)
