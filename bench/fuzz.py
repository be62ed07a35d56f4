"""Fuzzing the emulated NIC through the seam and its wire: it must never crash, leak or miscount.

    python bench/fuzz.py [--seed S] [--hwrm N] [--rcfw N] [--datagrams N] [--batches K]

1. HWRM: N requests on a live NIC, named commands with random fields (`nic.hwrm`) and raw random windows written to
   BAR0 and triggered; RCFW: N commands, named with random fields (`nic.rcfw`) and raw CMDQ commands with random
   opcodes and bodies. Every command must be answered (a status, never a timeout), nothing the fuzzing created may
   outlive it (firmware objects and driver DMA bytes compared before/after), and the NIC must still complete a
   verified RDMA WRITE.
2. Wire: N datagrams from a plain UDP socket on 127.0.0.1 to one NIC's UDP 4791, in K batches, each aimed at a fresh
   connected QP pair: random bytes, truncated packets, BTH with random opcode/QPN/PSN/pad (correct ICRC), wrong ICRC,
   RETH outside any MR, broken FIRST/MIDDLE/LAST order, PSNs far out of the window, and valid WRITEs mixed in. Each
   datagram's fate at the wire is predicted by decoding it locally; the NIC's counters must match exactly, the data
   path must report no internal error, and a fresh QP pair must complete a verified write after every batch.

Commands that tear down the NIC's own bring-up state are not sent (see HWRM_EXCLUDED, RCFW_EXCLUDED); destroying
and freeing commands only name objects the fuzzing created, or ids no object has.
Prints one JSON summary line (counts per category, crashes, leaks, elapsed). tests/emulator/test_fuzz.py runs a small
subset.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import random
import socket
import struct
import time
from typing import Any

import anyio

import aiofabric
from aiofabric.autogen import bnxt
from aiofabric.driver.rcfw_channel import CMDQ_SLOT
from aiofabric.errors import FirmwareError
from aiofabric.sim import codec, icrc
from aiofabric.sim import packets as pk
from aiofabric.sim.hwrm import Firmware
from aiofabric.sim.cmdq import OPCODE_NAMES
from aiofabric.sim.rcfw import Rcfw

# Why these are never sent to a live NIC: each one tears down what the driver brought up and still uses.
HWRM_EXCLUDED = {
    "func_reset": "wipes every ring, context and RoCE object the driver owns (the CREQ included: RCFW goes deaf)",
    "func_drv_unrgtr": "the driver leaving: the firmware drops the backing store RoCE runs on",
    "func_cfg": "may point the driver's async events (async_event_cr) at its CREQ or its RoCE NQ",
}
RCFW_EXCLUDED = {
    "deinitialize_fw": "un-initializes the RoCE function: every later command, the driver's teardown too, fails",
    "initialize_fw": "re-initializing may switch hardware retransmission off under the driver's live QPs",
}
# Commands whose id field may only name what the fuzzing created (else they would free the driver's own objects).
OWNED_ID = {"stat_ctx_free": ("stat_ctx_id", "stat_ctx"), "ring_free": ("ring_id", "ring"),
            "vnic_free": ("vnic_id", "vnic"), "vnic_cfg": ("vnic_id", "vnic"),
            "cfa_l2_filter_free": ("l2_filter_id", "l2_filter"), "delete_gid": ("gid_index", "gid"),
            "destroy_cq": ("cq_cid", "cq"), "destroy_qp": ("qp_cid", "qp"), "modify_qp": ("qp_cid", "qp"),
            "query_qp": ("qp_cid", "qp"), "deregister_mr": ("lkey", "mr"), "deallocate_key": ("key", "mr"),
            "register_mr": ("key", "mr")}
CREATES = {"stat_ctx_alloc": ("stat_ctx_id", "stat_ctx"), "ring_alloc": ("ring_id", "ring"),
           "vnic_alloc": ("vnic_id", "vnic"), "cfa_l2_filter_alloc": ("l2_filter_id", "l2_filter"),
           "add_gid": ("xid", "gid"), "create_cq": ("xid", "cq"), "create_qp": ("xid", "qp"),
           "allocate_mrw": ("xid", "mr"), "register_mr": ("xid", "mr")}
FREES = {"stat_ctx_free": "stat_ctx", "ring_free": "ring", "vnic_free": "vnic", "cfa_l2_filter_free": "l2_filter",
         "delete_gid": "gid", "destroy_cq": "cq", "destroy_qp": "qp", "deallocate_key": "mr"}
UNUSED_ID_FLOOR = 0x4000  # ids at or above this are never allocated in a fuzz run: naming them touches nothing
HWRM_NAMES = [n for n in Firmware.COMMANDS if n not in HWRM_EXCLUDED]
RCFW_NAMES = [n for n in Rcfw.COMMANDS if n not in RCFW_EXCLUDED]
# Raw CMDQ commands take any opcode except the excluded ones and those that destroy (a random id could name the
# driver's objects); those run by name above with owned ids.
RAW_RCFW_EXCLUDED = {getattr(bnxt, f"CMDQ_BASE_OPCODE_{n.upper()}") for n in (*RCFW_EXCLUDED, *FREES, "modify_qp",
                                                                              "deregister_mr", "register_mr")
                     if hasattr(bnxt, f"CMDQ_BASE_OPCODE_{n.upper()}")}
# An answer echoes its opcode in `event`, and 0xC0/0xC1 are also the QP/CQ error notification events: drivers (Linux
# and ours) take such an answer for an asynchronous event, so the command looks unanswered. Not input a driver sends.
RAW_RCFW_EXCLUDED |= {bnxt.CREQ_QP_EVENT_EVENT_QP_ERROR_NOTIFICATION, bnxt.CREQ_QP_EVENT_EVENT_CQ_ERROR_NOTIFICATION}
RAW_HWRM_EXCLUDED = {getattr(bnxt, f"HWRM_{n.upper()}") for n in (*HWRM_EXCLUDED, *FREES, "vnic_cfg")
                     if hasattr(bnxt, f"HWRM_{n.upper()}")}
HWRM_OPCODES = {getattr(bnxt, f"HWRM_{n.upper()}"): n for n in Firmware.COMMANDS}
HEADER_FIELDS = {"req_type", "cmpl_ring", "seq_id", "target_id", "resp_addr", "opcode", "cmd_size", "cookie",
                 "resp_size"}
FUZZ_BUFFERS, FUZZ_BUFFER_SIZE = 4, 1 << 16


class Pools:
    """What the fuzzing created on one NIC (by kind), and the DMA buffers its random addresses point into."""

    def __init__(self, nic: aiofabric.NIC) -> None:
        self.nic = nic
        self.ids: dict[str, list[int]] = collections.defaultdict(list)
        self.buffers = [nic.pci.alloc_dma(FUZZ_BUFFER_SIZE) for _ in range(FUZZ_BUFFERS)]

    def seed_memory(self, rng: random.Random) -> None:
        """Buffer 0 holds PTEs into the others (some VALID/LAST), the rest random bytes: page tables that walk."""
        pages = [b.bus_addr + off for b in self.buffers[1:] for off in range(0, FUZZ_BUFFER_SIZE, 4096)]
        ptes = [rng.choice(pages) | rng.choice((0, bnxt.PTU_PTE_VALID, bnxt.PTU_PTE_VALID | bnxt.PTU_PTE_LAST))
                for _ in range(FUZZ_BUFFER_SIZE // 8)]
        self.buffers[0].view[:] = struct.pack(f"<{len(ptes)}Q", *ptes)
        for buffer in self.buffers[1:]:
            buffer.view[:] = rng.randbytes(FUZZ_BUFFER_SIZE)

    def address(self, rng: random.Random) -> int:
        buffer = rng.choice(self.buffers)
        return buffer.bus_addr + rng.choice((0, 0, rng.randrange(0, FUZZ_BUFFER_SIZE, 8), FUZZ_BUFFER_SIZE - 8))

    def free_buffers(self) -> None:
        for buffer in self.buffers:
            buffer.free()


def random_value(rng: random.Random, bits: int, pools: Pools) -> int:
    roll = rng.random()
    if roll < 0.25:
        value = rng.choice((0, 1, 2, 0xFF, 0xFFFF, (1 << bits) - 1))
    elif roll < 0.45 and bits >= 64:
        value = pools.address(rng)
    elif roll < 0.8:
        value = rng.randrange(0, 300)
    else:
        value = rng.getrandbits(bits)
    return value & ((1 << bits) - 1)


def random_fields(rng: random.Random, struct_type: type, pools: Pools, name: str) -> dict[str, Any]:
    """Random values for a random subset of a binding's fields; an owned-id field names a fuzz object or none."""
    fields: dict[str, Any] = {}
    for field, ctype, *_ in struct_type._fields_:
        if field in HEADER_FIELDS or field.startswith(("reserved", "unused")) or rng.random() < 0.35:
            continue
        if issubclass(ctype, ctypes.Array):
            bits = ctypes.sizeof(ctype._type_) * 8
            fields[field] = tuple(random_value(rng, bits, pools) for _ in range(ctype._length_))
        else:
            fields[field] = random_value(rng, ctypes.sizeof(ctype) * 8, pools)
    owned = OWNED_ID.get(name)
    if owned is not None:
        field, kind = owned
        bits = ctypes.sizeof(dict((f, t) for f, t, *_ in struct_type._fields_)[field]) * 8
        pool = pools.ids[kind]
        fields[field] = rng.choice(pool) if pool and rng.random() < 0.7 else \
            rng.randrange(UNUSED_ID_FLOOR, 1 << min(bits, 16))
    for field, kind in (("nq_ring_id", None), ("cq_fco_cnq_id", None)):  # reach the NIC's NQ now and then
        if field in fields and rng.random() < 0.5:
            fields[field] = pools.nic.device.nq_id
    return fields


