"""The scheduler with RDMA across ranks: what a ring of NICs (a collective) needs the planner and the workers to get
right. Each test here failed before its fix."""
import functools
import re

import anyio
import numpy as np
import pytest

from aiofabric import QPState, RemoteRegion, open_nic, sched
from tests.support.nics import connect, connected_qps

COPY = r"""
#include <stdint.h>
void cpy(int64_t *out, const int64_t *in, int64_t n) { for (int64_t i = 0; i < n; i++) out[i] = in[i]; }
"""


connected = functools.partial(connected_qps, qp={"sq_depth": 64}, timeout=8)


def waits_of(batch) -> dict[str, str]:
    """Per call name, its `wait ...` clause in describe() ('' if none)."""
    found = {}
    for line in batch.describe().splitlines()[1:]:
        match = re.match(r"\s+#\d+\s+\S+(?: \S+)*?\[\d+\] ([^;]+)(.*)", line)
        if match:
            found[match.group(1)] = next((part.strip() for part in match.group(2).split(";")
                                          if part.strip().startswith("wait ") and "timeline" not in part), "")
    return found


def test_a_c_kernel_refuses_a_strided_view_naming_it():
    """A C kernel gets the first element's address: x[::2] would be read as x[:8], silently."""
    cpy = sched.CKernel(COPY, "cpy")
    x, out = np.arange(16, dtype=np.int64), np.zeros(8, np.int64)
    with pytest.raises(ValueError, match=r"cpy: ins\[0\] is not contiguous \(strides \(16,\)\)"):
        sched.kernel(cpy, [out], [x[::2]], [8], queue=sched.ComputeQueue())
    with pytest.raises(ValueError, match=r"outs\[0\] is not contiguous"):
        sched.kernel(cpy, [np.zeros(16, np.int64)[::2]], [x[:8]], [8], queue=sched.ComputeQueue())
    sched.kernel(lambda o, i: np.copyto(o, i), [out], [x[::2]], queue=sched.ComputeQueue())  # numpy follows strides


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_remote_memory_is_keyed_by_the_peer_so_a_ring_of_writes_is_not_a_chain():
    """Three ranks that allocate alike: every peer's region has the same rkey and address. A ring of writes (0->1,
    1->2, 2->0) touches three different memories and must run at once; two writes to one peer's bytes stay ordered."""
    async with open_nic("sim") as n0, open_nic("sim") as n1, open_nic("sim") as n2:
        nics = [n0, n1, n2]
        ring = [await connected(nics[i], nics[(i + 1) % 3]) for i in range(3)]
        sources = [await nic.register_mr(4096) for nic in nics]
        alike = RemoteRegion(0x10000, 0x77, 4096)  # the same names at every peer (registered at none here)
        calls = [sched.write(ring[i][0], sources[i], alike, 4096, name=f"write {i}->{(i + 1) % 3}") for i in range(3)]
        calls.append(sched.write(ring[0][0], sources[0], alike, 4096, name="again 0->1"))
        waits = waits_of(sched.compile(calls))
        assert waits["write 0->1"] == waits["write 1->2"] == waits["write 2->0"] == ""
        assert waits["again 0->1"] == ""  # the same QP as "write 0->1": in order, so a fence and no wait
        assert "fence" in sched.compile(calls).describe().splitlines()[4]
        # the same peer's bytes through two QPs (here: from two ranks), ordered
        assert re.fullmatch(rf"wait qp {ring[0][0].qpn:#x}( \(.*\))?>=1", waits_of(sched.compile(
            [*calls[:3], sched.write(ring[1][1], sources[2], alike, 4096, name="2->1")]))["2->1"])
        extra, _ = await connected(n0, n1)
        both = sched.compile([sched.write(ring[0][0], sources[0], alike, 4096, name="first"),
                              sched.write(extra, sources[0], alike, 4096, name="second")])
        assert waits_of(both)["second"] == f"wait qp {ring[0][0].qpn:#x}>=1"


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_write_to_a_local_mrs_remote_orders_before_the_kernel_that_reads_it():
    """Both ends in this process: the peer names its MR by mr.remote(), and the kernel reading that MR must see the
    bytes the write placed, not what was there before."""
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, _ = await connected(a, b)
        source, landing = await a.register_mr(4096), await b.register_mr(4096)
        np.frombuffer(source.view, np.int64)[:] = np.arange(512)
        seen = np.zeros(512, np.int64)
        compute = sched.ComputeQueue("sum")
        batch = sched.compile([
            sched.write(qa, source, landing.remote(), 4096, name="write"),
            sched.kernel(lambda out, arrived: np.copyto(out, arrived), [seen], [np.frombuffer(landing.view, np.int64)],
                         queue=compute, name="read landing")])
        assert waits_of(batch)["read landing"] == f"wait qp {qa.qpn:#x}>=1"
        with anyio.fail_after(20):
            await batch.run()
        assert (seen == np.arange(512)).all()
        # a remote region inside the MR (an offset), and one past what it holds: still ordered, still checked
        part = sched.compile([sched.write(qa, source, landing.remote(1024), 1024, name="write part"),
                              sched.kernel(lambda o: o.fill(0), [np.frombuffer(landing.view, np.int64)[128:256]],
                                           queue=compute, name="clear part")])
        assert waits_of(part)["clear part"] == f"wait qp {qa.qpn:#x}>=1"


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_receive_listed_before_the_send_on_its_qp_does_not_hold_the_send_up():
    """A QP's receive side and send side are separate queues. Here A's receive waits for B's send, B's send waits for
    a kernel, and the kernel waits for A's send: with one in-order queue per QP, A's send could not complete before
    A's receive, and the batch deadlocked."""
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        in_a, out_a, in_b, out_b = (await a.register_mr(64), await a.register_mr(64), await b.register_mr(64),
                                    await b.register_mr(64))
        np.frombuffer(out_a.view, np.int64)[:] = 5
        refill = sched.ComputeQueue("refill")
        batch = sched.compile([
            sched.recv(qa, in_a, name="a recv"),
            sched.send(qa, out_a, name="a send"),
            sched.kernel(lambda oa, ob: (oa.fill(7), ob.fill(9)), [np.frombuffer(out_a.view, np.int64),
                                                                  np.frombuffer(out_b.view, np.int64)],
                         queue=refill, name="refill"),
            sched.recv(qb, in_b, name="b recv"),
            sched.send(qb, out_b, name="b send")])
        with anyio.fail_after(20):
            await batch.run(timeout=10)
        assert f"qp {qa.qpn:#x} ({a.pci.address}) recv[1] a recv" in batch.describe()
        assert (np.frombuffer(in_b.view, np.int64) == 5).all() and (np.frombuffer(in_a.view, np.int64) == 9).all()


