"""The scheduler's executors (aiofabric/sched/run.py): compiled batches run on asyncio, uvloop and trio."""
import functools
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiofabric import QPState, RemoteRegion, open_nic, sched
from aiofabric.sched.calls import HOST
from tests.support import CHECKOUT
from tests.support.nics import connect, connected_qps

BACKENDS = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
SPIN = r"""
#include <stdint.h>
/* out[i] = in[i] * k, repeated `rounds` times: a busy kernel that holds no lock */
void spin(double *out, const double *in, int64_t n, int64_t rounds, double k) {
    for (int64_t r = 0; r < rounds; r++)
        for (int64_t i = 0; i < n; i++) out[i] = in[i] * k + (double)r * 0.0;
}
"""


def overlaps(a, b):
    return a.start_ns < b.end_ns and b.start_ns < a.end_ns


async def wait_until(event: threading.Event) -> None:
    """Until a worker thread sets `event` (a few seconds at most)."""
    with anyio.fail_after(5):
        while not event.is_set():
            await anyio.sleep(0.001)


# -- planned order holds when calls really run, with random durations ---------------------------------------------
@st.composite
def host_batches(draw):
    """Random kernels over 1-4 compute queues on slices of three 16-element arrays, each sleeping a random time."""
    queues = [sched.ComputeQueue(f"c{i}") for i in range(draw(st.integers(1, 4)))]
    arrays = {name: np.zeros(16, np.int64) for name in "xyz"}
    piece = st.builds(lambda name, a, b: (name, min(a, b), max(a, b)), st.sampled_from("xyz"),
                      st.integers(0, 16), st.integers(0, 16))
    calls = draw(st.lists(st.tuples(st.integers(0, len(queues) - 1), st.lists(piece, max_size=2),
                                    st.lists(piece, max_size=2), st.floats(0, 0.002)), min_size=1, max_size=12))
    return queues, arrays, calls


@pytest.mark.parametrize("backend", BACKENDS, ids=["asyncio", "uvloop", "trio"])
@settings(max_examples=15, deadline=None)
@given(case=host_batches())
def test_random_batches_respect_every_dependency_when_run(backend, case):
    queues, arrays, specs = case

    def sleeper(delay):
        def body(*_):
            time.sleep(delay)
        return body

    calls = [sched.kernel(sleeper(delay), [arrays[n][a:b] for n, a, b in writes], [arrays[n][a:b] for n, a, b in reads],
                          queue=queues[q], threaded=True, name=f"k{i}")
             for i, (q, reads, writes, delay) in enumerate(specs)]
    batch = sched.compile(calls)
    anyio.run(lambda: batch.run(), backend=backend[0], backend_options=backend[1])
    trace = batch.last_trace
    for i, j in conflicting_pairs(calls):
        assert trace[i].end_ns <= trace[j].start_ns, f"call {j} started before call {i} ended\n{batch.describe()}"


def conflicting_pairs(calls):
    def hit(a, b):
        return any(x.key == y.key == HOST and max(x.start, y.start) < min(x.stop, y.stop) for x in a for y in b)
    for i, a in enumerate(calls):
        for j in range(i + 1, len(calls)):
            b = calls[j]
            if hit(a.writes, b.reads) or hit(a.reads, b.writes) or hit(a.writes, b.writes):
                yield i, j