def record(pools: Pools, name: str, fields: dict[str, Any], answer: Any) -> None:
    """Remember what a successful command created, forget what it freed."""
    if name in CREATES:
        field, kind = CREATES[name]
        value = getattr(answer, field)
        if name != "register_mr" or value not in pools.ids[kind]:
            pools.ids[kind].append(value)
    if name in FREES:
        field = OWNED_ID[name][0]
        pools.ids[FREES[name]].remove(fields[field])
    if name == "deregister_mr" and fields.get("lkey") in pools.ids["mr"]:
        pass  # the key stays (unless REGISTER_MR allocated it, which deallocate_key then cannot free: see cleanup)


async def hwrm_raw(nic: aiofabric.NIC, rng: random.Random, pools: Pools) -> str:
    """A random 128-byte request window, written to BAR0 and triggered, as the driver does (one in flight)."""
    window = bytearray(rng.randbytes(bnxt.HWRM_MAX_REQ_LEN))
    if rng.random() < 0.5:
        known = rng.choice(HWRM_NAMES)
        struct.pack_into("<H", window, 0, getattr(bnxt, f"HWRM_{known.upper()}"))
    answered = rng.random() < 0.6
    req_type = struct.unpack_from("<H", window)[0]
    name = HWRM_OPCODES.get(req_type)
    if req_type in RAW_HWRM_EXCLUDED or (name in CREATES and not answered):  # an unanswered create would leak
        req_type = 0x7777  # an unknown opcode instead
        struct.pack_into("<H", window, 0, req_type)
    target = pools.buffers[1]
    if answered:
        struct.pack_into("<Q", window, 8, target.bus_addr)
        target.view[:16] = bytes(16)
    seq = struct.unpack_from("<H", window, 4)[0]
    async with nic.device.hwrm_channel.exclusive("raw window", 5):
        before = nic.pci.debug({"op": "stats"})["stats"]["hwrm"]
        nic.device.bar0.write_block(bnxt.BNXT_GRCPF_REG_CHIMP_COMM, bytes(window))
        nic.device.bar0.write32(bnxt.BNXT_GRCPF_REG_CHIMP_COMM_TRIGGER, 1)
        with anyio.fail_after(5):
            while nic.pci.debug({"op": "stats"})["stats"]["hwrm"] == before:
                await anyio.sleep(0.0002)
    if not answered:
        return "raw_unanswerable"  # maybe answerable by chance of the random address; either way it ran
    view = target.view
    length = int.from_bytes(view[6:8], "little")
    if not (int.from_bytes(view[4:6], "little") == seq and 16 <= length <= 0x1000 and view[length - 1] == 1):
        raise AssertionError(f"raw HWRM {req_type:#x} with a valid resp_addr was not answered: {bytes(view[:16])!r}")
    if int.from_bytes(view[0:2], "little"):
        return "raw_error"
    if name in CREATES:  # created something: remember it, to free it
        field, kind = CREATES[name]
        output = getattr(bnxt, f"hwrm_{name}_output").from_buffer_copy(bytes(view[:length]).ljust(
            ctypes.sizeof(getattr(bnxt, f"hwrm_{name}_output")), b"\0"))
        pools.ids[kind].append(getattr(output, field))
    return "raw_ok"


