"""The import rules of design.md §1 and §4, held by an AST walk so they cannot rot silently.

Imports flow downward: the emulated NIC (sim/) never reaches into the driver; the driver reaches into sim/ only in
nic.py's spec factory; peer/ and sched/ use the public driver API (nic, queues, completions, errors), never the
seam, device internals or sim/, and not each other; asyncssh lives only in peer/ssh.py; the pure modules import no
I/O framework.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aiofabric"
PUBLIC_API = {"aiofabric", "aiofabric.nic", "aiofabric.queues", "aiofabric.completions", "aiofabric.errors",
              "aiofabric.taskgroups"}  # the last: the one way our context managers run their own tasks


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `path`, function-level ones included."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            if node.module is None:  # `from . import x`: x may be a module
                found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return found


def modules(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py") if folder else PACKAGE.rglob("*.py"))


def offenders(paths: list[Path], allowed) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
            for path in paths for name, line in imports(path) if not allowed(path, name)]


def test_the_emulator_never_imports_the_driver():
    driver = ("aiofabric.device", "aiofabric.queues", "aiofabric.nic", "aiofabric.poller", "aiofabric.perftest",
              "aiofabric.cli", "aiofabric.peer", "aiofabric.sched", "aiofabric.completions", "aiofabric.latency")
    assert offenders(modules("sim"), lambda path, name: not name.startswith(driver) and name != "anyio") == []


def test_the_driver_reaches_into_sim_only_through_the_spec_factory():
    outside = [path for path in modules() if "sim" not in path.relative_to(PACKAGE).parts[:1]]
    assert offenders(outside, lambda path, name: not name.startswith("aiofabric.sim")
                     or path.name == "nic.py" and name == "aiofabric.sim.host") == []


@pytest.mark.parametrize("folder,other", [("peer", "aiofabric.sched"), ("sched", "aiofabric.peer")])
def test_peer_and_sched_use_only_the_public_driver_api_and_not_each_other(folder, other):
    def allowed(path, name):
        return (not name.startswith("aiofabric") or name.startswith(f"aiofabric.{folder}") or name in PUBLIC_API
                or name == "aiofabric.__version__")
    assert offenders(modules(folder), allowed) == []
    assert offenders(modules(folder), lambda path, name: not name.startswith(other)) == []


def test_asyncssh_only_in_peer_ssh():
    assert offenders(modules(), lambda path, name: not name.startswith("asyncssh")
                     or path.relative_to(PACKAGE).as_posix() == "peer/ssh.py") == []


@pytest.mark.parametrize("pure", ["sched/plan.py", "peer/protocol.py", "units.py", "rings.py"])
def test_pure_modules_import_no_io_framework(pure):
    banned = ("anyio", "trio", "asyncio", "socket", "asyncssh", "aiofabric.device", "aiofabric.nic")
    assert offenders([PACKAGE / pure], lambda path, name: not name.startswith(banned)) == []


def test_the_rules_can_fail():
    """The walk sees what it must: a deliberate violation in a scratch copy is reported."""
    scratch = PACKAGE / "sim" / "_layer_probe.py"
    try:
        scratch.write_text("def f():\n    from ..queues import QueuePair\n")
        assert any("_layer_probe.py:2 imports aiofabric.queues" in line
                   for line in offenders([scratch], lambda path, name: not name.startswith("aiofabric.queues")))
    finally:
        scratch.unlink()