# -- host calls -----------------------------------------------------------------------------------------------------
def double(out, a):
    out[:] = a * 2


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_replay_with_new_bindings_gives_new_results_without_planning_again():
    c0, c1, copier = sched.ComputeQueue("c0"), sched.ComputeQueue("c1"), sched.CopyQueue()
    x, y, z, w = np.arange(8.0), np.zeros(8), np.zeros(8), np.zeros(8)
    batch = sched.compile([sched.kernel(double, [y], [x], queue=c0), sched.copy(z, y, queue=copier),
                           sched.kernel(double, [w], [z], queue=c1)], inputs={"x": x})
    plan = batch.plan
    await batch.run()
    assert w.tolist() == (np.arange(8.0) * 4).tolist()
    await batch.run({"x": np.full(8, 3.0)})
    assert w.tolist() == [12.0] * 8 and batch.plan is plan and batch.runs == 2
    await batch.run([np.ones(8)])
    assert w.tolist() == [4.0] * 8
    with pytest.raises(sched.BindingError, match=r"input 'x' must be float64 with shape \(8,\).*got int64"):
        await batch.run({"x": np.ones(8, np.int64)})
    with pytest.raises(sched.BindingError, match=r"input 'x' must be float64 with shape \(8,\).*shape \(9,\)"):
        await batch.run({"x": np.ones(9)})
    with pytest.raises(sched.BindingError, match=r"no input named 'q'; the inputs are \['x'\]"):
        await batch.run({"q": np.ones(8)})


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_views_of_an_input_are_rebound_too():
    queue = sched.ComputeQueue()
    x, out = np.zeros(8), np.zeros(4)
    batch = sched.compile([sched.kernel(double, [out], [x[4:]], queue=queue)], inputs={"x": x})
    await batch.run({"x": np.arange(8.0)})
    assert out.tolist() == [8.0, 10.0, 12.0, 14.0]


def test_the_low_rank_rule_names_the_call_and_the_argument():
    queue = sched.ComputeQueue()
    grid, flat = np.zeros((4, 4)), np.zeros(16)
    with pytest.raises(ValueError, match=r"kernel double: argument ins\[1\] is 2-d \(shape \(4, 4\)\).*"
                                         r"sched.flatten"):
        sched.kernel(double, [flat], [flat, grid], queue=queue)
    with pytest.raises(ValueError, match=r"kernel named: argument outs\[0\] is 3-d"):
        sched.kernel(double, [np.zeros((2, 2, 2))], queue=queue, name="kernel named")
    sched.kernel(double, [np.zeros(())], [flat], queue=queue)  # 0-d is fine
    with pytest.raises(ValueError, match="not C-contiguous"):
        sched.flatten(grid.T[:, :2])


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_flatten_writes_land_in_the_nd_array():
    grid = np.arange(16.0).reshape(4, 4)
    result = np.zeros((4, 4))
    flat_result, flat_grid = sched.flatten(result, grid)
    await sched.compile([sched.kernel(double, [flat_result], [flat_grid], queue=sched.ComputeQueue())]).run()
    assert (result == grid * 2).all()


@pytest.mark.anyio
async def test_a_failing_kernel_aborts_the_batch_and_it_runs_again_after_the_fix():
    c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
    x, y, z = np.ones(4), np.zeros(4), np.zeros(4)
    broken = {"yes": True}
    ran_after = []

    def flaky(out, a):
        if broken["yes"]:
            raise ZeroDivisionError("bad input")
        out[:] = a + 1

    batch = sched.compile([sched.kernel(flaky, [y], [x], queue=c0, name="flaky"),
                           sched.kernel(lambda out, a: ran_after.append(1) or double(out, a), [z], [y], queue=c1,
                                        name="after")])
    with pytest.raises(sched.CallError, match=r"call 0 \(flaky\) on queue c0 failed: ZeroDivisionError: bad input; "
                                              "the batch was aborted") as caught:
        with anyio.fail_after(5):
            await batch.run()
    assert caught.value.call == 0 and caught.value.queue == "c0"
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert ran_after == []  # the waiting worker was stopped, not run
    broken["yes"] = False
    with anyio.fail_after(5):
        await batch.run()
    assert z.tolist() == [4.0] * 4 and ran_after == [1]


class Stop(BaseException):
    """A BaseException of the caller's own: neither an Exception nor a cancellation."""