async def fuzz_hwrm(nic: aiofabric.NIC, rng: random.Random, count: int, pools: Pools,
                    raw_share: float = 0.3) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    for _ in range(count):
        if rng.random() < raw_share:
            outcomes[await hwrm_raw(nic, rng, pools)] += 1
            continue
        name = rng.choice(HWRM_NAMES)
        try:
            fields = random_fields(rng, getattr(bnxt, f"hwrm_{name}_input"), pools, name)
            answer = await nic.hwrm(name, **fields)
        except FirmwareError:
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
            record(pools, name, fields, answer)
    return outcomes


async def rcfw_raw(nic: aiofabric.NIC, rng: random.Random, pools: Pools) -> bytes:
    """A CMDQ command with a random opcode and body (right cmd_size: a wrong one desynchronizes the queue, which is
    the driver's bug, not input); its CREQ answer. RcfwChannel.command only takes known names."""
    while (opcode := rng.randrange(256)) in RAW_RCFW_EXCLUDED:
        pass
    slots = rng.randint(1, 8)
    data = bytearray(rng.randbytes(slots * CMDQ_SLOT))
    resp_addr = pools.address(rng) if rng.random() < 0.7 else rng.getrandbits(64)
    struct.pack_into("<BBHHBxQ", data, 0, opcode, slots, rng.getrandbits(16), 0, rng.randint(0, 16), resp_addr)
    entry = await nic.device.rcfw_channel.raw(bytes(data), 5.0)  # the channel sets the cookie
    if entry is None:
        raise AssertionError(f"raw CMDQ command {opcode:#x} was not answered in 5 s: {bytes(data).hex()}")
    name = OPCODE_NAMES.get(opcode)
    if entry[1] == 0 and name in CREATES:  # created something by chance (ADD_GID, ALLOCATE_MRW take any body)
        pools.ids[CREATES[name][1]].append(int.from_bytes(entry[4:8], "little"))
    return entry