@pytest.mark.anyio
async def test_a_receive_waiting_for_room_does_not_hold_back_the_sends_doorbell():
    """The workers of a QP's two sides post behind one doorbell each. Here A's receive side waits for room (its RQ
    holds 2) inside its batch, while A's send side posts the write B's sends wait for: when the batch was the QP's,
    not the task's, the write's doorbell waited for the receive side's batch to end, which waited for B's sends
    (found by review; the run hung)."""
    async with open_nic("sim") as a, open_nic("sim") as b:
        cq_a, cq_b = await a.create_cq(64), await b.create_cq(64)
        qa = await a.create_qp(cq_a, sq_depth=16, rq_depth=2)
        qb = await b.create_qp(cq_b, sq_depth=16, rq_depth=2)
        await connect(qa, qb, timeout=14)
        source, landing, target = await a.register_mr(4096), await a.register_mr(4096), await b.register_mr(4096)
        slow = sched.kernel(lambda out: out.fill(1), [np.zeros(8)], queue=sched.ComputeQueue("slow"), name="slow")
        write = sched.write(qa, source, target, 64, name="write").after(slow)
        batch = sched.compile([slow, *[sched.recv(qa, landing, 64, local_offset=64 * i, name=f"recv{i}")
                                       for i in range(3)],
                               write, *[sched.send(qb, target, 64, name=f"send{i}").after(write) for i in range(3)]])
        with anyio.fail_after(20):
            await batch.run(timeout=10)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_run_past_its_timeout_names_the_calls_still_pending():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        inbox, done = await b.register_mr(64), np.zeros(1)
        batch = sched.compile([sched.recv(qb, inbox, name="wait for a"),
                               sched.kernel(lambda out, _: out.fill(1), [done], [np.frombuffer(inbox.view, np.int64)],
                                            queue=sched.ComputeQueue("after"), name="use it")])
        with anyio.fail_after(20):
            with pytest.raises(sched.BatchTimeoutError, match=rf"did not finish within 0.3 s and was aborted; 2 of 2 "
                               rf"calls pending: call 0 \(wait for a\) on qp {qb.qpn:#x} recv, call 1 \(use it\) "
                               rf"on after; qp {qb.qpn:#x} left in ERR"):
                await batch.run(timeout=0.3)
        assert isinstance(sched.BatchTimeoutError("x"), TimeoutError) and done[0] == 0
        assert qb.state is QPState.ERR  # the receive was flushed: it cannot take a later run's message


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_rdma_sizes_and_offsets_are_checked_at_compile():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, _ = await connected(a, b)
        source, target = await a.register_mr(4096), await b.register_mr(4096)
        cases = [(lambda: sched.write(qa, source, target.remote(), 4096, local_offset=1),
                  r"write: local_offset 1 \+ size 4096 is past the local region's 4096 bytes"),
                 (lambda: sched.write(qa, source, target.remote(2048), 4096),
                  r"write: remote_offset 0 \+ size 4096 is past the remote region's 2048 bytes"),
                 (lambda: sched.read(qa, source, target, 100, remote_offset=4000, name="rd"),
                  r"rd: remote_offset 4000 \+ size 100 is past the remote region's 4096 bytes"),
                 (lambda: sched.recv(qa, source, 8192), r"recv: local_offset 0 \+ size 8192 is past"),
                 (lambda: sched.send(qa, source, -1), r"send: size must be a non-negative integer, not -1"),
                 (lambda: sched.write(qa, source, target, 8, remote_offset=-8), r"remote_offset must be a non-neg")]
        for make, says in cases:
            with pytest.raises(ValueError, match=says):
                make()
        sched.write(qa, source, RemoteRegion(target.addr, target.rkey), 4096, remote_offset=1 << 20)  # length unknown


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_qp_input_rebound_to_one_connected_elsewhere_is_refused():
    """The plan ordered remote memory by the peer the QP was connected to: another peer's QP would race it."""
    async with open_nic("sim") as a, open_nic("sim") as b, open_nic("sim") as c:
        qa, _ = await connected(a, b)
        same_peer, _ = await connected(a, b)
        elsewhere, _ = await connected(a, c)
        source, target = await a.register_mr(64), await b.register_mr(64)
        batch = sched.compile([sched.write(qa, source, target.remote(), name="w")], inputs={"qp": qa})
        with pytest.raises(sched.BindingError, match=rf"'qp': qp {elsewhere.qpn:#x} is connected to another peer"):
            batch.bind({"qp": elsewhere})
        batch.bind({"qp": same_peer})
        with anyio.fail_after(20):
            await batch.run()
        assert bytes(target.view) == bytes(source.view)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_scalars_and_rdma_sizes_rebind_by_name_within_what_was_compiled():
    """A kernel's scale and an RDMA WRITE's size change between runs without compiling again; a size above the
    compiled one (bytes the plan never ordered), another type, or an unknown name is refused, and a refused run
    changes nothing."""
    scale_source = r"""
    #include <stdint.h>
    void scale(double *out, const double *in, int64_t n, double k) {
        for (int64_t i = 0; i < n; i++) out[i] = in[i] * k;
    }
    """
    scale = sched.CKernel(scale_source, "scale")
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, _ = await connected(a, b)
        source, landing = await a.register_mr(8192), await b.register_mr(8192)
        x = np.arange(1024, dtype=np.float64)
        staged = np.frombuffer(source.view, np.float64)
        k, nbytes = sched.Scalar("k", 2.0), sched.Scalar("bytes", 8192)
        queue = sched.ComputeQueue()
        batch = sched.compile([sched.kernel(scale, [staged], [x], [1024, k], queue=queue),
                               sched.write(qa, source, landing.remote(), nbytes)], inputs={"x": x})
        arrived = np.frombuffer(landing.view, np.float64)
        await batch.run()
        assert np.array_equal(arrived, x * 2.0)
        arrived[:] = 0
        await batch.run({"k": 3.0, "bytes": 4096})  # half the bytes, scaled by 3
        assert np.array_equal(arrived[:512], x[:512] * 3.0) and not arrived[512:].any()
        for bindings, message in (({"bytes": 8200}, r"must be in \[0, 8192\]"), ({"k": 3}, "is float .* got int"),
                                  ({"bytes": 1.5}, "is int .* got float"), ({"kk": 1.0}, "scalars \\['bytes', 'k'\\]"),
                                  ({"k": 5.0, "bytes": -1}, r"must be in \[0, 8192\]")):
            with pytest.raises(sched.BindingError, match=message):
                await batch.run(bindings)
        arrived[:] = 0
        await batch.run()  # the refused bindings changed nothing: k is 3.0, bytes 4096
        assert np.array_equal(arrived[:512], x[:512] * 3.0) and not arrived[512:].any()
    with pytest.raises(ValueError, match="two Scalars named 'k' with different values"):
        q = sched.ComputeQueue()
        sched.compile([sched.kernel(lambda o, s: None, [np.zeros(1)], [], [sched.Scalar("k", 1.0)], queue=q),
                       sched.kernel(lambda o, s: None, [np.zeros(1)], [], [sched.Scalar("k", 2.0)], queue=q)])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_receive_pool_serves_again_after_the_qp_is_reset_and_reconnected():
    """An aborted run leaves the QP in ERR and its pooled receives flushed; after the reset and reconnect the error
    note advises, the pool posts afresh instead of handing out the flushed ones."""
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        await sched.receive_pool(qb, 8)
        source, landing = await a.register_mr(64), await b.register_mr(64)
        waiter = sched.compile([sched.wait_imm(qb, imm=7, name="wait")])
        with pytest.raises(sched.BatchTimeoutError):
            await waiter.run(timeout=0.3)  # nobody sends: aborted, the QP moved to ERR to flush its receives
        assert qb.state is QPState.ERR
        for qp in (qa, qb):
            await qp.modify(QPState.RESET)
        await connect(qa, qb, timeout=8)
        sender = sched.compile([sched.write_with_imm(qa, source, landing, 7, 64)])
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(sender.run)
                await waiter.run(timeout=5)


def test_a_c_scalar_that_does_not_fit_int64_is_refused():
    cpy = sched.CKernel(COPY, "cpy")
    with pytest.raises(ValueError, match="scalar 0 = 1180591620717411303424 does not fit a C int64_t"):
        sched.kernel(cpy, [np.zeros(8, np.int64)], [np.zeros(8, np.int64)], [2 ** 70], queue=sched.ComputeQueue())