@pytest.mark.parametrize("where", ["kernel", "threaded kernel", "qp post"])
@pytest.mark.parametrize("backend, options", BACKENDS, ids=["asyncio", "uvloop", "trio"])
def test_system_exit_and_keyboard_interrupt_in_a_call_leave_the_run_as_themselves(backend, options, where):
    """Neither wrapped in an exception group nor tearing the event loop down under the batch's other tasks ("coroutine
    never awaited"): the batch aborts as for any failure, then the exception itself leaves run()."""
    pending: list[BaseException] = []
    ran_after = []

    def first(out, a):
        if pending:
            raise pending.pop()
        out[:] = a

    async def abort_and_rerun(calls, queue):
        batch = sched.compile(calls)
        if where == "qp post":
            async def post(qp, call, args):
                if pending:
                    raise pending.pop()
                return await sched.Batch._post(qp, call, args)
            batch._post = post
        for error in (SystemExit(3), KeyboardInterrupt(), Stop()):
            pending.append(error)
            with pytest.raises(type(error)) as caught:
                with anyio.fail_after(10):
                    await batch.run()
            assert caught.value is error and ran_after == []  # the waiting call was stopped, not run
            if sys.version_info >= (3, 11):
                assert caught.value.__notes__ == [f"raised by call 0 ({calls[0].name}) on queue {queue}; the batch "
                                                  "was aborted"]
        with anyio.fail_after(10):
            await batch.run()
        assert ran_after == [1] and batch.runs == 1

    def record(out, a):
        ran_after.append(1)

    async def main():
        if where != "qp post":
            x, y, z = np.ones(4), np.zeros(4), np.zeros(4)
            await abort_and_rerun([sched.kernel(first, [y], [x], queue=sched.ComputeQueue("c0"), name="first",
                                                threaded=where == "threaded kernel"),
                                   sched.kernel(record, [z], [y], queue=sched.ComputeQueue("c1"))], "c0")
            return
        async with open_nic("sim") as a, open_nic("sim") as b:
            qa, _ = await connected(a, b)
            staging, landing = await a.register_mr(4096), await b.register_mr(4096)
            await abort_and_rerun([sched.write(qa, staging, landing),
                                   sched.kernel(record, [np.zeros(1)], [np.frombuffer(landing.view, np.uint8)],
                                                queue=sched.ComputeQueue("c1"))], f"qp {qa.qpn:#x}")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            anyio.run(main, backend=backend, backend_options=options)
        except BaseException as error:
            pytest.fail(f"{error!r} escaped the event loop")
        gc.collect()
    assert [str(w.message) for w in seen if "never awaited" in str(w.message)] == []


@pytest.mark.anyio
async def test_a_cancelled_run_leaves_nothing_waiting_and_the_next_run_works():
    c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
    x, y = np.ones(4), np.zeros(4)
    started, release = threading.Event(), threading.Event()
    batch = sched.compile([sched.kernel(lambda o, a: started.set() or release.wait(5), [y], [x], queue=c0,
                                        threaded=True),
                           sched.kernel(double, [x], [y], queue=c1)])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(batch.run)
            await wait_until(started)  # the first call runs in its thread, the second waits for it
            scope.cancel()
            release.set()
    assert scope.cancelled_caught
    with anyio.fail_after(5):
        await batch.run()
    assert batch.runs == 1


@pytest.mark.anyio
async def test_concurrent_runs_of_one_batch_never_overlap_and_disjoint_batches_do():
    def nap(*_):
        time.sleep(0.05)  # a window for a second run of the batch to overlap this one
    meeting = threading.Barrier(2, timeout=5)  # broken (failing the run) unless both batches' kernels run at once

    c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
    a, b = np.zeros(1), np.zeros(1)
    first = sched.compile([sched.kernel(nap, [a], queue=c0, threaded=True)])
    together = [sched.compile([sched.kernel(lambda o: meeting.wait(), [buffer], queue=queue, threaded=True)])
                for buffer, queue in ((a, c0), (b, c1))]
    traces = []

    async def run_and_keep(batch):
        await batch.run()
        traces.append(batch.last_trace[0])

    async with anyio.create_task_group() as group:
        group.start_soon(run_and_keep, first)
        group.start_soon(run_and_keep, first)
    assert not overlaps(*traces), "two runs of one batch overlapped: the reuse fence failed"
    traces.clear()
    async with anyio.create_task_group() as group:
        for batch in together:
            group.start_soon(batch.run)
    assert overlaps(together[0].last_trace[0], together[1].last_trace[0])