async def fuzz_rcfw(nic: aiofabric.NIC, rng: random.Random, count: int, pools: Pools,
                    raw_share: float = 0.3) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()
    for _ in range(count):
        if rng.random() < raw_share:
            entry = await rcfw_raw(nic, rng, pools)
            outcomes["raw_ok" if entry[1] == 0 else "raw_error"] += 1
            continue
        name = rng.choice(RCFW_NAMES)
        try:
            fields = random_fields(rng, getattr(bnxt, f"cmdq_{name}"), pools, name)
            answer = await nic.rcfw(name, **fields)
        except FirmwareError:
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
            record(pools, name, fields, answer)
    return outcomes


async def cleanup(nic: aiofabric.NIC, pools: Pools) -> list[str]:
    """Free everything the fuzzing created, dependents first; what would not go."""
    failures = []

    async def attempt(kind: str, command: str, make: Any, channel: Any) -> None:
        for xid in reversed(pools.ids.pop(kind, [])):
            try:
                await channel(command, **make(xid))
            except FirmwareError as exc:
                failures.append(f"{command} {xid:#x}: {exc}")

    for qpn in pools.ids.get("qp", []):  # a QP in RTS with a random peer must be reset before it can go
        try:
            await nic.rcfw("modify_qp", qp_cid=qpn, modify_mask=bnxt.CMDQ_MODIFY_QP_MODIFY_MASK_STATE,
                           network_type_en_sqd_async_notify_new_state=bnxt.CMDQ_MODIFY_QP_NEW_STATE_RESET)
        except FirmwareError:
            pass
    await attempt("qp", "destroy_qp", lambda x: {"qp_cid": x}, nic.rcfw)
    await attempt("cq", "destroy_cq", lambda x: {"cq_cid": x}, nic.rcfw)
    for key in pools.ids.get("mr", []):
        try:
            await nic.rcfw("deregister_mr", lkey=key)  # frees keys REGISTER_MR allocated, unregisters the others
        except FirmwareError:
            pass
    live = []
    for key in pools.ids.pop("mr", []):
        try:
            await nic.rcfw("deallocate_key", key=key)
        except FirmwareError:
            live.append(key)  # gone already (REGISTER_MR's own key, freed by DEREGISTER_MR) or still registered
    await attempt("gid", "delete_gid", lambda x: {"gid_index": x}, nic.rcfw)
    await attempt("l2_filter", "cfa_l2_filter_free", lambda x: {"l2_filter_id": x}, nic.hwrm)
    await attempt("vnic", "vnic_free", lambda x: {"vnic_id": x}, nic.hwrm)
    rings = pools.ids.pop("ring", [])
    for _ in range(2):  # rings hanging off a fuzz NQ go first; the NQ in the second pass
        for ring_id in list(reversed(rings)):
            for ring_type in range(6):
                try:
                    await nic.hwrm("ring_free", ring_type=ring_type, ring_id=ring_id)
                except FirmwareError:
                    continue
                rings.remove(ring_id)
                break
    failures += [f"ring {r:#x} would not go" for r in rings]
    await attempt("stat_ctx", "stat_ctx_free", lambda x: {"stat_ctx_id": x}, nic.hwrm)
    await nic.set_loopback(bnxt.PORT_PHY_CFG_REQ_LPBK_NONE)  # PORT_PHY_CFG may have turned PHY loopback on
    link = nic.device.port_link  # and may have forced the link down (FUNC_DRV_IF_CHANGE, its interface down):
    await link.interface_up()  # brought up again as the boot does
    await link.update_phy_setting(single_pf=True)
    await nic.wait_for_link()
    return failures


