"""What an unauthenticated bench client may ask, as pure logic (aiofabric.peer.protocol's BENCH profile, its nesting
and text rules, aiofabric.peer.policy), and the DMA budget that caps a client's memory, on an emulated NIC."""
import ipaddress
import json
import mmap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiofabric import open_nic
from aiofabric.pci import DmaBudget
from aiofabric.peer import protocol
from aiofabric.peer.policy import Limits, ServerPolicy
from aiofabric.peer.operations import BENCH, ENDPOINT
from aiofabric.peer.protocol import NotAllowed, NotProtocolError

GID_OF = lambda ip: "00000000000000000000ffff" + ipaddress.IPv4Address(ip).packed.hex()  # noqa: E731
PEER = {"qpn": 2, "psn": 0, "gid": GID_OF("127.0.0.99"), "mac": "02:00:00:00:00:01"}


def _line(op, **args):
    return json.dumps({"id": 7, "op": op, "args": args}).encode()


@pytest.mark.parametrize("op, args, named", [
    ("open_nic", {"spec": "0000:41:00.0"}, "'spec'"),
    ("open_nic", {"spec": "sim"}, "'spec'"),
    ("open_nic", {"ip": "127.0.0.99"}, "'ip'"),
    ("open_nic", {"options": {"pcap": "/etc/cron.d/x"}}, "'pcap'"),
    ("open_nic", {"options": {"netns": "other"}}, "'netns'"),
    ("open_nic", {"options": {"transport": "raw"}}, "'transport'"),
    ("open_nic", {"options": {"fw_latency_us": 1e9, "loss": 0.1}}, "'fw_latency_us'"),
    ("post", {"qp": 1, "verb": "write", "mr": 2, "remote": {"addr": 0, "rkey": 1}}, "'post'"),
])
def test_the_bench_profile_refuses_what_touches_the_host_and_the_endpoint_takes_it(op, args, named):
    with pytest.raises(NotAllowed, match=named) as refused:
        protocol.decode_request(_line(op, **args), BENCH)
    assert refused.value.request_id == 7 and "the server chooses" in str(refused.value) + BENCH.why
    protocol.decode_request(_line(op, **args), ENDPOINT)  # the SSH endpoint's full protocol takes the same line


def test_the_bench_profile_takes_the_tests_own_wire_faults_and_nothing_else():
    request = protocol.decode_request(_line("open_nic", options={"loss": 0.01, "seed": 3}), BENCH)
    assert request.args == {"options": {"loss": 0.01, "seed": 3}}
    assert set(BENCH.ops) < set(ENDPOINT.ops) and "post" not in BENCH.ops
    with pytest.raises(ValueError, match="unknown op 'rm_rf'") as unknown:
        protocol.decode_request(_line("rm_rf"), BENCH)
    assert not isinstance(unknown.value, NotAllowed)


def _nested(depth: int) -> bytes:
    return b'{"id":1,"op":"ping","args":{},"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_nesting_is_limited_exactly_and_a_bomb_is_an_error_not_a_recursion_error():
    with pytest.raises(protocol.ProtocolError, match="unknown request key"):
        protocol.decode_request(_nested(protocol.MAX_DEPTH))  # deep enough, but a bad key: parsed, then refused
    for depth in (protocol.MAX_DEPTH + 1, 100_000):
        with pytest.raises(NotProtocolError, match=f"nested deeper than {protocol.MAX_DEPTH} levels"):
            protocol.decode_request(_nested(depth))
    with pytest.raises(NotProtocolError, match="deeper than 4 levels"):  # request, args, result, list, list
        protocol.decode_request(_line("report", result={"a": [[1]]}), BENCH, max_depth=4)
    assert protocol.decode_request(_line("report", result={"a": [1]}), BENCH, max_depth=4).op == "report"
    with pytest.raises(NotProtocolError, match="nested deeper"):
        protocol.decode_reply(b'{"id":1,"ok":true,"result":' + b"[" * 50_000 + b"]" * 50_000 + b"}")


def test_a_banner_before_the_protocol_is_shown_in_the_error():
    with pytest.raises(NotProtocolError, match=r"not JSON .*b'Welcome to host7, last login"):
        protocol.decode_reply(b"Welcome to host7, last login: yesterday")


