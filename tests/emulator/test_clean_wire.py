"""The emulator's data-path accounting through real emulated NICs: the per-QP "placed" counts bench verification
relies on, the deliberate placement bugs that prove it can fail, and the receive-overflow count of a clean wire."""
import os
import random
import signal

import anyio
import pytest

from aiofabric.pci import PCIError
from tests.support.nics import connected_pair

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # these check the emulator, not the event loop: one backend keeps the suite's time down


def placed(nic, qp) -> dict[str, int]:
    return nic.pci.debug({"op": "placed"})["qps"][str(qp.qpn)]


async def test_placed_counts_match_what_was_posted_under_loss_and_dup():
    async with connected_pair(loss=0.05, dup=0.05, seed=3) as (a, b, qa, qb):
        local, remote = await a.register_mr(1 << 17), await b.register_mr(1 << 17)
        local.view[:] = random.Random(5).randbytes(1 << 17)
        writes, reads, sends = [1, 1000, 4096, 20000] * 4, [3000, 7, 9000] * 3, [100, 2048] * 4
        with anyio.fail_after(60):
            receives = [await qb.post_recv(remote, 4096, local_offset=90000 + 4096 * i)  # the WRITE_IMM's first
                        for i in range(len(sends) + 1)]
            work = [await qa.post_write(local, remote, size, local_offset=1024 * i, remote_offset=1024 * i)
                    for i, size in enumerate(writes)]
            work.append(await qa.post_write_with_imm(local, remote, 9, 500, remote_offset=60000))
            work += [await qa.post_read(local, remote, size, local_offset=70000, remote_offset=1000)
                     for size in reads]
            work += [await qa.post_send(local, size) for size in sends]
            for completion in work + receives:
                await completion
        stats = a.pci.debug({"op": "stats"})["stats"]
        assert stats["retransmits"] > 0  # the faults did bite
        assert placed(b, qb) == {"write_messages": len(writes) + 1, "write_bytes": sum(writes) + 500,
                                 "send_messages": len(sends), "send_bytes": sum(sends),
                                 "read_messages": 0, "read_bytes": 0, "atomic_messages": 0, "atomic_bytes": 0}
        assert placed(a, qa) == {"write_messages": 0, "write_bytes": 0, "send_messages": 0, "send_bytes": 0,
                                 "read_messages": len(reads), "read_bytes": sum(reads), "atomic_messages": 0,
                                 "atomic_bytes": 0}


async def test_placement_faults_through_the_debug_channel():
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(8192), await b.register_mr(8192)
        source.view[:] = random.Random(6).randbytes(8192)
        b.pci.debug({"op": "fault", "kind": "skip_placement", "count": 1})
        with anyio.fail_after(10):
            await qa.write(source, target, 1000)  # completes as if all was well
        assert not any(target.view[:1000]) and placed(b, qb)["write_messages"] == 0
        b.pci.debug({"op": "fault", "kind": "misplace", "count": 1, "offset": 16})
        with anyio.fail_after(10):
            await qa.write(source, target, 1000, remote_offset=2000)
        assert bytes(target.view[2016:3016]) == bytes(source.view[:1000]) and not any(target.view[2000:2016])
        with anyio.fail_after(10):
            await qa.write(source, target, 1000, remote_offset=4000)  # both faults used up
        assert bytes(target.view[4000:5000]) == bytes(source.view[:1000])
        assert placed(b, qb)["write_messages"] == 2
        with pytest.raises(PCIError, match="unknown fault kind"):
            b.pci.debug({"op": "fault", "kind": "nonsense"})


async def test_rx_overflow_is_reported_apart_from_protocol_drops():
    async with connected_pair(loss=0.2, seed=4) as (a, b, qa, qb):
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        with anyio.fail_after(30):
            for i in range(8):
                await qa.write(source, target, 8192, local_offset=8192 * i, remote_offset=8192 * i)
        stats = b.pci.debug({"op": "stats"})["stats"]
        assert stats["dropped"] > 0 and stats["rx_overflow"] == 0  # the wire lost packets; the socket kept up


async def test_a_stalled_receiver_overflows_no_receive_buffer_under_fan_in():
    """128 QPs x 128 one-packet WRITEs, every window full, arrive while the receiving emulator is stopped (SIGSTOP):
    its socket must hold them all (the emulator sizes it for the QPs' windows). A 4 MiB buffer dropped thousands,
    counted as rx_overflow and then recovered by retransmission."""
    qps, depth = 128, 128
    async with connected_pair() as (a, b, _, _):
        cq_a, cq_b = await a.create_cq(qps * depth), await b.create_cq(256)
        source, target = await a.register_mr(64), await b.register_mr(qps * depth * 64)
        flows = []
        for _ in range(qps):
            qa = await a.create_qp(cq_a, sq_depth=depth, rq_depth=1)
            qb = await b.create_qp(cq_b, sq_depth=1, rq_depth=1)
            await qa.connect(qb.info(), mtu=4096, timeout=0)  # no timer: a stopped peer is no loss
            await qb.connect(qa.info(), mtu=4096)
            flows.append(qa)
        receiver = b.pci.debug({"op": "ping"})["pid"]
        os.kill(receiver, signal.SIGSTOP)
        try:
            with anyio.fail_after(60):
                pending = [await qa.post_write(source, target, 64, remote_offset=64 * (depth * q + i))
                           for q, qa in enumerate(flows) for i in range(depth)]
                while a.pci.debug({"op": "stats"})["stats"]["packets_sent"] < qps * depth:
                    await anyio.sleep(0.01)
        finally:
            os.kill(receiver, signal.SIGCONT)
        with anyio.fail_after(60):
            for completion in pending:
                await completion
        stats = b.pci.debug({"op": "stats"})["stats"]
        assert stats["rx_overflow"] == 0 and a.pci.debug({"op": "stats"})["stats"]["retransmits"] == 0
