"""Generate `aiofabric/autogen/bnxt.py`: ctypes bindings of the BNXT host interface from the Linux headers.

    python -m aiofabric.autogen.generate --fetch            # download Debian sid's linux-source, generate
    python -m aiofabric.autogen.generate --linux-source DIR  # from an unpacked kernel tree

Structures are parsed with pycparser; constants are the integer `#define`s of the headers (those inside a selected
HWRM structure, every one of the RoCE headers, and a few named ones from bnxt_en). Each HWRM structure's size is
checked against the `(size:NNNb/MMB)` comment the header carries, so a parse error cannot go unnoticed.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tarfile
import tempfile

HSI = "include/linux/bnxt/hsi.h"
ROCE = ["drivers/infiniband/hw/bnxt_re/roce_hsi.h", "drivers/infiniband/hw/bnxt_re/qplib_rcfw.h",
        "drivers/infiniband/hw/bnxt_re/qplib_res.h"]
BNXT_EN = ["drivers/net/ethernet/broadcom/bnxt/bnxt.h", "drivers/net/ethernet/broadcom/bnxt/bnxt_hwrm.h"]
HWRM_COMMANDS = (
    "ver_get|func_reset|func_qcaps|func_qcfg|func_cfg|func_resource_qcaps|func_drv_rgtr|func_drv_unrgtr"
    "|func_drv_if_change|func_backing_store_qcaps_v2|func_backing_store_cfg_v2|stat_ctx_alloc|stat_ctx_free"
    "|ring_alloc|ring_free|vnic_alloc|vnic_cfg|vnic_free|vnic_qcaps"
    "|cfa_l2_filter_alloc|cfa_l2_filter_free|port_phy_cfg|port_phy_qcfg|port_phy_qcaps")
HWRM_STRUCTS = re.compile(
    rf"hwrm_(({HWRM_COMMANDS})_(input|output)|cmd_hdr|resp_hdr|err_output|short_input|cmpl|async_event_cmpl)|dbc_dbc")
BNXT_EN_DEFINES = {"BNXT_GRCPF_REG_CHIMP_COMM", "BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER", "BNXT_GRCPF_REG_KONG_COMM",
                   "BNXT_GRCPF_REG_KONG_COMM_TRIGGER", "BNXT_HWRM_TARGET", "BNXT_HWRM_NO_CMPL_RING",
                   "BNXT_HWRM_REQ_MAX_SIZE", "DFLT_HWRM_CMD_TIMEOUT", "HWRM_RESET_TIMEOUT", "BNXT_NUM_RX_RING_STATS",
                   "BNXT_NUM_TX_RING_STATS", "BNXT_NUM_TPA_RING_STATS", "BNXT_NUM_TPA_RING_STATS_P5",
                   "BNXT_NUM_TPA_RING_STATS_P7"}
# Size comments the kernel left stale when fields were added (checked by hand: the slot counts Linux derives from
# sizeof, 4 for CREATE_CQ and 9 for MODIFY_QP, agree with the field sums).
STALE_SIZE_COMMENTS = {"cmdq_create_cq": 64, "cmdq_modify_qp": 144}
CTYPES = {"u8": "ctypes.c_uint8", "char": "ctypes.c_char", "__le16": "ctypes.c_uint16", "u16": "ctypes.c_uint16",
          "__le32": "ctypes.c_uint32", "u32": "ctypes.c_uint32", "__le64": "ctypes.c_uint64", "u64": "ctypes.c_uint64",
          "__be16": "ctypes.c_uint16", "__be32": "ctypes.c_uint32", "__be64": "ctypes.c_uint64"}
STRUCT_RE = re.compile(r"^struct (\w+) \{\n(.*?)^\};", re.M | re.S)
SIZE_RE = re.compile(r"/\* (\w+) \(size:(\d+)b/(\d+)B\) \*/")
DEFINE_RE = re.compile(r"^\s*#define\s+([A-Z_][A-Z0-9_]*)[ \t]+([^\n]+?)\s*(?:/\*.*)?$", re.M)
NUMBER_RE = re.compile(r"\b(0x[0-9a-fA-F]+|\d+)(?:ULL|UL|LL|U|L)\b")
CAST_RE = re.compile(r"\((?:u8|u16|u32|u64|unsigned\s+\w+|int)\)")


def parse_struct(name: str, body: str) -> list[tuple[str, str, int]]:
    """[(field, c type, array length or 0)] of one flat C structure, parsed by pycparser."""
    from pycparser import c_ast, c_parser

    body = re.sub(r"/\*.*?\*/|//[^\n]*", "", body, flags=re.S)
    body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))
    typedefs = "".join(f"typedef int {t};\n" for t in CTYPES if t != "char")
    unit = c_parser.CParser().parse(f"{typedefs}struct {name} {{\n{body}\n}};")
    struct = unit.ext[-1].type
    fields = []
    for decl in struct.decls:
        node, length = decl.type, 0
        if isinstance(node, c_ast.ArrayDecl):
            length, node = int(node.dim.value, 0), node.type
        fields.append((decl.name, node.type.names[-1], length))
    return fields


def parse_defines(text: str, namespace: dict[str, int]) -> dict[str, int]:
    """Integer-valued object-like macros of `text`, evaluated in order against `namespace` (updated in place)."""
    found = {}
    for name, value in DEFINE_RE.findall(text):
        expr = CAST_RE.sub("", NUMBER_RE.sub(r"\1", value.strip()))
        if not re.fullmatch(r"[\w\s()<>|&~^+\-*/]+", expr) or re.search(r"\w\s*\(", expr.replace("sizeof", "@")):
            continue
        try:
            result = eval(expr.replace("/", "//"), {"__builtins__": {}}, namespace)  # noqa: S307 - header constants
        except Exception:
            continue
        if isinstance(result, int):
            namespace[name] = found[name] = result
    return found


def read_header(root: str, path: str) -> str:
    with open(os.path.join(root, path)) as f:
        return re.sub(r"\\\n", " ", f.read())  # join continued #define lines


def collect(root: str) -> tuple[dict[str, list], dict[str, int], dict[str, int], str]:
    structs: dict[str, list] = {}
    sizes: dict[str, int] = {}
    namespace: dict[str, int] = {}
    defines: dict[str, int] = {}

    hsi = read_header(root, HSI)
    sizes.update({n: int(b) for n, _, b in SIZE_RE.findall(hsi)})
    every_hsi_define = parse_defines(hsi, namespace)
    wanted: set[str] = set()
    for name, body in STRUCT_RE.findall(hsi):
        if HWRM_STRUCTS.fullmatch(name):
            structs[name] = parse_struct(name, body)
            wanted.update(n for n, _ in DEFINE_RE.findall(body))
    defines.update({k: v for k, v in every_hsi_define.items() if k in wanted or k.startswith("HWRM_")})

    for path in ROCE:
        text = read_header(root, path)
        sizes.update({n: int(b) for n, _, b in SIZE_RE.findall(text)})
        for name, body in STRUCT_RE.findall(text):
            if not name.startswith("bnxt_"):
                structs[name] = parse_struct(name, body)
        defines.update(parse_defines(text, namespace))

    for path in BNXT_EN:
        text = read_header(root, path)
        defines.update({k: v for k, v in parse_defines(text, dict(namespace)).items() if k in BNXT_EN_DEFINES})
    found = re.search(r'#define HWRM_VERSION_STR "([^"]+)"', hsi)
    if found is None:
        raise SystemExit(f"{HSI}: no HWRM_VERSION_STR: not the header this generator knows")
    version = found.group(1)
    return structs, sizes, defines, version


def render(structs: dict[str, list], sizes: dict[str, int], defines: dict[str, int], version: str, kernel: str) -> str:
    out = [f'"""ctypes bindings of the BNXT host interface: HWRM {version}, RoCE HSI from Linux {kernel}.',
           "", "Generated by `python -m aiofabric.autogen.generate`; do not edit by hand.", '"""',
           "import ctypes", "", f"HWRM_INTERFACE_VERSION = {version!r}", f"LINUX_VERSION = {kernel!r}", ""]
    for name in sorted(defines):
        out.append(f"{name} = {defines[name]:#x}" if defines[name] >= 0 else f"{name} = {defines[name]}")
    for name, fields in structs.items():
        out += ["", "", f"class {name}(ctypes.LittleEndianStructure):", "    _pack_ = 1", "    _fields_ = ["]
        for field, ctype, length in fields:
            t = CTYPES[ctype] + (f" * {length}" if length else "")
            out.append(f"        ({field!r}, {t}),")
        out.append("    ]")
    out += ["", "", "STRUCT_SIZES = {", *(f"    {n!r}: {sizes[n]}," for n in structs if n in sizes), "}", ""]
    return "\n".join(out)


