"""A CQ error: the NIC found a CQ full (more completions outstanding than it holds) and dropped what did not fit, or
could not use the CQ at all, and said so on the CREQ (Linux's bnxt_re_handle_cq_async_error reports it as
IB_EVENT_CQ_ERR). The completions lost never come: the work waiting for them must fail, naming the CQ's error,
instead of waiting forever. A test that posts more signaled work than its CQ holds met this as a hang, whenever the
NIC wrote completions faster than the poller drained them (a loaded machine)."""
import contextlib
import time

import anyio
import pytest

from aiofabric import QPState, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver.firmware_events import DeviceEvent
from aiofabric.errors import CompletionError
from tests.support.nics import connect, connected_qps, stats, tag

pytestmark = pytest.mark.anyio
CQ_DEPTH = 16


@contextlib.asynccontextmanager
async def small_cq_pair(profile):
    """Two emulated NICs of `profile` with one connected RC QP each, `a`'s on a CQ of CQ_DEPTH entries; `a` writes
    into `b`'s region: (a, qa, source, target)."""
    name = tag()
    async with open_nic(f"sim:a{name}", profile=profile) as a, open_nic(f"sim:b{name}", profile=profile) as b:
        qa, _ = await connected_qps(a, b, cq_depth=CQ_DEPTH, qp={"sq_depth": 2 * CQ_DEPTH, "rq_depth": 8})
        yield a, qa, await a.register_mr(1 << 12), await b.register_mr(1 << 12)


def hold_until_completed(nic, count):
    """Block the event loop (so the poller drains nothing) until the emulated NIC wrote, or dropped for want of room,
    the CQEs of `count` work requests; return how many it dropped."""
    deadline = time.monotonic() + 20
    while (counted := stats(nic)).get("cqes", 0) + counted.get("cq_overflows", 0) < count:
        assert time.monotonic() < deadline, f"the NIC completed {counted.get('cqes', 0)} of {count} writes"
        time.sleep(0.005)
    return counted.get("cq_overflows", 0)


@pytest.mark.parametrize("profile", ["thor2", "thor-bs-v2"])
async def test_completions_a_full_cq_dropped_fail_their_work_naming_the_overflow(profile):
    async with small_cq_pair(profile) as (a, qa, source, target):
        writes = [await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i)
                  for i in range(CQ_DEPTH + 3)]  # all signaled; posting yields to nobody
        assert hold_until_completed(a, len(writes)) == 3
        with anyio.fail_after(10):
            for write in writes[:CQ_DEPTH]:  # their CQEs fit: delivered as they are
                await write
            for write in writes[CQ_DEPTH:]:
                with pytest.raises(CompletionError) as failed:
                    await write
                assert failed.value.flushed and str(failed.value.root) == \
                    f"CQ {qa.send_cq.id:#x} lost completions (REQ_CQ_OVERFLOW_ERROR): more completions were " \
                    f"outstanding than its {CQ_DEPTH} entries hold"
        assert qa.state == QPState.ERR and qa.send_cq.errors[0].kind == "cq_error"
        assert qa.send_cq.outstanding == 0
        flushed = await qa.post_write(source, target, 64)  # nothing more goes into the ring
        with pytest.raises(CompletionError, match="flushed"):
            await flushed


@pytest.mark.loop_agnostic
async def test_a_cq_filled_to_its_depth_and_no_further_loses_nothing():
    async with small_cq_pair("thor-bs-v2") as (a, qa, source, target):
        writes = [await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i)
                  for i in range(CQ_DEPTH)]
        assert hold_until_completed(a, len(writes)) == 0
        with anyio.fail_after(10):
            for write in writes:
                await write
        assert qa.state == QPState.RTS and not qa.send_cq.errors


async def test_a_cq_that_cannot_be_used_fails_the_receives_waiting_on_it():
    async with small_cq_pair("thor2") as (a, qa, source, target):
        receive = await qa.post_recv(source, 64)
        reason = bnxt.CREQ_CQ_ERROR_NOTIFICATION_CQ_ERR_REASON_RES_CQ_LOAD_ERROR
        a.pci.debug({"op": "event", "event": {"kind": "cq_error", "xid": qa.recv_cq.id, "reason": reason}})
        with anyio.fail_after(10), pytest.raises(CompletionError) as failed:
            await receive
        assert str(failed.value.root) == f"CQ {qa.recv_cq.id:#x} lost completions (RES_CQ_LOAD_ERROR)"
        assert qa.state == QPState.ERR


@pytest.mark.loop_agnostic
async def test_a_qp_error_delivers_every_completion_written_before_it_however_many():
    """A QP's error delivers the CQEs the NIC wrote before it (they succeeded) and flushes only the rest; more than
    one poll's usual budget may be waiting (here 600 on a 1024-entry CQ)."""
    count, name = 600, tag()
    async with open_nic(f"sim:a{name}") as a, open_nic(f"sim:b{name}") as b:
        qa = await a.create_qp(send_cq=await a.create_cq(1024), recv_cq=await a.create_cq(16), sq_depth=count,
                               rq_depth=8)
        qb = await b.create_qp(await b.create_cq(16), rq_depth=8)
        await connect(qa, qb)
        source, target = await a.register_mr(64 * count), await b.register_mr(64 * count)
        writes = [await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i)
                  for i in range(count)]
        assert hold_until_completed(a, count) == 0
        qa._on_error(DeviceEvent("qp_error", qa.qpn, {}))  # the loop still held: the poller took none of them
        with anyio.fail_after(10):
            for write in writes:
                await write
