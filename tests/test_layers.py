"""The layering rules, held by an AST walk so they cannot rot silently.

The package is a stack of floors (FLOORS, lowest first): a module imports only from its own box or from a box on a
lower floor, and the boxes (a package folder, or a top-level module) import each other without cycles. peer/ and
sched/ share a floor and never import each other. Above the driver, peer/, sched/ and collectives/ use the verbs
API (aiofabric.verbs, the package) and the small shared pieces, never the seam or the driver's internals. The
emulated NIC (sim/) never imports the driver's layers, anyio or an event loop; only the emulated PCI backend
(pci/emulated*.py) imports sim/. asyncssh lives only in peer/ssh.py; the pure modules import no I/O framework. The
host interface is described once, in hw/, which imports only the bindings and the standard library: no
`struct.Struct` for a hardware format is built anywhere else (the formats that are not the host interface are listed
with their files). No module imports upward even inside a function or under TYPE_CHECKING, and no package's modules
import each other in a circle.
"""
import ast
import shutil
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aiofabric"
TESTS = Path(__file__).resolve().parent
# The floors, lowest first; the boxes on one floor may not import each other. Top-level modules are boxes of their
# own ("version", "errors", "__init__" for the package's own namespace, "__main__").
FLOORS = [("util", "autogen", "version"), ("hw",), ("errors",), ("sim",), ("pci",), ("driver",), ("verbs",),
          ("peer", "sched"), ("collectives", "__init__"), ("tools",), ("__main__",)]
FLOOR = {box: level for level, boxes in enumerate(FLOORS) for box in boxes}
# What peer/, sched/ and collectives/ may use of the floors below theirs
ABOVE_THE_DRIVER = ("aiofabric.verbs", "aiofabric.errors", "aiofabric.util", "aiofabric.version")
IO_FRAMEWORKS = ("anyio", "trio", "asyncio", "socket", "asyncssh", "aiofabric.driver", "aiofabric.verbs")
# Structs that are not the host interface, by file (relative to the repository)
NON_HARDWARE_STRUCTS = {
    "aiofabric/sim/packets.py": "the RoCEv2 wire: the IPv4/UDP header",
    "aiofabric/sim/codec.py": "the RoCEv2 wire: BTH and its extension headers, per opcode",
    "aiofabric/sim/icrc.py": "the RoCEv2 wire: the ICRC",
    "aiofabric/sim/pcap.py": "pcap file and record headers",
    "aiofabric/sim/mmsg.py": "sockaddr_in for sendmmsg/recvmmsg",
    "aiofabric/sim/native.py": "the compiled core's own records: transmit descriptors, parsed datagrams, run state",
    "aiofabric/sim/wqeblock.py": "the compiled core's own records: WQE rows, fetch and pump state, what it is told of "
                                 "the WQE format (hw/wqe.py's offsets)",
    "aiofabric/sim/kick.py": "KICK: the MMIO-write record the driver process sends the emulator process",
    "aiofabric/tools/perftest.py": "STAMP: the benchmark's payload stamp",
}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
            submodules = [f"{name}.{alias.name}" for alias in node.names if is_module(f"{name}.{alias.name}")]
            # `from . import x`: x is a module (the package's own namespace is not what is used) or a name of it
            found += [(module, node.lineno) for module in submodules] if node.module is None and len(submodules) == len(
                node.names) else [(name, node.lineno)]
    return found


def modules(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py") if folder else PACKAGE.rglob("*.py"))


def offenders(paths: list[Path], allowed) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
            for path in paths for name, line in imports(path) if not allowed(path, name)]


def box(module: str) -> str:
    """The box a module (an absolute name) belongs to: its package folder below aiofabric, or its own name."""
    parts = module.split(".")
    return "__init__" if parts == ["aiofabric"] else parts[1]


