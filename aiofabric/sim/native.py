"""The emulator's compiled core: wirecodec.c and wirequeues.c (and the wirecore.h they share), built with the system
C compiler the first time an emulator needs them and loaded through ctypes as one library. It encodes RoCEv2 packets
straight into sendmmsg slots and checks and parses received datagrams into fixed records (`RECORD`), fetches, sends
and retires a send queue's plain WQEs in bulk (wqeblock.py) and places runs of RDMA WRITE packets (writeruns.py): the
per-packet loops that cost the emulator most of its Python time (bench/RESULTS.md).

The Python codec (codec.py) stays the reference and the fallback: `core()` is None when the build cannot be had (no
compiler, no private cache directory, a failed build) or when AIOFABRIC_SIM_NATIVE=0, and every caller then takes
the Python path, so `pip install .` never needs a compiler. The library is kept in the C kernel cache
($AIOFABRIC_CACHE, else ~/.cache/aiofabric/kernels, as the scheduler's kernels), named by the hash of compiler,
flags and source, and only loaded from a directory and file that only we can write (util.private): one build per
source and machine, ~0.4 s (`Core.build` says what it cost). Without a private cache no emulator process builds it
(each would pay the build): they run the Python path, and say so in the log once.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from . import packets as pk
from .codec import header_size
from ..util import c_build, private

ENV = "AIOFABRIC_SIM_NATIVE"  # "0": never build or load the core (the Python codec only)
HEADER, SOURCES = "wirecore.h", ("wirecodec.c", "wirequeues.c")  # beside this module
FLAGS = ("-O2", "-shared", "-fPIC")
log = logging.getLogger("aiofabric.sim")

# Transmit descriptors, TX_SIZE bytes each (wirecodec.c `struct segments`, `struct packet`, `struct burst`): a
# Segments, a Packet or a wqeblock.Burst field for field, the address in this process of their bytes and of the
# sockaddr their datagrams go to.
TX_SIZE = 128
TX_SEGMENTS = struct.Struct("<5BIIIIQIQII?IIQHIIHHHQ")
TX_PACKET = struct.Struct("<7BIIHQIIBIIQQQQIIIHHHQ")
TX_BURST = struct.Struct("<BQIIIIIIHIIHHHQ")  # kind 2, rows, packet, count, noack, ack_every, mtu, dest QP, P_Key, ...
# A received datagram, parsed (wirecore.h `struct record`): Packet's fields up to `immediate` in its order, then
# migreq, swap_add, compare, original, status (RX_DROPS), source IPv4 address and port, where the payload is in the
# datagram and its length.
RECORD = struct.Struct("<BII??H??QIIBII?QQQBIHII")
RECORD_FIELDS = 14  # Packet's positional fields before payload
# Why a datagram is dropped, by status (0: kept): the UDP transport's counter for each (wc_parse counts each status).
RX_DROPS = ("", "dropped_source_port", "dropped_short", "dropped_icrc", "dropped_opcode", "dropped_version",
            "dropped_length")
# What follows the BTH, per opcode, as wirecodec.c's table takes it (packets.py is the one place it is defined).
L_RETH, L_AETH, L_IMM, L_ATOMIC, L_ATOMIC_ACK, L_PAYLOAD, L_CNP, L_KNOWN = (1 << i for i in range(8))
# The responder's state while the core places a run of RDMA WRITE packets (wirequeues.c `struct write_run`): QPN, peer
# IPv4, path MTU, remote writes allowed; the region known (rkey, va, size, address); expected PSN; the WRITE half
# received (flag, target address, offset, length, RETH va); then out: WRITEs completed, their bytes, ACK owed and PSN.
WRITE_RUN = struct.Struct("<III?IQQQI?QQQQIQ?I")


def _layouts() -> tuple[bytes, bytes]:
    layouts, sizes = bytearray(256), bytearray(256)
    for op in pk.Op:
        layouts[op] = (L_KNOWN | (op in pk.HAS_RETH and L_RETH) | (op in pk.HAS_AETH and L_AETH)
                       | ((op in pk.HAS_IMM or op in pk.HAS_IETH) and L_IMM) | (op in pk.HAS_ATOMIC_ETH and L_ATOMIC)
                       | (op in pk.HAS_ATOMIC_ACK_ETH and L_ATOMIC_ACK) | (op in pk.HAS_PAYLOAD and L_PAYLOAD)
                       | (op == pk.Op.CNP and L_CNP))
        sizes[op] = header_size(op)
    return bytes(layouts), bytes(sizes)


class Core:
    """The loaded library: `encode` and `parse` (wirecodec.c says what they do), the queues' `sq_format`, `sq_parse`,
    `pump`, `retire` and `place_writes` (wirequeues.c), `crc32` and `icrc` for the tests that hold them to the Python
    codec; `build` says where it came from and what building it cost."""

    def __init__(self, library: ctypes.CDLL, build: dict[str, Any]) -> None:
        self.build = build
        p, u32, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int
        self.encode = library.wc_encode
        self.encode.argtypes = [p, i32, p, p, u32, i32, p, u32, u32, p]
        self.encode.restype = i32
        self.parse = library.wc_parse
        self.parse.argtypes = [p, u32, p, u32, u32, p, i32, u32, p, p]
        self.parse.restype = None
        self.place_writes = library.wc_place_writes
        self.place_writes.argtypes = [p, p, i32, i32, p, u32]
        self.place_writes.restype = i32
        self.sq_format = library.wc_sq_format
        self.sq_format.argtypes = [ctypes.c_char_p]
        self.sq_format.restype = None
        self.sq_parse = library.wc_sq_parse
        self.sq_parse.argtypes = [p]
        self.sq_parse.restype = None
        self.pump = library.wc_pump
        self.pump.argtypes = [p]
        self.pump.restype = None
        self.retire = library.wc_retire
        self.retire.argtypes = [p, i32, i32, u32, p, p]
        self.retire.restype = i32
        self.crc32 = library.wc_crc32
        self.crc32.argtypes = [u32, ctypes.c_char_p, ctypes.c_uint64]
        self.crc32.restype = u32
        self.icrc = library.wc_icrc
        self.icrc.argtypes = [ctypes.c_char_p, u32, u32, u32, u32, u32, u32]
        self.icrc.restype = u32
        init = library.wc_init
        init.argtypes = [p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
        init.restype = i32
        writes = bytes((pk.WRITE_FIRST, pk.WRITE_MIDDLE, pk.Op.RDMA_WRITE_LAST, pk.WRITE_ONLY))
        problem = init(_given_crc32(), *_layouts(), writes)
        if problem:
            raise RuntimeError(f"the core's header sizes disagree with the codec's for opcode {-1 - problem:#04x}")


def _given_crc32() -> int | None:
    """The address of ISA-L's CRC-32 in the isal module this process loaded already, if it is there (the core's own
    table CRC is several times slower on 4 KiB packets)."""
    try:
        from isal import isal_zlib
        function = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


def address(buffer: Any) -> int:
    """The address of a writable buffer's first byte (the core reads it during one call; TypeError if read-only,
    ValueError if empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


