"""The layering rules, held by an AST walk so they cannot rot silently.

Imports flow downward: the emulated NIC (sim/) never reaches into the driver; the driver reaches into sim/ only in
nic.py's spec factory; peer/ and sched/ use the public driver API (nic, queues, completions, errors), never the
seam, device internals or sim/, and not each other; asyncssh lives only in peer/ssh.py; the pure modules import no
I/O framework. The host interface is described once, in hw/, which imports only the bindings and the standard
library: no `struct.Struct` for a hardware format is built anywhere else (the formats that are not the host
interface are listed with their files), and the emulator's modules import each other without cycles.
"""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aiofabric"
TESTS = Path(__file__).resolve().parent
# taskgroups: how our context managers run their own tasks; lazy: how packages load their names; json_depth and
# escape: what the servers that take strangers' JSON and text share; private: the directories and files only we may
# write; close_budget: how long a NIC's close may take and whether its firmware still answers (servers ask it)
PUBLIC_API = {"aiofabric", "aiofabric.nic", "aiofabric.queues", "aiofabric.completions", "aiofabric.errors",
              "aiofabric.taskgroups", "aiofabric.version", "aiofabric.lazy", "aiofabric.json_depth",
              "aiofabric.escape", "aiofabric.private", "aiofabric.close_budget"}
IO_FRAMEWORKS = ("anyio", "trio", "asyncio", "socket", "asyncssh", "aiofabric.device", "aiofabric.nic")
# Structs that are not the host interface, by file (relative to the repository)
NON_HARDWARE_STRUCTS = {
    "aiofabric/sim/packets.py": "the RoCEv2 wire: IPv4/UDP pseudo-header, BTH and its extension headers, ICRC",
    "aiofabric/sim/pcap.py": "pcap file and record headers",
    "aiofabric/sim/mmsg.py": "sockaddr_in for sendmmsg/recvmmsg",
    "aiofabric/sim/host.py": "KICK: the MMIO-write record the driver process sends the emulator process",
    "aiofabric/perftest.py": "STAMP: the benchmark's payload stamp",
}


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
    """Nor anyio, but in debug.py: the debug channel's client, which runs in the driver's process only."""
    driver = ("aiofabric.device", "aiofabric.queues", "aiofabric.nic", "aiofabric.poller", "aiofabric.perftest",
              "aiofabric.cli", "aiofabric.peer", "aiofabric.sched", "aiofabric.completions", "aiofabric.latency")
    assert offenders(modules("sim"), lambda path, name: not name.startswith(driver)
                     and (name != "anyio" or path.name == "debug.py")) == []


def test_the_driver_reaches_into_sim_only_through_the_spec_factory():
    outside = [path for path in modules() if "sim" not in path.relative_to(PACKAGE).parts[:1]]
    assert offenders(outside, lambda path, name: not name.startswith("aiofabric.sim")
                     or path.name == "nic.py" and name == "aiofabric.sim.host") == []


@pytest.mark.parametrize("folder,other", [("peer", "aiofabric.sched"), ("sched", "aiofabric.peer")])
def test_peer_and_sched_use_only_the_public_driver_api_and_not_each_other(folder, other):
    def allowed(path, name):
        return not name.startswith("aiofabric") or name.startswith(f"aiofabric.{folder}") or name in PUBLIC_API
    assert offenders(modules(folder), allowed) == []
    assert offenders(modules(folder), lambda path, name: not name.startswith(other)) == []


def test_collectives_use_the_public_driver_api_and_the_scheduler_only():
    """And nothing below them imports them: the scheduler knows no collective."""
    def allowed(path, name):
        return not name.startswith("aiofabric") or name in PUBLIC_API or name.startswith(
            ("aiofabric.collectives", "aiofabric.sched"))
    assert offenders(modules("collectives"), allowed) == []
    below = [path for path in modules() if path.parent.name != "collectives" and path.name != "cli.py"]
    assert offenders(below, lambda path, name: not name.startswith("aiofabric.collectives")) == []


def test_asyncssh_only_in_peer_ssh():
    assert offenders(modules(), lambda path, name: not name.startswith("asyncssh")
                     or path.relative_to(PACKAGE).as_posix() == "peer/ssh.py") == []


