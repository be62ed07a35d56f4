"""The emulator's data-path accounting through real emulated NICs: the per-QP "placed" counts bench verification
relies on, the deliberate placement bugs that prove it can fail, and the receive-overflow count of a clean wire."""
import contextlib
import os
import random

import anyio
import pytest

from aiofabric import open_nic
from aiofabric.pci import PCIError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # these check the emulator, not the event loop: one backend keeps the suite's time down


@contextlib.asynccontextmanager
async def pair(**options):
    tag = f"{os.getpid()}-{random.getrandbits(20)}"
    async with open_nic(f"sim:pa{tag}", **options) as a, open_nic(f"sim:pb{tag}", **options) as b:
        cq_a, cq_b = await a.create_cq(256), await b.create_cq(256)
        qa = await a.create_qp(cq_a, sq_depth=64, rq_depth=64)
        qb = await b.create_qp(cq_b, sq_depth=64, rq_depth=64)
        await qa.connect(qb.info(), mtu=1024, timeout=8)
        await qb.connect(qa.info(), mtu=1024, timeout=8)
        yield a, b, qa, qb


def placed(nic, qp) -> dict[str, int]:
    return nic.pci.debug({"op": "placed"})["qps"][str(qp.qpn)]


async def test_placed_counts_match_what_was_posted_under_loss_and_dup():
    async with pair(loss=0.05, dup=0.05, seed=3) as (a, b, qa, qb):
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
                                 "read_messages": 0, "read_bytes": 0}
        assert placed(a, qa) == {"write_messages": 0, "write_bytes": 0, "send_messages": 0, "send_bytes": 0,
                                 "read_messages": len(reads), "read_bytes": sum(reads)}


async def test_placement_faults_through_the_debug_channel():
    async with pair() as (a, b, qa, qb):
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