def test_text_from_a_client_is_printed_escaped():
    hostile = "ok\x1b[2J\r\n verified: yes\u202egnp.exe\x00"
    safe = protocol.printable(hostile)
    assert safe.isprintable() and "\x1b" not in safe and "\n" not in safe
    assert safe == "ok\\x1b[2J\\r\\n verified: yes\\u202egnp.exe\\x00"
    assert protocol.printable("x" * 300, 10) == "x" * 10 + "..."
    tree = protocol.printable_tree({"fw\n": [hostile, 1.5, None, {"k": "\x07"}]})
    assert tree == {"fw\\n": [safe, 1.5, None, {"k": "\\x07"}]}


def test_a_server_qp_connects_only_to_the_client_or_an_allowed_network():
    policy = ServerPolicy(allow_peers=(ipaddress.ip_network("10.9.0.0/16"),))
    policy.check_peer(GID_OF("127.0.0.5"), "127.0.0.5")
    policy.check_peer(GID_OF("127.0.0.5"), "::ffff:127.0.0.5")  # a dual-stack listener's view of the client
    policy.check_peer(GID_OF("10.9.3.4"), "127.0.0.5")
    for gid in (GID_OF("127.0.0.99"), GID_OF("10.10.0.1"), "fe800000000000000000000000000001"):
        with pytest.raises(NotAllowed, match="talks only to the client that asked"):
            policy.check_peer(gid, "127.0.0.5")


def test_the_server_names_its_capture_files_and_pci_nics_take_no_options():
    policy = ServerPolicy(pcap="/tmp/cap.pcap")
    assert [policy.nic_options() for _ in range(3)] == [{"pcap": name, "pcap_max_bytes": 1 << 30} for name in
                                                        ("/tmp/cap.pcap", "/tmp/cap.pcap.1", "/tmp/cap.pcap.2")]
    assert ServerPolicy(nic="0000:41:00.0", ip="10.0.0.1", pcap="/tmp/x").nic_options() == {}
    with pytest.raises(ValueError, match="limit nics must be at least 1"):
        Limits(nics=0)
    with pytest.raises(ValueError, match="limit idle"):
        Limits(idle=0)


@given(st.integers(-2**70, 2**70), st.integers(0, 3 << 20), st.integers(0, 3 << 20))
def test_the_pattern_is_one_stream_per_seed_whatever_the_length(seed, short, long):
    short, long = sorted((short, long))
    assert protocol.pattern(seed, long)[:short] == protocol.pattern(seed, short)
    data = bytearray(long)
    protocol.fill_pattern(memoryview(data)[:short], seed)
    assert data[:short] == protocol.pattern(seed, short) and data[short:] == bytes(long - short)


def test_the_pattern_fills_more_than_a_c_int_of_bits():
    size = (256 << 20) + 4096  # randbytes(n) of one piece overflowed above 256 MiB
    with mmap.mmap(-1, size) as memory:
        protocol.fill_pattern(memoryview(memory), 5)
        assert memory[:64] == protocol.pattern(5, 64) and memory[-4096:] != bytes(4096)
    assert protocol.pattern(5, 64) != protocol.pattern(6, 64)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_dma_budget_caps_what_a_nic_may_allocate_and_gets_every_byte_back():
    budget = DmaBudget(256 << 20, "test budget")
    async with open_nic(dma_budget=budget) as nic:
        booted = budget.in_use
        assert 1 << 20 < booted < 16 << 20  # the NIC's own rings and backing store count too (bnxt_en's sizes, ~5 MiB)
        budget.limit = booted + (8 << 20)
        mr = await nic.register_mr(1 << 20)
        with_mr = budget.in_use
        assert booted + (1 << 20) <= with_mr <= booted + (1 << 20) + 0x10000  # its pages and their page table
        with pytest.raises(MemoryError, match=rf"sim:.*over the test budget of {budget.limit}"):
            await nic.register_mr(8 << 20)
        assert budget.in_use == with_mr  # a refused allocation holds nothing
        await mr.deregister()
        assert budget.in_use == booted
        cq = await nic.create_cq(64)
        await nic.create_qp(cq)
    assert budget.in_use == 0  # closing the NIC gave back everything it held