def downward(path: Path, name: str) -> bool:
    """Whether the module at `path` may import `name`: from its own box or a lower floor."""
    if not name.startswith("aiofabric"):
        return True
    here = box(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
    return here == box(name) or FLOOR[box(name)] < FLOOR[here]


def test_imports_go_down_the_floors_only():
    every = {box(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
             for path in modules()}
    assert every == set(FLOOR)  # a new folder or top-level module gets a floor
    assert offenders(modules(), downward) == []


def test_only_the_emulated_pci_backend_imports_the_emulator():
    outside = [path for path in modules() if path.relative_to(PACKAGE).parts[0] != "sim"]
    assert offenders(outside, lambda path, name: not name.startswith("aiofabric.sim")
                     or path.relative_to(PACKAGE).as_posix().startswith("pci/emulated")) == []


def test_the_emulator_runs_no_event_loop():
    assert offenders(modules("sim"), lambda path, name: not name.startswith(("anyio", "trio", "asyncio"))) == []


@pytest.mark.parametrize("folder", ["peer", "sched", "collectives"])
def test_above_the_driver_only_the_verbs_api(folder):
    def allowed(path, name):
        return (not name.startswith("aiofabric") or name.startswith(f"aiofabric.{folder}") or name == "aiofabric"
                or name.startswith(ABOVE_THE_DRIVER) and not name.startswith("aiofabric.verbs.")
                or folder == "collectives" and name.startswith("aiofabric.sched"))
    assert offenders(modules(folder), allowed) == []


def test_asyncssh_only_in_peer_ssh():
    assert offenders(modules(), lambda path, name: not name.startswith("asyncssh")
                     or path.relative_to(PACKAGE).as_posix() == "peer/ssh.py") == []


PURE = ["sched/plan.py", "peer/protocol.py", "tools/units.py", "driver/rings.py", "collectives/layout.py",
        "verbs/workqueue.py", "verbs/sq_runs.py", "util/escape.py", "peer/operations.py", "peer/launch.py",
        "peer/push.py", "peer/hostfile.py", "collectives/slurm.py", "collectives/env_ranks.py", "collectives/world.py"]


@pytest.mark.parametrize("pure", PURE)
def test_pure_modules_import_no_io_framework(pure):
    """(A pure module may import another.)"""
    others = {"aiofabric." + module.removesuffix(".py").replace("/", ".") for module in PURE}
    assert offenders([PACKAGE / pure], lambda path, name: name in others or not name.startswith(IO_FRAMEWORKS)) == []


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
    assert hardware_structs(modules() + sorted(TESTS.rglob("*.py"))) == []
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


def import_graph(folder: str = "") -> dict[str, set[str]]:
    """Each module (below `folder`) and the package's modules it imports (type-checking and function-level ones
    included); `from . import x` counts as importing the package and x."""
    graph = {}
    for path in modules(folder):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {name for name, _ in imports(path) if name.startswith("aiofabric")} - {module}
    return graph


def test_no_import_cycles():
    graph = import_graph()
    assert "aiofabric.sim.datapath" in graph["aiofabric.sim.emulator"]  # the walk sees the package's imports
    assert import_cycles(graph) == []


def test_the_rules_can_fail(tmp_path, monkeypatch):
    """The walks see what they must: deliberate violations in scratch files are reported. The scratch file is in a
    copy of the package: in the package itself, the other walks (of tests running beside this one) would see it."""
    copy = tmp_path / "tree" / "aiofabric"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setitem(globals(), "PACKAGE", copy)
    scratch = copy / "sim" / "_layer_probe.py"
    scratch.write_text("import struct\nCQE = struct.Struct('<QH')\n\ndef f():\n    from ..verbs import QueuePair\n"
                       "    from .requester import Requester\n")
    assert offenders([scratch], downward) == ["aiofabric/sim/_layer_probe.py:5 imports aiofabric.verbs"]
    assert hardware_structs([scratch]) == ["aiofabric/sim/_layer_probe.py:2 builds a struct.Struct"]
    graph = import_graph("sim")
    graph["aiofabric.sim.requester"].add("aiofabric.sim._layer_probe")  # as if the requester imported it back
    assert import_cycles(graph) == [["aiofabric.sim._layer_probe", "aiofabric.sim.requester",
                                     "aiofabric.sim._layer_probe"]]
    imported = tmp_path / "probe.py"
    imported.write_text("from struct import Struct\nNQE = Struct('<HHIII')\n")
    assert struct_constructions(imported) == [2]