@pytest.mark.parametrize("pure", ["sched/plan.py", "peer/protocol.py", "units.py", "rings.py", "collectives/layout.py",
                                  "workqueue.py", "escape.py"])
def test_pure_modules_import_no_io_framework(pure):
    assert offenders([PACKAGE / pure], lambda path, name: not name.startswith(IO_FRAMEWORKS)) == []


def test_hw_imports_only_the_bindings_and_the_standard_library():
    def allowed(path, name):
        if name.startswith("aiofabric"):
            return name.startswith(("aiofabric.autogen", "aiofabric.hw"))
        return name.split(".")[0] in sys.stdlib_module_names and not name.startswith(IO_FRAMEWORKS)
    assert modules("hw") and offenders(modules("hw"), allowed) == []


def struct_constructions(path: Path) -> list[int]:
    """Lines of `path` that build a struct.Struct (as struct.Struct(...) or an imported Struct(...))."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            called = node.func
            if (isinstance(called, ast.Attribute) and called.attr == "Struct"
                    and isinstance(called.value, ast.Name) and called.value.id == "struct") \
                    or (isinstance(called, ast.Name) and called.id == "Struct"):
                lines.append(node.lineno)
    return lines


def hardware_structs(paths: list[Path]) -> list[str]:
    """Where a Struct is built outside hw/ and the bindings, but in the files whose formats are not hardware."""
    root = PACKAGE.parent
    return [f"{path.relative_to(root)}:{line} builds a struct.Struct" for path in paths
            if path.relative_to(root).parts[:2] not in (("aiofabric", "hw"), ("aiofabric", "autogen"))
            and path.relative_to(root).as_posix() not in NON_HARDWARE_STRUCTS
            for line in struct_constructions(path)]


def test_no_struct_for_a_hardware_format_outside_hw():
    """Every host-interface layout is hw/'s, built from the bindings: the driver, the emulator and the tests import
    it. The exceptions are formats that are not the host interface (NON_HARDWARE_STRUCTS)."""
    assert hardware_structs(modules() + sorted(TESTS.glob("*.py"))) == []
    assert all(struct_constructions(PACKAGE.parent / path) for path in NON_HARDWARE_STRUCTS)  # none stale


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of an import graph (module -> modules it imports), each as the modules on it, in order."""
    cycles, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def sim_import_graph() -> dict[str, set[str]]:
    """The emulator's modules and the emulator modules each imports (type-checking and function-level included)."""
    graph = {}
    for path in modules("sim"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {name for name, _ in imports(path) if name.startswith("aiofabric.sim.")}
    return graph


def test_the_emulator_has_no_import_cycles():
    graph = sim_import_graph()
    assert "aiofabric.sim.datapath" in graph["aiofabric.sim.process"]  # the walk sees the package's imports
    assert import_cycles(graph) == []


def test_the_rules_can_fail(tmp_path):
    """The walks see what they must: deliberate violations in scratch files are reported."""
    scratch = PACKAGE / "sim" / "_layer_probe.py"
    try:
        scratch.write_text("import struct\nCQE = struct.Struct('<QH')\n\ndef f():\n    from ..queues import QueuePair\n"
                           "    from .requester import Requester\n")
        assert any("_layer_probe.py:5 imports aiofabric.queues" in line
                   for line in offenders([scratch], lambda path, name: not name.startswith("aiofabric.queues")))
        assert hardware_structs([scratch]) == ["aiofabric/sim/_layer_probe.py:2 builds a struct.Struct"]
        graph = sim_import_graph()
        graph["aiofabric.sim.requester"].add("aiofabric.sim._layer_probe")  # as if the requester imported it back
        assert import_cycles(graph) == [["aiofabric.sim._layer_probe", "aiofabric.sim.requester",
                                         "aiofabric.sim._layer_probe"]]
    finally:
        scratch.unlink()
    imported = tmp_path / "probe.py"
    imported.write_text("from struct import Struct\nNQE = Struct('<HHIII')\n")
    assert struct_constructions(imported) == [2]