def test_describe_dot_and_chrome_trace(tmp_path):
    c0, copier = sched.ComputeQueue("c0"), sched.CopyQueue("dma")
    x, y = np.ones(4), np.zeros(4)
    batch = sched.compile([sched.kernel(double, [y], [x], queue=c0), sched.copy(x, y, queue=copier)])
    assert "dma[1] copy; wait timeline; wait c0>=1; signal dma=1" in batch.describe()
    dot = batch.to_dot()
    assert "c0 -> c1;" in dot and 'label="dma"' in dot
    anyio.run(batch.run)
    path = tmp_path / "trace.json"
    batch.trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    slices = [e for e in events if e["ph"] == "X"]
    assert set(tracks) == {"c0", "dma"} and len(slices) == 2
    assert slices[1]["tid"] == tracks["dma"] and slices[1]["ts"] >= slices[0]["ts"] + slices[0]["dur"]


# -- C kernels --------------------------------------------------------------------------------------------------------
def test_c_kernels_are_cached_with_their_flags_and_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOFABRIC_CACHE", str(tmp_path))
    first = sched.CKernel(SPIN, "spin")
    again = sched.CKernel(SPIN, "spin")
    assert not first.build["cached"] and again.build["cached"]
    assert first.build["flags"] == ["-O2", "-shared", "-fPIC"] and first.build["library"].startswith(str(tmp_path))
    with pytest.raises(sched.KernelBuildError, match="C kernel 'bad': cc -O2 -shared -fPIC failed"):
        sched.CKernel("void bad(void) { syntax error }", "bad")
    with pytest.raises(sched.KernelBuildError, match="defines no function 'missing'"):
        sched.CKernel("void other(void) {}", "missing")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(sched.CompilerNotFoundError, match="no C compiler 'cc' on PATH.*numpy kernels work"):
        sched.CKernel(SPIN + "/* new */", "spin")


@pytest.mark.parametrize("name", ["../../escape", "{tmp_path}/escape", "a/b", "..", "", "9lives", "sp in", "spin\0",
                                  "caf\u00e9", b"spin"])
def test_c_kernel_names_must_be_c_identifiers_so_the_library_stays_in_the_cache(tmp_path, monkeypatch, name):
    cache = tmp_path / "a" / "b" / "cache"  # deep enough that "../../escape" would stay under tmp_path
    monkeypatch.setenv("AIOFABRIC_CACHE", str(cache))
    source = "void escape(void) {}"
    if isinstance(name, str):
        name = name.format(tmp_path=tmp_path)  # an absolute path, kept under tmp_path
    with pytest.raises(ValueError, match="C kernel name must be a C identifier .*not " + re.escape(repr(name))):
        sched.CKernel(source, name)
    assert [path.name for path in tmp_path.rglob("*.so")] == []
    kernel = sched.CKernel(source, "escape")
    assert Path(kernel.build["library"]).resolve().parent == cache.resolve()


def test_a_crashing_c_kernel_kills_its_process_so_untrusted_kernels_run_in_a_child(tmp_path):
    """As documented: no exception for a segfault, the process dies; run in a child, the parent sees -SIGSEGV."""
    child = textwrap.dedent("""
        import anyio, numpy as np
        from aiofabric import sched
        # reads the address it is given: 8 is unmapped, a SIGSEGV no compiler turns into a trap at build time
        crash = sched.CKernel("#include <stdint.h>\\n"
                              "void crash(double *out, int64_t at) { out[0] = *(volatile double *)(intptr_t)at; }",
                              "crash")
        batch = sched.compile([sched.kernel(crash, [np.zeros(1)], [], [8], queue=sched.ComputeQueue())])
        print("running", flush=True)
        try:
            anyio.run(batch.run)
        except BaseException as error:
            print("caught", repr(error), flush=True)
        print("survived", flush=True)
        """)
    process = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "AIOFABRIC_CACHE": str(tmp_path)})
    assert process.returncode == -signal.SIGSEGV, (process.returncode, process.stdout, process.stderr)
    assert process.stdout == "running\n"


