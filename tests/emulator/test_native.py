"""The emulator's compiled core (aiofabric/sim/native.py and its C sources) against the Python reference it stands in
for: packets encoded byte for byte as the codec encodes them, datagrams parsed (or dropped, and counted) as the codec
decodes them, and the whole data path, WQE blocks and WRITE runs included, sending and placing exactly what the Python
data path does (tests/support/twin.py)."""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import logging
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiofabric.autogen import bnxt
from aiofabric.hw.verbs import PSN_MASK, MRAccess, QPAccess, QPState
from aiofabric.hw.wqe import ATOMIC_SIZE
from aiofabric.sim import codec, native, rcfw, wqeblock, writeruns
from aiofabric.sim.icrc import icrc
from aiofabric.sim import packets as pk
from aiofabric.sim.packets import Op
from tests.support.emulator import (ALL_MR_ACCESS, ALL_QP_ACCESS, MASK, READ, SEND, SEND_IMM, WRITE, WRITE_IMM, Host,
                                    fill)
from tests.support.twin import Endpoint, TwinWire, core

A, B = "127.0.0.121", "127.0.0.122"
PAYLOAD_OPS = sorted(pk.HAS_PAYLOAD)
FIXTURE = HealthCheck.function_scoped_fixture  # the endpoint is stateless between examples
U24, U32, U64 = st.integers(0, PSN_MASK), st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1)
SLOT = 20000  # bytes of each operation's part of a region
MEMORY = 3 * 32 * SLOT + (4 << 20)  # a host's: three regions of 32 slots, and its rings


@pytest.fixture
def endpoint():
    end = Endpoint(A)
    yield end
    end.close()


# -- the codec -------------------------------------------------------------------------------------------------------
@st.composite
def packets(draw) -> pk.Packet:
    op = draw(st.sampled_from(list(Op)))
    payload = draw(st.binary(max_size=4096)) if op in pk.HAS_PAYLOAD else b""
    flag = st.booleans()
    return pk.Packet(op, draw(U24), draw(U24), draw(flag), draw(flag), draw(st.integers(0, 0xFFFF)), draw(flag),
                     draw(flag), draw(U64), draw(U32), draw(U32), draw(st.integers(0, 255)), draw(U24), draw(U32),
                     memoryview(bytearray(payload)), dst_ip=B, migreq=draw(flag), swap_add=draw(U64),
                     compare=draw(U64), original=draw(U64))


@st.composite
def segments(draw) -> pk.Segments:
    mtu = draw(st.sampled_from([256, 1024, 4096]))
    length = draw(st.integers(0, 5 * mtu))
    npkts = -(-length // mtu) or 1
    start = draw(st.integers(0, npkts - 1))
    count = draw(st.integers(1, min(npkts - start, 64)))
    ops = draw(st.sampled_from([(Op.SEND_MIDDLE, Op.SEND_LAST, Op.SEND_FIRST, Op.SEND_ONLY),
                                (Op.RDMA_WRITE_MIDDLE, Op.RDMA_WRITE_LAST_WITH_IMMEDIATE, Op.RDMA_WRITE_FIRST,
                                 Op.RDMA_WRITE_ONLY_WITH_IMMEDIATE)]))
    data = memoryview(bytearray(draw(st.binary(min_size=length, max_size=length))))
    return pk.Segments(tuple(map(int, ops)), draw(U24), draw(U24), npkts, mtu, data, length, draw(U64), draw(U32),
                       draw(U32), draw(st.booleans()), start, count, draw(st.integers(0, (1 << count) - 1)),
                       draw(st.integers(0, 0xFFFF)), dst_ip=B)


def reference(items: list[pk.Outgoing]) -> list[tuple[bytes, str]]:
    found = []
    for p in pk.expand(items):
        p.src_ip, p.src_port, p.dst_port, p.ip_id = A, pk.ROCE_PORT, pk.ROCE_PORT, 0
        found.append((codec.encode(p), p.dst_ip))
    return found


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[FIXTURE])
@given(items=st.lists(st.one_of(packets(), segments()), min_size=1, max_size=12))
def test_the_core_encodes_what_the_codec_encodes(endpoint, items):
    copies = [dataclasses.replace(item) for item in items]
    assert endpoint.encoded(items) == reference(copies)


def test_what_the_core_refuses_is_encoded_the_python_way(endpoint):
    """A payload its opcode does not carry: the core stops there, and the codec raises as it always did."""
    ack = pk.Packet(Op.ACKNOWLEDGE, 5, 7, payload=memoryview(bytearray(b"xyz")), dst_ip=B)
    with pytest.raises(ValueError, match="ACKNOWLEDGE carries no payload, got 3 bytes"):
        endpoint.encoded([ack])
    fine = pk.Packet(Op.ACKNOWLEDGE, 5, 7, dst_ip=B)
    before = endpoint.by_core
    assert endpoint.encoded([fine]) == reference([dataclasses.replace(fine)])
    assert endpoint.by_core == before + 1  # the core's bytes, not the codec's, were compared


