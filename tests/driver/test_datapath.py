"""The data path end to end: driver verbs → emulated NIC processes → RoCEv2 over UDP → verified bytes."""
import collections
import contextlib
import functools
import os
import random
import signal
import time
import types

import anyio
import anyio.lowlevel
import pytest

from aiofabric import Access, DeviceLostError, QPInfo, QPState, open_nic
from aiofabric.autogen import bnxt
from aiofabric.driver import firmware_events, hwrm_channel, rcfw_channel
from aiofabric.hw.wqe import MSN_ENTRY, SQ_SLOT
from aiofabric.errors import CompletionError
from aiofabric.verbs import cq as completion_queues, poller as pollers
from aiofabric.verbs.poller import QUIET_SAFETY_POLL
from aiofabric.verbs.types import LocalBuffer, RemoteRegion
from tests.support.nics import connect, connected_pair, count_wakeups

pytestmark = pytest.mark.anyio


@pytest.mark.loop_agnostic
async def test_write_lands_exactly_across_message_sizes():
    async with connected_pair(mtu=1024) as (a, b, qa, qb):
        source, target = await a.register_mr(1 << 16), await b.register_mr(1 << 16)
        source.view[:] = random.Random(1).randbytes(1 << 16)
        for size in (1, 61, 1024, 1025, 10000, 65536):
            target.view[:] = bytes(1 << 16)
            with anyio.fail_after(10):
                await qa.write(source, target, size)
            assert bytes(target.view[:size]) == bytes(source.view[:size])
            assert not any(target.view[size:size + 64])  # nothing beyond the message


@pytest.mark.loop_agnostic
async def test_zero_length_write_completes_as_one_message_that_places_nothing():
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = b"\x5a" * 4096
        with anyio.fail_after(5):
            done = await qa.write(source, target, 0)
        assert done.done and done.error is None and done.byte_len == 0
        assert not any(target.view)
        placed = b.pci.debug({"op": "placed"})["qps"][str(qb.qpn)]
        assert (placed["write_messages"], placed["write_bytes"]) == (1, 0)


@pytest.mark.loop_agnostic
async def test_unsignaled_work_before_a_failing_request_completes_without_its_error():
    """One error CQE retires the unsignaled work requests before it too: they succeeded, only the last one failed."""
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        source.view[:] = random.Random(5).randbytes(4096)
        good = [await qa.post_write(source, target, 64, local_offset=64 * i, remote_offset=64 * i, signaled=False)
                for i in range(3)]
        bad = await qa.post_write(source, RemoteRegion(target.addr, target.rkey ^ 0x100), 16)
        with anyio.fail_after(10), pytest.raises(CompletionError, match="REMOTE_ACCESS_ERR"):
            await bad
        for completion in good:
            assert completion.done and completion.error is None
            await completion
        assert bytes(target.view[:192]) == bytes(source.view[:192])


