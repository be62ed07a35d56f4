"""Fuzzing the emulated NIC, the fast subset: hostile input never crashes it, leaks or miscounts.

Sans-IO first (the codec, HWRM and RCFW firmware driven by tests/support/firmware.py's Driver, with hypothesis), then
a live NIC through the seam and its wire with bench/fuzz.py's generators at small counts (the long run is
`python bench/fuzz.py`).
"""
import ctypes
import importlib.util
import random

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiofabric
from aiofabric.autogen import bnxt
from aiofabric.hw.cqe import CREQ_COMMAND_EVENT
from aiofabric.hw.firmware import CMDQ_HEADER, CMDQ_SLOT, HWRM_REQUEST_HEADER
from aiofabric.sim import codec, icrc
from aiofabric.sim import packets as pk
from aiofabric.sim.hwrm import Firmware
from aiofabric.sim.memory import BUS_BASE
from aiofabric.sim.objects import NotificationQueue
from aiofabric.sim.rcfw import Rcfw
from tests.support import CHECKOUT
from tests.support.firmware import Driver

_spec = importlib.util.spec_from_file_location("fuzz", CHECKOUT / "bench" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

SRC, DST, PORT = "127.0.0.1", "127.0.0.9", 50000
FAST = settings(max_examples=60, deadline=None)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the emulator is the subject here, not the event loop


# -- the codec -----------------------------------------------------------------------------------------------------
def sealed(body: bytes) -> bytes:
    header = codec.encode_ipv4_header(pk.Packet(0, 0, 0, src_ip=SRC, dst_ip=DST, src_port=PORT), len(body) + 4)
    return body + icrc.icrc(header + body)


def decodes_or_refuses(datagram: bytes) -> None:
    try:
        codec.decode(datagram, SRC, DST, PORT)
    except codec.BadPacket as exc:
        assert exc.reason in codec.DROP_REASONS


@FAST
@given(st.binary(max_size=300))
def test_decode_takes_any_bytes(data):
    decodes_or_refuses(data)
    try:
        codec.decode_ipv4(data)
    except codec.BadPacket as exc:
        assert exc.reason in codec.DROP_REASONS


@FAST
@given(st.integers(0, 255), st.integers(0, 255), st.binary(min_size=10, max_size=80))
def test_decode_takes_any_bth_with_a_good_icrc(opcode, flags, rest):
    decodes_or_refuses(sealed(bytes((opcode, flags)) + rest))


@pytest.mark.parametrize("datagram, reason", [
    (b"\x0a" * 15, "short"), (sealed(bytes(12)) [:-1] + b"\0", "icrc"), (sealed(b"\x15" + bytes(11)), "opcode"),
    (sealed(b"\x11\x01" + bytes(14)), "version"), (sealed(b"\x11\x10" + bytes(14)), "length"),
    (sealed(b"\x0a\x00" + bytes(26) + b"abc"), "length")])
def test_every_refusal_names_its_reason(datagram, reason):
    with pytest.raises(codec.BadPacket) as refused:
        codec.decode(datagram, SRC, DST, PORT)
    assert refused.value.reason == reason


def test_icrc_of_a_packet_without_a_bth_is_a_value_error():
    # found by bench/fuzz.py: icrc() of an IPv4/UDP header plus one byte raised IndexError
    header = codec.encode_ipv4_header(pk.Packet(0, 0, 0, src_ip=SRC, dst_ip=DST, src_port=PORT), 5)
    with pytest.raises(ValueError, match="needs IPv4, UDP and a BTH"):
        icrc.icrc(header + b"\x0a")
    with pytest.raises(ValueError):
        icrc.icrc(b"")


# -- firmware, sans-IO ---------------------------------------------------------------------------------------------
def check_invariants(fw: Firmware) -> None:
    """The object tables agree with each other and nothing failed inside the emulator."""
    rcfw = fw.rcfw
    assert not fw.stats["internal_errors"], fw.last_error
    for ring_id, ring in fw.rings.items():
        assert ring.ring_id == ring_id
        assert ring.nq_ring_id is None or isinstance(fw.rings.get(ring.nq_ring_id), NotificationQueue)
    assert rcfw.creq is None or fw.rings.get(rcfw.creq.ring_id) is rcfw.creq
    for cq_id, cq in rcfw.cqs.items():
        assert cq.cq_id == cq_id and fw.rings.get(cq.nq.ring_id) is cq.nq
    for qpn, qp in rcfw.qps.items():
        assert qp.qpn == qpn and rcfw.cqs.get(qp.scq.cq_id) is qp.scq and rcfw.cqs.get(qp.rcq.cq_id) is qp.rcq
    for key, mr in rcfw.mrs.items():
        assert mr.key == key


def field_values(struct_type: type, draw, host: Driver) -> dict:
    """Random values for every field of a binding but the header: ids and sizes often small, addresses often host
    memory (where page tables and rings would be), anything else now and then."""
    pages = [host.alloc() for _ in range(4)]
    fields = {}
    for name, ctype, *_ in struct_type._fields_:
        if name in fuzz.HEADER_FIELDS:
            continue
        element = ctype._type_ if issubclass(ctype, ctypes.Array) else ctype
        bits = ctypes.sizeof(element) * 8
        value = st.one_of(st.integers(0, 8), st.sampled_from((0xFF, 0xFFFF, (1 << bits) - 1)),
                          st.integers(0, (1 << bits) - 1),
                          *([st.sampled_from(pages)] if bits == 64 else []))
        if issubclass(ctype, ctypes.Array):
            fields[name] = tuple(draw(value) & (1 << bits) - 1 for _ in range(ctype._length_))
        else:
            fields[name] = draw(value) & (1 << bits) - 1
    return fields


def answer_hwrm(host: Driver, request: bytes) -> None:
    result = host.fw.hwrm(request)
    if result is not None:
        addr, response = result
        assert addr >= BUS_BASE and response[-1] == bnxt.HWRM_RESP_VALID_KEY
        assert len(response) >= ctypes.sizeof(bnxt.hwrm_err_output)
        host.mem.write(addr, response)  # the shell's DMA: must land inside host memory


@FAST
@given(st.binary(min_size=0, max_size=200), st.booleans())
def test_any_hwrm_window_gets_an_answer_or_none(window, reachable):
    host = Driver()
    host.boot()
    header = HWRM_REQUEST_HEADER
    if reachable and len(window) >= header.size:  # a response address in host memory: the command runs and answers
        req_type, cmpl_ring, seq_id, target_id, _ = header.unpack_from(window)
        window = header.pack(req_type, cmpl_ring, seq_id, target_id, host.response) + window[header.size:]
    answer_hwrm(host, window)
    check_invariants(host.fw)


@FAST
@given(st.sampled_from(Firmware.COMMANDS), st.data())
def test_every_hwrm_command_with_random_fields_answers_with_a_status(name, data):
    host = Driver()
    host.boot()
    host.create_qp(host.create_cq())
    request = getattr(bnxt, f"hwrm_{name}_input")(**field_values(getattr(bnxt, f"hwrm_{name}_input"), data.draw,
                                                                 host))
    request.req_type, request.resp_addr = getattr(bnxt, f"HWRM_{name.upper()}"), host.response
    answer_hwrm(host, bytes(request).ljust(bnxt.HWRM_MAX_REQ_LEN, b"\0"))
    check_invariants(host.fw)


def run_command(host: Driver, name: str, fields: dict, **header) -> int:
    """Post one command, let the firmware run, return its CREQ status (it must answer, with our cookie)."""
    cookie = host.post(name, **header, **fields)
    assert host.run() == 1
    (status,) = [status for _, status, answered, _, _ in map(CREQ_COMMAND_EVENT.unpack, host.drain())
                 if answered == cookie]
    return status


@FAST
@given(st.sampled_from(Rcfw.COMMANDS), st.data())
def test_every_rcfw_command_with_random_fields_answers_with_a_status(name, data):
    host = Driver()
    host.boot()
    host.create_qp(host.create_cq())
    run_command(host, name, field_values(getattr(bnxt, f"cmdq_{name}"), data.draw, host))
    check_invariants(host.fw)
    if name != "deinitialize_fw":
        assert run_command(host, "query_version", {}) == 0  # and the channel goes on


@FAST
@given(st.integers(0, 255), st.integers(1, 8), st.binary(min_size=128, max_size=128), st.integers(0, 0xFFFF))
def test_random_cmdq_opcodes_and_bodies_are_answered(opcode, slots, body, resp_size):
    host = Driver()
    host.boot()
    fields = {"opcode": opcode, "cmd_size": slots, "resp_size": resp_size & 0xFF,
              "resp_addr": int.from_bytes(body[:8], "little")}
    request = bnxt.cmdq_query_version(**fields)  # a header; the body is random, `slots` slots long
    host.publish((bytes(request)[:CMDQ_HEADER.size] + body)[:slots * CMDQ_SLOT])
    assert host.run() == 1
    check_invariants(host.fw)


# -- a live NIC through the seam -----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_firmware_fuzz_through_the_seam_leaves_the_nic_working_and_clean():
    rng = random.Random(7)
    async with aiofabric.open_nic("sim", fw_latency_us=0) as a, aiofabric.open_nic("sim", fw_latency_us=0) as b:
        result = await fuzz.firmware_phase(a, b, rng, 400, 400)  # ends with a verified write a -> b
        assert a.pci.process.poll() is None
    assert result["leaks"] == {} and result["cleanup_failures"] == [] and result["internal_errors"] == 0, result
    assert result["hwrm"]["ok"] and result["hwrm"]["error"] and result["rcfw"]["ok"] and result["rcfw"]["error"]


@pytest.mark.anyio
async def test_hostile_datagrams_are_all_accounted_for_and_the_nic_keeps_serving():
    rng = random.Random(11)
    async with aiofabric.open_nic("sim", fw_latency_us=0) as a, aiofabric.open_nic("sim", fw_latency_us=0) as b:
        before = fuzz.objects(b)
        for _ in range(2):  # each batch: fresh target QPs, 1500 datagrams, then a verified write on a fresh pair
            result = await fuzz.wire_batch(a, b, rng, 1500)
            assert result["alive"] and result["mismatches"] == [], result
            assert set(result["fates"]) == {"received", "icrc", "malformed"}
            assert len(result["categories"]) == 8
        assert fuzz.objects(b) == before and fuzz.stats(b).get("internal_errors", 0) == 0
        assert fuzz.stats(b).get("fw_internal_errors", 0) == 0


@pytest.mark.anyio
async def test_malformed_drops_are_counted_per_reason():
    async with aiofabric.open_nic("sim", fw_latency_us=0) as nic:
        wire = fuzz.Wire(nic.ip)
        try:
            for datagram in (b"\x0a" * 15, wire.seal(b"\x15" + bytes(11)), wire.seal(b"\x11\x01" + bytes(14))):
                wire.sock.sendto(datagram, (nic.ip, pk.ROCE_PORT))
            with anyio.fail_after(5):
                while fuzz.stats(nic).get("wire_dropped_malformed", 0) < 3:
                    await anyio.sleep(0.01)
        finally:
            wire.close()
        counted = fuzz.stats(nic)
    assert {reason: counted.get(f"wire_dropped_{reason}", 0) for reason in ("short", "opcode", "version")} == \
        {"short": 1, "opcode": 1, "version": 1}
