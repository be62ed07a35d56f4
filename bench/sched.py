"""Scheduler benchmarks (bench/RESULTS.md, Scheduler): planning time vs batch size, compiling (building the calls,
planning, the input table) vs batch size, replay overhead per call, two C kernels on two compute queues against one, and the overlap of C kernels on two compute queues with RDMA writes against the same
calls run one after another.

    python bench/sched.py [--json] [--skip-nic]
"""
import argparse
import ctypes
import json
import random
import statistics
import time

import anyio
import numpy as np

from aiofabric import open_nic, sched
from aiofabric.sched.plan import PlannedCall, Span, plan

SPIN = r"""
#include <stdint.h>
/* Register-bound: v = v * k + 1 `rounds` times per element. A kernel that streams memory instead timed 30% apart
   from run to run here (the VM's memory bandwidth), which hid the scheduler's overlap in the machine's noise. */
void spin(double *out, const double *in, int64_t n, int64_t rounds, double k) {
    for (int64_t i = 0; i < n; i++) {
        double v = in[i];
        for (int64_t r = 0; r < rounds; r++) v = v * k + 1.0;
        out[i] = v;
    }
}
"""


def planning(sizes=(1_000, 10_000, 100_000), queues=8, buffers=256, rounds=7):
    """Per size: CPU seconds to plan N calls over `queues` queues, each reading two and writing one of `buffers`
    buffers (byte ranges of 4 KiB slots, so the interval maps cut and merge). Each measurement plans as many calls
    as the largest batch (a 1k batch 100 times, plans kept): the best of short windows is luckier than the best of
    long ones on a VM whose speed drifts, so every size gets windows of one length. The best of `rounds`, the sizes
    interleaved in each round."""
    rng = random.Random(1)
    keys, names = [f"b{i}" for i in range(buffers)], [f"q{i}" for i in range(queues)]  # shared, as calls share them

    def span():
        slot = rng.randrange(4)
        return Span(keys[rng.randrange(buffers)], slot * 4096, slot * 4096 + 4096)
    batches = {n: [PlannedCall(names[i % queues], "host", (span(), span()), (span(),)) for i in range(n)] for n in sizes}
    results = {n: float("inf") for n in sizes}
    for _ in range(rounds):
        for n, calls in batches.items():
            repeat = max(sizes) // n
            results[n] = min(results[n], _cpu_timed(lambda: [plan(calls) for _ in range(repeat)]) / repeat)
    return results