def objects(nic: aiofabric.NIC) -> dict[str, int]:
    return nic.pci.debug({"op": "objects"})["objects"]


def stats(nic: aiofabric.NIC) -> dict[str, int]:
    return nic.pci.debug({"op": "stats"})["stats"]


async def connected_pair(a: aiofabric.NIC, b: aiofabric.NIC, mtu: int = 1024) -> tuple[Any, Any, Any, Any]:
    cq_a, cq_b = await a.create_cq(depth=64), await b.create_cq(depth=64)
    qa, qb = await a.create_qp(cq_a, sq_depth=16, rq_depth=16), await b.create_qp(cq_b, sq_depth=16, rq_depth=16)
    await qa.connect(qb.info(), mtu=mtu)
    await qb.connect(qa.info(), mtu=mtu)
    return cq_a, cq_b, qa, qb


async def destroy(*objects_: Any) -> None:
    for item in objects_:
        await (item.deregister() if hasattr(item, "deregister") else item.destroy())


async def verified_write(a: aiofabric.NIC, b: aiofabric.NIC, rng: random.Random, size: int = 10_000) -> None:
    """A fresh QP pair moves `size` random bytes A -> B by RDMA WRITE; the bytes must arrive, then all is freed."""
    cq_a, cq_b, qa, qb = await connected_pair(a, b)
    source, target = await a.register_mr(size), await b.register_mr(size)
    data = rng.randbytes(size)
    source.view[:size] = data
    with anyio.fail_after(10):
        await qa.write(source, target.remote(), size)
    if bytes(target.view[:size]) != data:
        raise AssertionError("verified write: the target's bytes differ from the source's")
    await destroy(qa, qb, cq_a, cq_b, source, target)


async def firmware_phase(a: aiofabric.NIC, b: aiofabric.NIC, rng: random.Random, hwrm: int,
                         rcfw: int) -> dict[str, Any]:
    """HWRM then RCFW fuzzing on NIC `a`; a verified write a -> b afterwards; leaks compared."""
    objects_before, dma_before = objects(a), a.pci.dma_bytes_in_use
    pools = Pools(a)
    pools.seed_memory(rng)
    started = time.perf_counter()
    hwrm_outcomes = await fuzz_hwrm(a, rng, hwrm, pools)
    rcfw_outcomes = await fuzz_rcfw(a, rng, rcfw, pools)
    elapsed = time.perf_counter() - started
    failures = await cleanup(a, pools)
    pools.free_buffers()
    await verified_write(a, b, rng)
    objects_after = objects(a)
    leaks = {k: objects_after[k] - objects_before[k] for k in objects_before if objects_after[k] != objects_before[k]}
    if a.pci.dma_bytes_in_use != dma_before:
        leaks["driver_dma_bytes"] = a.pci.dma_bytes_in_use - dma_before
    internal = stats(a).get("fw_internal_errors", 0) + stats(a).get("internal_errors", 0)  # firmware + data path
    return {"hwrm": dict(hwrm_outcomes), "rcfw": dict(rcfw_outcomes), "cleanup_failures": failures, "leaks": leaks,
            "internal_errors": internal, "seconds": round(elapsed, 2)}


