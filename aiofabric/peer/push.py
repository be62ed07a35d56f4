"""What a push (`connect --push`) copies to a remote host: pure (no SSH, no I/O beyond reading this installation).

A push ships what this side's environment resolved: this package, and every distribution the endpoint imports
(aiofabric's requirements and theirs) that the remote python lacks or has in another version, so that the remote
runs the versions that run here. The copies go first on the remote's PYTHONPATH, ahead of its own. `PROBE` asks the
remote python for its version, ABI, platform and the version of each distribution; `push_plan` says what to copy.
Compiled distributions (numpy, isal) are copied only to the same Python ABI and platform; elsewhere one line says
what to install there if the remote lacks them, and the remote's own version runs if it has one. The SSH side is
`aiofabric.peer.ssh`.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import sysconfig
from pathlib import Path, PurePath
from typing import Any

from .launch import quoted
from ..errors import PeerError

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# The package as pip installs it: its modules and its package data (the emulator's C core, the results' schema)
PACKAGE_FILES = {".py", ".c", ".h", ".json", ".typed"}
CLIENT_ONLY = {"asyncssh"}  # requirements only this side imports: the endpoint never opens SSH
# The remote python's side of a push: a private (0700) temp dir, its version, ABI and platform, and the version it
# has of each distribution named in argv (null: none). One line (any login shell passes it on) in Python 3.8's syntax.
PROBE = ("import importlib.metadata as m, json, sys, sysconfig, tempfile; print(json.dumps({"
         "'dir': tempfile.mkdtemp(prefix='aiofabric-push.'), 'python': sys.version.split()[0], "
         "'abi': [sysconfig.get_config_var('SOABI'), sysconfig.get_platform()], "
         "'versions': {name: getattr(next(iter(m.distributions(name=name)), None), 'version', None) "
         "for name in sys.argv[1:]}}))")

Distributions = dict[str, tuple[importlib.metadata.Distribution, str]]  # normalized name -> (distribution, requirement)


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
    """What PROBE printed (its last line: "dir", "python", "abi", "versions"); PeerError if the python did not run."""
    try:
        remote = json.loads(str(stdout).strip().splitlines()[-1])
        if not isinstance(remote, dict) or not {"dir", "python", "abi"} <= remote.keys() or \
                not isinstance(remote.get("versions"), dict):
            raise ValueError("not PROBE's answer")
    except (ValueError, IndexError):
        lines = str(stderr or "").strip().splitlines()
        raise PeerError(f"{where}: push: the remote python ({quoted(argv)}) did not run: "
                        f"{lines[-1] if lines else f'exit status {exit_status}'}", host=where) from None
    return remote


@dataclasses.dataclass
class PushPlan:
    """What a push copies, as (root, file relative to it), and why: `shipped` the distributions copied, `kept` the
    compiled ones the remote runs in its own version, each "name version (remote: version or none)"."""
    files: list[tuple[Path, PurePath]]
    shipped: list[str]
    kept: list[str]


def push_plan(remote: dict[str, Any], needed: Distributions, argv: list[str], where: str) -> PushPlan:
    """This package's .py files and the files of each distribution the remote python lacks or has in another
    version. Compiled ones go only to the same Python ABI and platform: elsewhere, one the remote lacks is a
    PeerError saying what to install there, and one it has in another version runs in that version."""
    here = [sysconfig.get_config_var("SOABI"), sysconfig.get_platform()]
    same_abi = list(remote["abi"]) == here
    differing = [(distribution, requirement, remote["versions"].get(distribution.metadata["Name"]))
                 for distribution, requirement in needed.values()
                 if remote["versions"].get(distribution.metadata["Name"]) != distribution.version]
    blocked = [requirement for distribution, requirement, theirs in differing
               if theirs is None and not same_abi and not _is_pure(distribution)]
    if blocked:
        install = quoted([*argv, "-m", "pip", "install", *blocked])
        raise PeerError(f"{where}: push: the remote python ({quoted(argv)}: {remote['python']}, "
                        f"{' '.join(map(str, remote['abi']))}) lacks compiled packages built here for "
                        f"{' '.join(map(str, here))}: install them there: {install}", host=where)
    files: list[tuple[Path, PurePath]] = [(PACKAGE_DIR.parent, path.relative_to(PACKAGE_DIR.parent))
                                          for path in PACKAGE_DIR.rglob("*") if path.suffix in PACKAGE_FILES
                                          and "__pycache__" not in path.parts]
    plan = PushPlan(files, [], [])
    for distribution, _, theirs in differing:
        named = f"{distribution.metadata['Name']} {distribution.version} (remote: {theirs or 'none'})"
        if not same_abi and not _is_pure(distribution):
            plan.kept.append(named)
            continue
        plan.shipped.append(named)
        root = Path(str(distribution.locate_file("")))
        files += [(root, file) for file in _distribution_files(distribution)]
    return plan