@pytest.mark.anyio
async def test_c_kernels_on_two_queues_run_at_the_same_time():
    spin = sched.CKernel(SPIN, "spin")
    n = 1 << 14
    x, y0, y1 = np.arange(n, dtype=np.float64), np.zeros(n), np.zeros(n)
    rounds = 1
    while True:  # size the kernel to ~40 ms on this machine, whatever its speed
        started = time.perf_counter()
        await sched.compile([sched.kernel(spin, [y0], [x], [n, rounds, 2.0], queue=sched.ComputeQueue())]).run()
        if time.perf_counter() - started > 0.04 or rounds > 1 << 16:
            break
        rounds *= 2
    batch = sched.compile([sched.kernel(spin, [y0], [x], [n, rounds, 2.0], queue=sched.ComputeQueue("c0")),
                           sched.kernel(spin, [y1], [x], [n, rounds, 3.0], queue=sched.ComputeQueue("c1"))])
    await batch.run()
    first, second = batch.last_trace
    assert overlaps(first, second), f"C kernels on two queues ran one after the other: {first}, {second}"
    assert (y0 == x * 2).all() and (y1 == x * 3).all()


# -- NIC queues across two emulated NICs ------------------------------------------------------------------------------
connected = functools.partial(connected_qps, qp={"sq_depth": 64}, timeout=8)


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_batch_of_c_kernel_copy_and_rdma_writes_matches_the_steps_run_one_by_one():
    n = 4096
    spin = sched.CKernel(SPIN, "spin")
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, _ = await connected(a, b)
        staging, target = await a.register_mr(2 * n * 8), await b.register_mr(2 * n * 8)
        local = np.frombuffer(staging.view, np.float64)  # the MR's memory as the kernel's output
        x, kept = np.random.default_rng(1).random(n), np.zeros(n)
        compute, copier = sched.ComputeQueue("compute"), sched.CopyQueue("copy")
        calls = [sched.kernel(spin, [local[:n]], [x], [n, 1, 2.0], queue=compute),
                 sched.copy(local[n:], local[:n], queue=copier),
                 sched.write(qa, staging, target, n * 8, name="write low"),
                 sched.kernel(spin, [local[:n]], [x], [n, 1, 5.0], queue=compute),  # after the write read it
                 sched.write(qa, staging, target, n * 8, local_offset=n * 8, remote_offset=n * 8, name="write high"),
                 sched.copy(kept, local[:n], queue=copier)]
        batch = sched.compile(calls, inputs={"x": x})
        with anyio.fail_after(20):
            await batch.run()
        got = bytes(target.view[:2 * n * 8]), kept.copy()
        # the same steps one by one
        target.view[:2 * n * 8] = bytes(2 * n * 8)
        local[:n] = x * 2.0
        local[n:] = local[:n]
        await qa.write(staging, target, n * 8)
        local[:n] = x * 5.0
        await qa.write(staging, target, n * 8, local_offset=n * 8, remote_offset=n * 8)
        assert got[0] == bytes(target.view[:2 * n * 8]) and (got[1] == local[:n]).all()
        described = batch.describe()
        assert "write low; wait timeline; wait compute>=1; signal" in described
        assert f"compute[2] kernel spin; wait copy>=1, qp {qa.qpn:#x}>=1" in described  # write-after-read
        # new input, no planning: new bytes at the peer
        with anyio.fail_after(20):
            await batch.run({"x": np.full(n, 1.5)})
        assert (np.frombuffer(target.view, np.float64)[:2 * n] == 3.0).all() and (kept == 7.5).all()
        names = {r.queue for r in batch.last_trace}
        assert names == {"compute", "copy", f"qp {qa.qpn:#x}"}


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_rdma_remote_access_error_aborts_cleanly_and_the_batch_runs_again_with_new_or_reset_qps():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        source, target = await a.register_mr(1 << 14), await b.register_mr(1 << 14)
        source.view[:] = random.Random(2).randbytes(1 << 14)
        after = np.zeros(1)
        compute = sched.ComputeQueue()
        bad = RemoteRegion(target.addr, target.rkey ^ 0x5A5A, target.length)
        batch = sched.compile([sched.write(qa, source, bad, 4096, name="bad write"),
                               sched.write(qa, source, bad, 4096, local_offset=4096, remote_offset=4096),
                               sched.kernel(lambda o: o.fill(1), [after], queue=compute, name="after")],
                              inputs={"qp": qa, "remote": bad})
        # the kernel does not depend on the writes (the planner cannot see through a RemoteRegion): it may run
        with pytest.raises(sched.CallError, match=rf"call 0 \(bad write\) on queue qp {qa.qpn:#x} failed: "
                           rf"CompletionError: .*REMOTE_ACCESS_ERR.* qp {qa.qpn:#x} left in ERR \(its outstanding "
                           "work was flushed\\): reset and reconnect both ends"):
            with anyio.fail_after(20):
                await batch.run()
        assert qa.state.name == "ERR"
        fresh, _ = await connected(a, b)
        with anyio.fail_after(20):
            await batch.run({"qp": fresh, "remote": target.remote()})
        assert bytes(target.view[:8192]) == bytes(source.view[:8192]) and after[0] == 1
        # or, as the error says, the failed pair reset and reconnected in place
        for qp in (qa, qb):
            await qp.modify(QPState.RESET)
        await connect(qa, qb, timeout=8)
        target.view[:8192] = bytes(8192)
        with anyio.fail_after(20):
            await batch.run({"qp": qa, "remote": target.remote()})
        assert bytes(target.view[:8192]) == bytes(source.view[:8192])