@pytest.mark.loop_agnostic
async def test_msn_table_entries_name_each_messages_psns_and_wqe_as_the_wire_does():
    """The host MSN table after the SQ ring (one entry per message, wrapping; Linux's sq_msn_search layout): start
    PSN, next PSN and first SQ slot of each message. Its PSNs chain from the QP's initial PSN to the PSN the
    emulated requester sends next, each message taking one PSN per MTU-sized packet (one for zero bytes)."""
    mtu = 1024
    async with connected_pair(mtu=mtu) as (a, b, qa, qb):
        source, target = await a.register_mr(8 * mtu), await b.register_mr(8 * mtu)
        sizes = [0, 1, mtu, mtu + 1, 3 * mtu + 5]
        first_psn, first_slot = qa.info().psn, qa.send_queue.producer
        messages = qa.msn_entries + 3  # the table wraps
        expected, psn, slot = [], first_psn, first_slot
        with anyio.fail_after(20):
            for i in range(messages):
                size = sizes[i % len(sizes)]
                post = qa.post_read if i % 7 == 6 else qa.post_write
                await (await post(source, target, size))
                packets = max(1, -(-size // mtu))
                expected.append((psn, (psn + packets) & 0xFFFFFF, slot & (qa.sq_slots - 1)))
                psn, slot = (psn + packets) & 0xFFFFFF, qa.send_queue.producer
        entries = [MSN_ENTRY.unpack_from(qa.sq.view, qa.sq_slots * SQ_SLOT + k * MSN_ENTRY.size)[0]
                   for k in range(qa.msn_entries)]
        decoded = [((e & bnxt.SQ_MSN_SEARCH_START_PSN_MASK) >> bnxt.SQ_MSN_SEARCH_START_PSN_SFT,
                    (e & bnxt.SQ_MSN_SEARCH_NEXT_PSN_MASK) >> bnxt.SQ_MSN_SEARCH_NEXT_PSN_SFT,
                    (e & bnxt.SQ_MSN_SEARCH_START_IDX_MASK) >> bnxt.SQ_MSN_SEARCH_START_IDX_SFT) for e in entries]
        latest = {i % qa.msn_entries: entry for i, entry in enumerate(expected)}
        assert decoded == [latest[k] for k in range(qa.msn_entries)]
        wire = a.pci.debug({"op": "datapath"})["qps"][str(qa.qpn)]
        assert wire["next_psn"] & 0xFFFFFF == psn == expected[-1][1]


@pytest.mark.loop_agnostic
async def test_read_send_recv_and_write_with_imm():
    async with connected_pair(mtu=512) as (a, b, qa, qb):
        local, remote = await a.register_mr(8192), await b.register_mr(8192)
        remote.view[:] = random.Random(2).randbytes(8192)
        with anyio.fail_after(10):
            await qa.read(local, remote.remote(), 3000, local_offset=100, remote_offset=200)
        assert bytes(local.view[100:3100]) == bytes(remote.view[200:3200])

        inbox = await b.register_mr(4096)
        receive = await qb.post_recv(inbox, 2048)
        local.view[:1500] = b"s" * 1500
        with anyio.fail_after(10):
            await qa.send(local, 1500)
            got = await receive
        assert got.byte_len == 1500 and bytes(inbox.view[:1500]) == b"s" * 1500 and got.imm is None

        receive = await qb.post_recv(inbox, 64)
        with anyio.fail_after(10):
            await qa.write_with_imm(local, remote, 0xCAFEBABE, 700)
            got = await receive
        assert got.imm == 0xCAFEBABE and got.byte_len == 700
        assert bytes(remote.view[:700]) == bytes(local.view[:700])


@pytest.mark.loop_agnostic
async def test_hundreds_in_flight_unsignaled_retired_and_sq_wraps():
    async with connected_pair(sq_depth=32) as (a, b, qa, qb):
        source, target = await a.register_mr(256 * 64), await b.register_mr(256 * 64)
        source.view[:] = random.Random(3).randbytes(256 * 64)
        completions = []
        with anyio.fail_after(20):
            for i in range(600):  # the SQ holds far fewer: posting must wait for space, never overwrite
                slot = (i % 256) * 64
                completions.append(await qa.post_write(source, target, 64, local_offset=slot, remote_offset=slot,
                                                       signaled=(i % 50 == 49)))
            for completion in completions:
                await completion
        assert all(c.done and c.error is None for c in completions)
        assert qa.send_queue.producer > qa.sq_slots  # went round the ring
        assert bytes(target.view) == bytes(source.view)
        assert qa.send_cq.outstanding == 0


@pytest.mark.loop_agnostic
async def test_bad_rkey_fails_with_remote_access_error_and_flushes_the_rest():
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        good = await qa.post_write(source, target, 16)
        bad = await qa.post_write(source, RemoteRegion(target.addr, target.rkey ^ 0x100), 16)
        after = [await qa.post_write(source, target, 16) for _ in range(3)]
        with anyio.fail_after(10):
            await good
            with pytest.raises(CompletionError, match="REMOTE_ACCESS_ERR") as error:
                await bad
            for completion in after:
                with pytest.raises(CompletionError, match="FLUSHED"):
                    await completion
        assert error.value.qpn == qa.qpn
        assert qa.state == QPState.ERR
        with pytest.raises(CompletionError, match="FLUSHED"):
            await qa.write(source, target, 16)  # a QP in error flushes new work at once


@pytest.mark.loop_agnostic
async def test_bad_lkey_and_read_into_read_only_memory():
    async with connected_pair() as (a, b, qa, qb):
        target = await b.register_mr(4096)
        with anyio.fail_after(10), pytest.raises(CompletionError, match="LOCAL_PROTECTION_ERR"):
            await qa.write(LocalBuffer(0x10_0000_0000, 0xDEAD00, 64), target, 64)
    async with connected_pair() as (a, b, qa, qb):
        readonly = await a.register_mr(4096, Access.REMOTE_READ)
        remote = await b.register_mr(4096)
        with anyio.fail_after(10), pytest.raises(CompletionError, match="LOCAL_PROTECTION_ERR"):
            await qa.read(readonly, remote, 64)


@pytest.mark.loop_agnostic
async def test_modify_to_error_flushes_posted_receives():
    async with connected_pair() as (a, b, qa, qb):
        inbox = await b.register_mr(4096)
        receives = [await qb.post_recv(inbox, 64) for _ in range(5)]
        await qb.modify(QPState.ERR)
        with anyio.fail_after(5):
            for receive in receives:
                with pytest.raises(CompletionError, match="FLUSHED"):
                    await receive


@pytest.mark.loop_agnostic
async def test_qp_info_wider_than_the_wire_is_refused_and_reaches_no_qp():
    """BTH carries 24 bits of QP number and PSN: QP 1 << 24 | 2 must not become QP 2."""
    async with connected_pair() as (a, b, qa, qb):
        cq = await a.create_cq(16)
        qc = await a.create_qp(cq)
        good = qb.info()
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        wide = {"qpn": 1 << 24 | qb.qpn, "gid": good.gid, "mac": good.mac, "psn": good.psn}
        cases = [({"qpn": 1 << 24 | qb.qpn}, f"qpn .*{1 << 24 | qb.qpn}"), ({"psn": 1 << 24}, f"psn .*{1 << 24}"),
                 ({"qpn": -1}, "qpn .*-1"), ({"gid": good.gid[:15]}, "gid must be 16 bytes"),
                 ({"mac": "02:00:00:00:01"}, "mac must be 6 bytes .*'02:00:00:00:01'")]
        for change, message in cases:
            fields = {**vars(good), **change}
            with pytest.raises(ValueError, match=message):
                QPInfo(**fields)
            with pytest.raises(ValueError, match=message):  # a look-alike that skipped QPInfo's own check
                await qc.connect(types.SimpleNamespace(**fields))
        with pytest.raises(ValueError, match="qpn"):
            QPInfo.from_dict({**wide, "gid": good.gid.hex()})
        assert qc.state == QPState.INIT
        with pytest.raises(RuntimeError, match="INIT"):
            await qc.post_write(source, target, 64)
        assert b.pci.debug({"op": "placed"})["qps"][str(qb.qpn)]["write_messages"] == 0


@pytest.mark.loop_agnostic
async def test_a_completion_wakes_the_sleeping_poller_through_its_cqs_notification():
    """A CQ notifies only once CQ_ARMENA let it be armed, after CREATE_CQ and after each notification, as Linux rings
    it (bnxt_qplib_create_cq, bnxt_qplib_service_nq). The emulator ignores an arm without it: the poller would hear
    of each completion only at its safety poll (0.1 s)."""
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        took = []
        for _ in range(5):
            await anyio.sleep(0.3)  # nothing outstanding: the poller sleeps
            started = time.perf_counter()
            with anyio.fail_after(5):
                await qa.write(source, target, 64)
            took.append(time.perf_counter() - started)
        ignored = [nic.pci.debug({"op": "stats"})["stats"].get("cq_doorbells_ignored", 0) for nic in (a, b)]
    assert ignored == [0, 0], "CQ arms the emulated chip ignored: no CQ_ARMENA before them"
    assert sorted(took)[2] < 0.05, f"writes took {took} s: their completions waited for the safety poll"



async def test_a_wake_up_and_the_next_sleep_kick_the_nic_once(monkeypatch):
    """A poller woken by a notification enables its CQ again (CQ_ARMENA) and re-arms its NQ with the next sleep's
    CQ arm, in one kick: each kick wakes the emulator, and a ring of small messages sleeps once per hop. The arms
    still count (none ignored: the CQ_ARMENA goes first) and every completion is heard."""
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        a.poller.spin = 0.0  # sleep at once: each completion comes as a notification
        with anyio.fail_after(5):
            await qa.write(source, target, 64)
        rung: list[list[int]] = []
        original = a.device.doorbells.write64_doorbells
        monkeypatch.setattr(a.device.doorbells, "write64_doorbells",
                            lambda offset, values: (rung.append(list(values)), original(offset, values))[1])
        woke = a.poller.stats["wakeups"]
        with anyio.fail_after(30):
            for _ in range(20):
                await qa.write(source, target, 64)
        wakeups = a.poller.stats["wakeups"] - woke
        ignored = a.pci.debug({"op": "stats"})["stats"].get("cq_doorbells_ignored", 0)
    assert wakeups >= 1
    assert len(rung) <= wakeups + 1, f"{len(rung)} kicks of the poller's for {wakeups} wake-ups"
    assert ignored == 0, "CQ arms the emulated chip ignored: a CQ_ARMENA came after its arm, or not at all"


async def test_each_ring_entry_is_read_behind_a_read_barrier_after_its_valid_bit(monkeypatch):
    """Linux reads a CQE, NQE, CREQ entry, event or HWRM answer's body only after dma_rmb() behind its valid bit; on a
    weakly ordered CPU the body could otherwise be read from before the device wrote it. Every reader calls
    pci.read_barrier once per entry it takes (free on x86)."""
    calls = collections.Counter()
    for module in (completion_queues, pollers, rcfw_channel, firmware_events, hwrm_channel):
        monkeypatch.setattr(module, "read_barrier", functools.partial(calls.update, [module.__name__.split(".")[-1]]))
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        a.poller.spin = 0.0  # sleep at once: the completion comes as an NQ notification
        await anyio.sleep(0.3)
        before = a.poller.stats["cqes"], calls["cq"]
        with anyio.fail_after(5):
            await qa.write(source, target, 64)
        assert calls["cq"] - before[1] == a.poller.stats["cqes"] - before[0] >= 1  # one per CQE
        a.pci.debug({"op": "event", "event": {"kind": "link_down"}})
        with anyio.fail_after(5):
            while not any(event.kind == "link" for event in a.event_log):
                await anyio.sleep(0.01)
    assert all(calls[name] for name in ("cq", "poller", "rcfw_channel", "firmware_events", "hwrm_channel")), calls


async def test_an_idle_nic_wakes_nobody_yet_hears_the_next_completion(monkeypatch):
    async with connected_pair() as (a, b, qa, qb):
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        with anyio.fail_after(5):
            await qa.write(source, target, 64)
        counts = count_wakeups(monkeypatch, a, b)
        await anyio.sleep(0.5)  # one safety poll after the write, then none
        before = counts()
        await anyio.sleep(1.0)
        assert counts() == before  # nothing outstanding: no safety poll, no CREQ poll, no doorbell
        with anyio.fail_after(5):  # the completion's interrupt is heard
            await qb.write(target, source, 64)
        await anyio.sleep(0.5)
        qa.send_cq.arm = lambda: setattr(qa.send_cq, "armed", True)  # the next interrupt is lost
        started = time.perf_counter()
        with anyio.fail_after(5):  # the post woke the poller, whose next sleep has the short safety poll
            await qa.write(source, target, 64)
        assert time.perf_counter() - started < 0.7


@pytest.mark.parametrize("poller", ["sleeping", "awake"])
async def test_quiet_work_backs_off_its_safety_poll_but_new_work_is_insured_at_once(poller):
    async with connected_pair() as (a, b, qa, qb):
        cq = await a.create_cq(16)
        waiting = await a.create_qp(cq)
        inbox, source, target = await a.register_mr(4096), await a.register_mr(4096), await b.register_mr(4096)
        receive = await waiting.post_recv(inbox, 64)  # nobody sends: outstanding work that stays quiet
        await anyio.sleep(0.3)
        woke = a.poller.stats["wakeups"]
        await anyio.sleep(2.0)
        assert a.poller.stats["wakeups"] - woke <= 5  # a fixed 0.1 s safety poll woke 20 times
        assert a.poller.safety == QUIET_SAFETY_POLL

        # the next completion's interrupt is lost (qa's CQ arm never reaches the NIC), posted right after a quiet
        # wake-up, while the poller spins or once it sleeps again: only a safety poll finds it, and it must be the
        # first, short one that new work starts, not the 1 s one
        qa.send_cq.arm = lambda: setattr(qa.send_cq, "armed", True)
        woke = a.poller.stats["wakeups"]
        with anyio.fail_after(3):
            while a.poller.stats["wakeups"] == woke or a.poller.sleeping != (poller == "sleeping"):
                await anyio.lowlevel.checkpoint()
        started = time.perf_counter()
        with anyio.fail_after(5):
            await qa.write(source, target, 64)
        assert time.perf_counter() - started < 0.7

        os.kill(a.pci.pid, signal.SIGKILL)  # a device dying under a quiet poller is still noticed
        with anyio.fail_after(2), pytest.raises(DeviceLostError):
            await receive


@pytest.mark.loop_agnostic
async def test_faults_still_deliver_every_byte_exactly_once():
    async with connected_pair(loss=0.05, dup=0.05, reorder=0.05, corrupt=0.02, seed=11) as (a, b, qa, qb):
        source, target = await a.register_mr(64 * 1024), await b.register_mr(64 * 1024)
        source.view[:] = random.Random(4).randbytes(64 * 1024)
        inbox = await b.register_mr(64 * 1024)
        receives = [await qb.post_recv(inbox, 1024, local_offset=1024 * i) for i in range(16)]
        with anyio.fail_after(60):
            writes = [await qa.post_write(source, target, 4096, local_offset=4096 * i, remote_offset=4096 * i)
                      for i in range(16)]
            sends = [await qa.post_send(source, 1024, local_offset=1024 * i) for i in range(16)]
            for completion in writes + sends:
                await completion
            results = [await r for r in receives]
        assert bytes(target.view) == bytes(source.view)
        assert [r.byte_len for r in results] == [1024] * 16
        assert bytes(inbox.view[:16 * 1024]) == bytes(source.view[:16 * 1024])  # in order, exactly once
        stats = a.pci.debug({"op": "stats"})["stats"]
        assert stats["retransmits"] > 0 and b.pci.debug({"op": "stats"})["stats"]["dropped"] > 0


@pytest.mark.loop_agnostic
async def test_phy_loopback_write():
    from aiofabric.tools.perftest import run_loopback
    result = await run_loopback("sim", 5000)
    assert result["verified"] and result["packets"] >= 1


@pytest.mark.slow
async def test_256_qps_across_4_nics_from_one_loop():
    qps_per_pair, size = 128, 256
    async with contextlib.AsyncExitStack() as stack:
        nics = [await stack.enter_async_context(open_nic(f"sim:scale{os.getpid()}-{i}")) for i in range(4)]
        cqs = [await nic.create_cq(1024) for nic in nics]
        flows = []
        for p in range(2):
            a, b = 2 * p, 2 * p + 1
            source = await nics[a].register_mr(qps_per_pair * size)
            target = await nics[b].register_mr(qps_per_pair * size)
            source.view[:] = random.Random(p).randbytes(qps_per_pair * size)
            for q in range(qps_per_pair):
                qa = await nics[a].create_qp(cqs[a], sq_depth=8, rq_depth=8)
                qb = await nics[b].create_qp(cqs[b], sq_depth=8, rq_depth=8)
                await connect(qa, qb)
                flows.append((qa, source, target, q * size))

        async def run(qa, source, target, offset):
            for i in range(4):
                await qa.write(source, target, size, local_offset=offset, remote_offset=offset)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tasks:
                for flow in flows:
                    tasks.start_soon(run, *flow)
        assert len(flows) == 256
        for qa, source, target, offset in flows:
            assert bytes(target.view[offset:offset + size]) == bytes(source.view[offset:offset + size])