def compiling(sizes=(2_000, 8_000, 100_000), queues=8, arrays=256, inputs=64, rounds=3):
    """Per size: CPU seconds to build N kernel calls (each writing one and reading two of `arrays` arrays, `inputs`
    of them inputs of the batch) and to compile them, best of `rounds`; what a user pays, not only the planner."""
    rng = random.Random(3)
    pool = [np.zeros(16) for _ in range(arrays)]
    qs = [sched.ComputeQueue(f"c{i}") for i in range(queues)]
    bound = {f"x{i}": pool[i] for i in range(inputs)}

    def noop(*_):
        pass
    picks = {n: [(rng.randrange(arrays), rng.randrange(arrays), rng.randrange(arrays)) for _ in range(n)] for n in sizes}
    build, total = {n: float("inf") for n in sizes}, {n: float("inf") for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            made = []
            build[n] = min(build[n], _cpu_timed(lambda: made.extend(
                sched.kernel(noop, [pool[o]], [pool[a], pool[b]], queue=qs[i % queues])
                for i, (o, a, b) in enumerate(picks[n]))))
            total[n] = min(total[n], build[n] + _cpu_timed(lambda: sched.compile(made, inputs=bound)))
    return build, total


def _cpu_timed(fn):
    """CPU seconds of this thread: the machine is shared, and time spent descheduled is not planning time."""
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def _timed(fn):
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


async def replay_overhead(calls=10_000, queues=8):
    """Median seconds per call to replay a compiled batch of `calls` no-op numpy kernels on `queues` queues."""
    rng = random.Random(2)
    arrays = [np.zeros(1) for _ in range(64)]
    qs = [sched.ComputeQueue(f"c{i}") for i in range(queues)]

    def noop(*_):
        pass

    batch = sched.compile([sched.kernel(noop, [arrays[rng.randrange(64)]], [arrays[rng.randrange(64)]],
                                        queue=qs[i % queues]) for i in range(calls)])
    times = []
    for _ in range(5):
        started = time.perf_counter()
        await batch.run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / calls, batch.plan.waits, batch.plan.signals


async def overlap(kernels_per_queue=4, writes=32, write_bytes=1 << 16):
    """(overlapped s, serial s, median of the rounds' ratios, kernel s, calls): C kernels on two compute queues +
    RDMA writes on one QP, in one batch, vs every call as its own batch one after another (same executors, nothing
    overlaps)."""
    spin = sched.CKernel(SPIN, "spin")
    n = 1 << 14
    async with open_nic("sim") as a, open_nic("sim") as b:
        cq_a, cq_b = await a.create_cq(256), await b.create_cq(256)
        qa, qb = await a.create_qp(cq_a, sq_depth=64), await b.create_qp(cq_b, sq_depth=64)
        await qa.connect(qb.info())
        await qb.connect(qa.info())
        source, target = await a.register_mr(writes * write_bytes), await b.register_mr(writes * write_bytes)
        source.view[:] = random.Random(3).randbytes(writes * write_bytes)
        x = np.arange(n, dtype=np.float64)
        outs = [np.zeros(n) for _ in range(2 * kernels_per_queue)]
        rounds = _spin_rounds(spin, outs[0], x)
        c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
        calls = [sched.kernel(spin, [outs[i]], [x], [n, rounds, 0.5], queue=c0 if i % 2 else c1)
                 for i in range(2 * kernels_per_queue)]
        calls += [sched.write(qa, source, target, write_bytes, local_offset=i * write_bytes,
                              remote_offset=i * write_bytes) for i in range(writes)]
        together = sched.compile(calls)
        alone = [sched.compile([call]) for call in calls]
        await together.run()  # warm up: threads, emulator
        overlapped, serial = [], []
        for _ in range(5):  # each round's pair runs back to back: its ratio is what a slow spell spoils least
            overlapped.append(await _timed_async(together.run))
            serial.append(await _timed_async(lambda: _run_all(alone)))
        assert bytes(target.view) == bytes(source.view)
        kernel_time = statistics.median(r.end_ns - r.start_ns for r in together.last_trace[:len(outs)]) / 1e9
        ratio = statistics.median(o / s for o, s in zip(overlapped, serial))
        return statistics.median(overlapped), statistics.median(serial), ratio, kernel_time, len(calls)


def _spin_rounds(spin, out, x, seconds=0.02):
    """Rounds that make one spin kernel over `x` take `seconds` to twice that on this machine."""
    rounds = 1
    while _timed(lambda: spin.function(ctypes.c_void_p(out.ctypes.data), ctypes.c_void_p(x.ctypes.data),
                                         ctypes.c_int64(len(x)), ctypes.c_int64(rounds), ctypes.c_double(0.5))
                 ) < seconds:
        rounds *= 2
    return rounds


async def two_kernels_vs_one(n=1 << 14):
    """Median of 5 paired rounds: wall time of a batch of two equal C kernels on two compute queues over a batch of
    one of them (2.0 = they ran one after the other, 1.0 = fully in parallel)."""
    spin = sched.CKernel(SPIN, "spin")
    x, y0, y1 = np.arange(n, dtype=np.float64), np.zeros(n), np.zeros(n)
    rounds = _spin_rounds(spin, y0, x, 0.04)
    c0, c1 = sched.ComputeQueue("c0"), sched.ComputeQueue("c1")
    one = sched.compile([sched.kernel(spin, [y0], [x], [n, rounds, 0.5], queue=c0)])
    two = sched.compile([sched.kernel(spin, [y0], [x], [n, rounds, 0.5], queue=c0),
                         sched.kernel(spin, [y1], [x], [n, rounds, 0.5], queue=c1)])
    await two.run()  # warm up: the worker threads
    ratios = [await _timed_async(two.run) / await _timed_async(one.run) for _ in range(5)]
    assert (y0 == y1).all()
    return statistics.median(ratios)


async def _run_all(batches):
    for batch in batches:
        await batch.run()


async def _timed_async(fn):
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def main(as_json: bool, skip_nic: bool) -> None:
    result = {}
    plans = planning()
    result["plan_us_per_call"] = {n: seconds / n * 1e6 for n, seconds in plans.items()}
    result["plan_ratio_10k_over_1k"] = plans[10_000] / plans[1_000]
    result["plan_ratio_100k_over_10k"] = plans[100_000] / plans[10_000]
    build, total = compiling()
    result["build_us_per_call"] = {n: seconds / n * 1e6 for n, seconds in build.items()}
    result["compile_us_per_call"] = {n: seconds / n * 1e6 for n, seconds in total.items()}
    per_call, waits, signals = await replay_overhead()
    result["replay_us_per_noop_call"] = per_call * 1e6
    result["replay_plan"] = {"calls": 10_000, "waits": waits, "signals": signals}
    result["two_kernels_over_one"] = await two_kernels_vs_one()
    if not skip_nic:
        together, serial, ratio, kernel, count = await overlap()
        result["overlap"] = {"calls": count, "overlapped_s": together, "serial_s": serial, "ratio": ratio,
                             "kernel_s": kernel}
    if as_json:
        print(json.dumps(result))
        return
    for n, us in result["plan_us_per_call"].items():
        print(f"planning {n:>7} calls over 8 queues: {us:6.2f} us/call ({plans[n] * 1e3:8.1f} ms)")
    print(f"10x calls -> {result['plan_ratio_10k_over_1k']:.2f}x time (1k->10k), "
          f"{result['plan_ratio_100k_over_10k']:.2f}x (10k->100k)")
    for n, us in result["compile_us_per_call"].items():
        print(f"building and compiling {n:>7} calls (64 inputs): {us:6.2f} us/call (building alone "
              f"{result['build_us_per_call'][n]:.2f})")
    print(f"replay of 10k no-op kernels on 8 queues: {result['replay_us_per_noop_call']:.2f} us/call "
          f"({waits} waits, {signals} signals)")
    print(f"two equal C kernels on two queues: {result['two_kernels_over_one']:.2f}x the wall time of one")
    if "overlap" in result:
        o = result["overlap"]
        print(f"overlap: {o['calls']} calls (8 C kernels of {o['kernel_s'] * 1e3:.0f} ms on 2 queues + 32 RDMA writes): "
              f"{o['overlapped_s'] * 1e3:.1f} ms vs serial {o['serial_s'] * 1e3:.1f} ms = {o['ratio']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-nic", action="store_true", help="planning and replay only")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args()
    anyio.run(main, args.json, args.skip_nic, backend=args.backend)