def test_a_batch_held_past_its_worker_threads_lifetime_replays_on_every_backend():
    """Idle worker threads retire after 10 s (trio on their own, anyio's asyncio pool at the next to_thread call): a
    compiled batch of a threaded C kernel, an RDMA write and a numpy kernel across two NICs, held 10.5 s and replayed,
    must not care. The three backends run at once, each in its own thread, to spend the wait once."""
    scale = sched.CKernel(SPIN, "spin")
    n = 1024

    async def hold_and_replay():
        async with open_nic("sim") as a, open_nic("sim") as b:
            qa, _ = await connected(a, b)
            staging, landing = await a.register_mr(n * 8), await b.register_mr(n * 8)
            x, total = np.arange(n, dtype=np.float64), np.zeros(1)
            arrived = np.frombuffer(landing.view, np.float64)
            batch = sched.compile([
                sched.kernel(scale, [np.frombuffer(staging.view, np.float64)], [x], [n, 1, 3.0],
                             queue=sched.ComputeQueue("A")),
                sched.write(qa, staging, landing),
                sched.kernel(lambda out, got: out.__setitem__(0, got.sum()), [total], [arrived],
                             queue=sched.ComputeQueue("B"))], inputs={"x": x})
            with anyio.fail_after(20):
                await batch.run()
            first = total[0]
            await anyio.sleep(10.3)  # every worker thread of this loop idle for > 10 s
            await anyio.to_thread.run_sync(time.sleep, 0.01)  # asyncio: this call retires the idle ones
            with anyio.fail_after(20):
                await batch.run({"x": np.full(n, 2.0)})
            return first, total[0], batch.runs

    results, errors = {}, []

    def on(name, backend, options):
        try:
            results[name] = anyio.run(hold_and_replay, backend=backend, backend_options=options)
        except BaseException as error:  # reported below, with the backend's name
            errors.append((name, error))
    threads = [threading.Thread(target=on, args=(f"{backend}{options}", backend, options))
               for backend, options in BACKENDS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(results) == 3
    for first, second, runs in results.values():
        assert first == 3.0 * np.arange(n).sum() and second == 6.0 * n and runs == 2


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_a_batch_over_a_destroyed_qp_or_a_closed_nic_fails_at_once_naming_the_call():
    async with open_nic("sim") as b:
        async with open_nic("sim") as a:
            qa, _ = await connected(a, b)
            source, target = await a.register_mr(4096), await b.register_mr(4096)
            done = np.zeros(1)
            batch = sched.compile([sched.write(qa, source, target, name="w"),
                                   sched.kernel(lambda out: out.fill(1), [done], queue=sched.ComputeQueue("c"))])
            with anyio.fail_after(20):
                await batch.run()
            await qa.destroy()
            with pytest.raises(sched.CallError, match=rf"call 0 \(w\) on queue qp {qa.qpn:#x} failed: ClosedError: "
                               "write on QP .* the QP was destroyed"):
                with anyio.fail_after(5):
                    await batch.run()
        with pytest.raises(sched.CallError, match=r"call 0 \(w\) .* failed: ClosedError"):  # the NIC is closed
            with anyio.fail_after(5):
                await batch.run()


# -- rebinding: what it may and may not change ----------------------------------------------------------------------
def test_a_rebinding_that_makes_buffers_share_memory_is_refused_and_changes_nothing():
    x, y, z, out = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4)
    batch = sched.compile([sched.kernel(lambda o: o.fill(1.0), [y], queue=sched.ComputeQueue("A"), name="fill y"),
                           sched.kernel(lambda o, i: np.copyto(o, i), [z], [x], queue=sched.ComputeQueue("B"))],
                          inputs={"x": x})
    # x and y were disjoint when planned: the two kernels were not ordered. Bound to y, x would race the fill.
    with pytest.raises(sched.BindingError, match=r"input 'x': its new memory overlaps argument 0 of call 0 \(fill y\)"):
        batch.bind({"x": y})
    x[:] = 5.0
    anyio.run(batch.run)
    assert z.tolist() == [5.0] * 4 and y.tolist() == [1.0] * 4  # still x: the refused binding changed nothing
    fill = sched.compile([sched.kernel(lambda o: o.fill(1.0), [out], queue=sched.ComputeQueue())], inputs={"out": out})
    with pytest.raises(sched.BindingError, match="is read-only, and argument 0 of call 0"):
        fill.bind({"out": np.frombuffer(bytes(32))})
    anyio.run(fill.run)
    assert out.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match=r"outs\[0\] is read-only"):
        sched.kernel(lambda o: None, [np.frombuffer(bytes(8))], queue=sched.ComputeQueue())
    # an input whose memory a constant argument shares cannot be rebound: that argument would stay behind
    whole = np.zeros(8)
    entangled = sched.compile([sched.kernel(lambda o: o.fill(2.0), [whole], queue=sched.ComputeQueue("A")),
                               sched.kernel(lambda o: None, [whole[:4]], queue=sched.ComputeQueue("B"))],
                              inputs={"head": whole[:4]})
    with pytest.raises(sched.BindingError, match="cannot be rebound: argument 0 of call 0 .* shares its memory"):
        entangled.bind({"head": np.zeros(4)})


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_overlapping_runs_keep_their_own_bindings():
    x, z, seen = np.zeros(4), np.zeros(4), []
    q = sched.ComputeQueue("q")
    started, release = threading.Event(), threading.Event()
    batch = sched.compile([sched.kernel(lambda o: started.set() or release.wait(5), [np.zeros(1)], queue=q,
                                        threaded=True),
                           sched.kernel(lambda o, i: np.copyto(o, i), [z], [x], queue=q)], inputs={"x": x})

    async def run(value):
        await batch.run({"x": np.full(4, value)})
        seen.append((value, z[0]))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run, 1.0)
        await wait_until(started)  # the first run is inside its first kernel
        with pytest.raises(sched.BindingError, match="a run of this batch is in progress"):
            batch.bind({"x": np.full(4, 3.0)})
        tasks.start_soon(run, 2.0)
        release.set()
    assert seen == [(1.0, 1.0), (2.0, 2.0)]


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_rebinding_qps_and_mrs_stays_on_their_nic_is_all_or_nothing_and_errors_name_the_bound_qp():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        staging, staging2, landing = await a.register_mr(64), await a.register_mr(64), await b.register_mr(64)
        batch = sched.compile([
            sched.kernel(lambda out: out.fill(3.0), [np.frombuffer(staging.view, np.float64)],
                         queue=sched.ComputeQueue("c"), name="fill staging"),
            sched.write(qa, staging, landing, name="write")], inputs={"qp": qa, "staging": staging})
        other_nic_qp = await b.create_qp(await b.create_cq(64))
        with pytest.raises(sched.BindingError, match="must be a QP of .* whose MRs the calls use; got one of"):
            batch.bind({"qp": other_nic_qp})
        with pytest.raises(sched.BindingError, match="must be an MR of"):
            batch.bind({"staging": await b.register_mr(64)})
        idle = await a.create_qp(await a.create_cq(64))  # never connected
        with pytest.raises(sched.BindingError):  # the second binding is refused: the first must not stick
            batch.bind({"qp": idle, "staging": landing.remote()})
        with anyio.fail_after(20):
            await batch.run()  # still qa
        # an MR input rebinds the numpy views of it the calls use: the kernel fills what the write sends
        with anyio.fail_after(20):
            await batch.run({"staging": staging2})
        assert np.frombuffer(landing.view, np.float64)[0] == 3.0 and np.frombuffer(staging2.view, np.float64)[0] == 3.0
        np.frombuffer(landing.view, np.float64)[:] = 0
        with pytest.raises(sched.CallError, match=rf"call 1 \(write\) on queue qp {idle.qpn:#x} failed"):
            with anyio.fail_after(20):
                await batch.run({"qp": idle})
        assert f"qp {idle.qpn:#x}[1] write" in batch.describe()