_loaded: list[Core | None] = []  # [] until the first core() call, then [the core or None]


def core() -> Core | None:
    """The compiled core, built or loaded on the first call; None when the Python path must do (see the module's
    docstring)."""
    if not _loaded:
        _loaded.append(_load())
    return _loaded[0]


def _load() -> Core | None:
    if os.environ.get(ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: the emulator's codec runs in Python")
        return None
    here = Path(__file__).parent
    try:
        sources = {name: (here / name).read_text() for name in (HEADER, *SOURCES)}
    except OSError as exc:  # an installation without the package's C files
        log.warning("the emulator's codec runs in Python: its compiled core's sources cannot be read: %s", exc)
        return None
    digest = hashlib.sha256("\0".join((compiler, *FLAGS, *sources.values())).encode()).hexdigest()[:24]
    name = f"wirecore-{digest}.so"
    cache = os.environ.get(c_build.CACHE_ENV) or str(c_build.home_cache() or "")
    try:
        if not cache:
            raise private.NotPrivate("~/.cache/aiofabric/kernels", "cannot be had: there is no home directory")
        directory = private.open_directory(cache)
    except private.NotPrivate as exc:
        log.info("the emulator's codec runs in Python: no private cache for its compiled core (%s)", exc)
        return None
    try:
        started, cached = time.perf_counter(), c_build.library_problem(name, directory) == ""
        if not cached:
            def command(scratch: Path) -> list[str]:
                return [compiler, *FLAGS, "-o", str(scratch / name), *(str(scratch / source) for source in SOURCES)]
            try:
                c_build.build_into(command, sources, name, directory, timeout=120)
            except c_build.BuildFailed as failed:
                raise OSError(f"{compiler} {' '.join(FLAGS)} failed: {failed.stderr[-2000:]}") from None
            problem = c_build.library_problem(name, directory)
            if problem:
                raise OSError(f"{name} {problem} after building it")
        build = {"library": os.path.join(cache, name), "cached": cached, "seconds": time.perf_counter() - started}
        return Core(ctypes.CDLL(f"/proc/self/fd/{directory}/{name}"), build)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("the emulator's codec runs in Python: its compiled core cannot be had: %s", exc)
        return None
    finally:
        os.close(directory)