def check_sizes(source: str) -> None:
    module: dict = {}
    exec(compile(source, "bnxt.py", "exec"), module)  # noqa: S102 - our own generated code
    expected = module["STRUCT_SIZES"] | STALE_SIZE_COMMENTS
    bad = [f"{n}: header says {s} B, ctypes gives {ctypes.sizeof(module[n])} B"
           for n, s in expected.items() if ctypes.sizeof(module[n]) != s]
    if bad:
        raise SystemExit("size mismatch:\n" + "\n".join(bad))


def fetch(workdir: str) -> str:
    """Download Debian sid's newest linux-source package with apt and unpack the headers we need into workdir."""
    lists = os.path.join(workdir, "lists")
    os.makedirs(os.path.join(lists, "partial"), exist_ok=True)
    sources = os.path.join(workdir, "sources.list")
    with open(sources, "w") as f:
        f.write("deb http://deb.debian.org/debian sid main\n")
    apt = ["-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/dev/null",
           "-o", f"Dir::State::Lists={lists}"]
    subprocess.run(["apt-get", *apt, "update"], check=True, stdout=subprocess.DEVNULL)
    names = subprocess.run(["apt-cache", *apt, "pkgnames", "linux-source-"], check=True, capture_output=True,
                           text=True).stdout.split()
    package = max(names, key=lambda n: tuple(int(x) for x in re.findall(r"\d+", n)))
    subprocess.run(["apt-get", *apt, "download", package], check=True, cwd=workdir)
    deb = glob.glob(os.path.join(workdir, f"{package}_*.deb"))[0]
    subprocess.run(["ar", "x", deb, "data.tar.xz"], check=True, cwd=workdir)
    with tarfile.open(os.path.join(workdir, "data.tar.xz")) as outer:
        inner_name = next(n for n in outer.getnames() if n.endswith(".tar.xz"))
        outer.extract(inner_name, workdir, filter="data")
    wanted = [HSI, *ROCE, *BNXT_EN]
    with tarfile.open(os.path.join(workdir, inner_name)) as inner:
        members = [m for m in inner.getmembers() if any(m.name.endswith("/" + w) for w in wanted)]
        inner.extractall(workdir, members=members, filter="data")
    return os.path.join(workdir, members[0].name.split("/")[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--linux-source", metavar="DIR", help="an unpacked kernel source tree")
    source.add_argument("--fetch", action="store_true", help="download Debian sid's linux-source with apt")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "bnxt.py"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        root = fetch(workdir) if args.fetch else args.linux_source
        kernel = os.path.basename(os.path.normpath(root)).replace("linux-source-", "")
        source_text = render(*collect(root), kernel=kernel)
    check_sizes(source_text)
    with open(args.output, "w") as f:
        f.write(source_text)
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