@pytest.mark.anyio
async def test_a_run_that_ends_with_a_receive_posted_flushes_it_says_so_and_never_hangs_the_next():
    async with open_nic("sim") as a, open_nic("sim") as b:
        qa, qb = await connected(a, b)
        source, sink = await a.register_mr(64), await b.register_mr(64)
        broken = [True]

        def produce(out):
            if broken[0]:
                raise RuntimeError("bad input")
            out[:] = 7
        batch = sched.compile([sched.kernel(produce, [np.frombuffer(source.view, np.float64)],
                                            queue=sched.ComputeQueue("c"), name="produce"),
                               sched.send(qa, source, name="send"), sched.recv(qb, sink, name="recv")])
        started = time.monotonic()
        with pytest.raises(sched.CallError, match=rf"call 0 \(produce\).*RuntimeError: bad input.*qp {qb.qpn:#x} "
                           rf"\({b.pci.address}\) left in ERR \(its outstanding work was flushed\)"):
            await batch.run()
        assert time.monotonic() - started < 4 and qb.state is QPState.ERR and not qb.recv_queue.pending
        broken[0] = False
        with pytest.raises(sched.CallError, match="FLUSHED"):  # not reset: refused at once, no hang
            with anyio.fail_after(10):
                await batch.run()
        for qp in (qa, qb):
            await qp.modify(QPState.RESET)
        await connect(qa, qb, timeout=8)
        with anyio.fail_after(20):
            await batch.run()
        assert bytes(sink.view) == bytes(source.view) and np.frombuffer(sink.view, np.float64)[0] == 7
        # cancelled from outside while the receive waits: the cancel is prompt and the receive does not linger
        batch = sched.compile([sched.recv(qb, sink, name="recv")])
        started = time.monotonic()
        with anyio.move_on_after(0.1):
            await batch.run()
        assert time.monotonic() - started < 3 and qb.state is QPState.ERR and not qb.recv_queue.pending