# -- the wire ------------------------------------------------------------------------------------------------------
class Wire:
    """A plain UDP socket on a free 127.0.0.x's 4791, as an emulator sends (the UDP transport drops loopback senders
    on other ports), sending to one NIC's 4791 (DF set, so the kernel writes IP ID 0: the ICRC of the packets we build
    is right on arrival)."""

    def __init__(self, nic_ip: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO
        for host in range(254, 1, -1):  # bounded: a free address is found long before
            try:
                self.sock.bind((f"127.0.0.{host}", pk.ROCE_PORT))
                break
            except OSError:
                continue
        else:
            self.sock.close()
            raise OSError("no 127.0.0.x with UDP 4791 free to send from")
        self.src_ip, self.src_port = self.sock.getsockname()
        self.dst_ip = nic_ip

    def packet(self, opcode: int, qpn: int, psn: int, **fields: Any) -> pk.Packet:
        return pk.Packet(opcode, qpn, psn, src_ip=self.src_ip, dst_ip=self.dst_ip, src_port=self.src_port, **fields)

    def seal(self, body: bytes) -> bytes:
        """`body` (BTH onwards) with the ICRC this socket's IPv4/UDP header gives it (4 random bytes when `body` is
        shorter than a BTH: no ICRC exists for it, and the decoder refuses it by length first)."""
        if len(body) < pk.BTH_SIZE:
            return body + bytes(4)
        header = codec.encode_ipv4_header(self.packet(0, 0, 0), len(body) + pk.ICRC_SIZE)
        return body + icrc.icrc(header + body)

    def fate(self, datagram: bytes) -> str:
        """What the NIC's decoder will do with it: "received", "icrc" or "malformed"."""
        try:
            codec.decode(datagram, self.src_ip, self.dst_ip, self.src_port)
        except codec.IcrcMismatch:
            return "icrc"
        except codec.BadPacket:
            return "malformed"
        return "received"

    def close(self) -> None:
        self.sock.close()


REQUEST_OPS = [op for op in pk.Op if op not in pk.HAS_AETH and op != pk.Op.CNP]


def make_datagram(rng: random.Random, wire: Wire, qpns: list[int], epsn: int, mr: Any, mtu: int) -> tuple[str, bytes]:
    """One hostile datagram aimed at `qpns` (live QPs whose responder expects `epsn`); (category, bytes)."""
    qpn = rng.choice(qpns)
    kind = rng.choice(("random", "truncated", "random_bth", "bad_icrc", "reth_outside", "broken_order",
                       "far_psn", "valid_write"))
    if kind == "random":
        return kind, rng.randbytes(rng.choice((0, 1, 7, 12, 15, 16, 20, rng.randrange(0, 1500))))
    if kind == "random_bth":  # any opcode, pad, version bits now and then, random QPN (often ours), PSN near epsn
        opcode = rng.choice((rng.randrange(256), rng.choice(list(pk.Op))))
        flags = rng.randrange(256) & (0xFF if rng.random() < 0.1 else 0xF0)
        bth = struct.pack(">BBHII", opcode, flags, rng.choice((0xFFFF, rng.randrange(1 << 16))),
                          qpn if rng.random() < 0.7 else rng.getrandbits(32),
                          rng.getrandbits(1) << 31 | (epsn + rng.randrange(-4, 5)) & pk.PSN_MASK)
        return kind, wire.seal(bth + rng.randbytes(rng.choice((0, 4, 12, 16, 28, rng.randrange(0, mtu + 64)))))
    if kind == "truncated":  # a valid packet cut short, resealed half of the time so the length checks run
        op = rng.choice(REQUEST_OPS)
        body = codec.encode(wire.packet(op, qpn, epsn, remote_addr=mr.addr, rkey=mr.rkey, dma_length=64,
                                     payload=rng.randbytes(64) if op in pk.HAS_PAYLOAD else b""))[:-pk.ICRC_SIZE]
        cut = body[:rng.randrange(0, len(body))]
        return kind, wire.seal(cut) if rng.random() < 0.5 else cut
    if kind == "bad_icrc":
        good = bytearray(codec.encode(wire.packet(pk.Op.RDMA_WRITE_ONLY, qpn, epsn, remote_addr=mr.addr, rkey=mr.rkey,
                                               dma_length=8, payload=rng.randbytes(8))))
        good[rng.randrange(len(good))] ^= 1 << rng.randrange(8)
        return kind, bytes(good)
    if kind == "reth_outside":  # a bad rkey, or an address/length leaving the MR: NAK remote access, QP to ERR
        addr, rkey, length = rng.choice(((mr.addr, rng.getrandbits(32), 8), (mr.addr + mr.length - 4, mr.rkey, 8),
                                         (rng.getrandbits(64), mr.rkey, 8), (mr.addr, mr.rkey, 1 << 31)))
        op = rng.choice((pk.Op.RDMA_WRITE_ONLY, pk.Op.RDMA_WRITE_FIRST, pk.Op.RDMA_READ_REQUEST))
        payload = b"" if op == pk.Op.RDMA_READ_REQUEST else rng.randbytes(8 if op == pk.Op.RDMA_WRITE_ONLY else mtu)
        return kind, codec.encode(wire.packet(op, qpn, epsn, remote_addr=addr, rkey=rkey, dma_length=length,
                                           payload=payload, ack_req=True))
    if kind == "broken_order":  # a MIDDLE/LAST with no FIRST, or a FIRST inside another message
        op = rng.choice((pk.Op.SEND_MIDDLE, pk.Op.SEND_LAST, pk.Op.RDMA_WRITE_MIDDLE, pk.Op.RDMA_WRITE_LAST,
                         pk.Op.SEND_FIRST, pk.Op.RDMA_WRITE_FIRST, pk.Op.SEND_LAST_WITH_IMMEDIATE))
        size = mtu if "MIDDLE" in op.name or "FIRST" in op.name else rng.randrange(0, mtu + 1)
        return kind, codec.encode(wire.packet(op, qpn, epsn, remote_addr=mr.addr, rkey=mr.rkey, dma_length=mtu * 2,
                                           payload=rng.randbytes(size)))
    if kind == "far_psn":
        psn = (epsn + rng.choice((1 << 22, -(1 << 22), 1 << 23, rng.randrange(1 << 24)))) & pk.PSN_MASK
        return kind, codec.encode(wire.packet(pk.Op.RDMA_WRITE_ONLY, qpn, psn, remote_addr=mr.addr, rkey=mr.rkey,
                                           dma_length=4, payload=b"\xee" * 4, ack_req=rng.random() < 0.5))
    length = rng.randrange(1, min(mr.length, mtu) + 1)  # a well-formed WRITE into the MR: the responder's good path
    return kind, codec.encode(wire.packet(pk.Op.RDMA_WRITE_ONLY, qpn, epsn, remote_addr=mr.addr, rkey=mr.rkey,
                                       dma_length=length, payload=rng.randbytes(length), ack_req=rng.random() < 0.3))


WIRE_KEYS = ("wire_received", "wire_dropped_icrc", "wire_dropped_malformed")
WATCHED = ("packets_received", "dropped_no_qp", "internal_errors", "wire_receive_errors")


async def wire_batch(a: aiofabric.NIC, b: aiofabric.NIC, rng: random.Random, count: int,
                     burst: int = 64) -> dict[str, Any]:
    """`count` hostile datagrams at fresh connected QPs of `b`, in bursts; the accounting checked after each burst."""
    pairs = [await connected_pair(a, b) for _ in range(2)]
    mr = await b.register_mr(1 << 16)
    region = mr.remote()
    live = {qb.qpn for *_, qb in pairs}
    wire = Wire(b.ip)
    categories: collections.Counter = collections.Counter()
    fates: collections.Counter = collections.Counter()
    mismatches: list[str] = []
    sent = 0
    try:
        while sent < count:
            described = b.pci.debug({"op": "datapath"})["qps"]
            epsns = [described[str(q)]["epsn"] for q in live if str(q) in described] or [0]
            before = stats(b)
            expected: collections.Counter = collections.Counter()
            for _ in range(min(burst, count - sent)):
                category, datagram = make_datagram(rng, wire, sorted(live), rng.choice(epsns), region, 1024)
                categories[category] += 1
                fate = wire.fate(datagram)
                expected[fate] += 1
                if fate == "received":
                    decoded = codec.decode(datagram, wire.src_ip, wire.dst_ip, wire.src_port)
                    expected["no_qp"] += decoded.dest_qp not in live
                wire.sock.sendto(datagram, (b.ip, pk.ROCE_PORT))
                sent += 1
            total = sum(expected[f] for f in ("received", "icrc", "malformed"))
            with anyio.fail_after(10):  # until the NIC has taken every datagram of the burst off its socket
                while True:
                    after = stats(b)
                    if sum(after.get(k, 0) - before.get(k, 0) for k in WIRE_KEYS) >= total:
                        break
                    await anyio.sleep(0.001)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in (*WIRE_KEYS, *WATCHED)}
            got = {"received": delta["wire_received"], "icrc": delta["wire_dropped_icrc"],
                   "malformed": delta["wire_dropped_malformed"], "no_qp": delta["dropped_no_qp"]}
            fates.update({k: got[k] for k in ("received", "icrc", "malformed")})
            if got != {k: expected[k] for k in got} or delta["packets_received"] != delta["wire_received"] \
                    or delta["internal_errors"] or delta["wire_receive_errors"]:
                mismatches.append(f"expected {dict(expected)}, counted {delta}")
            await anyio.sleep(0)
    finally:
        wire.close()
    alive = b.pci.process.poll() is None
    for cq_a, cq_b, qa, qb in pairs:
        await destroy(qa, qb, cq_a, cq_b)
    await destroy(mr)
    await verified_write(a, b, rng)
    return {"categories": dict(categories), "fates": dict(fates), "mismatches": mismatches, "alive": alive,
            "last_error": b.pci.debug({"op": "datapath"})["last_error"]}