def datagram(draw) -> tuple[bytes, str, int]:
    wire = bytearray(codec.encode(dataclasses.replace(draw(packets()), src_ip=B, dst_ip=A, src_port=pk.ROCE_PORT)))
    damage = draw(st.sampled_from(["none", "none", "flip", "cut", "version", "port", "pad"]))
    port = pk.ROCE_PORT
    if damage == "flip":
        wire[draw(st.integers(0, len(wire) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif damage == "cut":
        wire = wire[:draw(st.integers(0, len(wire) - 1))]
    elif damage == "version":  # a good ICRC over a bad header: the checks after the ICRC's see it
        wire[1] |= draw(st.integers(1, 15))
    elif damage == "pad":
        wire[1] ^= draw(st.integers(1, 3)) << 4
    elif damage == "port":
        port = draw(st.integers(1, 65535))
    if damage in ("version", "pad"):  # the ICRC made right again, by the plain rule
        header = codec.encode_ipv4_header(pk.Packet(0, 0, 0, src_ip=B, dst_ip=A, src_port=pk.ROCE_PORT), len(wire))
        wire[-4:] = icrc(header + bytes(wire[:-4]))
    return bytes(wire), B, port


@st.composite
def datagrams(draw) -> list[tuple[bytes, str, int]]:
    return [datagram(draw) for _ in range(draw(st.integers(1, 20)))]


def decoded(data: bytes, port: int) -> tuple[str, pk.Packet | None]:
    """What the UDP transport's Python path makes of a datagram: the packet, or the counter its drop goes to."""
    try:
        if port != pk.ROCE_PORT:
            return "dropped_source_port", None
        return "", codec.decode(data, B, A, port)
    except codec.IcrcMismatch:
        return "dropped_icrc", None
    except codec.BadPacket as exc:
        return f"dropped_{exc.reason}", None


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[FIXTURE])
@given(arriving=datagrams())
def test_the_core_parses_what_the_codec_decodes(endpoint, arriving):
    endpoint.counters.clear()
    batch = endpoint.staged(arriving)
    expected = [decoded(data, port) for data, _, port in arriving]
    assert [dataclasses.replace(p, payload=bytes(p.payload)) for p in batch.packets()] == \
        [dataclasses.replace(p, payload=bytes(p.payload)) for _, p in expected if p is not None]
    drops = [reason for reason, _ in expected if reason]
    assert batch.good == len(arriving) - len(drops)
    assert endpoint.counters["received"] == batch.good
    for reason in set(drops):
        assert endpoint.counters[reason] == drops.count(reason), reason
    malformed = sum(1 for r in drops if r not in ("dropped_icrc", "dropped_source_port"))
    assert endpoint.counters["dropped_malformed"] == malformed


def test_the_core_crc_is_zlibs_with_or_without_isal():
    import zlib
    data = bytes(range(256)) * 40
    for length in (0, 1, 7, 100, 255, 256, 257, 4096, len(data)):
        assert core().crc32(12345, data, length) == zlib.crc32(data[:length], 12345)


# -- the data path ----------------------------------------------------------------------------------------------------
def twins(mtu: int, sq_psn: int, variable: bool, faults: dict[str, float], seed: int, profile: str = "thor2",
          hw_retx: bool = False):
    """Two pairs of hosts set up alike: one carried through the compiled core, one through the Python path."""
    made = []
    for native_path in (True, False):
        a, b = (Host(ip, memory=MEMORY, profile=profile, hw_retx=hw_retx) for ip in (A, B))
        for host in (a, b):
            host.create_qp(host.create_cq(4096), sq_slots=2048, variable=variable)
        made.append((a, b, TwinWire(a, b, native=native_path, seed=seed, **faults)))
        a.connect(b, mtu=mtu, sq_psn=sq_psn, rq_psn=sq_psn ^ 0x5555, timeout=3)
        b.connect(a, mtu=mtu, sq_psn=sq_psn ^ 0x5555, rq_psn=sq_psn, timeout=3)
        for host in (a, b):  # atomics too
            host.modify(QPState.RTS, MASK["ACCESS"], access=ALL_QP_ACCESS | QPAccess.REMOTE_ATOMIC)
    return made


# Sizes up to SLOT: at MTU 256 a message that long asks for ACKs every ACK_EVERY packets, not only at its end.
OPERATIONS = st.lists(st.tuples(st.sampled_from(["write", "write", "write_imm", "send", "send_imm", "read",
                                                 "other_key", "bad_key", "fetch_add", "compare_swap"]),
                                st.one_of(st.integers(0, 6000), st.integers(6000, SLOT)), st.booleans(),
                                st.booleans()), min_size=1, max_size=30)


class DrawnKeys:
    """What rcfw.py draws MR key bytes from, made repeatable, so that the twins' keys (in the packets) match."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def randbits(self, bits: int) -> int:
        return self.random.getrandbits(bits)


def run_script(a: Host, b: Host, wire: TwinWire, operations, seed: int) -> dict:
    size = SLOT * (len(operations) + 1)
    with mock.patch.object(rcfw, "secrets", DrawnKeys(seed)):
        src, lkey = a.register(size)
        other, other_key = a.register(size)
        dst, rkey = b.register(size, ALL_MR_ACCESS | MRAccess.REMOTE_ATOMIC)
    fill(a, src, size, seed)
    fill(a, other, size, seed + 2)
    fill(b, dst, size, seed + 1)
    for i, (kind, length, signaled, ring) in enumerate(operations):
        slot = SLOT * i
        sge = [(src + slot, lkey, length)]
        if kind == "read":
            a.post(READ, sge, remote=dst + slot, rkey=rkey, signaled=signaled, ring=ring)
        elif kind in ("send", "send_imm", "write_imm"):
            b.post_recv([(dst + slot, rkey, SLOT)], tag=i)
            if kind == "write_imm":
                a.post(WRITE_IMM, sge, remote=dst + slot, rkey=rkey, imm=i, signaled=signaled, ring=ring)
            else:
                a.post(SEND if kind == "send" else SEND_IMM, sge, imm=i, signaled=signaled, ring=ring)
        elif kind == "other_key":
            a.post(WRITE, [(other + slot, other_key, length)], remote=dst + slot, rkey=rkey, signaled=signaled,
                   ring=ring)
        elif kind in ("fetch_add", "compare_swap"):  # on the slot's first 8 bytes, the original into ours
            a.post(ATOMICS[kind], [(src + slot, lkey, ATOMIC_SIZE)], remote=dst + slot, rkey=rkey, swap=length,
                   compare=length >> 1, signaled=signaled, ring=ring)
        elif kind == "bad_key":  # a local protection error: the QP fails, the rest is flushed
            a.post(WRITE, [(src + slot, lkey + 1000, length)], remote=dst + slot, rkey=rkey, signaled=signaled,
                   ring=ring)
        else:
            a.post(WRITE, sge, remote=dst + slot, rkey=rkey, signaled=signaled, ring=ring)
        if i % 7 == 6:
            wire.run(max_time=60)
    a.ring_sq()
    a.post(WRITE, [(src, lkey, 0)], remote=dst, rkey=rkey)
    wire.run(max_time=600)
    wire.close()
    return {"datagrams": [hashlib.sha256(data).hexdigest() + destination for data, destination in wire.datagrams],
            "memory": (hashlib.sha256(a.mem.buffer).hexdigest(), hashlib.sha256(b.mem.buffer).hexdigest()),
            "cqes": (a.poll(), b.poll()), "stats": (dict(a.dp.stats), dict(b.dp.stats)),
            "placed": (a.dp.placed_report(), b.dp.placed_report()), "state": (a.dp.describe(), b.dp.describe()),
            "events": (a.creq_events(), b.creq_events())}


ATOMICS = {"fetch_add": bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_FA, "compare_swap": bnxt.SQ_ATOMIC_HDR_WQE_TYPE_ATOMIC_CS}
FAULTS = [{}, {"loss": 0.05}, {"dup": 0.2, "reorder": 0.3}, {"loss": 0.03, "dup": 0.05, "reorder": 0.2}]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS, seed=st.integers(0, 1 << 16), mtu=st.sampled_from([256, 1024, 4096]),
       faults=st.sampled_from(FAULTS), variable=st.booleans(), wraps=st.booleans(),
       table=st.sampled_from([("thor2", False), ("thor2", True), ("psn-table", True)]))
def test_the_compiled_data_path_sends_and_places_what_the_python_one_does(operations, seed, mtu, faults, variable,
                                                                         wraps, table):
    """`table`: the firmware profile (MSN or PSN search table) and whether go-backs resume from it."""
    (a, b, fast), (ra, rb, slow) = twins(mtu, PSN_MASK - 3 if wraps else 0x100, variable, faults, seed, *table)
    found = differences(run_script(a, b, fast, operations, seed), run_script(ra, rb, slow, operations, seed))
    del a, b, fast, ra, rb, slow
    gc.collect()  # the hosts' memories are cycles' garbage: without this, hundreds of examples' worth accumulates
    assert not found, found


def differences(got: dict, expected: dict) -> list[str]:
    """What differs, said briefly (pytest's own account of thousands of datagrams would take gigabytes)."""
    found = []
    for key, value in expected.items():
        if got[key] == value:
            continue
        if key == "datagrams":
            first = next((i for i, pair in enumerate(zip(got[key], value)) if pair[0] != pair[1]), None)
            found.append(f"datagrams: {len(got[key])} sent against {len(value)}, first difference at {first}")
        else:
            found.append(f"{key}: {got[key]!r:.2000} against {value!r:.2000}")
    return found


def test_the_twins_took_the_compiled_paths(monkeypatch):
    """The comparison above means something only if the native twin really runs WQE blocks and WRITE runs."""
    calls = {"runs": 0, "bursts": 0}
    place, pump = writeruns.place_run, wqeblock.WqeBlock.pump

    def counted_place(*args):
        end = place(*args)
        calls["runs"] += end > args[3]
        return end

    def counted_pump(self, *args):
        burst = pump(self, *args)
        calls["bursts"] += burst[0] is not None
        return burst

    monkeypatch.setattr("aiofabric.sim.datapath.place_run", counted_place)
    monkeypatch.setattr(wqeblock.WqeBlock, "pump", counted_pump)
    (a, b, fast), _ = twins(1024, 0x100, True, {}, 1)
    run_script(a, b, fast, [("write", 3000, True, True)] * 10, 1)
    assert calls["runs"] and calls["bursts"] and fast.endpoints[a.ip].by_core


def test_the_comparison_sees_a_run_that_forgets_an_ack(monkeypatch):
    """Break the WRITE runs (the ACK a packet asked for is not owed): the twins must differ."""
    original = writeruns.place_run

    def forgetful(core_, responder, batch, i, head):
        owe, responder.owe_ack = responder.owe_ack, lambda psn: None
        try:
            return original(core_, responder, batch, i, head)
        finally:
            responder.owe_ack = owe

    monkeypatch.setattr("aiofabric.sim.datapath.place_run", forgetful)
    (a, b, fast), (ra, rb, slow) = twins(1024, 0x100, True, {}, 1)
    script = [("write", 100, True, True)] * 3
    assert differences(run_script(a, b, fast, script, 1), run_script(ra, rb, slow, script, 1))


# -- building it ----------------------------------------------------------------------------------------------------
def test_without_a_compiler_the_python_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.INFO, "aiofabric.sim"):
        assert native.core() is None
    assert "no C compiler" in caplog.text


def test_a_failed_build_leaves_the_python_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.WARNING, "aiofabric.sim"):
        assert native.core() is None
    assert "its compiled core cannot be had" in caplog.text and "failed" in caplog.text


def test_switched_off_the_emulator_never_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", [])
    assert native.core() is None
    assert not (tmp_path / "cache").exists()


def test_a_build_lands_in_the_private_cache_and_is_loaded_from_there_next_time(monkeypatch, tmp_path):
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", [])
    built = native.core()
    assert built is not None and built.build["cached"] is False
    assert built.build["library"].startswith(str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", [])
    again = native.core()
    assert again is not None and again.build["cached"] is True


def test_without_its_sources_the_python_path_runs(monkeypatch, caplog):
    monkeypatch.setattr(native, "SOURCES", ("wirecodec.c", "no-such-file.c"))
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.WARNING, "aiofabric.sim"):
        assert native.core() is None
    assert "sources cannot be read" in caplog.text and "no-such-file.c" in caplog.text


@pytest.mark.parametrize("home", ["raises", "missing"])
def test_without_a_home_the_python_path_runs(monkeypatch, caplog, tmp_path, home):
    """No $HOME and no passwd entry, or a home that does not exist (a service user's HOME=/nonexistent): the home is
    never made, and the emulator says why it runs the Python path."""
    monkeypatch.delenv("AIOFABRIC_CACHE", raising=False)
    if home == "raises":
        monkeypatch.setattr(native.Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home directory")))
    else:
        monkeypatch.setenv("HOME", str(tmp_path / "nonexistent"))
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.INFO, "aiofabric.sim"):
        assert native.core() is None
    assert ("no private cache for its compiled core (~/.cache/aiofabric/kernels cannot be had: there is no home "
            "directory)") in caplog.text
    assert not (tmp_path / "nonexistent").exists()


def test_a_cache_others_can_write_is_not_used(monkeypatch, tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.INFO, "aiofabric.sim"):
        assert native.core() is None
    assert "no private cache" in caplog.text and "writable by" in caplog.text
    assert list(cache.iterdir()) == []


def test_the_udp_transport_takes_the_python_path_without_the_core(monkeypatch):
    from aiofabric.sim import udp
    monkeypatch.setattr(udp, "NativeSender", None)  # would fail if used
    monkeypatch.setattr(native, "_loaded", [None])  # the core that could not be had
    with udp.UdpTransport(A) as port:
        assert not port.parsed and port._native_out is None