@pytest.mark.anyio
@pytest.mark.loop_agnostic
async def test_qps_of_two_nics_with_one_number_get_their_own_names_and_trace_tracks(tmp_path):
    async with open_nic("sim") as a, open_nic("sim") as b, open_nic("sim") as c:
        qa, qb = await connected(a, b)  # each NIC numbers its own QPs: the first QP of every NIC has one number
        qc, qb2 = await connected(c, b)
        assert qa.qpn == qc.qpn
        source_a, source_c, target = await a.register_mr(8192), await c.register_mr(8192), await b.register_mr(8192)
        batch = sched.compile([sched.write(qa, source_a, target, 4096, name="from a"),
                               sched.write(qc, source_c, target, 4096, remote_offset=4096, name="from c")])
        with anyio.fail_after(20):
            await batch.run()
        names = batch.queue_names()
        assert names == [f"qp {qa.qpn:#x} ({a.pci.address})", f"qp {qc.qpn:#x} ({c.pci.address})"]
        assert f"{names[0]}[1] from a" in batch.describe() and f"{names[1]}[1] from c" in batch.describe()
        batch.trace(tmp_path / "run.json")
        events = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
        tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
        slices = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
        assert slices == {"from a": tracks[names[0]], "from c": tracks[names[1]]} and len(set(tracks.values())) == 2


# -- the example ------------------------------------------------------------------------------------------------------
def test_example_batch_runs_as_is():
    path = CHECKOUT / "examples" / "batch.py"
    process = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(path.parents[1])})
    assert process.returncode == 0, process.stderr
    assert "verified" in process.stdout