async def run(seed: int, hwrm: int, rcfw: int, datagrams: int, batches: int) -> dict[str, Any]:
    rng = random.Random(seed)
    started = time.perf_counter()
    summary: dict[str, Any] = {"seed": seed}
    async with aiofabric.open_nic("sim", fw_latency_us=0) as a, aiofabric.open_nic("sim", fw_latency_us=0) as b:
        base_a, base_b = objects(a), objects(b)
        summary["firmware"] = await firmware_phase(a, b, rng, hwrm, rcfw)
        wire: dict[str, Any] = {"datagrams": 0, "categories": collections.Counter(), "fates": collections.Counter(),
                                "mismatches": [], "batches": 0}
        for i in range(batches):
            share = datagrams // batches + (i < datagrams % batches)
            result = await wire_batch(a, b, rng, share)
            wire["datagrams"] += share
            wire["batches"] += 1
            wire["categories"].update(result["categories"])
            wire["fates"].update(result["fates"])
            wire["mismatches"] += result["mismatches"]
            if not result["alive"]:
                wire["mismatches"].append(f"batch {i}: the emulator died")
                break
        wire["seconds"] = round(time.perf_counter() - started - summary["firmware"]["seconds"], 2)
        summary["wire"] = {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in wire.items()}
        summary["wire"]["internal_errors"] = stats(b).get("internal_errors", 0)
        summary["wire"]["last_error"] = b.pci.debug({"op": "datapath"})["last_error"]
        leaks = {f"{name}.{k}": now[k] - base[k] for name, nic, base in (("a", a, base_a), ("b", b, base_b))
                 for now in [objects(nic)] for k in base if now[k] != base[k]}
        alive = a.pci.process.poll() is None and b.pci.process.poll() is None
    firmware = summary["firmware"]
    summary["crashes"] = (not alive) + firmware["internal_errors"] + summary["wire"]["internal_errors"]
    summary["leaks"] = len(leaks) + len(firmware["leaks"]) + len(firmware["cleanup_failures"])
    summary["leak_detail"] = {**leaks, **firmware["leaks"]}
    summary["miscounts"] = len(summary["wire"]["mismatches"])
    summary["elapsed"] = round(time.perf_counter() - started, 2)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hwrm", type=int, default=10_000)
    parser.add_argument("--rcfw", type=int, default=10_000)
    parser.add_argument("--datagrams", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args()
    summary = anyio.run(run, args.seed, args.hwrm, args.rcfw, args.datagrams, args.batches)
    print(json.dumps(summary))
    raise SystemExit(0 if not (summary["crashes"] or summary["leaks"] or summary["miscounts"]) else 1)


if __name__ == "__main__":
    main()
